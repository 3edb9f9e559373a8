"""The one-shot all-reduce kernels (`kernels.allreduce`) against XLA's psum (NCCL) on 2 GPUs, then in decode.

    python benchmarks/allreduce_kernel_gpu.py [--no-decode] [--decode-only] [--batch1] [--70b [--70b-kernel-only]]
        # 2 Hopper GPUs; table last, JSON to $OUT/allreduce_kernel_gpu.json

Implementations: "psum"; "kernel" (`all_reduce_kernel`, behind XLA's cross-device barrier);
"persistent" (`all_reduce_persistent`, barrier-free, flags and mailbox passed in and kept alive).
1. Values: [B, 4096] bf16 per device, different on each, B = 1, 8, 16: each kernel's sum equals
   psum's bit for bit on both devices; and a loop of 200 dependent all-reduces (lax.fori_loop, each
   input made device-dependent) gives the same values (no stale or torn reads across calls).
2. Latency: a jitted fori_loop of 100 dependent all-reduces of [B, 4096] bf16, best of 5, time / 100.
3. Profile: kernel durations on GPU 0 in that loop at B = 1.
4. Decode: Llama-3.1-8B, random bf16 weights, batch 1 and 8, 1k context, the default looped engine
   on 1 GPU and on 2 with psum and with `TPForward(allreduce="kernel")`; greedy tokens compared.
   With --70b, Llama-3.1-70B on 2 GPUs the same two ways.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import sys
import time
import traceback

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxdecode.bench import read_ceiling_gb_s, time_engine, tokens_agree  # noqa: E402
from jaxdecode.config import get_preset  # noqa: E402
from jaxdecode.cost import decode_cost  # noqa: E402
from jaxdecode.decode import Engine  # noqa: E402
from jaxdecode.model import init_random  # noqa: E402
from jaxdecode.tp import AXIS, TPForward, make_mesh  # noqa: E402
from kernels import allreduce  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gpu_trace, tp_gpu
DIM = 4096
WATCHDOG_S = 150  # a decode section that makes no progress for this long ends the process (a hung kernel)


IMPLS = ("psum", "kernel", "persistent")
_BUFFERS = {}  # the persistent kernel's state and mailbox: made once, passed to every call


def reduce_fn(impl: str, bufs=None):
    if impl == "psum":
        return lambda x: jax.lax.psum(x, AXIS)
    if impl == "kernel":
        return lambda x: allreduce.all_reduce_kernel(x, AXIS, 2)
    return lambda x: allreduce.all_reduce_persistent(x, AXIS, *bufs)


def sharded(fn, mesh):
    """jit(shard_map(fn)) with fn(x, state, mailbox); returns a function of x alone."""
    if "bufs" not in _BUFFERS:
        _BUFFERS["bufs"] = allreduce.persistent_buffers(mesh, AXIS, jnp.bfloat16)
    run = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(AXIS),) * 3, out_specs=P(AXIS), check_vma=False))
    return lambda x: run(x, *_BUFFERS["bufs"])


def values(mesh, out):
    rng = np.random.default_rng(0)
    for b in (1, 8, 16):
        x = jnp.asarray(rng.standard_normal((2 * b, DIM)), jnp.bfloat16)  # rows [0, b) on GPU 0, [b, 2b) on GPU 1
        ref = np.asarray(sharded(lambda v, *bufs: reduce_fn("psum")(v), mesh)(x), np.float32)
        for impl in IMPLS[1:]:
            got = np.asarray(sharded(lambda v, *bufs, impl=impl: reduce_fn(impl, bufs)(v), mesh)(x), np.float32)
            host = np.asarray(x[:b], np.float32) + np.asarray(x[b:], np.float32)
            out["values"].append(
                {
                    "impl": impl,
                    "batch": b,
                    "bitwise_equal_psum": bool(np.array_equal(ref, got)),
                    "devices_equal": bool(np.array_equal(got[:b], got[b:])),
                    "max_abs_vs_host_f32": float(np.abs(got[:b] - host).max()),
                }
            )
            print(out["values"][-1], flush=True)
    loops = {}
    for impl in IMPLS:

        def loop(x, *bufs, impl=impl):
            bump = (jax.lax.axis_index(AXIS) + 1).astype(x.dtype) * jnp.asarray(1e-2, x.dtype)
            step = lambda i, x: reduce_fn(impl, bufs)(x) * jnp.asarray(0.5, x.dtype) + bump
            return jax.lax.fori_loop(0, 200, step, x)

        loops[impl] = np.asarray(sharded(loop, mesh)(jnp.ones((16, DIM), jnp.bfloat16)), np.float32)
    out["values"].append(
        {f"loop_200_equal_{impl}": bool(np.array_equal(loops["psum"], loops[impl])) for impl in IMPLS[1:]}
    )
    print(out["values"][-1], flush=True)


def chain_fn(impl: str, n: int):
    """fn(x, state, mailbox): a fori_loop of n dependent all-reduces, each input device-dependent."""

    def chain(x, *bufs):
        bump = (jax.lax.axis_index(AXIS) + 1).astype(x.dtype) * jnp.asarray(1e-3, x.dtype)
        return jax.lax.fori_loop(0, n, lambda i, x: reduce_fn(impl, bufs)(x) * jnp.asarray(0.5, x.dtype) + bump, x)

    return chain


def latency(mesh, out, n: int = 100):
    from tp_gpu import best_wall_s

    for b in (1, 8, 16):
        for impl in IMPLS:
            seconds = best_wall_s(sharded(chain_fn(impl, n), mesh), jnp.ones((2 * b, DIM), jnp.bfloat16))
            out["latency"].append({"batch": b, "impl": impl, "form": "fori_loop", "us": round(seconds / n * 1e6, 2)})
            print(out["latency"][-1], flush=True)


def profile(mesh, out, n: int = 100):
    """Kernel durations and gaps on GPU 0 in a fori_loop of n all-reduces of [1, 4096] bf16."""
    from gpu_trace import gpu_pids, traced_events, track_names

    for impl in IMPLS:
        fn = sharded(chain_fn(impl, n), mesh)
        x = jnp.ones((2, DIM), jnp.bfloat16)
        fn(x).block_until_ready()
        events = traced_events(lambda: fn(x).block_until_ready(), f"/tmp/trace_{impl}")
        names = track_names(events)
        pid = min(gpu_pids(names))
        kernels = sorted(
            (e for e in events if e.get("ph") == "X" and e.get("pid") == pid and e.get("dur")), key=lambda e: e["ts"]
        )
        by_name = {}
        for e in kernels:
            by_name.setdefault(e["name"][:60], []).append(e["dur"])
        span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"] if kernels else 0
        out["profile"].append(
            {
                "impl": impl,
                "span_us_per_call": round(span / n, 2),
                "kernels": {k: {"count": len(v), "mean_us": round(float(np.mean(v)), 2)} for k, v in by_name.items()},
            }
        )
        print(out["profile"][-1], flush=True)


def decode(out):
    cfg = get_preset("llama-3.1-8b")
    ceiling = read_ceiling_gb_s(4)
    out["read_ceiling_gb_s"] = round(ceiling, 1)
    model = init_random(cfg, seed=0, dtype=jnp.bfloat16)
    tokens = {}
    # the kernel first: if it hangs, the watchdog (main) ends the run early
    variants = [("tp2_kernel", dict(allreduce="kernel")), ("tp2_psum", dict(allreduce="psum")), ("tp1", dict(tp=1))]
    for name, kw in variants:
        if name == "tp1":
            engine = Engine(model)
        else:
            engine = Engine(None, tp=TPForward.from_model(model, 2, loop_mode="inplace", **kw))
        for b in (1,) if "--batch1" in sys.argv else (1, 8):
            prompts = np.random.default_rng(b).integers(0, cfg.vocab_size, (b, 16))
            time_engine(engine, prompts, context=1024, steps=32)  # compile
            runs = [time_engine(engine, prompts, context=1024, steps=64) for _ in range(2)]
            best = min(runs, key=lambda t: t.decode_s / t.steps)
            ms = best.decode_s / best.steps * 1e3
            tokens[(name, b)] = best.tokens
            moved = decode_cost(cfg, batch=b, context=1024 + 16 + 32, itemsize=2).bytes
            tp = 1 if name == "tp1" else 2
            out["decode"].append(
                {
                    "variant": name,
                    "batch": b,
                    "ms_per_token": round(ms, 3),
                    "all_ms": [round(t.decode_s / t.steps * 1e3, 3) for t in runs],
                    "pct_roofline": round(100 * moved / (ms / 1e3) / 1e9 / (ceiling * tp), 1),
                }
            )
            print(out["decode"][-1], flush=True)
            faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)  # re-armed: progress was made
        engine = None
        gc.collect()
    for r in out["decode"]:
        if not r["variant"].startswith("tp"):
            continue
        one = next(x for x in out["decode"] if x["variant"] == "tp1" and x["batch"] == r["batch"])
        r["speedup_vs_tp1"] = round(one["ms_per_token"] / r["ms_per_token"], 3)
        r["tokens_agree_vs_tp1"] = tokens_agree(tokens[(r["variant"], r["batch"])], tokens[("tp1", r["batch"])])
        r["tokens_equal_vs_tp2_psum"] = bool(
            np.array_equal(tokens[(r["variant"], r["batch"])], tokens[("tp2_psum", r["batch"])])
        )


def decode_70b(out):
    """Llama-3.1-70B on 2 GPUs (random weights made in place), psum against the kernel."""
    cfg = get_preset("llama-3.1-70b")
    ceiling = out.get("read_ceiling_gb_s") or read_ceiling_gb_s(4)
    tokens = {}
    names = ("kernel",) if "--70b-kernel-only" in sys.argv else ("kernel", "psum")
    for name in names:
        engine = Engine(None, tp=TPForward.random(cfg, 2, dtype=jnp.bfloat16, loop_mode="inplace", allreduce=name))
        for b in (1,):  # at batch 8 ([8, 8192]) all_reduce runs psum either way
            prompts = np.random.default_rng(b).integers(0, cfg.vocab_size, (b, 16))
            time_engine(engine, prompts, context=1024, steps=32)  # compile
            best = min(
                (time_engine(engine, prompts, context=1024, steps=32) for _ in range(2)),
                key=lambda t: t.decode_s / t.steps,
            )
            ms = best.decode_s / best.steps * 1e3
            tokens[(name, b)] = best.tokens
            moved = decode_cost(cfg, batch=b, context=1024 + 16 + 16, itemsize=2).bytes
            out["decode"].append(
                {
                    "variant": f"70b_tp2_{name}",
                    "batch": b,
                    "ms_per_token": round(ms, 3),
                    "pct_roofline": round(100 * moved / (ms / 1e3) / 1e9 / (ceiling * 2), 1),
                }
            )
            print(out["decode"][-1], flush=True)
            faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
        engine = None
        gc.collect()
    for b in (1,) if len(names) == 2 else ():
        out["decode"].append(
            {
                "variant": "70b_tokens_equal",
                "batch": b,
                "equal": bool(np.array_equal(tokens[("psum", b)], tokens[("kernel", b)])),
            }
        )


def main() -> int:
    if len(jax.devices()) < 2:
        print(f"needs 2 GPUs, JAX sees {jax.devices()}", file=sys.stderr)
        return 2
    from jax.experimental.mosaic.gpu import core as mgpu_core

    out = {
        "device": jax.devices()[0].device_kind,
        "devices": len(jax.devices()),
        "jax": jax.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "single_process_multi_device": mgpu_core.is_single_process_multi_device_topology(),
        "nvshmem_available": mgpu_core.is_nvshmem_available(),
        "values": [],
        "latency": [],
        "profile": [],
        "decode": [],
        "errors": [],
    }
    print({k: out[k] for k in ("device", "jax", "single_process_multi_device", "nvshmem_available")}, flush=True)
    mesh = make_mesh(2)
    sections = (
        []
        if "--decode-only" in sys.argv
        else [lambda: values(mesh, out), lambda: latency(mesh, out), lambda: profile(mesh, out)]
    )
    if "--no-decode" not in sys.argv:
        sections.append(lambda: decode(out))
    if "--70b" in sys.argv:
        sections.append(lambda: decode_70b(out))
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    for section in sections:
        try:
            section()
        except Exception as e:  # keep the other sections
            out["errors"].append(f"{type(e).__name__}: {str(e)[-1500:]}")
            traceback.print_exc()
    print("\nall-reduce of [B, 4096] bf16 over 2 GPUs, µs per call")
    for r in out["latency"]:
        print(f"  B={r['batch']:>2} {r['impl']:>6} {r['form']:>9}: {r['us']:.2f}")
    print("decode, Llama-3.1-8B, 1k context")
    for r in out["decode"]:
        if "ms_per_token" not in r:
            print("  ", r)
            continue
        print(
            f"  {r['variant']:>10} B={r['batch']}: {r['ms_per_token']:.3f} ms/token, {r['pct_roofline']}% roofline, "
            f"x{r.get('speedup_vs_tp1')} vs TP1, tokens agree {r.get('tokens_agree_vs_tp1')}, "
            f"equal to psum {r.get('tokens_equal_vs_tp2_psum')}"
        )
    for e in out["errors"]:
        print("error:", e[:600])
    faulthandler.cancel_dump_traceback_later()
    with open(os.path.join(os.environ.get("OUT", "."), "allreduce_kernel_gpu.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

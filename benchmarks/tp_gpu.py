"""Tensor-parallel decode on 2 GPUs vs 1 (`jaxdecode.tp`): ms/token, same tokens, all-reduce cost, roofline.

    python benchmarks/tp_gpu.py              # 2 GPUs: llama-3.1-8b TP1 vs TP2, then llama-3.1-70b on 2 if it fits
    python benchmarks/tp_gpu.py --dry-run    # the same code path on the CPU: tiny presets, 2 fake devices

Random bf16 weights, the engine's default decode (looped; in place through kernels on a GPU).
Each config prefills 16 random tokens after a 1024-token zero prefix (`bench.time_engine`) and times
32 greedy decode steps in one on-device chunk, after a first compiling run. Reported per row:
ms/token, tok/s, GB/s = `cost.decode_cost` bytes / step time, and % of the read roofline of the GPUs
used (the HBM read ceiling of GPU 0, measured here, times tp). For the 8B model, TP2 against TP1:
leading greedy tokens equal in every sequence (of the first 16) and the max logit difference of one
16-token forward. The all-reduce row times one psum of [B, D] bf16 over 2 GPUs: a jitted chain of 100
psums (each input made device-dependent by a fused add, so that XLA cannot fold them), time / 100.
The 70B model (141 GB in bf16) is made shard by shard on the 2 GPUs (`TPForward.random`), only if
the per-device memory preflight passes. Output: a table, then JSON to $OUT/tp_gpu.json (or stdout).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

DRY = "--dry-run" in sys.argv
if DRY:  # before JAX starts: CPU with 2 fake devices (or as many as an importer, tp_scaling.py, already asked for)
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
        ).strip()
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # the 70B shards need ~72 GB of 141 per GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxdecode.bench import read_ceiling_gb_s, time_engine, tokens_agree  # noqa: E402
from jaxdecode.bench_report import device_name  # noqa: E402
from jaxdecode.config import get_preset  # noqa: E402
from jaxdecode.cost import decode_cost  # noqa: E402
from jaxdecode.decode import Engine, default_dtype  # noqa: E402
from jaxdecode.looped_model import default_loop_mode  # noqa: E402
from jaxdecode.memory import device_memory_bytes, preflight  # noqa: E402
from jaxdecode.model import init_random  # noqa: E402
from jaxdecode.tp import AXIS, TPForward, make_mesh  # noqa: E402

PROMPT, STEPS, AGREE = 16, 32, 16


def allreduce_us(dim: int, batch: int, n: int = 100, devices: int = 2, compiler_options=None) -> float:
    """Microseconds per psum of one [B, D] bf16 array over `devices` devices (a jitted chain of n,
    compiled with XLA's `compiler_options`, if any)."""
    mesh = make_mesh(devices)

    def chain(x):  # x: [B, D] on each device
        bump = (jax.lax.axis_index(AXIS) + 1).astype(x.dtype) * 1e-3
        for _ in range(n):
            x = jax.lax.psum(x, AXIS) * 0.5 + bump  # [B, D]
        return x

    fn = jax.jit(
        jax.shard_map(chain, mesh=mesh, in_specs=P(), out_specs=P(AXIS), check_vma=False),
        compiler_options=compiler_options,
    )
    return best_wall_s(fn, jnp.ones((batch, dim), jnp.bfloat16)) / n * 1e6


def best_wall_s(fn, *args, runs: int = 5) -> float:
    """The best of `runs` wall-clock timings of fn(*args), after one warm-up (compiling) call."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def row(name: str, cfg, engine: Engine, batch: int, context: int, ceiling: float, rng) -> tuple[dict, np.ndarray]:
    prompts = rng.integers(0, cfg.vocab_size, (batch, PROMPT))
    timing = time_engine(engine, prompts, context=context, steps=STEPS)
    step_s = timing.decode_s / timing.steps
    itemsize = jnp.dtype(engine.cache_dtype).itemsize
    moved = decode_cost(cfg, batch=batch, context=context + PROMPT + STEPS // 2, itemsize=itemsize).bytes
    plan = engine._tp if engine._tp is not None else engine._plan
    return {
        "model": name,
        "tp": engine.tp,
        "batch": batch,
        "context": context,
        "loop_mode": plan.mode if plan is not None and engine.loop_layers else "unrolled",
        "first_call_s": round(timing.first_call_s, 2),
        "ms_per_token": round(step_s * 1e3, 3),
        "tok_s": round(batch / step_s, 1),
        "gb_s": round(moved / step_s / 1e9, 1),
        "pct_roofline": round(100 * moved / step_s / 1e9 / (ceiling * engine.tp), 1),
    }, timing.tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny presets, 2 fake devices")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--budget-s", type=float, default=400.0, help="skip the large model past this (seconds)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    if len(jax.devices()) < 2:
        print(
            f"tp_gpu: error: needs 2 devices, JAX sees {len(jax.devices())} ({jax.default_backend()})", file=sys.stderr
        )
        return 2
    small, large = ("tiny-gqa", "tiny-mha") if args.dry_run else ("llama-3.1-8b", "llama-3.1-70b")
    context = 16 if args.dry_run else 1024
    batches = [int(b) for b in args.batches.split(",")]
    dtype = default_dtype()
    ceiling = read_ceiling_gb_s(0.25 if args.dry_run else 4)
    out = {
        "device": device_name(),
        "devices": len(jax.devices()),
        "backend": jax.default_backend(),
        "read_ceiling_gb_s_per_device": round(ceiling, 1),
        "date": time.strftime("%Y-%m-%d"),
        "rows": [],
        "allreduce": [],
        "errors": [],
    }
    print(f"{out['device']} x{out['devices']}: read ceiling {ceiling:.0f} GB/s per device", file=sys.stderr)

    cfg = get_preset(small)
    for b in batches:
        us = allreduce_us(cfg.dim, b)
        out["allreduce"].append({"batch": b, "dim": cfg.dim, "dtype": "bfloat16", "us_per_psum": round(us, 2)})
        print(f"psum [{b}, {cfg.dim}] bf16 over 2: {us:.1f} us", file=sys.stderr)

    # The small model: TP1 vs TP2 on the same weights.
    model = init_random(cfg, seed=0, dtype=dtype)
    rng_prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, PROMPT))
    logits, tokens = {}, {}
    modes = list(dict.fromkeys([default_loop_mode(), "slice"]))  # on an error, fall back to the sliced scan
    for tp in (1, 2):
        for mode in modes:
            try:
                engine = Engine(model, tp=tp, loop_mode=mode)
                logits[tp] = engine.forward_logits(rng_prompt)  # [1, T, V]
                for b in batches:
                    r, tokens[(tp, b)] = row(small, cfg, engine, b, context, ceiling, np.random.default_rng(b))
                    out["rows"].append(r)
                    print(r, file=sys.stderr)
                break
            except Exception as e:  # keep the other rows
                out["errors"].append(f"{small} tp{tp} {mode}: {type(e).__name__}: {str(e)[-800:]}")
                print(out["errors"][-1], file=sys.stderr)
            finally:
                engine = None
                gc.collect()
    if 1 in logits and 2 in logits:
        out["max_logit_diff_tp2_vs_tp1"] = float(np.abs(logits[1] - logits[2]).max())
        out["max_abs_logit"] = float(np.abs(logits[1]).max())
    for r in out["rows"]:
        if r["tp"] == 2 and (1, r["batch"]) in tokens:
            one = next(x for x in out["rows"] if x["tp"] == 1 and x["batch"] == r["batch"])
            r["speedup_vs_tp1"] = round(one["ms_per_token"] / r["ms_per_token"], 2)
            r["tokens_agree_of_16"] = tokens_agree(
                tokens[(2, r["batch"])][:, :AGREE], tokens[(1, r["batch"])][:, :AGREE]
            )
    del model, logits, tokens
    gc.collect()

    # The large model on 2 devices, made in place, if it fits and time allows.
    cfg = get_preset(large)
    cache_len = -(-(context + PROMPT + STEPS) // 64) * 64
    try:
        est = preflight(
            cfg,
            itemsize=jnp.dtype(dtype).itemsize,
            batch=max(batches),
            context=cache_len,
            looped=False,
            tp=2,
            available=device_memory_bytes(),
        )
        print(f"{large} on 2: preflight {est.describe()} per device", file=sys.stderr)
        if time.perf_counter() - t0 > args.budget_s - 120:
            raise TimeoutError(f"skipped: {time.perf_counter() - t0:.0f} s used of the {args.budget_s:.0f} s budget")
        start = time.perf_counter()
        done = {r["loop_mode"] for r in out["rows"] if r["tp"] == 2}  # the mode that worked for the small model
        engine = Engine(None, tp=TPForward.random(cfg, 2, dtype=dtype, loop_mode=next(iter(done), modes[-1])))
        jax.block_until_ready(engine.params)
        out["large_weights_s"] = round(time.perf_counter() - start, 1)
        for b in batches:
            r, _ = row(large, cfg, engine, b, context, ceiling, np.random.default_rng(b))
            out["rows"].append(r)
            print(r, file=sys.stderr)
    except Exception as e:
        out["errors"].append(f"{large} tp2: {type(e).__name__}: {str(e)[-800:]}")
        print(out["errors"][-1], file=sys.stderr)
    engine = None
    out["wall_s"] = round(time.perf_counter() - t0, 1)

    print(
        f"\n{'model':16} {'tp':>2} {'B':>3} {'mode':>8} {'ms/tok':>8} {'tok/s':>8} {'GB/s':>7} {'%roof':>6} "
        f"{'xTP1':>5} {'agree':>5}"
    )
    for r in out["rows"]:
        print(
            f"{r['model']:16} {r['tp']:>2} {r['batch']:>3} {r['loop_mode']:>8} {r['ms_per_token']:>8.2f} "
            f"{r['tok_s']:>8.1f} {r['gb_s']:>7.0f} {r['pct_roofline']:>6.1f} {r.get('speedup_vs_tp1', ''):>5} "
            f"{r.get('tokens_agree_of_16', ''):>5}"
        )
    for a in out["allreduce"]:
        print(f"psum [{a['batch']}, {a['dim']}] bf16 over 2 devices: {a['us_per_psum']:.1f} us")
    if "max_logit_diff_tp2_vs_tp1" in out:
        print(f"max |logit TP2 - TP1| {out['max_logit_diff_tp2_vs_tp1']:.4g} (max |logit| {out['max_abs_logit']:.3g})")
    for e in out["errors"]:
        print(f"error: {e}")
    text = json.dumps(out, indent=1)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "tp_gpu.json"), "w") as f:
            f.write(text)
        print(f"wrote {os.environ['OUT']}/tp_gpu.json")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

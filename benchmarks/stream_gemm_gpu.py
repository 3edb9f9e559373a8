"""GPU: the Stream-K flat GEMM (kernels/flat_gemm_stream.py) against the tile-per-CTA Mosaic kernel,
XLA (cuBLAS) and torch (cuBLAS in a CUDA graph), on Llama-3.1-8B's decode projections in a loop over
32 stacked layers; then where one decode step of the engine spends its time (a profiler trace).

    JAX_PLATFORMS=cuda,cpu python benchmarks/stream_gemm_gpu.py --out $OUT [--only correct,loop,sweep,profile]

Sections:
- correct: the compiled kernel against `flat_gemm_multi_reference` (one, two and three weights,
  M = 1..256, K up to 14336, tiles shared by up to 56 CTAs).
- loop: µs per layer of each projection (qkv, o, gate+up, down) at M = 1, 8, 32, looped over 32
  stacked layers: xla_unrolled (one XLA dot per weight, unrolled), mosaic (kernels/flat_gemm, one
  launch per weight; gate+up as flat_gemm_swiglu), stream (one flat_gemm_multi launch for all the
  weights of the projection), torch (one cuBLAS matmul on the weights concatenated, 32 calls in a
  CUDA graph: the hardware's best case, no launch gaps).
- sweep: stream tile and stage choices at M = 1 and 8.
- gemv: the M = 1 GEMV path's tile, split and warp choices on the o projection.
- profile: one decode chunk of the engine (Llama-3.1-8B, random bf16, batch 1, 1k context) under
  `jax.profiler.trace`; GPU kernel time per kernel kind, and the gaps between kernels.
The ceiling (sum over 4 GiB, jax and torch) is measured first; % is of the higher of the two.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import kernels_bench as kb  # noqa: E402  (sets XLA_FLAGS before jax is imported)
import numpy as np  # noqa: E402
from gpu_trace import gpu_pids, kernel_events, traced_events, track_names  # noqa: E402
from jax import lax  # noqa: E402

from kernels import flat_gemm as fg  # noqa: E402
from kernels import flat_gemm_stream as fs  # noqa: E402

LAYERS = 32
D, F, KV = 4096, 14336, 1024
# projection -> (K, weight widths)
PROJECTIONS = {"qkv": (D, (D, KV, KV)), "o": (D, (D,)), "gate_up": (D, (F, F)), "down": (F, (D,))}


def check_correctness():
    kb.log("\n== stream kernel, compiled, vs the reference ==")
    cases = [
        (1, 4096, (4096, 1024, 1024)),
        (5, 4096, (14336, 14336)),
        (8, 14336, (4096,)),
        (32, 4096, (4096,)),
        (64, 4096, (6144,)),
        (128, 1024, (512, 256)),
        (256, 2048, (1024,)),
        (3, 14336, (128,)),
    ]
    for m, k, ns in cases:
        key = jax.random.split(jax.random.key(m + k), len(ns) + 1)
        x = jax.random.normal(key[0], (m, k), jnp.bfloat16)
        ws = tuple((jax.random.normal(kk, (2, k, n)) / np.sqrt(k)).astype(jnp.bfloat16) for kk, n in zip(key[1:], ns))
        out = fs.flat_gemm_multi(x, ws, jnp.int32(1))
        ref = fs.flat_gemm_multi_reference(x, ws, 1)
        errs = [kb.rel_err(o, r) for o, r in zip(out, ref)]
        sched = fs.schedule(k, ns, fs.StreamBlocks(), fs.default_ctas())
        kb.log(f"  M={m} K={k} N={ns}: rel err {max(errs):.2e} (ctas {sched.ctas}, slots {sched.slots})")
        kb.RESULTS.append(
            dict(group="correct", name=f"m{m}_k{k}_n{'+'.join(map(str, ns))}", rel_err=max(errs), ok=max(errs) < 1e-2)
        )


def check_every_m():
    """Compiled correctness for every M = 1..64 (batch sizes are arbitrary), two tilings."""
    kb.log("\n== stream kernel, compiled, every M ==")
    tilings = {
        "default": (4096, (4096, 1024, 1024), fs.StreamBlocks()),
        "small": (256, (128,), fs.StreamBlocks(tile_n=64, tile_k=128, stages=2, ctas=7)),
    }
    for label, (k, ns, cfg) in tilings.items():
        bad = []
        for m in range(1, 65):
            key = jax.random.split(jax.random.key(m), len(ns) + 1)
            x = jax.random.normal(key[0], (m, k), jnp.bfloat16)
            ws = tuple(
                (jax.random.normal(kk, (2, k, n)) / np.sqrt(k)).astype(jnp.bfloat16) for kk, n in zip(key[1:], ns)
            )
            try:
                out = fs.flat_gemm_multi(x, ws, jnp.int32(1), block_sizes=cfg)
                err = max(kb.rel_err(o, r) for o, r in zip(out, fs.flat_gemm_multi_reference(x, ws, 1)))
            except Exception as e:  # noqa: BLE001
                err, msg = float("nan"), f"{type(e).__name__}: {str(e)[:300]}"
                kb.log(f"  {label} M={m}: {msg}")
            if not err < 1e-2:
                bad.append(m)
            kb.RESULTS.append(dict(group="every_m", name=f"{label}_m{m}", rel_err=err))
        kb.log(f"  {label}: M with a wrong or failed result: {bad or 'none'}")


def _weights(k, ns, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(ns))
    return tuple(jax.random.normal(kk, (LAYERS, k, n), jnp.bfloat16) * 0.02 for kk, n in zip(keys, ns))


def _loop_variants(proj, blocks=fs.StreamBlocks()):
    """impl -> fn(x, ws, l) -> [M, D-ish] output of one layer's projection."""

    def xla(x, ws, l):
        ys = [x @ w[l] for w in ws]
        return jax.nn.silu(ys[0]) * ys[1] if proj == "gate_up" else jnp.concatenate(ys, axis=1)

    def mosaic(x, ws, l):
        if proj == "gate_up":
            return fg.flat_gemm_swiglu(x, *ws, l, impl="mosaic")
        return jnp.concatenate([fg.flat_gemm(x, w, l, impl="mosaic") for w in ws], axis=1)

    def stream(x, ws, l):
        if proj == "gate_up":
            g, u = fs.flat_gemm_multi(x, ws, l, out_dtype=jnp.float32, block_sizes=blocks)
            return (jax.nn.silu(g) * u).astype(x.dtype)
        return jnp.concatenate(fs.flat_gemm_multi(x, ws, l, block_sizes=blocks), axis=1)

    return {"xla_unrolled": xla, "mosaic": mosaic, "stream": stream}


def time_loop(fn, ws, m, k, unrolled: bool) -> float:
    """µs per layer of fn over 32 stacked layers, with a dependency from layer to layer."""
    reps = 4
    small = [(jax.random.normal(jax.random.key(i), (m, k), jnp.bfloat16),) for i in range(reps)]

    def step(x, y):
        return (
            x + 1e-3 * y[:, : x.shape[1]].astype(x.dtype)
            if y.shape[1] >= x.shape[1]
            else x + 1e-3 * jnp.pad(y, ((0, 0), (0, x.shape[1] - y.shape[1]))).astype(x.dtype)
        )

    def loop(x, *ws):
        if unrolled:
            for l in range(LAYERS):
                x = step(x, fn(x, ws, l))
            return x
        return lax.fori_loop(0, LAYERS, lambda l, c: step(c, fn(c, ws, l)), x)

    return kb.time_jax(loop, [ws], small, reps=reps) / LAYERS


def torch_layer_us(m, k, ns) -> float:
    import torch

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    sets = [(torch.randn(k, sum(ns), device="cuda", dtype=torch.bfloat16),) for _ in range(LAYERS)]
    us = kb.time_torch(lambda w: x @ w, sets, reps=LAYERS)
    del sets
    torch.cuda.empty_cache()
    return us


def bench_loop(ms=(1, 8, 32)):
    kb.log("\n== 32 stacked layers, µs per layer (bytes = one layer's weights of the projection) ==")
    for proj, (k, ns) in PROJECTIONS.items():
        ws = _weights(k, ns)
        nbytes = k * sum(ns) * 2
        for m in ms:
            for impl, fn in _loop_variants(proj).items():
                us = kb.attempt(
                    f"loop/{proj}/m{m}/{impl}", lambda: time_loop(fn, ws, m, k, unrolled=impl == "xla_unrolled")
                )
                if us is not None:
                    kb.record("loop", f"{proj}_m{m}", impl, us, nbytes, m=m)
        del ws
        for m in ms:
            us = kb.attempt(f"loop/{proj}/m{m}/torch", lambda: torch_layer_us(m, k, ns))
            if us is not None:
                kb.record("loop", f"{proj}_m{m}", "torch_cudagraph", us, nbytes, m=m)


def bench_sweep():
    kb.log("\n== stream: tile and stage sweep (µs per layer) ==")
    configs = [
        fs.StreamBlocks(tile_n=tn, tile_k=tk, stages=st)
        for tn in (64, 128)
        for tk in (128, 256, 512)
        for st in (3, 4, 6)
        if st * tk * (tn + 8) * 2 <= 200 * 1024
    ]
    for proj in ("gate_up", "down", "o"):
        k, ns = PROJECTIONS[proj]
        ws = _weights(k, ns)
        for m in (1, 8):
            for cfg in configs:
                fn = _loop_variants(proj, cfg)["stream"]
                us = kb.attempt(f"sweep/{proj}/m{m}/{cfg}", lambda: time_loop(fn, ws, m, k, unrolled=False))
                if us is not None:
                    kb.record(
                        "sweep",
                        f"{proj}_m{m}",
                        f"stream_n{cfg.tile_n}_k{cfg.tile_k}_s{cfg.stages}",
                        us,
                        k * sum(ns) * 2,
                        m=m,
                    )
        del ws


def bench_gemv():
    """The M = 1 GEMV path (kernels/flat_gemm, impl "gemv") on the o projection, looped over 32 stacked
    layers, over tile, split and warp choices; the default BlockSizes() row is the shipped choice."""
    kb.log("\n== gemv: o projection (K 4096, N 4096), M = 1, µs per layer ==")
    k, ns = PROJECTIONS["o"]
    ws = _weights(k, ns)
    configs = [fg.BlockSizes()] + [
        fg.BlockSizes(tile_n=tn, tile_k=tk, k_splits=sp, num_warps=nw, num_stages=st)
        for tn, tk, sp, nw, st in [
            (64, 256, 8, 4, 3),
            (128, 256, 4, 4, 3),
            (128, 256, 8, 4, 3),
            (128, 128, 8, 4, 3),
            (128, 128, 16, 4, 3),
            (256, 128, 8, 8, 3),
            (256, 64, 16, 8, 3),
            (64, 128, 8, 4, 3),
            (64, 512, 2, 4, 3),
            (128, 512, 4, 8, 3),
            (32, 256, 4, 2, 3),
            (32, 512, 2, 4, 3),
            (64, 256, 4, 4, 4),
            (128, 128, 8, 4, 4),
            (64, 64, 16, 2, 4),
            (128, 64, 16, 4, 4),
        ]
    ]
    for cfg in configs:
        fn = lambda x, ws, l, cfg=cfg: fg.flat_gemm(x, ws[0], l, impl="gemv", block_sizes=cfg)  # noqa: E731
        us = kb.attempt(f"gemv/{cfg}", lambda: time_loop(fn, ws, 1, k, unrolled=False))
        if us is not None:
            kb.record(
                "gemv",
                "o_m1",
                f"gemv_n{cfg.tile_n}_k{cfg.tile_k}_s{cfg.k_splits}_w{cfg.num_warps}_st{cfg.num_stages}",
                us,
                k * sum(ns) * 2,
                m=1,
            )
    del ws


def profile_decode(out_dir):
    """Kernel time per kind and gaps, one decode chunk of the engine (8B, batch 1, 1k context)."""
    from jaxdecode.bench import time_engine
    from jaxdecode.config import get_preset
    from jaxdecode.decode import Engine
    from jaxdecode.model import init_random

    kb.log("\n== profile: one decode chunk, Llama-3.1-8B bf16, batch 1, context 1k ==")
    engine = Engine(init_random(get_preset("llama-3.1-8b"), dtype=jnp.bfloat16))
    prompts = np.ones((1, 16), np.int32)
    timing = time_engine(engine, prompts, context=1024, steps=32)
    kb.log(f"  untraced: {timing.decode_s / timing.steps * 1e3:.3f} ms/token")
    cache = engine.new_cache(1, 1024 + 64)
    step = (
        jax.jit(engine.forward)
        .lower(engine.params, jnp.ones((1, 1), jnp.int32), jnp.full((1, 1), 1024, jnp.int32), cache)
        .compile()
    )
    with open(os.path.join(out_dir, "decode_step_hlo.txt"), "w") as fh:
        fh.write(step.as_text())
    del cache
    events = traced_events(lambda: time_engine(engine, prompts, context=1024, steps=32), os.path.join(out_dir, "trace"))
    on_gpu = gpu_pids(track_names(events))
    kernels = kernel_events(events, on_gpu)
    by_tid = defaultdict(list)
    for e in kernels:
        by_tid[(e["pid"], e["tid"])].append(e)
    (pid_tid, evs) = max(by_tid.items(), key=lambda kv: len(kv[1]))  # the compute stream
    evs.sort(key=lambda e: e["ts"])
    # the decode chunk: the densest 32-step window is the whole trace minus prefill; take all
    busy = sum(e["dur"] for e in evs)
    span = evs[-1]["ts"] + evs[-1]["dur"] - evs[0]["ts"]
    kinds = defaultdict(lambda: [0, 0.0])
    for e in evs:
        name = e["name"]
        kind = (
            "flat_gemm_stream"
            if "stream" in name
            else "mosaic_gemm"
            if "mosaic" in name or "_mosaic_kernel" in name
            else "attention"
            if "attention" in name or "decode" in name
            else "triton"
            if "triton" in name
            else "cublas"
            if "gemm" in name.lower() or "cublas" in name.lower() or "cutlass" in name.lower()
            else "xla_fusion"
        )
        kinds[kind][0] += 1
        kinds[kind][1] += e["dur"]
    top = defaultdict(lambda: [0, 0.0])
    for e in evs:
        top[e["name"][:80]][0] += 1
        top[e["name"][:80]][1] += e["dur"]
    tail = evs[-1200:]  # the last decode steps: one step is ~30 kernels per layer + the LM head
    sequence = [
        [e["name"][:60], round(e["dur"], 2), round(e["ts"] - (p["ts"] + p["dur"]), 2)] for p, e in zip(tail, tail[1:])
    ]
    summary = dict(
        stream=str(pid_tid),
        kernels=len(evs),
        busy_us=busy,
        span_us=span,
        sequence=sequence,
        kinds={k: dict(count=c, us=round(t, 1)) for k, (c, t) in kinds.items()},
        top=sorted(([n, c, round(t, 1)] for n, (c, t) in top.items()), key=lambda r: -r[2])[:40],
    )
    kb.RESULTS.append(dict(group="profile", **summary))
    kb.log(
        f"  {len(evs)} kernels, busy {busy / 1e3:.2f} ms of a {span / 1e3:.2f} ms span ({100 * busy / span:.1f}% busy)"
    )
    for k, (c, t) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
        kb.log(f"  {k:18s} {c:6d} kernels {t / 1e3:8.2f} ms")
    for n, c, t in summary["top"][:25]:
        kb.log(f"  {c:6d} x {t / max(c, 1):8.1f} us  {n}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--only", default="correct,loop,sweep,profile")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = jax.devices()[0]
    kb.log(
        f"jax {jax.__version__}, {dev.device_kind}, {getattr(dev, 'core_count', '?')} SMs, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    kb.measure_ceiling()
    path = os.path.join(args.out, "stream_gemm_gpu.json")
    meta = dict(
        jax=jax.__version__,
        device=dev.device_kind,
        date=time.strftime("%Y-%m-%d %H:%M UTC"),
        ceiling=kb.CEILING,
        xla_flags=os.environ.get("XLA_FLAGS"),
    )
    sections = dict(
        correct=check_correctness,
        every_m=check_every_m,
        loop=bench_loop,
        sweep=bench_sweep,
        gemv=bench_gemv,
        profile=lambda: profile_decode(args.out),
    )
    t0 = time.time()
    for name in args.only.split(","):
        kb.attempt(name, sections[name])
        kb.log(f"  [{name} done at {time.time() - t0:.0f}s]")
        with open(path, "w") as fh:
            json.dump(dict(meta=meta, results=kb.RESULTS), fh, indent=1)
    rows = [r for r in kb.RESULTS if r.get("group") == "loop"]
    kb.log(
        "\nprojection  M  " + "  ".join(f"{i:>16s}" for i in ("xla_unrolled", "mosaic", "stream", "torch_cudagraph"))
    )
    for name in dict.fromkeys(r["name"] for r in rows):
        cells = {r["impl"]: f"{r['us']:.1f} ({r['pct_ceiling']:.0f}%)" for r in rows if r["name"] == name}
        kb.log(
            f"{name:14s} "
            + "  ".join(f"{cells.get(i, '-'):>16s}" for i in ("xla_unrolled", "mosaic", "stream", "torch_cudagraph"))
        )


if __name__ == "__main__":
    main()

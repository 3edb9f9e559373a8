"""Check and time the kernels/ ops against XLA and peers on one GPU; print a table, write JSON.

  python benchmarks/kernels_bench.py [--out DIR] [--quick] [--only SECTIONS] [--smoke]

Order: HBM read ceiling (sum over a 4 GiB bf16 array); correctness of every kernel against its
jnp reference on the GPU; the headline: a loop over stacked weights [L, K, N], `lax.scan` with
`x @ W[l]` (XLA copies W[l]) against `flat_gemm(x, W, l)` (read in place); flat GEMM on the four
Llama-3.1-8B projections for M = 1..128, plain and looped over stacked layers (ours gemv / mosaic /
triton vs XLA dot, through `kernels.tune`, which also writes the dispatch table
`tune_<gpu>.json` next to the JSON), torch.matmul and SwiGLU; decode attention for B in {1, 8, 32}
x S in {1k, 4k, 32k} (ours async / async without fallback / sync, XLA einsum softmax, JAX's
deprecated Pallas-Triton `decode_attention.gqa`, torch SDPA) and the async-vs-sync speedup.

--smoke runs every section on tiny shapes in interpret mode (the CPU works), so that a typo fails
here and not on GPU time. Its timings mean nothing.

Timing: XLA's dot-merger pass is disabled (it merges timed calls that share a weight). One jit
holds R calls that rotate over input sets totalling > 2× the L2 cache, so each call
reads HBM; time = median wall time of the jit over runs / R (dispatch amortized over R).
Bytes counted: weights or K and V read once. Every row ends with GB/s and % of the read ceiling.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
import traceback

# XLA's dot-merger would fuse the timed calls that share a weight into one wider GEMM (seen on the
# H200: "x @ W" at 2x the HBM ceiling). A decode step has nothing to merge, so turn it off here.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_disable_hlo_passes=dot-merger"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from kernels import decode_attention as da  # noqa: E402
from kernels import (
    dispatch,  # noqa: E402
    tune,  # noqa: E402
)
from kernels import flat_gemm as fg  # noqa: E402
from kernels.shapes import MODELS, decode_shapes  # noqa: E402

L2_BYTES = 60 * 2**20
RESULTS: list[dict] = []
CEILING = {"read_gbps": float("nan")}
# What --smoke changes: calls per timed jit, timed runs, interpret mode, model and shapes.
RUN = dict(
    reps=32,
    runs=5,
    interpret=False,
    smoke=False,
    model=MODELS["llama3_8b"],
    attn_batches=(1, 8, 32),
    attn_lens=(1024, 4096, 32768),
    gemm_ms=tune.M_VALUES,
    loop_layers=16,
    da_blocks=da.BlockSizes(),
    fg_blocks=fg.BlockSizes(),
    out=".",
    save=lambda: None,
)


def smoke_mode():
    RUN.update(
        reps=2,
        runs=1,
        interpret=True,
        smoke=True,
        model=tune.SMOKE_MODEL,
        attn_batches=(1, 2),
        attn_lens=(64, 100),
        gemm_ms=(1, 2, 8),
        loop_layers=2,
        da_blocks=da.BlockSizes(block_k=32),
        fg_blocks=tune.SMOKE_BLOCKS,
    )


def log(*a):
    print(*a, flush=True)


def _sets(make, nbytes: int, max_sets: int = 8):
    """Enough independent input sets that rotating over them defeats the L2 cache."""
    n = min(max_sets, max(2, math.ceil(2.5 * L2_BYTES / max(nbytes, 1))))
    return [make(i) for i in range(n)]


def time_jax(fn, sets, small, reps: int | None = None, runs: int | None = None) -> float:
    """Median µs per call of fn(*small[i], *sets[i % len(sets)]) over `reps` calls in one jit.

    `small` holds one distinct small input tuple per call (x or q): without it XLA's CSE would merge
    the calls that share a set. `sets` rotate the large operands (weights, caches) past the L2.
    """
    reps, runs = reps or RUN["reps"], runs or RUN["runs"]
    assert len(small) == reps
    many = jax.jit(lambda sm, ss: [fn(*sm[i], *ss[i % len(ss)]) for i in range(reps)])
    jax.block_until_ready(many(small, sets))
    jax.block_until_ready(many(small, sets))
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(many(small, sets))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) / reps * 1e6


def time_torch(fn, sets, reps: int = 32, runs: int = 5) -> float:
    """Median µs per call, `reps` calls captured in one CUDA graph (no launch gaps)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for s in sets:
            fn(*s)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(*sets[i % len(sets)])
    graph.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(ts)


def record(group, name, impl, us, nbytes, **extra):
    gbps = nbytes / us / 1e3
    row = dict(
        group=group,
        name=name,
        impl=impl,
        us=round(us, 2),
        gbps=round(gbps, 1),
        pct_ceiling=round(100 * gbps / CEILING["read_gbps"], 1),
        bytes=nbytes,
        **extra,
    )
    RESULTS.append(row)
    log(f"  {group:9s} {name:38s} {impl:22s} {us:10.1f} us {gbps:8.0f} GB/s {row['pct_ceiling']:5.1f}%")


def attempt(label, f):
    try:
        return f()
    except Exception as e:  # one failing variant must not end the run
        log(f"  FAILED {label}: {type(e).__name__}: {str(e)[:600]}")
        RESULTS.append(dict(group="failure", name=label, error=f"{type(e).__name__}: {str(e)[:2000]}"))
        traceback.print_exc(limit=3)
        return None


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


# ---------------------------------------------------------------------------------------------


def measure_ceiling():
    x = jnp.ones((2**20 if RUN["smoke"] else 2**31,), jnp.bfloat16)  # 4 GiB
    f = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    jax.block_until_ready(f(x))
    ts = []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        ts.append(time.perf_counter() - t0)
    jax_gbps = x.nbytes / statistics.median(ts) / 1e9
    del x
    torch_gbps = float("nan")
    try:
        if RUN["smoke"]:
            raise RuntimeError("smoke mode: no torch")
        import torch

        t = torch.ones(2**31, device="cuda", dtype=torch.bfloat16)
        torch_gbps = t.nbytes / time_torch(lambda a: a.sum(dtype=torch.float32), [(t,)], reps=4, runs=10) / 1e3
        del t
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001
        log(f"  torch ceiling failed: {e}")
    CEILING["read_gbps"] = max(jax_gbps, np.nan_to_num(torch_gbps))
    CEILING.update(jax_sum_gbps=jax_gbps, torch_sum_gbps=torch_gbps)
    log(
        f"HBM read ceiling: {CEILING['read_gbps']:.0f} GB/s (sum over 4 GiB bf16: jax "
        f"{jax_gbps:.0f}, torch {torch_gbps:.0f})"
    )


def check_correctness():
    log("\n== correctness on the device (relative L2 error vs the jnp reference) ==")
    key = jax.random.key(1)
    ks = jax.random.split(key, 8)
    md, interp = RUN["model"], RUN["interpret"]
    b, t, n, kh, h = 3, 1, md.num_heads, md.num_kv_heads, md.head_dim
    s = 100 if RUN["smoke"] else 4100  # not a multiple of the block: exercises the padding
    q = jax.random.normal(ks[0], (b, t, n, h), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, s, kh, h), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, s, kh, h), jnp.bfloat16)
    lengths = jnp.array([1, s // 4, s], jnp.int32)
    ref, _ = da.decode_attention_reference(q, k, v, lengths)
    akw = dict(block_sizes=RUN["da_blocks"], interpret=interp, poison=True)
    checks = {}

    def c_async():
        o, info = da.decode_attention_async(q, k, v, lengths, 0.0, **akw)
        return rel_err(o, ref), float(info.recomputed.mean())

    def c_bad_phi():
        o, info = da.decode_attention_async(q, k, v, lengths, 500.0, **akw)
        return rel_err(o, ref), float(info.recomputed.mean())

    def c_sync():
        return rel_err(da.decode_attention_sync(q, k, v, lengths, **akw), ref), 0.0

    def c_t3():
        q3 = jax.random.normal(ks[3], (b, 3, n, h), jnp.bfloat16)
        r3, _ = da.decode_attention_reference(q3, k, v, lengths + 2)
        o, info = da.decode_attention_async(q3, k, v, lengths + 2, 0.0, **akw)
        return rel_err(o, r3), float(info.recomputed.mean())

    for name, f in dict(attn_async=c_async, attn_async_bad_phi=c_bad_phi, attn_sync=c_sync, attn_async_t3=c_t3).items():
        r = attempt(name, f)
        if r is not None:
            checks[name] = dict(rel_err=r[0], recompute_rate=r[1])
            log(f"  {name:28s} rel_err={r[0]:.2e} recompute_rate={r[1]:.3f}")

    layers, kk, nn = 4, md.d_model, md.ffn
    w = jax.random.normal(ks[4], (layers, kk, nn), jnp.bfloat16) * 0.02
    wu = jax.random.normal(ks[5], (layers, kk, nn), jnp.bfloat16) * 0.02
    gkw = dict(block_sizes=RUN["fg_blocks"], interpret=interp)
    for m in (1, 8, 13, 64, 128):
        x = jax.random.normal(ks[6], (m, kk), jnp.bfloat16)
        r = jax.random.normal(ks[7], (m, nn), jnp.bfloat16)
        ref = fg.flat_gemm_reference(x, w, 2, r)
        ref_sw = fg.flat_gemm_swiglu_reference(x, w, wu, 3)
        impls = ["mosaic", "triton"] + (["gemv"] if m == 1 else [])
        for impl in impls:
            poison = interp or impl != "mosaic"  # compiled Mosaic cannot alias its output
            e = attempt(
                f"gemm_{impl}_m{m}",
                lambda: rel_err(fg.flat_gemm(x, w, jnp.int32(2), r, impl=impl, poison=poison, **gkw), ref),
            )
            if e is not None:
                checks[f"gemm_{impl}_m{m}"] = dict(rel_err=e)
                log(f"  gemm {impl:7s} M={m:3d}              rel_err={e:.2e}")
            if impl == "gemv":
                continue
            e = attempt(
                f"swiglu_{impl}_m{m}",
                lambda: rel_err(fg.flat_gemm_swiglu(x, w, wu, jnp.int32(3), impl=impl, poison=poison, **gkw), ref_sw),
            )
            if e is not None:
                checks[f"swiglu_{impl}_m{m}"] = dict(rel_err=e)
                log(f"  swiglu {impl:7s} M={m:3d}            rel_err={e:.2e}")
    RESULTS.append(dict(group="correctness", checks=checks))


# ---------------------------------------------------------------------------------------------


def bench_attention(quick: bool):
    log("\n== decode attention (bytes = K and V read once) ==")
    md, interp, blocks = RUN["model"], RUN["interpret"], RUN["da_blocks"]
    shapes = [decode_shapes(md, b, s).attention for b in RUN["attn_batches"] for s in RUN["attn_lens"]]
    if quick:
        shapes = shapes[::3]
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from jax.experimental.pallas.ops.gpu import decode_attention as jax_da
    except Exception:  # noqa: BLE001
        jax_da = None
    if interp:
        jax_da = None  # JAX's kernel hard-codes GPU compiler params
    kw = dict(block_sizes=blocks, interpret=interp)
    for a in shapes:
        sname = a.name
        b, t, n, kh, h, s = a.batch, a.tokens, a.num_heads, a.num_kv_heads, a.head_dim, a.cache_len

        def make(i):
            ks = jax.random.split(jax.random.key(100 + i), 2)
            return (
                jax.random.normal(ks[0], (b, s, kh, h), jnp.bfloat16),
                jax.random.normal(ks[1], (b, s, kh, h), jnp.bfloat16),
            )

        sets = _sets(make, a.kv_bytes)
        small = [
            (jax.random.normal(jax.random.key(i), (b, t, n, h), jnp.bfloat16), jnp.full((b,), s, jnp.int32))
            for i in range(RUN["reps"])
        ]
        variants = {
            "ours_async": lambda q, L, k, v: da.decode_attention_async(q, k, v, L, 0.0, **kw)[0],
            "ours_async_norecompute": lambda q, L, k, v: da.decode_attention_async(
                q, k, v, L, 0.0, recompute=False, **kw
            )[0],
            "ours_sync": lambda q, L, k, v: da.decode_attention_sync(q, k, v, L, **kw),
            "xla_einsum_softmax": lambda q, L, k, v: da.decode_attention_reference(q, k, v, L)[0],
        }
        if jax_da is not None and t == 1:
            variants["jax_pallas_gqa(triton)"] = lambda q, L, k, v: jax_da.gqa(q[:, 0], k, v, kv_seq_len=L)
        times = {}
        for impl, f in variants.items():
            us = attempt(f"{sname}/{impl}", lambda: time_jax(f, sets, small))
            if us is not None:
                times[impl] = us
                record("attention", sname, impl, us, a.kv_bytes, batch=b, cache_len=s)
        sets = None  # freed before torch makes its own inputs
        if {"ours_async", "ours_sync", "ours_async_norecompute"} <= set(times):
            speed = dict(
                with_fallback=times["ours_sync"] / times["ours_async"],
                without_fallback=times["ours_sync"] / times["ours_async_norecompute"],
            )
            RESULTS.append(
                dict(
                    group="async_speedup",
                    name=sname,
                    batch=b,
                    cache_len=s,
                    **{k: round(v, 3) for k, v in speed.items()},
                )
            )
            log(
                f"  async vs sync {sname}: x{speed['with_fallback']:.2f} with the fallback launch, "
                f"x{speed['without_fallback']:.2f} without (sync µs / async µs)"
            )
        if RUN["smoke"]:
            continue

        def torch_sdpa():
            import torch
            import torch.nn.functional as F

            tsets = []
            for i in range(len(_sets(lambda i: i, a.kv_bytes))):
                g = torch.Generator(device="cuda").manual_seed(i)
                mk = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
                tsets.append((mk(b, n, t, h), mk(b, kh, s, h), mk(b, kh, s, h)))
            return time_torch(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), tsets)

        us = attempt(f"{sname}/torch_sdpa", torch_sdpa)
        if us is not None:
            record("attention", sname, "torch_sdpa", us, a.kv_bytes, batch=b, cache_len=s)
        RUN["save"]()  # after every shape: a run cut short keeps what it measured


def bench_gemm(quick: bool):
    """The four projections, plain and looped, through kernels.tune; writes the dispatch table."""
    log("\n== flat GEMM, Llama-3.1-8B projections, plain and looped (bytes = one layer's weight) ==")
    if not RUN["smoke"]:
        w = jnp.ones((4096, 4096), jnp.bfloat16)
        xs = [jnp.full((8, 4096), i, jnp.bfloat16) for i in range(2)]
        hlo = jax.jit(lambda a, b, w: [a @ w, b @ w]).lower(*xs, w).compile().as_text()
        log(
            f"  dot-merger check, 2 dots sharing W: {hlo.count('__cublas')} cuBLAS calls, "
            f"{hlo.count(' dot(')} dots (2 and 2 = not merged)"
        )
    ms = tuple(m for m in RUN["gemm_ms"] if not quick or m in (1, 8, 32))
    shapes = tune.decode_gemm_shapes(RUN["model"], layers=RUN["loop_layers"])
    device_timer = tune.device_timer(
        reps=RUN["reps"], runs=RUN["runs"], interpret=RUN["interpret"], block_sizes=RUN["fg_blocks"]
    )

    def timer(s, impl, m):
        us = attempt(f"gemm/{s.form}/{s.op}/m{m}/{impl}", lambda: device_timer(s, impl, m))
        if us is not None:
            record(
                "gemm" if s.form == "plain" else "gemm_looped",
                f"{s.op}_k{s.k}_n{s.n}_m{m}",
                impl,
                us,
                2 * s.k * s.n,
                m=m,
                k=s.k,
                n=s.n,
                form=s.form,
                layers=s.layers,
            )
        return us

    gemm = tune.profile_gemm(shapes, timer, ms, log=lambda *a: None)
    dev = jax.devices()[0]
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    source = f"benchmarks/kernels_bench.py (kernels.tune timer) on {dev.device_kind}, jax {jax.__version__}, {date}" + (
        " (SMOKE: meaningless)" if RUN["smoke"] else ""
    )
    attention = _attention_timings()
    table = attempt("tune_table", lambda: tune.build_table(dev.device_kind, source, gemm, ms, attention))
    if table is not None:
        path = os.path.join(RUN["out"], f"tune_{dispatch.normalize_gpu_name(dev.device_kind)}.json")
        with open(path, "w") as fh:
            json.dump(table, fh, indent=1)
        RESULTS.append(
            dict(
                group="tune_table",
                path=path,
                gemm=[{k: e[k] for k in ("op", "form", "n", "k", "m1", "m2", "flat_impl")} for e in table["gemm"]],
                attention=table.get("attention", {}).get("impl"),
            )
        )
        for e in table["gemm"]:
            log(
                f"  table {e['form']:6s} {e['op']:8s} [N, K]=[{e['n']}, {e['k']}]  M1={e['m1']} "
                f"M2={e['m2']} flat={e['flat_impl']}"
            )
        log(f"  wrote {path}")
    if RUN["smoke"]:
        return
    for s in shapes:
        if s.form != "plain":
            continue
        for m in (1, 8, 32, 64):
            us = attempt(f"{s.op}/m{m}/torch", lambda: _torch_matmul(m, s.k, s.n, 4))
            if us is not None:
                record(
                    "gemm",
                    f"{s.op}_k{s.k}_n{s.n}_m{m}",
                    "torch_matmul",
                    us,
                    2 * s.k * s.n,
                    m=m,
                    k=s.k,
                    n=s.n,
                    form="plain",
                )
    log("\n== SwiGLU (gate+up in one kernel) ==")
    d, f_ = 4096, 14336
    wg = [
        (
            jax.random.normal(jax.random.key(300 + i), (2, d, f_), jnp.bfloat16) * 0.02,
            jax.random.normal(jax.random.key(400 + i), (2, d, f_), jnp.bfloat16) * 0.02,
        )
        for i in range(2)
    ]
    for m in (1, 8, 32):
        small = [(jax.random.normal(jax.random.key(i), (m, d), jnp.bfloat16),) for i in range(32)]
        for impl in ("xla", "mosaic", "triton"):
            us = attempt(
                f"swiglu/m{m}/{impl}",
                lambda: time_jax(lambda x, a, b: fg.flat_gemm_swiglu(x, a, b, 1, impl=impl), wg, small),
            )
            if us is not None:
                record("swiglu", f"swiglu_d{d}_f{f_}_m{m}", impl, us, 2 * 2 * d * f_, m=m)


def _attention_timings():
    """The attention rows already measured, as tune.build_table wants them (impl -> shape -> µs)."""
    names = {"ours_async": "async", "ours_sync": "sync", "xla_einsum_softmax": "xla"}
    out: dict[str, dict[str, float]] = {}
    for r in RESULTS:
        if r.get("group") == "attention" and r["impl"] in names:
            out.setdefault(names[r["impl"]], {})[r["name"]] = r["us"]
    return out or None


def _torch_matmul(m, k, n, nsets):
    import torch

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ws = [(torch.randn(k, n, device="cuda", dtype=torch.bfloat16),) for _ in range(nsets)]
    return time_torch(lambda w: x @ w, ws)


def bench_looped(quick: bool):
    log("\n== headline: loop over stacked weights [L, K, N] (bytes = L layers' weights) ==")
    md, interp, blocks = RUN["model"], RUN["interpret"], RUN["fg_blocks"]
    layers = md.num_layers
    cases = [(layers, md.d_model, md.d_model), (layers, md.d_model, md.ffn)]
    for layers, k, n in cases:
        w = jax.random.normal(jax.random.key(7), (layers, k, n), jnp.bfloat16) * 0.02
        nbytes = layers * k * n * 2
        for m in (1, 8):
            reps = 2 if RUN["smoke"] else 4
            small = [(jax.random.normal(jax.random.key(i), (m, k), jnp.bfloat16),) for i in range(reps)]

            def step(x, y):  # keeps a dependency from layer to layer, like a decoder
                return x + 1e-3 * y[:, :k].astype(x.dtype)

            def scan_xla(x, w):
                return lax.scan(lambda c, wl: (step(c, c @ wl), None), x, w)[0]

            def loop_kernel(x, w, impl):
                return lax.fori_loop(
                    0,
                    layers,
                    lambda l, c: step(c, fg.flat_gemm(c, w, l, impl=impl, block_sizes=blocks, interpret=interp)),
                    x,
                )

            def unrolled_xla(x, w):
                for l in range(layers):
                    x = step(x, x @ w[l])
                return x

            variants = {
                "xla_scan(x@W[l])": scan_xla,
                "xla_unrolled": unrolled_xla,
                "ours_mosaic_loop(W,l)": functools.partial(loop_kernel, impl="mosaic"),
                "ours_triton_loop(W,l)": functools.partial(loop_kernel, impl="triton"),
            }
            if m == 1:
                variants["ours_gemv_loop(W,l)"] = functools.partial(loop_kernel, impl="gemv")
            for impl, f in variants.items():
                us = attempt(f"loop/{k}x{n}/m{m}/{impl}", lambda: time_jax(f, [(w,)], small, reps=reps))
                if us is not None:
                    record("looped", f"L{layers}_k{k}_n{n}_m{m}", impl, us, nbytes, m=m)
        w = None  # freed before the next shape's weights


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--smoke", action="store_true", help="tiny shapes in interpret mode (CPU): checks the script, times nothing"
    )
    p.add_argument("--only", default="ceiling,correct,looped,attention,gemm")
    args = p.parse_args()
    if args.smoke:
        smoke_mode()
    RUN["out"] = args.out
    os.makedirs(args.out, exist_ok=True)
    dev = jax.devices()[0]
    log(
        f"jax {jax.__version__}, device {dev.device_kind} ({dev.platform}), "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}" + (" SMOKE" if args.smoke else "")
    )
    log(f"dispatch: gemm M=1 {dispatch.choose_gemm(1, 14336, 4096)}, attention {dispatch.choose_attention()}")
    only = args.only.split(",")
    t0 = time.time()
    measure_ceiling()
    meta = dict(
        jax=jax.__version__,
        device=dev.device_kind,
        date=time.strftime("%Y-%m-%d"),
        xla_flags=os.environ["XLA_FLAGS"],
        ceiling=CEILING,
        smoke=args.smoke,
    )
    path = os.path.join(args.out, "kernels_bench.json")

    def save():  # after every section, so a run cut short still leaves its numbers
        with open(path, "w") as fh:
            json.dump(dict(meta=meta, results=RESULTS), fh, indent=1)

    RUN["save"] = save

    # attention before gemm: the tune table takes its attention entry from those rows
    for name, f in (
        ("correct", check_correctness),
        ("looped", bench_looped),
        ("attention", bench_attention),
        ("gemm", bench_gemm),
    ):
        if name in only:
            attempt(name, (lambda f=f: f() if f is check_correctness else f(args.quick)))
            log(f"  [{name} done at {time.time() - t0:.0f}s]")
            save()
    save()
    log(f"\nwrote {path}")
    failures = [r["name"] for r in RESULTS if r.get("group") == "failure"]
    log(json.dumps(dict(meta=meta, n_results=len(RESULTS), failures=failures)))
    return 1 if args.smoke and failures else 0


if __name__ == "__main__":
    sys.exit(main())

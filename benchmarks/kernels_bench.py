"""Check and time the kernels/ ops against XLA and peers on one GPU; print a table, write JSON.

  python benchmarks/kernels_bench.py [--out DIR] [--quick]

Order: HBM read ceiling (sum over a 4 GiB bf16 array); correctness of every kernel against its
jnp reference on the GPU; decode attention (ours async/sync, XLA einsum softmax, JAX's deprecated
Pallas-Triton `decode_attention.gqa`, torch SDPA); flat GEMM (ours mosaic/triton/gemv, XLA dot,
torch.matmul, a small tile sweep); and the headline: a loop over stacked weights [L, K, N],
`lax.scan` with `x @ W[l]` (XLA copies W[l]) against `flat_gemm(x, W, l)` (read in place).

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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# XLA's dot-merger would fuse the timed calls that share a weight into one wider GEMM (seen on the
# H200: "x @ W" at 2x the HBM ceiling). A decode step has nothing to merge, so turn it off here.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_disable_hlo_passes=dot-merger"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from kernels import decode_attention as da  # noqa: E402
from kernels import dispatch  # noqa: E402
from kernels import flat_gemm as fg  # noqa: E402
from kernels.shapes import CATALOG  # noqa: E402

L2_BYTES = 60 * 2**20
RESULTS: list[dict] = []
CEILING = {"read_gbps": float("nan")}


def log(*a):
  print(*a, flush=True)


def _sets(make, nbytes: int, max_sets: int = 8):
  """Enough independent input sets that rotating over them defeats the L2 cache."""
  n = min(max_sets, max(2, math.ceil(2.5 * L2_BYTES / max(nbytes, 1))))
  return [make(i) for i in range(n)]


def time_jax(fn, sets, small, reps: int = 32, runs: int = 5) -> float:
  """Median µs per call of fn(*small[i], *sets[i % len(sets)]) over `reps` calls in one jit.

  `small` holds one distinct small input tuple per call (x or q): without it XLA's CSE would merge
  the calls that share a set. `sets` rotate the large operands (weights, caches) past the L2.
  """
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
  row = dict(group=group, name=name, impl=impl, us=round(us, 2), gbps=round(gbps, 1),
             pct_ceiling=round(100 * gbps / CEILING["read_gbps"], 1), bytes=nbytes, **extra)
  RESULTS.append(row)
  log(f"  {group:9s} {name:38s} {impl:22s} {us:10.1f} us {gbps:8.0f} GB/s "
      f"{row['pct_ceiling']:5.1f}%")


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
  x = jnp.ones((2**31,), jnp.bfloat16)  # 4 GiB
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
    import torch
    t = torch.ones(2**31, device="cuda", dtype=torch.bfloat16)
    torch_gbps = t.nbytes / time_torch(lambda a: a.sum(dtype=torch.float32), [(t,)], reps=4,
                                       runs=10) / 1e3
    del t
    torch.cuda.empty_cache()
  except Exception as e:  # noqa: BLE001
    log(f"  torch ceiling failed: {e}")
  CEILING["read_gbps"] = max(jax_gbps, np.nan_to_num(torch_gbps))
  CEILING.update(jax_sum_gbps=jax_gbps, torch_sum_gbps=torch_gbps)
  log(f"HBM read ceiling: {CEILING['read_gbps']:.0f} GB/s (sum over 4 GiB bf16: jax "
      f"{jax_gbps:.0f}, torch {torch_gbps:.0f})")


def check_correctness():
  log("\n== correctness on the GPU (relative L2 error vs the jnp reference) ==")
  key = jax.random.key(1)
  ks = jax.random.split(key, 8)
  b, t, n, kh, h, s = 3, 1, 32, 8, 128, 4096
  q = jax.random.normal(ks[0], (b, t, n, h), jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, s, kh, h), jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, s, kh, h), jnp.bfloat16)
  lengths = jnp.array([1, 1000, 4096], jnp.int32)
  ref, _ = da.decode_attention_reference(q, k, v, lengths)
  checks = {}

  def c_async():
    o, info = da.decode_attention_async(q, k, v, lengths, 0.0)
    return rel_err(o, ref), float(info.recomputed.mean())

  def c_bad_phi():
    o, info = da.decode_attention_async(q, k, v, lengths, 500.0)
    return rel_err(o, ref), float(info.recomputed.mean())

  def c_sync():
    return rel_err(da.decode_attention_sync(q, k, v, lengths), ref), 0.0

  def c_t3():
    q3 = jax.random.normal(ks[3], (b, 3, n, h), jnp.bfloat16)
    r3, _ = da.decode_attention_reference(q3, k, v, lengths + 2)
    o, info = da.decode_attention_async(q3, k, v, lengths + 2, 0.0)
    return rel_err(o, r3), float(info.recomputed.mean())

  for name, f in dict(attn_async=c_async, attn_async_bad_phi=c_bad_phi, attn_sync=c_sync,
                      attn_async_t3=c_t3).items():
    r = attempt(name, f)
    if r is not None:
      checks[name] = dict(rel_err=r[0], recompute_rate=r[1])
      log(f"  {name:28s} rel_err={r[0]:.2e} recompute_rate={r[1]:.3f}")

  layers, kk, nn = 4, 4096, 14336
  w = jax.random.normal(ks[4], (layers, kk, nn), jnp.bfloat16) * 0.02
  wu = jax.random.normal(ks[5], (layers, kk, nn), jnp.bfloat16) * 0.02
  for m in (1, 8, 13, 64):
    x = jax.random.normal(ks[6], (m, kk), jnp.bfloat16)
    r = jax.random.normal(ks[7], (m, nn), jnp.bfloat16)
    ref = fg.flat_gemm_reference(x, w, 2, r)
    ref_sw = fg.flat_gemm_swiglu_reference(x, w, wu, 3)
    impls = ["mosaic", "triton"] + (["gemv"] if m == 1 else [])
    for impl in impls:
      e = attempt(f"gemm_{impl}_m{m}",
                  lambda: rel_err(fg.flat_gemm(x, w, jnp.int32(2), r, impl=impl), ref))
      if e is not None:
        checks[f"gemm_{impl}_m{m}"] = dict(rel_err=e)
        log(f"  gemm {impl:7s} M={m:3d}              rel_err={e:.2e}")
      if impl == "gemv":
        continue
      e = attempt(f"swiglu_{impl}_m{m}",
                  lambda: rel_err(fg.flat_gemm_swiglu(x, w, wu, jnp.int32(3), impl=impl), ref_sw))
      if e is not None:
        checks[f"swiglu_{impl}_m{m}"] = dict(rel_err=e)
        log(f"  swiglu {impl:7s} M={m:3d}            rel_err={e:.2e}")
  RESULTS.append(dict(group="correctness", checks=checks))


# ---------------------------------------------------------------------------------------------


def bench_attention(quick: bool):
  log("\n== decode attention (bytes = K and V read once) ==")
  names = ["llama3_8b_b1_s8192_decode", "llama3_8b_b1_s32768_decode",
           "llama3_8b_b8_s8192_decode", "llama3_8b_b32_s8192_decode"]
  if quick:
    names = names[:2]
  try:
    import warnings
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      from jax.experimental.pallas.ops.gpu import decode_attention as jax_da
  except Exception:  # noqa: BLE001
    jax_da = None
  for sname in names:
    a = CATALOG[sname].attention
    b, t, n, kh, h, s = a.batch, a.tokens, a.num_heads, a.num_kv_heads, a.head_dim, a.cache_len

    def make(i):
      ks = jax.random.split(jax.random.key(100 + i), 2)
      return (jax.random.normal(ks[0], (b, s, kh, h), jnp.bfloat16),
              jax.random.normal(ks[1], (b, s, kh, h), jnp.bfloat16))

    sets = _sets(make, a.kv_bytes)
    small = [(jax.random.normal(jax.random.key(i), (b, t, n, h), jnp.bfloat16),
              jnp.full((b,), s, jnp.int32)) for i in range(32)]
    variants = {
        "ours_async": lambda q, L, k, v: da.decode_attention_async(q, k, v, L, 0.0)[0],
        "ours_async_norecompute": lambda q, L, k, v: da.decode_attention_async(
            q, k, v, L, 0.0, recompute=False)[0],
        "ours_sync": lambda q, L, k, v: da.decode_attention_sync(q, k, v, L),
        "ours_async_norecompute_2xsplits": lambda q, L, k, v: da.decode_attention_async(
            q, k, v, L, 0.0, recompute=False, block_sizes=da.BlockSizes(target_programs=528))[0],
        "xla_einsum_softmax": lambda q, L, k, v: da.decode_attention_reference(q, k, v, L)[0],
    }
    if jax_da is not None and t == 1:
      variants["jax_pallas_gqa(triton)"] = lambda q, L, k, v: jax_da.gqa(
          q[:, 0], k, v, kv_seq_len=L)
    for impl, f in variants.items():
      us = attempt(f"{sname}/{impl}", lambda: time_jax(f, sets, small))
      if us is not None:
        record("attention", sname, impl, us, a.kv_bytes)
    del sets

    def torch_sdpa():
      import torch
      import torch.nn.functional as F
      tsets = []
      for i in range(len(_sets(lambda i: i, a.kv_bytes))):
        g = torch.Generator(device="cuda").manual_seed(i)
        mk = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
        tsets.append((mk(b, n, t, h), mk(b, kh, s, h), mk(b, kh, s, h)))
      return time_torch(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                        tsets)
    us = attempt(f"{sname}/torch_sdpa", torch_sdpa)
    if us is not None:
      record("attention", sname, "torch_sdpa", us, a.kv_bytes)


def bench_gemm(quick: bool):
  log("\n== flat GEMM, Llama-3.1-8B per-layer shapes (bytes = one layer's weight) ==")
  w = jnp.ones((4096, 4096), jnp.bfloat16)
  xs = [jnp.full((8, 4096), i, jnp.bfloat16) for i in range(2)]
  hlo = jax.jit(lambda a, b, w: [a @ w, b @ w]).lower(*xs, w).compile().as_text()
  log(f"  dot-merger check, 2 dots sharing W: {hlo.count('__cublas')} cuBLAS calls, "
      f"{hlo.count(' dot(')} dots (2 and 2 = not merged)")
  shapes = [g for g in CATALOG["llama3_8b_b1_s8192_decode"].gemms if g.op in ("qkv", "o", "gate",
                                                                             "down")]
  ms = (1, 8, 32) if quick else (1, 8, 32, 64)
  for g in shapes:
    def make(i, g=g):
      kw = jax.random.key(200 + i)
      return (jax.random.normal(kw, (2, g.k, g.n), jnp.bfloat16) * 0.02,)  # [L=2, K, N]
    wsets = _sets(make, g.weight_bytes * 2)
    for m in ms:
      small = [(jax.random.normal(jax.random.key(i), (m, g.k), jnp.bfloat16),) for i in range(32)]
      variants = {
          "xla_dot": lambda x, w: jnp.dot(x, w[1]),
          "ours_mosaic": lambda x, w: fg.flat_gemm(x, w, 1, impl="mosaic"),
          "ours_triton": lambda x, w: fg.flat_gemm(x, w, 1, impl="triton"),
      }
      if m == 1:
        variants["ours_gemv"] = lambda x, w: fg.flat_gemm(x, w, 1, impl="gemv")
      if m in (1, 8) and g.op in ("gate", "o"):
        for tk, st, sp in ((512, 3, None), (256, 6, None), (256, 4, 2), (256, 4, 4)):
          cfg = fg.BlockSizes(tile_k=tk, max_concurrent_steps=st, k_splits=sp)
          variants[f"ours_mosaic_k{tk}_s{st}_sp{sp}"] = functools.partial(
              lambda x, w, cfg: fg.flat_gemm(x, w, 1, impl="mosaic", block_sizes=cfg), cfg=cfg)
      for impl, f in variants.items():
        us = attempt(f"{g.name}/m{m}/{impl}", lambda: time_jax(f, wsets, small))
        if us is not None:
          record("gemm", f"{g.op}_k{g.k}_n{g.n}_m{m}", impl, us, g.weight_bytes, m=m, k=g.k,
                 n=g.n)
      if m in (1, 8, 32):
        us = attempt(f"{g.name}/m{m}/torch", lambda: _torch_matmul(m, g.k, g.n, len(wsets)))
        if us is not None:
          record("gemm", f"{g.op}_k{g.k}_n{g.n}_m{m}", "torch_matmul", us, g.weight_bytes, m=m,
                 k=g.k, n=g.n)
    del wsets
  log("\n== SwiGLU (gate+up in one kernel) ==")
  d, f_ = 4096, 14336
  wg = [(jax.random.normal(jax.random.key(300 + i), (2, d, f_), jnp.bfloat16) * 0.02,
         jax.random.normal(jax.random.key(400 + i), (2, d, f_), jnp.bfloat16) * 0.02)
        for i in range(2)]
  for m in (1, 8, 32):
    small = [(jax.random.normal(jax.random.key(i), (m, d), jnp.bfloat16),) for i in range(32)]
    for impl in ("xla", "mosaic", "triton"):
      us = attempt(f"swiglu/m{m}/{impl}", lambda: time_jax(
          lambda x, a, b: fg.flat_gemm_swiglu(x, a, b, 1, impl=impl), wg, small))
      if us is not None:
        record("swiglu", f"swiglu_d{d}_f{f_}_m{m}", impl, us, 2 * 2 * d * f_, m=m)


def _torch_matmul(m, k, n, nsets):
  import torch
  x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
  ws = [(torch.randn(k, n, device="cuda", dtype=torch.bfloat16),) for _ in range(nsets)]
  return time_torch(lambda w: x @ w, ws)


def bench_looped(quick: bool):
  log("\n== headline: loop over stacked weights [L, K, N] (bytes = L layers' weights) ==")
  cases = [(32, 4096, 4096), (32, 4096, 14336)]
  for layers, k, n in cases:
    w = jax.random.normal(jax.random.key(7), (layers, k, n), jnp.bfloat16) * 0.02
    nbytes = layers * k * n * 2
    for m in (1, 8):
      small = [(jax.random.normal(jax.random.key(i), (m, k), jnp.bfloat16),) for i in range(4)]

      def step(x, y):  # keeps a dependency from layer to layer, like a decoder
        return x + 1e-3 * y[:, :k].astype(x.dtype)

      def scan_xla(x, w):
        return lax.scan(lambda c, wl: (step(c, c @ wl), None), x, w)[0]

      def loop_kernel(x, w, impl):
        return lax.fori_loop(0, layers, lambda l, c: step(c, fg.flat_gemm(c, w, l, impl=impl)), x)

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
        us = attempt(f"loop/{k}x{n}/m{m}/{impl}", lambda: time_jax(f, [(w,)], small, reps=4))
        if us is not None:
          record("looped", f"L{layers}_k{k}_n{n}_m{m}", impl, us, nbytes, m=m)
    del w


def suggest_dispatch():
  """Per [N, K]: M1 = first M where the flat GEMM beats gemv, M2 = first M where XLA beats it."""
  log("\n== dispatch suggestion from the GEMM rows ==")
  rows = [r for r in RESULTS if r.get("group") == "gemm"]
  out = {}
  for key in sorted({(r["k"], r["n"]) for r in rows}):
    by_m = {}
    for r in rows:
      if (r["k"], r["n"]) == key:
        by_m.setdefault(r["m"], {})[r["impl"]] = r["us"]
    m2 = next((m for m in sorted(by_m) if by_m[m].get("xla_dot", 1e9) < min(
        by_m[m].get("ours_mosaic", 1e9), by_m[m].get("ours_triton", 1e9))), None)
    best = {m: min(v, key=v.get) for m, v in by_m.items()}
    out[f"k{key[0]}_n{key[1]}"] = dict(m2=m2, best=best)
    log(f"  K={key[0]:6d} N={key[1]:6d}  M2={m2}  best per M: {best}")
  RESULTS.append(dict(group="dispatch_suggestion", table=out))


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--out", default=os.environ.get("OUT", "."))
  p.add_argument("--quick", action="store_true")
  p.add_argument("--only", default="ceiling,correct,attention,gemm,looped")
  args = p.parse_args()
  dev = jax.devices()[0]
  log(f"jax {jax.__version__}, device {dev.device_kind} ({dev.platform}), "
      f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
  log(f"dispatch: gemm M=1 {dispatch.choose_gemm(1, 14336, 4096)}, "
      f"attention {dispatch.choose_attention()}")
  only = args.only.split(",")
  t0 = time.time()
  measure_ceiling()
  meta = dict(jax=jax.__version__, device=dev.device_kind, date=time.strftime("%Y-%m-%d"),
              xla_flags=os.environ["XLA_FLAGS"], ceiling=CEILING)
  path = os.path.join(args.out, "kernels_bench.json")

  def save():  # after every section, so a run cut short still leaves its numbers
    with open(path, "w") as fh:
      json.dump(dict(meta=meta, results=RESULTS), fh, indent=1)

  for name, f in (("correct", check_correctness), ("looped", bench_looped),
                  ("gemm", bench_gemm), ("attention", bench_attention)):
    if name in only:
      attempt(name, (lambda f=f: f() if f is check_correctness else f(args.quick)))
      log(f"  [{name} done at {time.time() - t0:.0f}s]")
      save()
  if "gemm" in only:
    suggest_dispatch()
  save()
  log(f"\nwrote {path}")
  log(json.dumps(dict(meta=meta, n_results=len(RESULTS),
                      failures=[r["name"] for r in RESULTS if r.get("group") == "failure"])))


if __name__ == "__main__":
  main()

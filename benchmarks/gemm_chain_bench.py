"""Does a grid barrier inside a persistent kernel cost less than a launch? (#26's premise, `kernels/gemm_chain.py`)

    JAX_PLATFORMS=cuda python benchmarks/gemm_chain_bench.py --out $OUT/gemm_chain.json
    python benchmarks/gemm_chain_bench.py --dry-run   # the CPU: interpret mode, one CTA, tiny shapes

A chain of P dependent bf16 GEMVs, x_{p+1} = x_p · w[p], w [P, D, D] with D = 64 · (SMs) (8448 on an H200: each
of the 143 MB weights spread over every SM, one 64-column tile each), at M = 1 and 8, four ways in one process:
- "one launch": `gemm_chain` with P phases, the phases meeting at an in-kernel grid barrier while the next
  phase's weights stream;
- "one launch, no stream across": the same with the next phase's weight copies held until after the barrier (so
  the barrier's own cost and what streaming across it hides are told apart);
- "a launch per phase": the same kernel with one phase, P launches in one jit (the same code, so the difference
  between the two rows is what the boundaries cost);
- "stream kernel per phase": the engine's bf16 flat GEMM (`flat_gemm_stream`, Stream-K, its partials' combine),
  P launches;
- "XLA per phase": `jnp.dot` on w[p], P of them.
Each is checked against `gemm_chain_reference` (each product rounded to bf16: within a bf16 step a phase of the
largest value) and timed as the median of --repeats runs' wall time, each run --calls calls of the jit queued
back to back; GB/s counts the weights' bytes, % is of the HBM read ceiling measured in the same process.
"µs a boundary" is (a launch per phase − one launch) / (P − 1). Ends with a table and one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.bench import read_ceiling_gb_s
from kernels.flat_gemm_stream import default_ctas, flat_gemm_multi
from kernels.gemm_chain import ChainBlocks, gemm_chain, gemm_chain_reference


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def variants(phases: int, cfg: ChainBlocks, interpret: bool) -> dict:
    """name -> jitted f(x, w) giving [phases, M, D]."""
    held = dataclasses.replace(cfg, stream_across_barrier=False)

    def per_phase(step):
        def run(x, w):
            outs = []
            for p in range(phases):
                x = step(x, w, p)
                outs.append(x)
            return jnp.stack(outs)

        return jax.jit(run)

    found = {
        "one launch": jax.jit(lambda x, w: gemm_chain(x, w, 0, phases=phases, block_sizes=cfg, interpret=interpret)),
        "one launch, no stream across": jax.jit(
            lambda x, w: gemm_chain(x, w, 0, phases=phases, block_sizes=held, interpret=interpret)
        ),
        "a launch per phase": per_phase(
            lambda x, w, p: gemm_chain(x, w, p, phases=1, block_sizes=cfg, interpret=interpret)[0]
        ),
        "XLA per phase": per_phase(
            lambda x, w, p: jnp.dot(x, w[p], preferred_element_type=jnp.float32).astype(x.dtype)
        ),
    }
    if not interpret:  # the stream kernel's smallest tiles do not fit the one-CTA dry run's width
        found["stream kernel per phase"] = per_phase(lambda x, w, p: flat_gemm_multi(x, (w,), p)[0])
    return found


def timed(fn, x, w, calls: int, repeats: int) -> list[float]:
    """Wall seconds per call, one entry per run of `calls` queued calls."""
    jax.block_until_ready(fn(x, w))
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(x, w)
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - start) / calls)
    return runs


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phases", type=int, default=16)
    ap.add_argument("--batches", default="1,8", help="comma-separated M (at most 8)")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dry-run", action="store_true", help="interpret mode on the CPU: one CTA, D = 64")
    ap.add_argument("--out", default=None, help="write the JSON here")
    args = ap.parse_args(argv)
    interpret = args.dry_run
    cfg = ChainBlocks(tile_k=16, stages=2) if interpret else ChainBlocks()
    ctas = 1 if interpret else default_ctas()
    d = ctas * cfg.tile_n
    phases = min(args.phases, 3) if interpret else args.phases
    calls, repeats = (1, 1) if interpret else (args.calls, args.repeats)
    result = dict(bench="gemm_chain", device=str(jax.devices()[0].device_kind), jax=jax.__version__, D=d, phases=phases)
    result["read_ceiling_gb_s"] = ceiling = 0.0 if interpret else read_ceiling_gb_s()
    w = (jax.random.normal(jax.random.key(1), (phases, d, d), jnp.float32) * d**-0.5).astype(jnp.bfloat16)
    weight_bytes = w.nbytes
    rows = []
    for m in [int(b) for b in args.batches.split(",")]:
        x = jax.random.normal(jax.random.key(m), (m, d), jnp.float32).astype(jnp.bfloat16)
        ref = np.asarray(gemm_chain_reference(x, w, phases=phases), np.float32)
        tol = phases * 2.0**-8 * np.abs(ref).max()  # a bf16 rounding of the largest value per phase
        for name, fn in variants(phases, cfg, interpret).items():
            row = dict(variant=name, m=m)
            try:
                err = float(np.abs(np.asarray(fn(x, w), np.float32) - ref).max())
                runs = timed(fn, x, w, calls, repeats)
            except Exception as e:  # noqa: BLE001  (a variant that fails must not end the run)
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                rows.append(row)
                log(f"  M={m} {name}: FAILED {row['error']}")
                continue
            s = statistics.median(runs)
            gb_s = weight_bytes / s / 1e9
            row.update(
                max_abs_err=err,
                right=bool(err <= tol),
                us=s * 1e6,
                us_per_phase=s * 1e6 / phases,
                gb_s=gb_s,
                pct_ceiling=100 * gb_s / ceiling if ceiling else None,
                runs_us=[r * 1e6 for r in runs],
            )
            rows.append(row)
    for m in {r["m"] for r in rows}:
        by = {r["variant"]: r for r in rows if r["m"] == m and "error" not in r}
        if "one launch" in by and "a launch per phase" in by and phases > 1:
            result[f"us_per_boundary_m{m}"] = (by["a launch per phase"]["us"] - by["one launch"]["us"]) / (phases - 1)
    result["rows"] = rows
    log(f"\nD={d}, {phases} phases, {weight_bytes / 1e9:.2f} GB of weights; read ceiling {ceiling:.0f} GB/s")
    log(f"{'M':>2} {'variant':24} {'µs':>9} {'µs/phase':>9} {'GB/s':>7} {'%ceil':>6} {'right':>5}")
    for r in rows:
        if "error" in r:
            log(f"{r['m']:>2} {r['variant']:24} error: {r['error'][:120]}")
            continue
        pct = f"{r['pct_ceiling']:.1f}" if r["pct_ceiling"] else "-"
        log(
            f"{r['m']:>2} {r['variant']:24} {r['us']:>9.1f} {r['us_per_phase']:>9.2f} {r['gb_s']:>7.0f} {pct:>6} "
            f"{'yes' if r['right'] else 'NO':>5}"
        )
    for key in sorted(k for k in result if k.startswith("us_per_boundary")):
        log(f"{key}: {result[key]:.2f}")
    print(json.dumps(result), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    return result


if __name__ == "__main__":
    main()

"""Inside a quantized GEMM launch: where the time its bytes do not take goes, and the fixed cost per launch.

The timeline inside a launch comes from Mosaic GPU's in-kernel profiler; the fixed cost is set against bf16's.

  JAX_PLATFORMS=cuda python benchmarks/kernel_timeline.py --out $OUT/kernel_timeline.json
  python benchmarks/kernel_timeline.py --cases o_int4,down_int4 --no-sweep

(a) Timeline. For each case (an 8B launch shape, M, code width, `QuantStreamBlocks` fields) one jit makes
    L - 1 untraced launches over the stacked layers and then one traced launch (`QuantStreamBlocks.trace_dir`),
    so the traced one follows warm launches as in a decode; its first run's trace is dropped (cold pages).
    The trace holds, for every warpgroup of every CTA, the SM clock at the entry and exit of the kernel's
    named regions (`issue_first`, `wait_free` and `issue` for the memory warpgroup; `round_x`, `wait_x`,
    `wait_stage`, `unit`, `flush` and `drain` for the compute ones) and the global timer at the CTA's start.
    Per case: the launch's GPU time from the JAX profiler in the same run, the spread of the CTAs' starts,
    and per CTA (median and max over CTAs) when its first weight stage landed, its units' compute and
    waits, its flushes and its end; times in ns at the SM clock `nvidia-smi` reports.
(b) Sweep. Kernel µs of one launch against its bytes, N = 4096 and K from 512 to 16384, for the int4
    default feed and bf16 `flat_gemm_stream`: the intercept of a least-squares line is the fixed cost of a
    launch, the slope its streaming rate.
Prints a table per part and one JSON line; --out writes the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_trace  # noqa: E402
from quant_gemm_bench import quant_inputs  # noqa: E402

from kernels import flat_gemm_stream as fgs  # noqa: E402
from kernels import quant_gemm_stream as qs  # noqa: E402

LAYERS = 32
GROUP = 128
WIDTHS = {"o": ((4096,), 4096), "qkv": ((4096, 1024, 1024), 4096), "gate+up": ((14336, 14336), 4096)}
WIDTHS["down"] = ((4096,), 14336)
CASES = {  # name: (shape, code dtype, QuantStreamBlocks fields)
    "o_int4": ("o", jnp.int4, {}),
    "qkv_int4": ("qkv", jnp.int4, {}),
    "down_int4": ("down", jnp.int4, {}),
    "down_int4_unbounded": ("down", jnp.int4, {"in_flight": 4}),  # every stage out at once (in_flight off)
    "gate+up_int4": ("gate+up", jnp.int4, {}),
    "down_int4_relabel": ("down", jnp.int4, {"int4_feed": "relabel"}),
    "down_int8": ("down", jnp.int8, {}),
}
SWEEP_KS = (512, 2048, 8192, 16384)
SWEEP_LAYERS = 8


def log(*a):
    print(*a, flush=True)


def sm_clock_ghz() -> float:
    """The SM clock nvidia-smi reports for GPU 0 now (the max clock where it reports none)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        now, top = (float(v) for v in out.strip().split(","))
        return (now or top) / 1e3
    except (OSError, ValueError, subprocess.SubprocessError):
        return float("nan")


def launch_kernels(run, name: str | None = None) -> list[float]:
    """GPU µs of each GEMM launch of one run(), in order, from a profiler trace: the kernels whose name holds
    `name`, or (None) those of the most time-consuming kernel name."""
    kernels = gpu_trace.run_kernels(run)
    top = gpu_trace.top_by_name(kernels, 1)[0][0]
    pick = (lambda n: name in n) if name else (lambda n: n[:60] == top)  # noqa: E731
    return [e["dur"] for e in kernels if pick(e["name"])]


def weights_for(shape: str, cdt, layers: int = LAYERS):
    ns, k = WIDTHS[shape]
    offsets = cdt == jnp.int4  # --quantize int4 is asymmetric
    return tuple(
        quant_inputs(jax.random.key(i), layers, n, k, cdt, GROUP, jnp.float32, offsets) for i, n in enumerate(ns)
    ), k


# ---------------------------------------------------------------------------------------------
# (a) the timeline of one launch


def read_trace(path: str, wgs: int, ghz: float) -> list[dict]:
    """Per CTA: its start (global ns) and, per warpgroup, the (name, entry ns, exit ns) of its regions,
    times from the CTA's start. The trace's "ts" is (global timer at the start + SM cycles since the first
    region) / 1e3, the profiler's own convention: the cycles are turned into ns here."""
    events = json.load(open(path))["traceEvents"]
    by_track: dict[int, list] = {}
    for e in events:
        by_track.setdefault(e["tid"] - 1, []).append(e)
    ctas: dict[int, dict] = {}
    for track, evs in by_track.items():
        cta, wg = divmod(track, wgs + 1)
        start_ns = evs[0]["ts"] * 1e3
        stack, regions = [], []
        for e in evs:
            t = (e["ts"] * 1e3 - start_ns) / ghz  # cycles -> ns
            if e["ph"] == "B":
                stack.append((e["name"], t))
            else:
                name, t0 = stack.pop()
                regions.append((name, t0, t))
        entry = ctas.setdefault(cta, {"start": start_ns, "wgs": {}})
        entry["start"] = min(entry["start"], start_ns)
        entry["wgs"][wg] = (start_ns, regions)
    out = []
    for cta, entry in sorted(ctas.items()):
        wg_regions = {
            wg: [(n, a + s - entry["start"], b + s - entry["start"]) for n, a, b in regs]
            for wg, (s, regs) in entry["wgs"].items()
        }
        out.append({"cta": cta, "start": entry["start"], "wgs": wg_regions})
    return out


def summarize(ctas: list[dict], wgs: int) -> dict:
    """Medians and maxima over CTAs of where each CTA's time went (ns; compute warpgroup 0 and the memory one)."""
    t0 = min(c["start"] for c in ctas)
    rows = []
    for c in ctas:
        comp = c["wgs"].get(0, [])
        mem = c["wgs"].get(wgs, [])
        total = lambda regs, name: sum(b - a for n, a, b in regs if n == name)  # noqa: E731
        stage_waits = [(a, b) for n, a, b in comp if n == "wait_stage"]
        end = max([b for _, _, b in comp + mem] or [0.0])
        rows.append(
            {
                "start": c["start"] - t0,
                "end": c["start"] - t0 + end,
                "span": end,
                "first_stage": stage_waits[0][1] if stage_waits else float("nan"),
                "round_x": total(comp, "round_x"),
                "wait_x": total(comp, "wait_x"),
                "units": sum(1 for n, *_ in comp if n == "unit"),
                "unit": total(comp, "unit") - total(comp, "wait_stage"),
                "wait_stage": total(comp, "wait_stage") - (stage_waits[0][1] - stage_waits[0][0] if stage_waits else 0),
                "flush": total(comp, "flush"),
                "drain": total(comp, "drain"),
                "issue_first": total(mem, "issue_first"),
                "wait_free": total(mem, "wait_free"),
            }
        )
    keys = rows[0].keys() if rows else ()
    return {
        "ctas": len(rows),
        "median": {k: float(statistics.median(r[k] for r in rows)) for k in keys},
        "max": {k: float(max(r[k] for r in rows)) for k in keys},
        "last_end": float(max(r["end"] for r in rows)) if rows else float("nan"),
    }


def timeline(name: str, ghz: float, root: str) -> dict:
    shape, cdt, fields = CASES[name]
    weights, k = weights_for(shape, cdt)
    x = jax.random.normal(jax.random.key(7), (1, k), jnp.float32).astype(jnp.bfloat16)
    trace_dir = os.path.join(root, name)
    os.makedirs(trace_dir, exist_ok=True)
    plain = qs.QuantStreamBlocks(**fields)
    traced = dataclasses.replace(plain, trace_dir=trace_dir)
    resolved = qs.resolve_blocks(plain, x, weights, GROUP)

    def gemm(cfg, x, l, weights):
        return qs.quant_gemm_multi(x, weights, l, group=GROUP, block_sizes=cfg, permuted_codes=cdt == jnp.int4)

    @jax.jit
    def run(x, weights, index):
        outs = [gemm(plain, x, index[l], weights) for l in range(LAYERS - 1)]
        return outs + [gemm(traced, x, index[LAYERS - 1], weights)]

    index = jnp.arange(LAYERS, dtype=jnp.int32)
    log(f"  {name}: compiling and a first run")
    jax.block_until_ready(run(x, weights, index))  # compiles; its trace (cold pages) is dropped
    log(f"  {name}: the timed run")
    for f in glob.glob(os.path.join(trace_dir, "*.json")):
        os.remove(f)
    durations = launch_kernels(lambda: jax.block_until_ready(run(x, weights, index)), "quant_gemm_stream")
    files = glob.glob(os.path.join(trace_dir, "*.json"))
    if not files:
        raise RuntimeError(f"no in-kernel trace written under {trace_dir}")
    ctas = read_trace(files[0], resolved.compute_wgs, ghz)
    summary = summarize(ctas, resolved.compute_wgs)
    return {
        "case": name,
        "shape": shape,
        "bits": 4 if cdt == jnp.int4 else 8,
        "feed": resolved.feed_for(4 if cdt == jnp.int4 else 8),
        "tile_n": resolved.tile_n,
        "tile_k": resolved.tile_k,
        "untraced_us": float(statistics.median(durations[:-1])) if len(durations) > 1 else float("nan"),
        "traced_us": float(durations[-1]) if durations else float("nan"),
        **summary,
    }


# ---------------------------------------------------------------------------------------------
# (b) the fixed cost per launch


def sweep_point(kind: str, k: int, n: int = 4096) -> tuple[int, float]:
    """(bytes, median kernel µs) of SWEEP_LAYERS launches of one [n, k] weight at M = 1."""
    x = jax.random.normal(jax.random.key(7), (1, k), jnp.float32).astype(jnp.bfloat16)
    if kind == "bf16":
        w = (jax.random.normal(jax.random.key(1), (SWEEP_LAYERS, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
        nbytes = 2 * n * k

        def gemm(x, l, w):
            return fgs.flat_gemm_multi(x, (w,), l)[0]

        weights = w
    else:
        weights = (quant_inputs(jax.random.key(1), SWEEP_LAYERS, n, k, jnp.int4, GROUP, jnp.float32, True),)
        nbytes = n * k // 2 + (k // GROUP) * n * 8

        def gemm(x, l, weights):
            return qs.quant_gemm_multi(x, weights, l, group=GROUP, permuted_codes=True)[0]

    @jax.jit
    def run(x, weights, index):
        return [gemm(x, index[l], weights) for l in range(SWEEP_LAYERS)]

    index = jnp.arange(SWEEP_LAYERS, dtype=jnp.int32)
    jax.block_until_ready(run(x, weights, index))
    durations = launch_kernels(lambda: jax.block_until_ready(run(x, weights, index)))
    return nbytes, float(statistics.median(durations))


def sweep() -> list[dict]:
    out = []
    for kind in ("int4", "bf16"):
        pts = []
        for k in SWEEP_KS:
            pts.append(sweep_point(kind, k))
            log(f"  {kind} K={k}: {pts[-1][1]:.2f} µs")
        b = np.array([p[0] for p in pts], float)
        t = np.array([p[1] for p in pts], float)
        slope, fixed = np.polyfit(b, t, 1)  # µs per byte, µs
        out.append(
            {
                "kind": kind,
                "ks": list(SWEEP_KS),
                "bytes": b.tolist(),
                "us": t.tolist(),
                "fixed_us": float(fixed),
                "rate_gb_s": float(1e-3 / slope),
            }
        )
        log(
            f"  {kind:5s} fixed {fixed:5.2f} µs, rate {1e-3 / slope:6.0f} GB/s; µs at K = "
            + ", ".join(f"{k}: {v:.2f}" for k, v in zip(SWEEP_KS, t))
        )
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated names of CASES")
    ap.add_argument("--no-sweep", action="store_true", help="skip (b)")
    ap.add_argument("--sweep-only", action="store_true", help="skip (a)")
    ap.add_argument("--out", default=None, help="write the JSON here")
    args = ap.parse_args(argv)
    result = {"bench": "kernel_timeline", "device": str(jax.devices()[0].device_kind), "jax": jax.__version__}
    root = tempfile.mkdtemp()
    ghz = sm_clock_ghz()
    result["sm_clock_ghz"] = ghz
    log(f"SM clock {ghz:.3f} GHz")
    rows = []
    for name in [] if args.sweep_only else args.cases.split(","):
        try:
            rows.append(timeline(name, ghz, root))
        except Exception as e:  # noqa: BLE001  (one case that fails to build must not end the run)
            rows.append({"case": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"})
        r = rows[-1]
        if "error" in r:
            log(f"  {name}: FAILED {r['error']}")
            continue
        med, mx = r["median"], r["max"]
        us = lambda v: f"{v / 1e3:.2f}"  # noqa: E731
        log(
            f"  {name:18s} {r['feed']:8s} launch {r['untraced_us']:.2f} µs (traced {r['traced_us']:.2f}); "
            f"starts spread {us(mx['start'])}; CTA span {us(med['span'])} (max {us(mx['span'])}); "
            f"last end {us(r['last_end'])}; "
            f"first stage {us(med['first_stage'])} (max {us(mx['first_stage'])}); {med['units']:.0f} units: compute "
            f"{us(med['unit'])}, stage waits {us(med['wait_stage'])}; round_x {us(med['round_x'])} (wait_x "
            f"{us(med['wait_x'])}); flush {us(med['flush'])}, drain {us(med['drain'])}; memory warpgroup: issue_first "
            f"{us(med['issue_first'])}, wait_free {us(med['wait_free'])} µs (medians over CTAs)"
        )
    result["timelines"] = rows
    shutil.rmtree(root, ignore_errors=True)
    if not args.no_sweep:
        log("fixed cost per launch (N = 4096, M = 1, kernel µs against bytes):")
        result["sweep"] = sweep()
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()

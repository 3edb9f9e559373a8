"""What a GPU timeline shows: read a JAX profiler trace, profile one decode step from it, and probe the
idle time between kernels with a chain of tiny kernels.

As a module (`benchmarks/ab.py --profile` imports it): `traced_events` runs something under the
profiler and returns the trace's events; `step_profile` reads one decode step out of a traced chunk.

As a script, the gap probe:

    python benchmarks/gpu_trace.py [--out DIR] [--setups one,shard2,shard2_psum,...]

Tensor-parallel decode on 2 H200s leaves more idle time between consecutive kernels than one GPU does
(docs/log/). The probe strips the decode away: a `fori_loop` of 32 steps, each a chain of 12
elementwise kernels (an optimization barrier between them keeps XLA from fusing them), run several ways:

  one          jit on GPU 0
  one_dev1     jit on GPU 1
  shard2       shard_map over both GPUs, the same chain on each, no communication
  shard2_psum  as shard2, plus a psum of one float per loop step (what a TP layer has)
  two_jits     the one-GPU jit dispatched to GPU 0 and to GPU 1 back to back, so both run at once
  psum_only    one small psum over both GPUs, nothing else (NCCL set up)

A suffix changes the chain: "+mosaic" its middle kernel becomes a Mosaic GPU kernel (`plgpu.kernel`, as
the decode's GEMMs), "+triton" a Pallas-Triton kernel (`kernels.rms_norm`), "+axis" an XLA fusion that
reads the device's index (`lax.axis_index`, shard_map setups only); "+heavy" makes every kernel also
read 32 MB of its own (a sum over a slab, as memory-bound as the decode's GEMMs).

For each setup: untraced wall µs per kernel (median of 5 runs / kernels), and from a profiler trace the
kernels and the median gap between consecutive kernels on GPU 0. Prints a table, appends the rows to
DIR/gap_probe.json (DIR: --out, default $OUT or the current directory). Process-wide XLA_FLAGS (command
buffers, PDL) are read once per process: run the probe once per flag set.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

BOUNDARY_US = 2.0  # a gap at least this long is a CUDA-graph (layer loop) boundary, not one between two kernels


# -- reading a trace ---------------------------------------------------------------------------------


def traced_events(run, trace_dir: str) -> list[dict]:
    """Runs `run()` under `jax.profiler.trace` and returns the events of the Perfetto trace it writes
    (Chrome trace format: "X" events carry ts and dur in µs, pid, tid, name and args)."""
    os.makedirs(trace_dir, exist_ok=True)
    trace_dir = tempfile.mkdtemp(dir=trace_dir)  # a fresh folder: an earlier run's trace is never read back
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        run()
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        raise RuntimeError(f"the profiler wrote no Perfetto trace under {trace_dir}")
    with gzip.open(files[0]) as fh:
        events = json.load(fh)
    return events["traceEvents"] if isinstance(events, dict) else events


def track_names(events) -> dict:
    """{(pid, None): process name, (pid, tid): thread name} from the trace's metadata events."""
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
            names[(e["pid"], e.get("tid") if e["name"] == "thread_name" else None)] = e["args"]["name"]
    return names


def gpu_pids(names: dict) -> set:
    """The pids of the GPU devices' tracks."""
    return {pid for (pid, tid), n in names.items() if tid is None and "/device:GPU" in n}


def kernel_events(events, pids) -> list[dict]:
    """The kernels ("X" events, memory copies left out) on the GPU tracks `pids`, in trace order."""
    return [
        e
        for e in events
        if e.get("ph") == "X" and e.get("pid") in pids and "dur" in e and "memcpy" not in e.get("name", "").lower()
    ]


def run_kernels(run) -> list[dict]:
    """The GPU kernels of one `run()` under the profiler, in time order."""
    events = traced_events(run, tempfile.mkdtemp())
    kernels = kernel_events(events, gpu_pids(track_names(events)))
    return sorted(kernels, key=lambda e: e["ts"])


def top_by_name(kernels: list, n: int = 16) -> list:
    """[name, kernels, total µs] of kernels grouped by name, the n longest in total."""
    totals = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        totals[e["name"][:60]][0] += 1
        totals[e["name"][:60]][1] += e["dur"]
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:n]
    return [[name, count, round(total, 1)] for name, (count, total) in ranked]


def _head_launches(evs: list, durations: dict, steps: int) -> tuple[list[int], str]:
    """(indices in evs, name) of the LM head's launches: of each kernel name, its launches within half of
    that name's longest (a quantized model's head shares its kernel's name with every projection's, so
    the name alone cannot tell it); among the names where those number one or two a step, the one with
    the longest median. A per-layer kernel longer than the head (a fused MLP) is launched too often to
    be taken for it."""
    launches = defaultdict(list)
    for i, e in enumerate(evs):
        launches[e["name"][:60]].append(i)
    best, best_us = None, -1.0
    for name, idx in launches.items():
        longest = max(durations[name])
        long = [i for i in idx if evs[i]["dur"] >= 0.5 * longest]
        median = float(np.median([evs[i]["dur"] for i in long]))
        if steps <= len(long) <= 2 * steps + 4 and median > best_us:
            best, best_us = (long, name), median
    if best is None:
        raise ValueError(f"no kernel ran once or twice a step in {steps} steps: no LM head to cut steps at")
    return best


def step_profile(events, steps: int) -> dict:
    """One decode step of a traced chunk of `steps` steps, read on GPU 0's busiest stream.

    A step runs from one launch of the LM head (the longest kernel, once a step) to the next. Returned:
    its kernels, their summed time, the step's span, the median and mean idle time between two kernels
    inside a layer (gaps under BOUNDARY_US) and the count and median of the
    longer ones (CUDA-graph boundaries), the longest kernels by name, 20 kernels from the middle of the
    step ([name, µs, idle µs before]), and the kernels per stream (a command buffer whose DAG has
    parallel branches runs them on several streams). The profiler adds time at graph boundaries, so
    the gaps are an upper bound.
    """
    pids = gpu_pids(track_names(events))
    if not pids:
        raise ValueError("the trace has no GPU track: profile on a GPU")
    streams = defaultdict(list)
    for e in kernel_events(events, {min(pids)}):
        streams[e["tid"]].append(e)
    busiest = max(streams.values(), key=len)
    evs = sorted(busiest, key=lambda e: e["ts"])
    durations = defaultdict(list)
    for e in evs:
        durations[e["name"][:60]].append(e["dur"])
    starts, head = _head_launches(evs, durations, steps)
    if len(starts) < 2:
        raise ValueError(f"the LM head kernel {head!r} ran {len(starts)} time(s): no whole step in the trace")
    before = evs[starts[-2]]
    step = evs[starts[-2] + 1 : starts[-1] + 1]
    gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip([before, *step], step)]
    inner = [g for g in gaps[1:] if g < BOUNDARY_US]
    boundary = [g for g in gaps[1:] if g >= BOUNDARY_US]
    mid = len(step) // 2
    return dict(
        kernels_per_step=len(step),
        step_kernel_us=round(sum(e["dur"] for e in step), 1),
        step_span_us=round(step[-1]["ts"] + step[-1]["dur"] - (before["ts"] + before["dur"]), 1),
        median_inner_gap_us=round(statistics.median(inner), 3) if inner else None,
        mean_inner_gap_us=round(statistics.mean(inner), 3) if inner else None,
        boundary_gaps=len(boundary),
        boundary_gap_us=round(statistics.median(boundary), 2) if boundary else None,
        lm_head_kernel=head,
        top_kernels=top_by_name(step),
        middle_kernels=[[e["name"][:40], round(e["dur"], 2), round(g, 2)] for e, g in zip(step, gaps)][mid : mid + 20],
        streams={str(tid): len(v) for tid, v in sorted(streams.items(), key=lambda kv: -len(kv[1]))},
        other_stream_kernels=sorted({e["name"][:50] for v in streams.values() if v is not busiest for e in v})[:12],
    )


# -- the gap probe -----------------------------------------------------------------------------------

STEPS, CHAIN, WIDTH = 32, 12, 8192
SLAB = 16 * 2**20  # bf16 elements a heavy kernel reads: 32 MB


def mosaic_step(x):
    """x * 1.0001 + 0.25 as one Mosaic GPU kernel (Lane semantics, 4096 elements per step)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def body(x_ref, y_ref):
        for start in range(0, x_ref.shape[0], 4096):
            part = pl.ds(start, 4096)
            y_ref[part] = (x_ref[part].astype(jnp.float32) * 1.0001 + 0.25).astype(y_ref.dtype)

    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), compiler_params=params)(x)


def triton_step(x):
    """An RMSNorm of x as one Pallas-Triton kernel (the decode's norm kernel)."""
    from kernels.rms_norm import rms_norm

    return rms_norm(x.reshape(1, -1), jnp.ones((1, x.shape[0]), x.dtype), 0, eps=1e-5).reshape(x.shape)


def chain(x, slabs=None, psum_axis=None, middle=None, axis=None):
    """STEPS loop iterations of CHAIN separate elementwise kernels (and optionally a tiny psum);
    `middle` ("mosaic", "triton" or "axis") replaces the middle one; with `slabs` [CHAIN, SLAB]
    each plain kernel also sums its slab."""

    def body(_, x):
        for i in range(CHAIN):
            if slabs is not None and not (i == CHAIN // 2 and middle):
                x = jax.lax.optimization_barrier(x + 1e-6 * jnp.sum(slabs[i], dtype=jnp.float32).astype(x.dtype))
            elif i == CHAIN // 2 and middle == "mosaic":
                x = mosaic_step(x)
            elif i == CHAIN // 2 and middle == "triton":
                x = triton_step(x)
            elif i == CHAIN // 2 and middle == "axis":
                x = x + jax.lax.axis_index(axis).astype(x.dtype)
            else:
                x = jax.lax.optimization_barrier(jnp.sin(x) * 1.0001 + 0.25)
        if psum_axis is not None:
            x = x + 1e-6 * jax.lax.psum(x[:1], psum_axis)
        return x

    return jax.lax.fori_loop(0, STEPS, body, x)


def build(setup: str):
    """(run, block) for one setup: run() dispatches once, block(out) waits for it."""
    devs = jax.devices()
    if setup == "psum_only":  # one small psum over both GPUs (sets NCCL up), timed like the rest
        mesh = Mesh(np.array(devs[:2]), ("tp",))
        x = jax.device_put(jnp.ones((2, 128), jnp.bfloat16), NamedSharding(mesh, P("tp")))
        f = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "tp"), mesh=mesh, in_specs=P("tp"), out_specs=P()))
        return (lambda: f(x)), jax.block_until_ready
    setup, *suffixes = setup.split("+")
    unknown = set(suffixes) - {"heavy", "mosaic", "triton", "axis"}
    if setup not in ("one", "one_dev1", "two_jits", "shard2", "shard2_psum") or unknown:
        raise ValueError(f"unknown gap probe setup {'+'.join([setup, *suffixes])!r} (see the module docstring)")
    heavy = "heavy" in suffixes
    middle = next((s for s in suffixes if s != "heavy"), None)
    dtype = jnp.bfloat16
    slab_shape = (CHAIN, SLAB) if heavy else (1, 1)

    def slabs_on(where):
        return jax.device_put(jnp.ones(slab_shape, dtype), where)

    if setup in ("one", "one_dev1", "two_jits"):
        f = jax.jit(lambda x, slabs: chain(x, slabs if heavy else None, middle=middle))
        targets = {"one": devs[:1], "one_dev1": devs[1:2], "two_jits": devs[:2]}[setup]
        args = [(jax.device_put(jnp.zeros((WIDTH,), dtype), d), slabs_on(d)) for d in targets]
        return (lambda: [f(*a) for a in args]), jax.block_until_ready
    mesh = Mesh(np.array(devs[:2]), ("tp",))
    x = jax.device_put(jnp.zeros((2 * WIDTH,), dtype), NamedSharding(mesh, P("tp")))
    slabs = jax.device_put(jnp.ones((2 * slab_shape[0], slab_shape[1]), dtype), NamedSharding(mesh, P("tp")))
    psum_axis = "tp" if setup == "shard2_psum" else None
    f = jax.jit(
        jax.shard_map(
            lambda x, s: chain(x, s if heavy else None, psum_axis=psum_axis, middle=middle, axis="tp"),
            mesh=mesh,
            in_specs=(P("tp"), P("tp")),
            out_specs=P("tp"),
            check_vma=False,
        )
    )
    return (lambda: f(x, slabs)), jax.block_until_ready


def measure(setup: str, trace_root: str) -> dict:
    """Untraced wall time per kernel and, from a trace, the kernels and gaps on GPU 0 of one setup."""
    run, block = build(setup)
    block(run())
    walls = []
    for _ in range(5):
        t0 = time.perf_counter()
        block(run())
        walls.append((time.perf_counter() - t0) * 1e6)
    events = traced_events(lambda: block(run()), os.path.join(trace_root, setup))
    names = track_names(events)
    gpu0 = min(gpu_pids(names))
    kernels = sorted((e["ts"], e["dur"]) for e in kernel_events(events, {gpu0}))
    gaps = [b[0] - (a[0] + a[1]) for a, b in zip(kernels, kernels[1:])]
    inner = [g for g in gaps if g < BOUNDARY_US]
    return dict(
        setup=setup,
        wall_us=round(statistics.median(walls), 1),
        wall_us_per_kernel=round(statistics.median(walls) / (STEPS * CHAIN), 3),
        traced_kernels=len(kernels),
        median_kernel_us=round(statistics.median(d for _, d in kernels), 3) if kernels else None,
        median_gap_us=round(statistics.median(inner), 3) if inner else None,
        long_gaps=len(gaps) - len(inner),
        gpu0_events=event_kinds(events, gpu0, names),  # per stream: count and longest, to catch work left running
    )


def event_kinds(events, pid, names) -> dict:
    """The 12 most frequent (track | event name) on track `pid`: (count, longest µs)."""
    kinds: dict = {}
    for e in events:
        if e.get("pid") == pid and e.get("ph") == "X":
            key = f"{names.get((pid, e.get('tid')), e.get('tid'))} | {e['name'][:40]}"
            count, longest = kinds.get(key, (0, 0.0))
            kinds[key] = (count + 1, round(max(longest, e.get("dur", 0.0)), 2))
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1][0])[:12])


def main() -> int:
    p = argparse.ArgumentParser(description="the gap probe: idle time between tiny kernels on one GPU and two")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for gap_probe.json and the traces")
    p.add_argument(
        "--setups",
        default="one,one_dev1,shard2,shard2_psum,two_jits,one+mosaic,shard2+mosaic,"
        "one+triton,shard2+triton,shard2+axis",
    )
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    flags = os.environ.get("XLA_FLAGS", "")
    rows = []
    for setup in args.setups.split(","):
        try:
            rows.append(dict(measure(setup, os.path.join(args.out, "traces")), xla_flags=flags))
        except Exception as e:  # a setup that fails is reported, the rest still run
            rows.append(dict(setup=setup, error=f"{type(e).__name__}: {e}"[:300], xla_flags=flags))
        print(json.dumps(rows[-1]), flush=True)
    path = os.path.join(args.out, "gap_probe.json")
    old = json.load(open(path)) if os.path.exists(path) else []
    with open(path, "w") as fh:
        json.dump(old + rows, fh, indent=1)
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}, XLA_FLAGS={flags!r}", file=sys.stderr)
    print(f"{'setup':14s} {'wall µs/kernel':>15s} {'kernels':>8s} {'kernel µs':>10s} {'gap µs':>7s}", file=sys.stderr)
    for r in rows:
        if "error" in r:
            print(f"{r['setup']:14s} {r['error'][:80]}", file=sys.stderr)
        else:
            print(
                f"{r['setup']:14s} {r['wall_us_per_kernel']:15.3f} {r['traced_kernels']:8d} "
                f"{r['median_kernel_us']!s:>10s} {r['median_gap_us']!s:>7s}",
                file=sys.stderr,
            )
    print(json.dumps(dict(summary=True, device=jax.devices()[0].device_kind, jax=jax.__version__, rows=len(rows))))
    return 0


if __name__ == "__main__":
    sys.exit(main())

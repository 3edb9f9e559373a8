"""Is the idle time between kernels on 2 GPUs the decode's, or any program's? A chain of tiny kernels.

  JAX_PLATFORMS=cuda,cpu python benchmarks/device_gap_gpu.py [--out DIR] [--setups a,b,...]

Tensor-parallel decode on 2 H200s leaves about 0.42 µs between consecutive kernels; one GPU leaves
none (BENCHMARKS.md, "The all-reduce kernel also normalizes"). This script strips the decode away:
a `fori_loop` of 32 steps, each a chain of 12 elementwise kernels (an optimization barrier between
them keeps XLA from fusing them), run several ways:

  one        jit on GPU 0
  one_dev1   jit on GPU 1
  shard2     shard_map over both GPUs, the same chain on each, no communication
  shard2_psum  as shard2, plus a psum of one float per loop step (what a TP layer has)
  two_jits   the one-GPU jit dispatched to GPU 0 and to GPU 1 back to back, so both run at once
  psum_only  one small psum over both GPUs, nothing else (NCCL set up)
  enable_peers  CUDA peer access between the GPUs switched on by hand (CuPy), then one small kernel

A suffix changes the chain's middle kernel: "+mosaic" a Mosaic GPU kernel (`plgpu.kernel`, as the
decode's GEMMs), "+triton" a Pallas-Triton kernel (`kernels.rms_norm`), "+axis" an XLA fusion that
reads the device's index (`lax.axis_index`, shard_map setups only), "+heavy" makes every kernel
also read 32 MB of its own (a sum over a slab, as memory-bound as the decode's GEMMs).

For each: untraced wall µs per kernel (median of 5 runs / kernels), and from a profiler trace the
kernels per step and the median gap between consecutive kernels on GPU 0. Prints a table, writes
device_gap_gpu.json under --out. Process-wide XLA_FLAGS (command buffers, PDL) are set by the
caller, so run the script once per flag set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

from benchmarks.gpu_trace import gpu_pids, kernel_events, traced_events, track_names  # noqa: E402

STEPS, CHAIN, WIDTH = 32, 12, 8192


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


SLAB = 16 * 2**20  # bf16 elements a heavy kernel reads: 32 MB


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
    if setup == "enable_peers":  # CUDA peer access between the two GPUs' primary contexts, nothing else
        import cupy

        for me, peer in ((0, 1), (1, 0)):
            with cupy.cuda.Device(me):
                if not cupy.cuda.runtime.deviceCanAccessPeer(me, peer):
                    raise RuntimeError(f"GPU {me} cannot access GPU {peer}")
                try:
                    cupy.cuda.runtime.deviceEnablePeerAccess(peer)
                except cupy.cuda.runtime.CUDARuntimeError as e:  # already enabled (by XLA or NCCL)
                    print(f"enable_peers {me}->{peer}: {e}", flush=True)
        x = jax.device_put(jnp.zeros((WIDTH,), jnp.bfloat16), devs[0])
        f = jax.jit(lambda a: a + 1)
        return (lambda: f(x)), jax.block_until_ready
    setup, *suffixes = setup.split("+")
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
    inner = [g for g in gaps if g < 2.0]
    n = STEPS * CHAIN
    return dict(
        setup=setup,
        wall_us=round(statistics.median(walls), 1),
        wall_us_per_kernel=round(statistics.median(walls) / n, 3),
        traced_kernels=len(kernels),
        median_kernel_us=round(statistics.median(d for _, d in kernels), 3) if kernels else None,
        median_gap_us=round(statistics.median(inner), 3) if inner else None,
        long_gaps=len(gaps) - len(inner),
        # every kind of event on GPU 0 (per stream: count and longest), to catch work left running
        gpu0_events=_event_kinds(events, gpu0, names),
    )


def _event_kinds(events, pid, names) -> dict:
    kinds: dict = {}
    for e in events:
        if e.get("pid") == pid and e.get("ph") == "X":
            key = f"{names.get((pid, e.get('tid')), e.get('tid'))} | {e['name'][:40]}"
            count, longest = kinds.get(key, (0, 0.0))
            kinds[key] = (count + 1, round(max(longest, e.get("dur", 0.0)), 2))
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1][0])[:12])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
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
        except Exception as e:  # noqa: BLE001  (a setup that fails is reported, the rest still run)
            rows.append(dict(setup=setup, error=f"{type(e).__name__}: {e}"[:300], xla_flags=flags))
        print(json.dumps(rows[-1]), flush=True)
    path = os.path.join(args.out, "device_gap_gpu.json")
    old = json.load(open(path)) if os.path.exists(path) else []
    with open(path, "w") as fh:
        json.dump(old + rows, fh, indent=1)
    print(
        f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, XLA_FLAGS={flags!r}"
    )
    print(f"{'setup':14s} {'wall µs/kernel':>15s} {'kernels':>8s} {'kernel µs':>10s} {'gap µs':>7s}")
    for r in rows:
        if "error" in r:
            print(f"{r['setup']:14s} {r['error'][:80]}")
        else:
            print(
                f"{r['setup']:14s} {r['wall_us_per_kernel']:15.3f} {r['traced_kernels']:8d} "
                f"{r['median_kernel_us']!s:>10s} {r['median_gap_us']!s:>7s}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

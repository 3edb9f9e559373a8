"""Where a tensor-parallel decode step spends its time on 2 GPUs: a profile of one decode chunk.

    python benchmarks/tp_profile_gpu.py [--allreduce kernel,psum]   # 2 Hopper GPUs; JSON to $OUT/tp_profile_gpu.json

Llama-3.1-8B, random bf16 weights, batch 1, 1k context, the default looped in-place engine split over
2 GPUs (`TPForward`), once per all-reduce implementation. For each: the untraced ms/token (best of
three 64-step chunks), then one 32-step chunk under `jax.profiler.trace`. From GPU 0's busiest stream:
per kernel name, its count and median duration; the sum of kernel time per decode step against the
untraced step time (what is left is time the GPU had no kernel to run); and one layer's kernels in
order with the idle time before each (the profiler itself adds time at CUDA-graph boundaries, so the
gaps are an upper bound).
"""

from __future__ import annotations

import gc
import json
import os
import sys
from collections import defaultdict

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxdecode.bench import time_engine  # noqa: E402
from jaxdecode.config import get_preset  # noqa: E402
from jaxdecode.decode import Engine  # noqa: E402
from jaxdecode.model import init_random  # noqa: E402
from jaxdecode.tp import TPForward  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_trace import gpu_pids, traced_events, track_names  # noqa: E402

STEPS = 32


def profile_one(model, allreduce: str, out_dir: str) -> dict:
    engine = Engine(None, tp=TPForward.from_model(model, 2, loop_mode="inplace", allreduce=allreduce))
    prompts = np.ones((1, 16), np.int32)
    time_engine(engine, prompts, context=1024, steps=STEPS)  # compiles
    runs = [time_engine(engine, prompts, context=1024, steps=64) for _ in range(3)]
    step_us = min(t.decode_s / t.steps for t in runs) * 1e6
    events = traced_events(
        lambda: time_engine(engine, prompts, context=1024, steps=STEPS), os.path.join(out_dir, f"trace_{allreduce}")
    )
    names = track_names(events)
    gpu0 = min(gpu_pids(names))
    streams = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("pid") == gpu0 and "memcpy" not in e.get("name", "").lower():
            streams[e["tid"]].append(e)
    evs = sorted(max(streams.values(), key=len), key=lambda e: e["ts"])
    per = defaultdict(list)
    for e in evs:
        per[e["name"][:70]].append(e["dur"])
    # the decode chunk's steps: the last STEPS * (kernels per step) kernels; a step is counted between two
    # launches of the LM head's GEMM (the largest kernel that runs once per step)
    head = max(per, key=lambda n: float(np.median(per[n])) if STEPS <= len(per[n]) <= 2 * STEPS + 4 else 0.0)
    starts = [i for i, e in enumerate(evs) if e["name"][:70] == head]
    last = evs[starts[-2] + 1 : starts[-1] + 1]  # one whole step, LM head to LM head
    busy = sum(e["dur"] for e in last)
    span = last[-1]["ts"] + last[-1]["dur"] - (evs[starts[-2]]["ts"] + evs[starts[-2]]["dur"])
    seq, prev_end = [], evs[starts[-2]]["ts"] + evs[starts[-2]]["dur"]
    for e in last:
        seq.append([e["name"][:50], round(e["dur"], 2), round(e["ts"] - prev_end, 2)])
        prev_end = e["ts"] + e["dur"]
    kernels = sorted(
        ([n, len(d), round(float(np.median(d)), 2), round(sum(d) / 1e3, 2)] for n, d in per.items()),
        key=lambda r: -r[3],
    )
    result = {
        "allreduce": allreduce,
        "untraced_step_us": round(step_us, 1),
        "traced_step_span_us": round(span, 1),
        "traced_step_kernel_us": round(busy, 1),
        "kernels_per_step": len(last),
        "lm_head_kernel": head,
        "kernels": kernels[:30],
        "step_sequence": seq,
    }
    print(
        f"\n== {allreduce}: untraced {step_us:.1f} us/step; traced step {span:.1f} us, kernels {busy:.1f} us "
        f"({len(last)} kernels) ==",
        flush=True,
    )
    for n, c, med, tot in kernels[:22]:
        print(f"  {n:60s} {c:6d} x {med:7.2f} us = {tot:8.2f} ms", flush=True)
    layer = seq[len(seq) // 2 : len(seq) // 2 + 40]
    print("  one stretch of the step (name, us, idle before):", flush=True)
    for n, d, gap in layer:
        print(f"    {n:50s} {d:7.2f} {gap:6.2f}", flush=True)
    return result


def main() -> int:
    out_dir = os.environ.get("OUT", "/tmp")
    out = {
        "device": jax.devices()[0].device_kind,
        "devices": len(jax.devices()),
        "jax": jax.__version__,
        "profiles": [],
    }
    model = init_random(get_preset("llama-3.1-8b"), seed=0, dtype=jnp.bfloat16)
    impls = sys.argv[sys.argv.index("--allreduce") + 1].split(",") if "--allreduce" in sys.argv else ["kernel", "psum"]
    for impl in impls:
        out["profiles"].append(profile_one(model, impl, out_dir))
        gc.collect()
    with open(os.path.join(out_dir, "tp_profile_gpu.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

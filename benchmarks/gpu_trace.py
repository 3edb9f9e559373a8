"""Shared by the GPU benchmark scripts: run something under the JAX profiler and read its events back."""

import glob
import gzip
import json
import os
import tempfile

import jax


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

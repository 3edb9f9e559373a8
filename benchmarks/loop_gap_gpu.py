"""GPU diagnosis: what the decode layer loop does at each iteration boundary, and what unrolling it saves.

    JAX_PLATFORMS=cuda,cpu python benchmarks/loop_gap_gpu.py   (writes $OUT/loop_gap.json, HLO, trace)

A batch-1 profile of the engine shows ~4 µs with no kernel on the compute stream between the last
kernel of one layer and the first of the next. This script (Llama-3.1-8B, random bf16, 1k context):
1. writes the optimized HLO of one decode step and lists, for each while loop, its backend config
   and every instruction of its body that is not a fusion or a kernel call (copies, async ops);
2. traces a decode chunk and prints every GPU event, on every stream and memcpys included, around two
   layer boundaries;
3. times the decode with the layer scan unrolled by 1, 2 and 4 (`lax.scan(unroll=)`), best of 3.
"""

import functools
import json
import os
import re
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
from gpu_trace import gpu_pids, traced_events, track_names
from jax import lax

from jaxdecode.bench import time_engine
from jaxdecode.config import get_preset
from jaxdecode.decode import Engine
from jaxdecode.looping import rewrite
from jaxdecode.model import init_random

OUT = os.environ.get("OUT", ".")
RESULTS: dict = {
    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    "jax": jax.__version__,
    "device": jax.devices()[0].device_kind,
}


def log(*a):
    print(*a, flush=True)


def use_unroll(unroll: int):
    """Make the looping pass build its scans with `unroll` (a patched `lax` namespace in looping.rewrite)."""
    rewrite.lax = types.SimpleNamespace(**{k: getattr(lax, k) for k in dir(lax) if not k.startswith("__")})
    rewrite.lax.scan = functools.partial(lax.scan, unroll=unroll)


def while_bodies(hlo: str) -> list[dict]:
    """For each while op: its backend config and the body's instructions that are not fusions/calls."""
    comps, name, lines = {}, None, []
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m:
            name, lines = m.group(1), []
        elif line.startswith("}") and name:
            comps[name] = lines
            name = None
        elif name:
            lines.append(line.strip())
    found = []
    for body_lines in comps.values():
        for line in body_lines:
            if " while(" not in line:
                continue
            body = re.search(r"body=%?([\w.\-]+)", line).group(1)
            config = re.search(r"backend_config=(\{.*\})", line)
            ops = [
                ln
                for ln in comps.get(body, [])
                if not re.search(
                    r"= \S+ (fusion|custom-call|parameter|"
                    r"get-tuple-element|tuple|constant)\(",
                    ln,
                )
            ]
            kernels = [ln for ln in comps.get(body, []) if re.search(r" (fusion|custom-call)\(", ln)]
            found.append(
                dict(
                    body=body,
                    config=config.group(1)[:400] if config else None,
                    n_instructions=len(comps.get(body, [])),
                    n_kernels=len(kernels),
                    other_ops=[o[:300] for o in ops],
                    root=[ln[:600] for ln in comps.get(body, []) if ln.startswith("ROOT")],
                )
            )
    return found


def trace_boundaries(engine, prompts):
    events = traced_events(lambda: time_engine(engine, prompts, context=1024, steps=32), os.path.join(OUT, "trace"))
    names = track_names(events)
    on_gpu = gpu_pids(names)
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("pid") in on_gpu), key=lambda e: e["ts"])
    host = sorted((e for e in events if e.get("ph") == "X" and e.get("pid") not in on_gpu), key=lambda e: e["ts"])
    norms = [i for i, e in enumerate(gpu) if e["name"].startswith("rms_norm")]
    # the layer boundary is the norm preceded by the largest gap on its stream; take two of them late in the trace
    by_corr = {}
    for e in host:
        corr = (e.get("args") or {}).get("correlation_id")
        if corr is not None:
            by_corr[str(corr)] = e
    windows, host_windows = [], []
    for i in norms[-40:-30]:
        lo, hi = max(0, i - 8), min(len(gpu), i + 4)
        t0 = gpu[i]["ts"]
        rows = []
        for e in gpu[lo:hi]:
            launch = by_corr.get(str((e.get("args") or {}).get("correlation_id")))
            rows.append(
                [
                    e["name"][:40],
                    round(e["ts"] - t0, 2),
                    round(e["dur"], 2),
                    None if launch is None else round(launch["ts"] - t0, 2),
                    None if launch is None else round(launch["dur"], 2),
                    None if launch is None else launch["name"][:30],
                ]
            )
        windows.append(rows)
        # every host event in the window: what the host threads were doing at the boundary
        h0, h1 = gpu[lo]["ts"] - 300, gpu[hi - 1]["ts"]
        host_windows.append(
            [
                [
                    names.get((e["pid"], e["tid"]), str(e["tid"]))[:24],
                    e["name"][:50],
                    round(e["ts"] - t0, 2),
                    round(e["dur"], 2),
                ]
                for e in host
                if h0 <= e["ts"] <= h1
            ][:150]
        )
    sample_args = [(e["name"][:40], e.get("args")) for e in gpu[-3:]]
    streams = {}
    for e in gpu:
        key = names.get((e["pid"], e["tid"]), str(e["tid"]))
        streams.setdefault(key, [0, 0.0])
        streams[key][0] += 1
        streams[key][1] += e["dur"]
    memcpys = {}
    for e in gpu:
        if "memcpy" in e["name"].lower() or "memset" in e["name"].lower():
            memcpys.setdefault(e["name"][:60], [0, 0.0])
            memcpys[e["name"][:60]][0] += 1
            memcpys[e["name"][:60]][1] += e["dur"]
    host_names = {}
    for e in host[-20000:]:
        host_names.setdefault(e["name"][:60], [0, 0.0])
        host_names[e["name"][:60]][0] += 1
        host_names[e["name"][:60]][1] += e["dur"]
    top_host = sorted(host_names.items(), key=lambda kv: -kv[1][1])[:30]
    return dict(
        windows=windows,
        host_windows=host_windows,
        streams=streams,
        memcpys=memcpys,
        top_host=top_host,
        sample_args=sample_args,
        n_corr=len(by_corr),
    )


def gap_census(engine, prompts, label: str) -> dict:
    """Trace a 32-step chunk; count graph launches and kernel-free gaps on the compute stream."""
    events = traced_events(
        lambda: time_engine(engine, prompts, context=1024, steps=32), os.path.join(OUT, f"trace_{label}")
    )
    on_gpu = gpu_pids(track_names(events))
    kernels = sorted(
        (
            e
            for e in events
            if e.get("ph") == "X" and e.get("pid") in on_gpu and e.get("args", {}).get("hlo_module") == "jit__chunk_fn"
        ),
        key=lambda e: e["ts"],
    )
    graphs = {(e["args"].get("cuda_graph_id"), e["args"].get("correlation_id")) for e in kernels}
    gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(kernels, kernels[1:])]
    big = [g for g in gaps if 2.5 < g < 50]
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    out = dict(
        label=label,
        kernels=len(kernels),
        graph_launches=len(graphs),
        gaps_over_2_5us=len(big),
        gap_us=round(sum(big), 1),
        busy_us=round(sum(e["dur"] for e in kernels), 1),
        span_us=round(span, 1),
    )
    log("census", out)
    return out


def unroll_ab(model, prompts):
    """Gap census and alternating timings for the layer scan unrolled by 1 and 2."""
    RESULTS["census"], RESULTS["unroll_ab"] = [], []
    engines = {}
    for unroll in (1, 2):
        use_unroll(unroll)
        engines[unroll] = Engine(model)
        time_engine(engines[unroll], prompts, context=1024, steps=32)  # compile
        RESULTS["census"].append(gap_census(engines[unroll], prompts, f"unroll{unroll}"))
    for rep in range(3):
        for unroll, engine in engines.items():
            runs = [time_engine(engine, prompts, context=1024, steps=64) for _ in range(3)]
            ms = min(t.decode_s / t.steps for t in runs) * 1e3
            RESULTS["unroll_ab"].append(dict(unroll=unroll, rep=rep, ms=ms))
            log(f"unroll {unroll} rep {rep}: {ms:.3f} ms/token")


def main():
    model = init_random(get_preset("llama-3.1-8b"), dtype=jnp.bfloat16)
    prompts = np.ones((1, 16), np.int32)
    if "--unroll-ab" in sys.argv:
        unroll_ab(model, prompts)
        with open(os.path.join(OUT, "loop_gap_unroll.json"), "w") as fh:
            json.dump(RESULTS, fh, indent=1)
        return

    engine = Engine(model)
    cache = engine.new_cache(1, 1024 + 64)
    step = (
        jax.jit(engine.forward)
        .lower(engine.params, jnp.ones((1, 1), jnp.int32), jnp.full((1, 1), 1024, jnp.int32), cache)
        .compile()
    )
    hlo = step.as_text()
    with open(os.path.join(OUT, "decode_step_hlo.txt"), "w") as fh:
        fh.write(hlo)
    del cache
    RESULTS["while"] = while_bodies(hlo)
    for w in RESULTS["while"]:
        log(
            f"while body {w['body']}: {w['n_instructions']} instructions, {w['n_kernels']} kernels; "
            f"config {w['config']}"
        )
        for o in w["other_ops"]:
            log("   ", o[:200])
        for r in w["root"]:
            log("  ROOT", r[:400])

    RESULTS["trace"] = trace_boundaries(engine, prompts)
    log(
        "sample GPU event args:",
        RESULTS["trace"]["sample_args"],
        "host events with a correlation id:",
        RESULTS["trace"]["n_corr"],
    )
    for win in RESULTS["trace"]["windows"][:4]:
        log("-- boundary window (kernel, GPU start rel. to the norm, dur, launch start, launch dur, api) --")
        for row in win:
            log("   ", row)
    for win in RESULTS["trace"]["host_windows"][:1]:
        log("-- host events in the first window --")
        for row in win:
            log("   ", row)
    log("streams:", RESULTS["trace"]["streams"])
    log("memcpys:", RESULTS["trace"]["memcpys"])
    log("host:", RESULTS["trace"]["top_host"][:12])
    del engine
    if "--trace-only" in sys.argv:
        with open(os.path.join(OUT, "loop_gap.json"), "w") as fh:
            json.dump(RESULTS, fh, indent=1)
        return

    RESULTS["unroll"] = []
    for unroll in (1, 2, 4, 1):
        use_unroll(unroll)
        engine = Engine(model)
        start = time.perf_counter()
        time_engine(engine, prompts, context=1024, steps=32)
        first = time.perf_counter() - start
        runs = [time_engine(engine, prompts, context=1024, steps=64) for _ in range(3)]
        ms = min(t.decode_s / t.steps for t in runs) * 1e3
        RESULTS["unroll"].append(dict(unroll=unroll, ms=ms, first_s=first))
        log(f"unroll {unroll}: {ms:.3f} ms/token, first call {first:.1f} s")
        del engine
        with open(os.path.join(OUT, "loop_gap.json"), "w") as fh:
            json.dump(RESULTS, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())

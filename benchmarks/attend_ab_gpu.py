"""GPU A/B: the attention kernel that writes the new KV rows itself, and the one-launch split combine.

    JAX_PLATFORMS=cuda,cpu python benchmarks/attend_ab_gpu.py   (writes $OUT/attend_ab.json)

Llama-3.1-8B with random bf16 weights, 1k context. Three engines in one process:
- "new": the default (the `attend` hook: the cache write inside the attention kernel; the split
  combine as one `kernels.decode_attention` launch);
- "no_attend": XLA writes the cache (two kernels), then the attention kernel and its combine kernel;
- "before": as "no_attend" with the combine in jnp (three XLA kernels), the engine before this change.
For each: the compiled decode step's layer loop (kernels per layer, and no copy of a cache stack),
the per-layer kernel sequence from a profile of the new engine, and decode timings at batch 1 and 8
alternating the engines (best of 3 runs of 64 steps, twice), with their greedy tokens compared.
"""
import glob
import gzip
import json
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.bench import time_engine
from jaxdecode.config import get_preset
from jaxdecode.decode import Engine
from jaxdecode.model import init_random
from kernels import decode_attention as da

OUT = os.environ.get("OUT", ".")
RESULTS: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "jax": jax.__version__,
                 "device": jax.devices()[0].device_kind}
_combine_call, _sync = da._combine_call, da.decode_attention_sync
# "before" traces its own jitted copy of decode_attention_sync, so no trace is shared with the others
_before_sync = jax.jit(_sync.__wrapped__, static_argnames=("sm_scale", "block_sizes", "length_offset", "interpret",
                                                            "poison"))


def _jnp_combine(acc, l, m, *, heads, dtype, group, **_):
    o, _ = da._combine_partials(acc, l, m)
    return da._from_rows(o, 1, group).astype(dtype)


def make(model, variant: str) -> Engine:
    engine = Engine(model)
    if variant != "new":
        engine._plan._calls.pop("attend")
    return engine


def run(engine, variant, fn, *args):
    if variant == "before":  # both are looked up when a step is traced
        da._combine_call, da.decode_attention_sync = _jnp_combine, _before_sync
    try:
        return fn(engine, *args)
    finally:
        da._combine_call, da.decode_attention_sync = _combine_call, _sync


def loop_body(engine, batch: int) -> dict:
    cache = engine.new_cache(batch, 1024 + 64)
    hlo = jax.jit(engine.forward).lower(engine.params, jnp.ones((batch, 1), jnp.int32),
                                        jnp.full((batch, 1), 1024, jnp.int32), cache).compile().as_text()
    stack = f"bf16[32,{batch},1088,8,128]"
    bodies = re.findall(r"body=%?([\w.\-]+)", hlo)
    body = max(bodies, key=lambda b: hlo.count(b))  # the layer loop
    text = hlo.split(f"%{body} ")[1].split("\n}\n")[0]
    kernels = re.findall(r"\s(fusion|custom-call)\(", text)
    copies = [ln.strip()[:160] for ln in text.splitlines() if " copy(" in ln and stack in ln]
    return dict(kernels_per_layer=len(kernels), cache_stack_copies=copies)


def profile_layer(engine, prompts) -> list:
    trace_dir = os.path.join(OUT, "trace")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        time_engine(engine, prompts, context=1024, steps=32)
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    with gzip.open(files[0]) as fh:
        events = json.load(fh)
    events = events["traceEvents"] if isinstance(events, dict) else events
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("args", {}).get("hlo_module") == "jit__chunk_fn"
                      and "memcpy" not in e["name"].lower()), key=lambda e: e["ts"])
    norms = [i for i, e in enumerate(kernels) if e["name"].startswith("rms_norm")]
    i, j = norms[-12], norms[-10]  # one whole layer late in the trace: norm ... up to the same norm
    return [[e["name"][:50], round(e["dur"], 2)] for e in kernels[i:j]]


def main():
    model = init_random(get_preset("llama-3.1-8b"), dtype=jnp.bfloat16)
    variants = ("new", "no_attend", "before")
    engines = {v: make(model, v) for v in variants}
    RESULTS["hlo"] = {v: run(engines[v], v, loop_body, 1) for v in variants}
    RESULTS["hlo_b8"] = {v: run(engines[v], v, loop_body, 8) for v in variants}
    print("HLO:", json.dumps(RESULTS["hlo"]), json.dumps(RESULTS["hlo_b8"]), flush=True)
    RESULTS["first_call_s"], tokens = {}, {}
    for batch in (1, 8):
        prompts = np.ones((batch, 16), np.int32)
        for v in variants:
            start = time.perf_counter()
            t = run(engines[v], v, lambda e: time_engine(e, prompts, context=1024, steps=32))
            RESULTS["first_call_s"][f"{v}_b{batch}"] = time.perf_counter() - start
            tokens[(v, batch)] = t.tokens
        same = [bool(np.array_equal(tokens[(v, batch)], tokens[("before", batch)])) for v in variants]
        RESULTS[f"tokens_equal_b{batch}"] = dict(zip(variants, same))
        print(f"B{batch} greedy tokens equal to 'before':", dict(zip(variants, same)), flush=True)
    RESULTS["layer_sequence"] = run(engines["new"], "new", profile_layer, np.ones((1, 16), np.int32))
    print("one layer of the new engine:", RESULTS["layer_sequence"], flush=True)
    RESULTS["timings"] = []
    for rep in range(2):
        for batch in (1, 8):
            prompts = np.ones((batch, 16), np.int32)
            for v in variants:
                runs = [run(engines[v], v, lambda e: time_engine(e, prompts, context=1024, steps=64)) for _ in range(3)]
                ms = min(t.decode_s / t.steps for t in runs) * 1e3
                RESULTS["timings"].append(dict(variant=v, batch=batch, rep=rep, ms=ms))
                print(f"rep {rep} B{batch} {v:10s} {ms:.3f} ms/token", flush=True)
            with open(os.path.join(OUT, "attend_ab.json"), "w") as fh:
                json.dump(RESULTS, fh, indent=1)


if __name__ == "__main__":
    main()

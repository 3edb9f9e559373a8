"""GPU A/B: the attention kernel that writes the step's new KV rows itself (`kernel_attend`) or not.

    JAX_PLATFORMS=cuda,cpu python benchmarks/attend_ab_gpu.py   (writes $OUT/attend_ab.json)

Llama-3.1-8B with random bf16 weights, 1k context. Two engines in one process:
- "attend": the model's `attend` call (cache write, then attention) handed to `kernel_attend`: the
  attention kernel writes the new rows into the stacked cache;
- "default": the engine's defaults: XLA writes the rows (two kernels), then the attention kernel.
For each: the compiled decode step's layer loop (kernels per layer, and no copy of a cache stack),
the per-layer kernel sequence from a profile of the "attend" engine, and decode timings at batch 1
and 8 alternating the engines (best of 3 runs of 64 steps, twice), with their greedy tokens compared.
The stored results_attend_ab_gpu.json comes from an earlier form of this script that also tried a
one-launch split-combine kernel (since removed: 8.0 µs against XLA's three kernels' 4.0 µs).
"""
import json
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from gpu_trace import traced_events
from jaxdecode.bench import time_engine
from jaxdecode.config import get_preset
from jaxdecode.decode import Engine
from jaxdecode.model import init_random
from jaxdecode.looped_model import kernel_attend

OUT = os.environ.get("OUT", ".")
RESULTS: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "jax": jax.__version__,
                 "device": jax.devices()[0].device_kind}
def make(model, variant: str) -> Engine:
    engine = Engine(model)
    if variant == "attend":
        engine._plan._calls["attend"] = kernel_attend
    return engine


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
    events = traced_events(lambda: time_engine(engine, prompts, context=1024, steps=32), os.path.join(OUT, "trace"))
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("args", {}).get("hlo_module") == "jit__chunk_fn"
                      and "memcpy" not in e["name"].lower()), key=lambda e: e["ts"])
    norms = [i for i, e in enumerate(kernels) if e["name"].startswith("rms_norm")]
    i, j = norms[-12], norms[-10]  # one whole layer late in the trace: norm ... up to the same norm
    return [[e["name"][:50], round(e["dur"], 2)] for e in kernels[i:j]]


def main():
    model = init_random(get_preset("llama-3.1-8b"), dtype=jnp.bfloat16)
    variants = ("attend", "default")
    engines = {v: make(model, v) for v in variants}
    RESULTS["hlo"] = {v: loop_body(engines[v], 1) for v in variants}
    RESULTS["hlo_b8"] = {v: loop_body(engines[v], 8) for v in variants}
    print("HLO:", json.dumps(RESULTS["hlo"]), json.dumps(RESULTS["hlo_b8"]), flush=True)
    RESULTS["first_call_s"], tokens = {}, {}
    for batch in (1, 8):
        prompts = np.ones((batch, 16), np.int32)
        for v in variants:
            start = time.perf_counter()
            t = time_engine(engines[v], prompts, context=1024, steps=32)
            RESULTS["first_call_s"][f"{v}_b{batch}"] = time.perf_counter() - start
            tokens[(v, batch)] = t.tokens
        same = [bool(np.array_equal(tokens[(v, batch)], tokens[("default", batch)])) for v in variants]
        RESULTS[f"tokens_equal_b{batch}"] = dict(zip(variants, same))
        print(f"B{batch} greedy tokens equal to 'default':", dict(zip(variants, same)), flush=True)
    RESULTS["layer_sequence"] = profile_layer(engines["attend"], np.ones((1, 16), np.int32))
    print("one layer of the attend engine:", RESULTS["layer_sequence"], flush=True)
    RESULTS["timings"] = []
    for rep in range(2):
        for batch in (1, 8):
            prompts = np.ones((batch, 16), np.int32)
            for v in variants:
                runs = [time_engine(engines[v], prompts, context=1024, steps=64) for _ in range(3)]
                ms = min(t.decode_s / t.steps for t in runs) * 1e3
                RESULTS["timings"].append(dict(variant=v, batch=batch, rep=rep, ms=ms))
                print(f"rep {rep} B{batch} {v:10s} {ms:.3f} ms/token", flush=True)
            with open(os.path.join(OUT, "attend_ab.json"), "w") as fh:
                json.dump(RESULTS, fh, indent=1)


if __name__ == "__main__":
    main()

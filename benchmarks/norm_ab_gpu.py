"""GPU A/B: the default engine with and without the RMSNorm kernel hook (`kernel_rms_norm`), one process.

    JAX_PLATFORMS=cuda,cpu python benchmarks/norm_ab_gpu.py   (writes $OUT/ab_norm.json)

Llama-3.1-8B with random bf16 weights, 1k context, batch 1 and 8; the best of three 64-step decode
timings per variant (`bench.time_engine`), with the norm kernel measured before and after the XLA
norm to show the drift within the run. The first call's time is printed too.
"""

import json
import os
import time

import jax.numpy as jnp
import numpy as np

from jaxdecode.bench import time_engine
from jaxdecode.config import get_preset
from jaxdecode.decode import Engine
from jaxdecode.model import init_random


def main():
    model = init_random(get_preset("llama-3.1-8b"), dtype=jnp.bfloat16)
    rows = []
    for variant in ("norm_kernel", "xla_norm", "norm_kernel"):
        for batch in (1, 8):
            engine = Engine(model)
            if variant == "xla_norm":
                engine._plan._calls.pop("rms_norm")  # the hook list of the in-place loop
            prompts = np.ones((batch, 16), np.int32)
            start = time.perf_counter()
            time_engine(engine, prompts, context=1024, steps=32)
            first = time.perf_counter() - start
            runs = [time_engine(engine, prompts, context=1024, steps=64) for _ in range(3)]
            best = min(t.decode_s / t.steps for t in runs)
            rows.append(dict(variant=variant, batch=batch, ms=best * 1e3, first_s=first))
            print(f"{variant:12s} B{batch}: {best * 1e3:.3f} ms/token (first {first:.1f} s)", flush=True)
            del engine
    with open(os.path.join(os.environ.get("OUT", "."), "ab_norm.json"), "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()

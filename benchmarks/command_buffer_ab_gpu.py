"""GPU A/B: the engine's decode chunk compiled with different XLA command-buffer (CUDA graph) settings.

    JAX_PLATFORMS=cuda,cpu python benchmarks/command_buffer_ab_gpu.py   (writes $OUT/command_buffer_ab.json)

By default XLA on the GPU captures the body of the layer loop (fusions and kernel calls) as a CUDA
graph and launches it once per layer; a trace shows ~4 µs with no kernel between one layer's graph
and the next. This times the decode (Llama-3.1-8B, random bf16, 1k context; batch 1, 8 and 32) with
the chunk function compiled per variant through `jax.jit(compiler_options=...)`, alternating the
variants twice, best of 3 runs of 64 steps each.
"""

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.bench import time_engine
from jaxdecode.config import get_preset
from jaxdecode.decode import Engine
from jaxdecode.model import init_random

VARIANTS = {
    "xla_default": None,
    "no_command_buffer": {"xla_gpu_enable_command_buffer": ""},
    "whole_loop_graph": {"xla_gpu_enable_command_buffer": "FUSION,CUSTOM_CALL,CUBLAS,CUBLASLT,WHILE,CONDITIONAL"},
}


def main():
    model = init_random(get_preset("llama-3.1-8b"), dtype=jnp.bfloat16)
    rows = []
    engine = Engine(model)
    for rep in range(2):
        for name, options in VARIANTS.items():
            engine._chunk = jax.jit(
                engine._chunk_fn, static_argnames=("steps", "sampling"), donate_argnums=1, compiler_options=options
            )
            for batch in (1, 8, 32):
                prompts = np.ones((batch, 16), np.int32)
                start = time.perf_counter()
                first = time_engine(engine, prompts, context=1024, steps=32)
                first_s = time.perf_counter() - start
                runs = [time_engine(engine, prompts, context=1024, steps=64) for _ in range(3)]
                ms = min(t.decode_s / t.steps for t in runs) * 1e3
                same = bool(np.array_equal(runs[0].tokens[:, : first.tokens.shape[1]], first.tokens))
                rows.append(dict(variant=name, rep=rep, batch=batch, ms=ms, first_s=first_s, tokens_agree=same))
                print(f"{name:18s} rep {rep} B{batch:<3d} {ms:.3f} ms/token (first {first_s:.1f} s)", flush=True)
            with open(os.path.join(os.environ.get("OUT", "."), "command_buffer_ab.json"), "w") as fh:
                json.dump(
                    dict(
                        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                        jax=jax.__version__,
                        device=jax.devices()[0].device_kind,
                        rows=rows,
                    ),
                    fh,
                    indent=1,
                )


if __name__ == "__main__":
    main()

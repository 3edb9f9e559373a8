"""2 GPUs: does capturing the all-reduces in XLA's command buffers (CUDA graphs) make TP decode cheaper?

    python benchmarks/tp_command_buffer_gpu.py   (writes $OUT/tp_command_buffer.json)

XLA's default command buffers capture fusions and kernel calls but not collectives, so each psum of
a tensor-parallel layer splits the layer's CUDA graph and runs NCCL between graphs. This compiles
the same programs with `xla_gpu_enable_command_buffer` also naming COLLECTIVES
(`jax.jit(compiler_options=...)`) and times, against XLA's default:
1. one psum of [1, 4096] bf16 over 2 GPUs (`tp_gpu.allreduce_us`: a jitted chain of 100);
2. Llama-3.1-8B TP2 decode at batch 1, 1k context (random bf16 weights; the decode chunk compiled
   per setting; alternating, best of 3 runs of 64 steps, twice), with the greedy tokens compared.
"""

import json
import os
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tp_gpu import allreduce_us  # noqa: E402

from jaxdecode.bench import time_engine  # noqa: E402
from jaxdecode.config import get_preset  # noqa: E402
from jaxdecode.decode import Engine  # noqa: E402
from jaxdecode.model import init_random  # noqa: E402

SETTINGS = {
    "xla_default": None,
    "with_collectives": {"xla_gpu_enable_command_buffer": "FUSION,CUSTOM_CALL,CUBLAS,CUBLASLT,COLLECTIVES"},
}


def main():
    if len(jax.devices()) < 2:
        print("needs 2 GPUs", file=sys.stderr)
        return 2
    out = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": jax.devices()[0].device_kind,
        "psum_us": {},
        "decode": [],
    }
    for name, options in SETTINGS.items():
        out["psum_us"][name] = allreduce_us(4096, 1, compiler_options=options)
        print(f"psum [1, 4096] bf16 over 2, {name}: {out['psum_us'][name]:.1f} us", flush=True)
    engine = Engine(init_random(get_preset("llama-3.1-8b"), dtype=jnp.bfloat16), tp=2)
    prompts = np.ones((1, 16), np.int32)
    chunks, tokens = {}, {}
    for name, options in SETTINGS.items():
        chunks[name] = jax.jit(
            engine._chunk_fn, static_argnames=("steps", "sampling"), donate_argnums=1, compiler_options=options
        )
        engine._chunk = chunks[name]
        tokens[name] = time_engine(engine, prompts, context=1024, steps=32).tokens
    out["tokens_equal"] = bool(np.array_equal(tokens["xla_default"], tokens["with_collectives"]))
    print("greedy tokens equal:", out["tokens_equal"], flush=True)
    for rep in range(2):
        for name in SETTINGS:
            engine._chunk = chunks[name]
            runs = [time_engine(engine, prompts, context=1024, steps=64) for _ in range(3)]
            ms = min(t.decode_s / t.steps for t in runs) * 1e3
            out["decode"].append(dict(setting=name, rep=rep, ms=ms))
            print(f"TP2 8B b1 1k, {name}, rep {rep}: {ms:.3f} ms/token", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "tp_command_buffer.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

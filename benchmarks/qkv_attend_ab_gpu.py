"""GPU A/B: the q·k·v epilogue as one kernel (the `qkv_attend` hook: `kernels.qkv_rope`) or as XLA's
fusions (q's RoPE and padding, two cache writes), in the default engine.

    JAX_PLATFORMS=cuda,cpu python benchmarks/qkv_attend_ab_gpu.py [--tp 1|2] [--batches 1,8] [--variants off,on,off]
        # one JSON line per row on stdout and in $OUT/qkv_attend_ab_gpu.jsonl

Llama-3.1-8B, random bf16 weights, 1k context, on one GPU or 2 (`--tp 2`: the all-reduce kernel).
Per variant and batch: the best of three 64-step decode timings (`bench.time_engine`); "off" first
and last shows the drift within the run. Greedy tokens are compared with the first variant's.
"""
import json
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxdecode import looped_model  # noqa: E402
from jaxdecode.bench import time_engine, tokens_agree  # noqa: E402
from jaxdecode.config import get_preset  # noqa: E402
from jaxdecode.decode import Engine  # noqa: E402
from jaxdecode.model import init_random  # noqa: E402

DEFAULT_CALLS = dict(looped_model.KERNEL_CALLS)


def engine_with(model, variant: str, tp: int):
    """An engine with the `qkv_attend` hook on or off. The hook table is patched until the caller
    restores it after the first (tracing) call: the TP engine traces lazily."""
    looped_model.KERNEL_CALLS.clear()
    looped_model.KERNEL_CALLS.update({k: v for k, v in DEFAULT_CALLS.items() if variant == "on" or k != "qkv_attend"})
    if tp == 1:
        return Engine(model)
    from jaxdecode.tp import TPForward
    return Engine(None, tp=TPForward.from_model(model, 2, loop_mode="inplace"))


def arg(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def main():
    model = init_random(get_preset("llama-3.1-8b"), dtype=jnp.bfloat16)
    tp = int(arg("--tp", "1"))
    batches = tuple(int(b) for b in arg("--batches", "1,8").split(","))
    first_tokens = {}
    for variant in arg("--variants", "off,on,off").split(","):
        engine = engine_with(model, variant, tp)
        for batch in batches:  # each batch's step is traced at its first call, with the hooks patched
            prompts = np.random.default_rng(batch).integers(0, 1000, (batch, 16))
            time_engine(engine, prompts, context=1024, steps=32)  # traces and compiles
            runs = [time_engine(engine, prompts, context=1024, steps=64) for _ in range(3)]
            best = min(runs, key=lambda t: t.decode_s / t.steps)
            agree = tokens_agree(first_tokens[batch], best.tokens) if batch in first_tokens else None
            first_tokens.setdefault(batch, best.tokens)
            row = dict(tp=tp, qkv_attend=variant, batch=batch, ms=round(best.decode_s / best.steps * 1e3, 3),
                       all_ms=[round(t.decode_s / t.steps * 1e3, 3) for t in runs], tokens_agree_with_first=agree)
            print(json.dumps(row), flush=True)
            with open(os.path.join(os.environ.get("OUT", "."), "qkv_attend_ab_gpu.jsonl"), "a") as fh:
                fh.write(json.dumps(row) + "\n")
        looped_model.KERNEL_CALLS.clear()
        looped_model.KERNEL_CALLS.update(DEFAULT_CALLS)
        del engine


if __name__ == "__main__":
    main()

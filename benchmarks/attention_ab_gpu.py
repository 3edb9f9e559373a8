"""GPU A/B of the decode attention kernel's tunables inside the default engine (one GPU).

    JAX_PLATFORMS=cuda,cpu python benchmarks/attention_ab_gpu.py [--variants "base;num_warps=2;base"]
        [--batches 1,8] [--contexts 1024,4096]   # one JSON line per row on stdout and in $OUT/attention_ab_gpu.jsonl

Llama-3.1-8B, random bf16 weights. A variant is `base` or fields of `decode_attention.BlockSizes` joined by
"+" (a bool field alone means True). Each variant builds a fresh engine whose `qkv_attend` and
`sdpa` hooks run the attention with those block sizes; per (batch, context): the best of three 64-step
decode timings after a compiling call, and the greedy tokens against the first variant's. "base" first
and last shows the drift within the run.
"""

import dataclasses
import functools
import os
import sys

import numpy as np

from jaxdecode import looped_model
from kernels import decode_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_runs import arg, record  # noqa: E402

DEFAULT_CALLS = dict(looped_model.KERNEL_CALLS)


def block_sizes(variant: str) -> decode_attention.BlockSizes:
    """`base` -> the defaults; "a=1+b" -> BlockSizes(a=1, b=True), each value cast to the field's type."""
    if variant == "base":
        return decode_attention.BlockSizes()
    fields = {f.name: f for f in dataclasses.fields(decode_attention.BlockSizes)}
    kw = {}
    for part in variant.split("+"):
        name, _, value = part.partition("=")
        if name not in fields:
            raise SystemExit(f"attention_ab_gpu: unknown BlockSizes field {name!r}")
        default = getattr(decode_attention.BlockSizes(), name)
        kw[name] = True if not value else (value == "1" if isinstance(default, bool) else type(default or 0)(value))
    return decode_attention.BlockSizes(**kw)


def main():
    import jax.numpy as jnp

    from jaxdecode.bench import time_engine, tokens_agree
    from jaxdecode.config import get_preset
    from jaxdecode.decode import Engine
    from jaxdecode.model import init_random

    model = init_random(get_preset("llama-3.1-8b"), dtype=jnp.bfloat16)
    batches = tuple(int(b) for b in arg("--batches", "1,8").split(","))
    contexts = tuple(int(c) for c in arg("--contexts", "1024,4096").split(","))
    first = {}
    for variant in arg("--variants", "base;num_warps=2;base").split(";"):
        blocks = block_sizes(variant)
        looped_model.KERNEL_CALLS.update(
            qkv_attend=functools.partial(DEFAULT_CALLS["qkv_attend"], attention_blocks=blocks),
            sdpa=functools.partial(DEFAULT_CALLS["sdpa"], block_sizes=blocks),
        )
        engine = Engine(model)
        for context in contexts:
            for batch in batches:
                prompts = np.random.default_rng(batch).integers(0, 1000, (batch, 16))
                time_engine(engine, prompts, context=context, steps=32)  # traces and compiles
                runs = [time_engine(engine, prompts, context=context, steps=64) for _ in range(3)]
                best = min(runs, key=lambda t: t.decode_s / t.steps)
                key = (batch, context)
                agree = tokens_agree(first[key], best.tokens) if key in first else None
                first.setdefault(key, best.tokens)
                record(
                    dict(
                        variant=variant,
                        batch=batch,
                        context=context,
                        ms=round(best.decode_s / best.steps * 1e3, 3),
                        all_ms=[round(t.decode_s / t.steps * 1e3, 3) for t in runs],
                        tokens_agree_with_first=agree,
                    ),
                    "attention_ab_gpu.jsonl",
                )
        looped_model.KERNEL_CALLS.update(DEFAULT_CALLS)
        del engine


if __name__ == "__main__":
    main()

"""Shared by the GPU A/B scripts that patch the engine's kernel hooks (combine_ab_gpu.py,
qkv_attend_ab_gpu.py): the engine on 1 or 2 GPUs, the timing of one batch, the command line."""

import json
import os
import sys

import numpy as np

from jaxdecode.bench import time_engine, tokens_agree
from jaxdecode.decode import Engine


def arg(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def engine_for(model, tp: int) -> Engine:
    """The default engine on one GPU, or over 2 (`TPForward`, in place, the all-reduce kernel)."""
    if tp == 1:
        return Engine(model)
    from jaxdecode.tp import TPForward

    return Engine(None, tp=TPForward.from_model(model, 2, loop_mode="inplace"))


def time_batch(engine: Engine, batch: int, first_tokens: dict) -> dict:
    """Best of three 64-step decode timings at `batch` (1k context, 16-token prompts) after a compiling
    call; greedy tokens compared with the first variant's at this batch (kept in `first_tokens`)."""
    prompts = np.random.default_rng(batch).integers(0, 1000, (batch, 16))
    time_engine(engine, prompts, context=1024, steps=32)  # traces and compiles
    runs = [time_engine(engine, prompts, context=1024, steps=64) for _ in range(3)]
    best = min(runs, key=lambda t: t.decode_s / t.steps)
    agree = tokens_agree(first_tokens[batch], best.tokens) if batch in first_tokens else None
    first_tokens.setdefault(batch, best.tokens)
    return dict(
        batch=batch,
        ms=round(best.decode_s / best.steps * 1e3, 3),
        all_ms=[round(t.decode_s / t.steps * 1e3, 3) for t in runs],
        tokens_agree_with_first=agree,
    )


def record(row: dict, name: str) -> None:
    """Print one JSON line and append it to $OUT/<name>."""
    print(json.dumps(row), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), name), "a") as fh:
        fh.write(json.dumps(row) + "\n")


def run_variants(field: str, default_variants: str, engine_with, restore, out_name: str) -> None:
    """The A/B loop: Llama-3.1-8B (random bf16) built once; for each variant of `--variants` (default
    `default_variants`), `engine_with(model, variant, tp)` patches the hooks and builds the engine, each
    batch of `--batches` is timed (its step traced with the hooks patched), then `restore()`. Rows carry
    `field`=variant and go to $OUT/<out_name>."""
    import jax.numpy as jnp

    from jaxdecode.config import get_preset
    from jaxdecode.model import init_random

    model = init_random(get_preset("llama-3.1-8b"), dtype=jnp.bfloat16)
    tp = int(arg("--tp", "1"))
    batches = tuple(int(b) for b in arg("--batches", "1,8").split(","))
    first_tokens = {}
    for variant in arg("--variants", default_variants).split(","):
        engine = engine_with(model, variant, tp)
        for batch in batches:
            record({"tp": tp, field: variant, **time_batch(engine, batch, first_tokens)}, out_name)
        restore()
        del engine

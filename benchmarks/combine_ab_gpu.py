"""GPU A/B: the attention's split combine as XLA fusions (combine="xla") or as one Pallas kernel
(combine="kernel", `kernels.decode_attention_kernels.combine_splits`), in the default engine.

    JAX_PLATFORMS=cuda,cpu python benchmarks/combine_ab_gpu.py [--tp 1|2] [--batches 1,8] [--variants xla,kernel,xla]
        # one JSON line per row on stdout and in $OUT/combine_ab_gpu.jsonl

Llama-3.1-8B, random bf16 weights, 1k context, on one GPU or 2 (`--tp 2`: the all-reduce kernel).
Per variant: the best of three 64-step decode timings (`bench.time_engine`); run "xla" first and last
to show the drift within the run. Greedy tokens are compared with the first variant's (leading
tokens equal in every sequence).
"""
import functools
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
from kernels.decode_attention import BlockSizes  # noqa: E402

DEFAULT_SDPA = looped_model.KERNEL_CALLS["sdpa"]


def engine_with(model, combine: str, tp: int):
    """An engine whose attention hook combines the splits as `combine` says. The hook table is patched
    until the caller restores it after the first (tracing) call: the TP engine traces lazily."""
    looped_model.KERNEL_CALLS["sdpa"] = functools.partial(looped_model.kernel_attention,
                                                          block_sizes=BlockSizes(combine=combine))
    if tp == 1:
        return Engine(model)
    from jaxdecode.tp import TPForward
    return Engine(None, tp=TPForward.from_model(model, 2, loop_mode="inplace"))


def arg(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def main():
    model = init_random(get_preset("llama-3.1-8b"), dtype=jnp.bfloat16)
    rows, first_tokens = [], {}
    plans = [(int(arg("--tp", "1")), tuple(int(b) for b in arg("--batches", "1,8").split(",")))]
    for tp, batches in plans:
        for variant in arg("--variants", "xla,kernel,xla").split(","):
            engine = engine_with(model, variant, tp)
            for batch in batches:  # each batch's step is traced at its first call, with the hook patched
                prompts = np.random.default_rng(batch).integers(0, 1000, (batch, 16))
                time_engine(engine, prompts, context=1024, steps=32)  # traces and compiles
                runs = [time_engine(engine, prompts, context=1024, steps=64) for _ in range(3)]
                best = min(runs, key=lambda t: t.decode_s / t.steps)
                key = (tp, batch)
                agree = tokens_agree(first_tokens[key], best.tokens) if key in first_tokens else None
                first_tokens.setdefault(key, best.tokens)
                rows.append(dict(tp=tp, combine=variant, batch=batch, ms=round(best.decode_s / best.steps * 1e3, 3),
                                 all_ms=[round(t.decode_s / t.steps * 1e3, 3) for t in runs],
                                 tokens_agree_with_first=agree))
                print(json.dumps(rows[-1]), flush=True)
                with open(os.path.join(os.environ.get("OUT", "."), "combine_ab_gpu.jsonl"), "a") as fh:
                    fh.write(json.dumps(rows[-1]) + "\n")
            looped_model.KERNEL_CALLS["sdpa"] = DEFAULT_SDPA
            del engine


if __name__ == "__main__":
    main()

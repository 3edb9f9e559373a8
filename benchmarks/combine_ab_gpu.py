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
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off

from jaxdecode import looped_model  # noqa: E402
from kernels.decode_attention import BlockSizes  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_runs import engine_for, run_variants  # noqa: E402

DEFAULT_SDPA = looped_model.KERNEL_CALLS["sdpa"]


def engine_with(model, combine: str, tp: int):
    """An engine whose attention hook combines the splits as `combine` says. The hook table is patched
    until the caller restores it after the first (tracing) call: the TP engine traces lazily."""
    looped_model.KERNEL_CALLS["sdpa"] = functools.partial(
        looped_model.kernel_attention, block_sizes=BlockSizes(combine=combine)
    )
    return engine_for(model, tp)


def main():
    run_variants(
        "combine",
        "xla,kernel,xla",
        engine_with,
        lambda: looped_model.KERNEL_CALLS.update(sdpa=DEFAULT_SDPA),
        "combine_ab_gpu.jsonl",
    )


if __name__ == "__main__":
    main()

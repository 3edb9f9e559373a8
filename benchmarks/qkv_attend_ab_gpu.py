"""GPU A/B: the q·k·v epilogue as one kernel (the `qkv_attend` hook: `kernels.qkv_rope`) or as XLA's
fusions (q's RoPE and padding, two cache writes), in the default engine.

    JAX_PLATFORMS=cuda,cpu python benchmarks/qkv_attend_ab_gpu.py [--tp 1|2] [--batches 1,8] [--variants off,on,off]
        # one JSON line per row on stdout and in $OUT/qkv_attend_ab_gpu.jsonl

Llama-3.1-8B, random bf16 weights, 1k context, on one GPU or 2 (`--tp 2`: the all-reduce kernel).
Per variant and batch: the best of three 64-step decode timings (`bench.time_engine`); "off" first
and last shows the drift within the run. Greedy tokens are compared with the first variant's.
"""

import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off

from jaxdecode import looped_model  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_runs import engine_for, run_variants  # noqa: E402

DEFAULT_CALLS = dict(looped_model.KERNEL_CALLS)


def engine_with(model, variant: str, tp: int):
    """An engine with the `qkv_attend` hook on or off. The hook table is patched until the caller
    restores it after the first (tracing) call: the TP engine traces lazily."""
    looped_model.KERNEL_CALLS.clear()
    looped_model.KERNEL_CALLS.update({k: v for k, v in DEFAULT_CALLS.items() if variant == "on" or k != "qkv_attend"})
    return engine_for(model, tp)


def main():
    run_variants(
        "qkv_attend",
        "off,on,off",
        engine_with,
        lambda: looped_model.KERNEL_CALLS.update(DEFAULT_CALLS),
        "qkv_attend_ab_gpu.jsonl",
    )


if __name__ == "__main__":
    main()

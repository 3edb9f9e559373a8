"""GPU A/B: the attention block's end on one GPU as one kernel (the `residual_norm` hook:
`kernels.rms_norm.residual_rms_norm` adds the o GEMV's split partials, the residual and normalizes) or
as XLA's fusion (split sum and residual add) followed by the norm kernel, in the default engine.

    JAX_PLATFORMS=cuda,cpu python benchmarks/residual_norm_ab_gpu.py [--batches 1,8] [--variants off,on,on8,on+norm16,off]
        # one JSON line per row on stdout and in $OUT/residual_norm_ab_gpu.jsonl

Llama-3.1-8B, random bf16 weights, 1k context, one GPU. Per variant and batch: the best of three 64-step
decode timings (`bench.time_engine`); "off" first and last shows the drift within the run. "on" is the
engine's default. Greedy
tokens are compared with the first variant's. At batch 8 the o projection runs the Stream-K kernel,
whose partials the hook does not take: "on" and "off" run the same kernels there (a control).
"""

import functools
import os
import sys

from jaxdecode import looped_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_runs import engine_for, run_variants  # noqa: E402

DEFAULT_CALLS = dict(looped_model.KERNEL_CALLS)


def engine_with(model, variant: str, tp: int):
    """An engine for `variant`, parts joined by "+": "off" (the one-device `residual_norm` hook off),
    "onN" (on, its kernel with N warps; "on" alone: the default), "normN" (the `rms_norm` kernel with N
    warps). The hook table is patched until `restore`."""
    looped_model.KERNEL_CALLS.clear()
    looped_model.KERNEL_CALLS.update(DEFAULT_CALLS)
    for part in variant.split("+"):
        if part == "off":
            del looped_model.KERNEL_CALLS["residual_norm"]
        elif part.startswith("on") and part[2:]:
            looped_model.KERNEL_CALLS["residual_norm"] = functools.partial(
                DEFAULT_CALLS["residual_norm"], num_warps=int(part[2:])
            )
        elif part.startswith("norm"):
            looped_model.KERNEL_CALLS["rms_norm"] = functools.partial(
                DEFAULT_CALLS["rms_norm"], num_warps=int(part[4:])
            )
        elif part != "on":
            raise SystemExit(f"residual_norm_ab_gpu: unknown variant part {part!r}")
    return engine_for(model, tp)


def main():
    run_variants(
        "residual_norm",
        "off,on,off",
        engine_with,
        lambda: looped_model.KERNEL_CALLS.update(DEFAULT_CALLS),
        "residual_norm_ab_gpu.jsonl",
    )


if __name__ == "__main__":
    main()

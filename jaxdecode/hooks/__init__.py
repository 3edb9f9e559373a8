"""The kernel hooks of the in-place looped decode: the model's named calls (`jaxdecode.model.Hook`) that
`looping.kernel_loop` hands to kernels reading the stacked weights and caches in place. Each hook
returns its outputs, or None to leave the call as written (XLA then runs it, and the hooks of the calls
inside it still apply).

  gemm.py       dense and quantized dots, SwiGLU's pair, q·k·v, a quantized MLP block
  attention.py  q·k·v, epilogue and attention for one new token; attention over the cache
  norms.py      RMSNorm; the attention block's end on one device and under tensor parallelism
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping

from jaxdecode.config import TensorParallel
from jaxdecode.hooks.attention import MAX_ATTENTION_ROWS, kernel_attention, kernel_qkv_attend
from jaxdecode.hooks.gemm import kernel_mlp, kernel_qkv, kernel_quant_dot, kernel_stacked_dot, kernel_swiglu
from jaxdecode.hooks.norms import kernel_residual_norm, kernel_rms_norm, kernel_split_residual_norm
from jaxdecode.model import Hook

# The model's named calls that the in-place loop hands to kernels (`stacked_calls` of `kernel_loop`).
# Each was kept because it measured faster than the calls it replaces (docs/log/).
KERNEL_CALLS: Mapping[Hook, Callable] = types.MappingProxyType(
    {
        Hook.SDPA: kernel_attention,
        Hook.SWIGLU: kernel_swiglu,
        Hook.QKV: kernel_qkv,
        Hook.RMS_NORM: kernel_rms_norm,
        Hook.QKV_ATTEND: kernel_qkv_attend,
        Hook.RESIDUAL_NORM: kernel_split_residual_norm,
        Hook.QUANT_DOT: kernel_quant_dot,
    }
)

# Built, not on by default: `kernel_mlp` (the quantized MLP block as one launch; docs/kernels.md, "The
# quantized MLP as one kernel": right, but slower than its two launches). `kernel_calls(overrides={Hook.MLP:
# kernel_mlp})` runs it.
OPTIONAL_CALLS: Mapping[Hook, Callable] = types.MappingProxyType({Hook.MLP: kernel_mlp})

# Under tensor parallelism these replace the one-device hooks of the same name, and `kernel_calls` binds
# whatever hook sits at these names to the mesh axis and the all-reduce (keywords `axis`, `allreduce_impl`).
TP_CALLS: Mapping[Hook, Callable] = types.MappingProxyType({Hook.RESIDUAL_NORM: kernel_residual_norm})


def kernel_calls(
    tp: TensorParallel | None = None, overrides: Mapping[Hook | str, Callable | None] | None = None
) -> dict[Hook, Callable]:
    """The hooks of the in-place loop: KERNEL_CALLS, under tensor parallelism (`tp` given) TP_CALLS in
    their place, then `overrides` on top: {hook: function} replaces a hook, {hook: None} turns it off
    (the call then runs as written, and the hooks of the calls inside it still apply)."""
    calls = dict(KERNEL_CALLS)
    if tp is not None:
        calls.update(TP_CALLS)
    for name, hook in (overrides or {}).items():
        if name not in set(Hook):
            raise ValueError(f"unknown kernel hook {name!r}; the hooks are {', '.join(h.value for h in Hook)}")
        if hook is None:
            calls.pop(Hook(name), None)
        else:
            calls[Hook(name)] = hook
    if tp is not None:
        for name in TP_CALLS.keys() & calls.keys():
            calls[name] = functools.partial(calls[name], axis=tp.axis, allreduce_impl=tp.allreduce)
    return calls


__all__ = [
    "KERNEL_CALLS",
    "MAX_ATTENTION_ROWS",
    "OPTIONAL_CALLS",
    "TP_CALLS",
    "kernel_attention",
    "kernel_calls",
    "kernel_mlp",
    "kernel_qkv",
    "kernel_qkv_attend",
    "kernel_quant_dot",
    "kernel_residual_norm",
    "kernel_rms_norm",
    "kernel_split_residual_norm",
    "kernel_stacked_dot",
    "kernel_swiglu",
]

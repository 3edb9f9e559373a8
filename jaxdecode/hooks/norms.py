"""The in-place loop's norm hooks: RMSNorm with the weight read in place, the attention block's end (split
sums, residual add, the MLP's norm) in one kernel on one device, and under tensor parallelism in the
all-reduce kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdecode.looping import SplitSum, StackedRef, takes_split_sums
from kernels import allreduce, dispatch, rms_norm


def _constant_eps(eps) -> float | None:
    """eps as a Python float, or None where it is not a constant of the traced layer."""
    try:
        return float(eps)
    except (TypeError, jax.errors.ConcretizationTypeError):
        return None


def _norm_kernel_runs(dtype, impl: str | None, hook: str) -> bool:
    """Whether a norm hook's Triton kernel runs: with impl=None for 16-bit inputs on a device with a tuned
    kernel table (like the other kernels: measured on the H200 only); always with impl="triton" (tests)."""
    if impl is None:
        return dtype in (jnp.bfloat16, jnp.float16) and dispatch.table_for()[0] is not None
    if impl != "triton":
        raise ValueError(f"{hook} impl must be None or 'triton', got {impl!r}")
    return True


def _backend_fits(backend: str, dim: int) -> bool:
    """Whether the norm kernels of `backend` take rows of D (Mosaic GPU: a multiple of 64)."""
    return backend != "mosaic" or rms_norm.mosaic_fits(dim)


def kernel_rms_norm(
    x,
    weight,
    eps,
    *,
    impl: str | None = None,
    backend: str = "mosaic",
    num_warps: int = 4,
    interpret: bool = False,
):
    """The `stacked_calls["rms_norm"]` hook: `model.rms_norm` as one `kernels.rms_norm` launch that
    reads the layer's norm weight in place (XLA runs a norm as two kernels, a reduction and a scale).
    x [..., D]; weight a `StackedRef` of the [L, D] stack; eps the model's (a constant of the traced
    layer). Returns [y [..., D]], or None (the call is then evaluated as written): when eps is not a
    constant, for a D the backend's kernel does not take, and, with `impl=None`, for inputs that are
    not 16-bit or on a device without a tuned kernel table (like the other kernels: measured on the
    H200 only). backend: the kernel's, "mosaic" (the default) or "triton" (`kernels.rms_norm`)."""
    if (
        not isinstance(weight, StackedRef)
        or isinstance(x, StackedRef)
        or x.dtype != weight.stack.dtype
        or (eps := _constant_eps(eps)) is None
    ):
        return None
    if not _norm_kernel_runs(x.dtype, impl, "kernel_rms_norm") or not _backend_fits(backend, x.shape[-1]):
        return None
    y = rms_norm.rms_norm(
        x.reshape(-1, x.shape[-1]),
        weight.stack,
        weight.index,
        eps=eps,
        num_warps=num_warps,
        impl=backend,
        interpret=interpret,
    )
    return [y.reshape(x.shape)]


@takes_split_sums
def kernel_split_residual_norm(
    x,
    block_out,
    weight,
    eps,
    *comm,
    impl: str | None = None,
    backend: str = "mosaic",
    num_warps: int = 16,
    interpret: bool = False,
):
    """The `stacked_calls["residual_norm"]` hook on one device: `model.residual_norm` (the attention's
    residual add, then the MLP's input norm) as one `kernels.rms_norm.residual_rms_norm` launch that
    also adds the o projection's split-K partials (block_out a `SplitSum` from a GEMV) or its summed
    output, the norm weight read in place. XLA would run the split sum and the add as one fusion,
    then the norm kernel.

    x [..., D]; block_out a `SplitSum` or an array of x's shape and dtype; weight a `StackedRef` of the
    [L, D] stack; eps the model's (a constant); comm empty (one device). Returns [s, normed], or None
    (the call is then evaluated as written, block_out summed first): for a D the backend's kernel does
    not take, and with `impl=None` for inputs that are not 16-bit or on a device without a tuned
    kernel table. `impl="triton"` (tests, with `interpret=True`) skips those two checks. backend: the
    kernel's, "mosaic" (the default) or "triton" (`kernels.rms_norm`).
    """
    if (
        not isinstance(weight, StackedRef)
        or comm
        or isinstance(x, (StackedRef, SplitSum))
        or isinstance(block_out, StackedRef)
        or block_out.shape != x.shape
        or not x.dtype == block_out.dtype == weight.stack.dtype
        or (eps := _constant_eps(eps)) is None
    ):
        return None
    if not _norm_kernel_runs(x.dtype, impl, "kernel_split_residual_norm") or not _backend_fits(backend, x.shape[-1]):
        return None
    dim = x.shape[-1]
    if isinstance(block_out, SplitSum):
        partials = block_out.partials
    else:  # already summed (o by Stream-K, whose combine is an XLA fusion): one partial, f32 as the kernel sums
        partials = block_out.astype(jnp.float32).reshape(1, -1, dim)
    s, normed = rms_norm.residual_rms_norm(
        partials,
        x.reshape(-1, dim),
        weight.stack,
        weight.index,
        eps=eps,
        num_warps=num_warps,
        impl=backend,
        interpret=interpret,
    )  # [M, D] each
    return [s.reshape(x.shape), normed.reshape(x.shape)]


def kernel_residual_norm(x, block_out, weight, eps, *comm, axis: str, allreduce_impl: str, all_reduce_norm=None):
    """The `stacked_calls["residual_norm"]` hook under tensor parallelism, bound to the model's config by
    `kernel_calls`: `model.residual_norm` (the attention's all-reduce and residual add, then the MLP's
    input norm) as one barrier-free all-reduce kernel that sums block_out over the devices, adds x and
    normalizes, the norm weight read in place (`allreduce.all_reduce_persistent(..., norm=...)`).
    `all_reduce_norm(block_out, axis, state, mailbox, residual=, norm=)` replaces that kernel (tests).

    x, block_out [..., D] (block_out this device's partial sum); weight a `StackedRef` of the [L, D]
    stack; eps the model's (a constant); comm the kernel's (state, mailbox). Returns [s, normed], or
    None (the call is then evaluated as written: the all-reduce, then the `rms_norm` hook) where the
    all-reduce kernel does not take block_out (`allreduce.takes`), with psum, and when eps is not a
    constant. One device has its own hook, `kernel_split_residual_norm`.
    """
    if (
        not isinstance(weight, StackedRef)
        or any(isinstance(a, StackedRef) for a in (x, block_out, *comm))
        or x.dtype != weight.stack.dtype
        or block_out.shape != x.shape
        or block_out.dtype != x.dtype
        or (eps := _constant_eps(eps)) is None
    ):
        return None
    if allreduce_impl != "kernel" or not (all_reduce_norm or allreduce.takes(block_out, axis, comm)):
        return None
    reduce = all_reduce_norm or allreduce.all_reduce_persistent
    return list(reduce(block_out, axis, *comm, residual=x, norm=(weight.stack, weight.index, eps)))

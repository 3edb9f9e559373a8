"""The in-place loop's GEMM hooks: dense and quantized `x @ W[i]` read in place from the stacks, the
SwiGLU pair in one launch, q·k·v in one launch (`kernels.flat_gemm*`, `kernels.quant_gemm_stream`), a
quantized MLP block in one launch (`kernels.quant_mlp`, `kernels.quant_mlp_owned`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxdecode.looping import SplitSum, StackedRef, outside_runs
from jaxdecode.quantized import in_kernel_order
from kernels import (
    dispatch,
    flat_gemm,
    flat_gemm_stream,
    quant_gemm,
    quant_gemm_stream,
    quant_mlp,
    quant_mlp_owned,
    superblocks,
)


def _gemm_impl(m: int, n: int, k: int, dtype, block_sizes: flat_gemm.BlockSizes, weights: int = 1) -> str | None:
    """The flat-GEMM kernel `kernels.dispatch` picks for a looped x [M, K] · W[i] ([K, N]), or None
    where XLA's dot should run (off Hopper, shapes the kernels do not tile, inputs not 16-bit, or
    pipeline stages that do not fit in shared memory: Mosaic's x and `weights` weight tiles, two of them;
    the Stream-K kernel's x and one weight tile, two of them beside its flush buffer)."""
    if dtype not in (jnp.bfloat16, jnp.float16):
        return None
    impl = dispatch.choose_gemm(m, n, k, looped=True, block_sizes=block_sizes).impl
    m8 = -(-m // 8) * 8
    stage_bytes = block_sizes.tile_k * (m8 + weights * block_sizes.tile_n) * jnp.dtype(dtype).itemsize
    # two pipeline stages must fit, counted as flat_gemm counts them (counting them twice here would
    # send one-weight looped GEMMs with M > 40 to XLA and reject every SwiGLU)
    if impl == "xla" or (impl == "mosaic" and 2 * stage_bytes > block_sizes.smem_bytes):
        return None
    if impl == "stream" and _stream_blocks(block_sizes).max_stages(m8, jnp.dtype(dtype).itemsize) < 2:
        return None
    return impl


def kernel_stacked_dot(
    x,
    stack,
    index,
    out_dtype,
    *,
    impl: str | None = None,
    block_sizes: flat_gemm.BlockSizes = flat_gemm.BlockSizes(),
    pdl: bool = False,
    interpret: bool = False,
):
    """The `stacked_dot` hook of the engine: x [M, K] · stack[index] ([L, K, N]) with the stack
    read in place by `kernels.flat_gemm`, or None (the caller then runs the plain dot). pdl: the Stream-K
    kernel loads its first weight tiles before the previous kernel ends (`StreamBlocks.pdl`).

    `impl=None` asks `kernels.dispatch.choose_gemm(looped=True)` (see `_gemm_impl`). An explicit
    `impl` (tests: "triton" with `interpret=True`) skips the checks. The Triton kernels' result is a
    `SplitSum` (their split-K partials, batch-major): `kernel_split_residual_norm` adds them in its
    kernel, every other consumer gets the sum, which equals `flat_gemm`'s.
    """
    m, k = x.shape  # x [M, K]
    n = stack.shape[2]  # stack [L, K, N]
    if jnp.dtype(out_dtype) != x.dtype or x.dtype != stack.dtype:
        return None
    if impl is None and (impl := _gemm_impl(m, n, k, x.dtype, block_sizes)) is None:
        return None
    if impl == "stream":
        return flat_gemm_stream.flat_gemm_multi(
            x, (stack,), index, block_sizes=_stream_blocks(block_sizes, pdl), interpret=interpret
        )[0]
    if impl in ("gemv", "triton"):  # batch-major partials: left unsummed for a hook that adds them itself
        parts = flat_gemm.flat_gemm_partials(x, stack, index, impl=impl, block_sizes=block_sizes, interpret=interpret)
        return SplitSum(parts, (m, n), x.dtype)  # parts [splits, M, N] f32
    return flat_gemm.flat_gemm(x, stack, index, impl=impl, block_sizes=block_sizes, interpret=interpret)


def quantized_weights(refs, count: int):
    """The leaves of `count` quantized weights as the hooks receive them (codes, scales(, offsets) each, or
    two levels of scales: `kernels.superblocks.weight_arrays`; `StackedRef`s of [L, N, K] and [L, K/., N]
    stacks), grouped per weight; None for dense weights, biases among the leaves, or a leaf count that does
    not split evenly into weights. Formats that differ between the weights (group size, dtypes) are left to
    the kernel's own shape check."""
    if not refs or len(refs) % count or not all(isinstance(r, StackedRef) and r.stack.ndim == 3 for r in refs):
        return None
    per = len(refs) // count
    weights = [tuple(refs[i : i + per]) for i in range(0, len(refs), per)]
    if any(not jnp.issubdtype(w[0].stack.dtype, jnp.integer) for w in weights):
        return None
    try:
        arrays = [superblocks.weight_arrays([r.stack for r in w]) for w in weights]
    except ValueError:  # a leaf count no quantized weight has
        return None
    if len({tuple(a is None for a in w) for w in arrays}) > 1:
        return None  # one level and two mixed in one call
    return weights


def two_level(weights) -> bool:
    """Whether the weights' scales have two levels (`kernels.superblocks`)."""
    return any(jnp.issubdtype(w[1].stack.dtype, jnp.integer) for w in weights)


def on_hopper_16bit(x) -> bool:
    return dispatch.gpu_kind() in ("H100", "H200") and x.dtype in (jnp.bfloat16, jnp.float16)


def stream_arrays(weights):
    """(codes, scales, offsets, super_scales, super_offsets) stacks per weight, absent ones None, for
    `kernels.quant_gemm_stream`."""
    return tuple(superblocks.weight_arrays([r.stack for r in w]) for w in weights)


def codes_permuted(weights) -> bool:
    """Whether the weights' codes are stored in the kernels' K order (`quantized.in_kernel_order`; the
    weights of one launch share one format, which the kernel checks)."""
    return in_kernel_order(weights[0][0].stack, weights[0][1].stack)


@outside_runs
def kernel_quant_dot(
    x,
    codes,
    scales,
    *rest,
    impl: str | None = None,
    block_sizes: quant_gemm.QuantBlocks = quant_gemm.QuantBlocks(),
    stream_blocks: quant_gemm_stream.QuantStreamBlocks = quant_gemm_stream.QuantStreamBlocks(),
    interpret: bool = False,
):
    """The `stacked_calls["quant_dot"]` hook: x [..., K] times layer i of a quantized weight stack, codes
    [L, N, K] and scales (offsets) [L, K/G, N] read in place; outside the looped runs, a plain quantized
    weight (codes [N, K]: the output projection). `rest`: the weight's leaves after its scales (offsets, or
    two levels: `kernels.superblocks`). impl "stream" (the default for M <= 64 on Hopper:
    `kernels.quant_gemm_stream`, every SM busy to the end) or "mosaic" (`kernels.quant_gemm`, one tile
    per CTA, M up to 256). Returns [y [..., N]], or None (the call then runs as written: XLA dequantizes and
    dots): off Hopper, activations that are not 16-bit, M past the kernels' limits, or shapes they do not tile.
    An explicit `impl` (tests: with `interpret=True`) skips the device and dtype checks, not the tiling."""
    refs = (codes, scales, *rest)
    stacked = all(isinstance(r, StackedRef) for r in refs)
    plain = not any(isinstance(r, StackedRef) for r in refs) and codes.ndim == 2
    if not (stacked or plain) or isinstance(x, StackedRef):
        return None
    arrays = [r.stack for r in refs] if stacked else list(refs)  # [L, ...] stacks, or one layer's arrays
    try:
        weight = superblocks.weight_arrays(arrays)  # (codes, scales, offsets, super_scales, super_offsets)
    except ValueError:  # not a quantized weight's leaves
        return None
    index = codes.index if stacked else None
    *lead, k = x.shape
    m = int(np.prod(lead, dtype=int))
    n, groups = arrays[0].shape[-2], arrays[1].shape[-2]
    if impl is None:
        if not on_hopper_16bit(x):
            return None
        impl = "stream" if m <= quant_gemm_stream.MAX_M else "mosaic"
    if m > dispatch.MOSAIC_MAX_M:
        return None
    permuted = in_kernel_order(arrays[0], arrays[1])
    try:
        if impl == "stream":
            (y,) = quant_gemm_stream.quant_gemm_multi(
                x.reshape(m, k),
                (weight,),
                index,
                group=k // groups,
                block_sizes=stream_blocks,
                permuted_codes=permuted,
                interpret=interpret,
            )  # [M, N]
        else:
            y = quant_gemm.quant_gemm(
                x.reshape(m, k),
                *weight[:3],
                index,
                super_scales=weight[3],
                super_offsets=weight[4],
                group=k // groups,
                impl=impl,
                block_sizes=block_sizes,
                permuted_codes=permuted,
                interpret=interpret,
            )  # [M, N]
    except quant_gemm.UntiledShape:  # a shape or dtype the kernel does not tile: XLA runs the call
        return None
    return [y.reshape(*lead, n)]


def _kernel_swiglu_quantized(x, weights, impl, blocks, interpret):
    """`kernel_swiglu` for quantized gate and up: one `quant_gemm_multi` launch (x read once, both
    stacks in place), then silu(g)·u in f32, rounded once. None where the kernel declines."""
    if impl is None and not on_hopper_16bit(x):
        return None
    if impl not in (None, "stream"):
        return None
    *lead, d = x.shape
    m = int(np.prod(lead, dtype=int))
    group = d // weights[0][1].stack.shape[1]
    try:
        g, u = quant_gemm_stream.quant_gemm_multi(
            x.reshape(m, d),
            stream_arrays(weights),
            weights[0][0].index,
            group=group,
            out_dtype=jnp.float32,
            block_sizes=blocks,
            permuted_codes=codes_permuted(weights),
            interpret=interpret,
        )  # [M, F] each
    except quant_gemm.UntiledShape:
        return None
    return [(jax.nn.silu(g) * u).astype(x.dtype).reshape(*lead, g.shape[-1])]


def kernel_mlp(
    x,
    w_gate,
    w_up,
    w_down,
    *quantized,
    impl: str | None = None,
    design: str = "phases",
    block_sizes: quant_mlp.QuantMLPBlocks = quant_mlp.QuantMLPBlocks(),
    owned_blocks: quant_mlp_owned.OwnedMLPBlocks = quant_mlp_owned.OwnedMLPBlocks(),
    interpret: bool = False,
):
    """A `stacked_calls["mlp"]` hook, not in the default table (`hooks.OPTIONAL_CALLS`): `model.mlp` of
    quantized stacks as one launch (gate and up, SwiGLU and down), of one of two designs:
    - "phases": `kernels.quant_mlp`, Stream-K phases that meet through semaphores in HBM; down's weights
      stream while gate/up drains. Right compiled on an H200, but slower end to end than the two launches it
      replaces (docs/kernels.md);
    - "owned": `kernels.quant_mlp_owned`, each CTA owning columns of h end to end, no CTA waiting on another
      (int4 codes stored in the kernels' order, or int8; groups of 128).
    The weights arrive as their leaves (codes, scales(, offsets) each, `StackedRef`s). Returns [y [..., D]],
    or None (the call then runs as written, through the `swiglu` and `quant_dot` hooks): dense weights, off
    Hopper or activations that are not 16-bit (impl None), or what the kernel does not take (M > 8, widths
    that are not whole tiles, mixed formats). impl "fused" (tests, with `interpret=True`) skips the device
    and dtype checks."""
    if not quantized or impl not in (None, "fused"):
        return None
    if design not in ("phases", "owned"):
        raise ValueError(f"kernel_mlp design must be 'phases' or 'owned', got {design!r}")
    weights = quantized_weights((w_gate, w_up, w_down, *quantized), 3)
    if weights is None or two_level(weights) or (impl is None and not on_hopper_16bit(x)):
        return None  # the MLP kernels take one level of scales
    *lead, d = x.shape
    m = int(np.prod(lead, dtype=int))
    group = d // weights[0][1].stack.shape[1]
    if weights[2][0].stack.shape[-1] // weights[2][1].stack.shape[1] != group:
        return None  # down's group size differs from gate's and up's
    if design == "owned":  # int4 codes in groups of 128 are always stored in the kernels' order
        kernel, kw = quant_mlp_owned.quant_mlp_owned, dict(block_sizes=owned_blocks)
    else:
        kernel, kw = quant_mlp.quant_mlp, dict(block_sizes=block_sizes, permuted_codes=codes_permuted(weights))
    layer = weights[0][0].index
    try:
        arrays = (w[:3] for w in stream_arrays(weights))  # codes, scales, offsets: one level
        y = kernel(x.reshape(m, d), *arrays, layer, group=group, interpret=interpret, **kw)
    except quant_gemm.UntiledShape:
        return None
    return [y.astype(x.dtype).reshape(*lead, d)]  # [M, D]: f32 from "owned", x's dtype from "phases"


def _stream_blocks(block_sizes: flat_gemm.BlockSizes, pdl: bool = False) -> flat_gemm_stream.StreamBlocks:
    """The Stream-K kernel's tiles for a dispatch decision made with `block_sizes`' tiles."""
    return flat_gemm_stream.StreamBlocks(tile_n=block_sizes.tile_n, tile_k=block_sizes.tile_k, pdl=pdl)


def kernel_swiglu(
    x,
    w_gate,
    w_up,
    *quantized,
    impl: str | None = None,
    block_sizes: flat_gemm.BlockSizes = flat_gemm.BlockSizes(),
    quant_blocks: quant_gemm_stream.QuantStreamBlocks = quant_gemm_stream.QuantStreamBlocks(),
    pdl: bool = False,
    interpret: bool = False,
):
    """The `stacked_calls["swiglu"]` hook: `model.swiglu` as one `kernels.flat_gemm_swiglu` call that
    reads x once and both stacked weights in place (one launch instead of two GEMMs and the
    elementwise product). x [..., D]; w_gate, w_up `StackedRef`s of [L, D, F] stacks. Returns
    [y [..., F]], or None (then the two dots go through `kernel_stacked_dot` one by one). The
    kernel computes silu·mul in f32 before one rounding; the model rounds g and u first. Quantized
    weights arrive as their leaves (codes, scales(, offsets) each): both go to one
    `kernels.quant_gemm_stream` launch (impl None on Hopper, or "stream"); where it declines, their
    dots go to `kernel_quant_dot` one by one. pdl: the dense Stream-K launch as `kernel_stacked_dot`'s
    (quantized: `quant_blocks.pdl`).
    """
    if quantized:
        weights = quantized_weights((w_gate, w_up, *quantized), 2)
        return None if weights is None else _kernel_swiglu_quantized(x, weights, impl, quant_blocks, interpret)
    if not (isinstance(w_gate, StackedRef) and isinstance(w_up, StackedRef)):
        return None
    d, f = w_gate.stack.shape[1:]
    lead = x.shape[:-1]
    m = int(np.prod(lead, dtype=int))
    if x.dtype != w_gate.stack.dtype or x.dtype != w_up.stack.dtype:
        return None
    if impl is None:
        impl = _gemm_impl(m, f, d, x.dtype, block_sizes, weights=2)
        if impl not in ("mosaic", "stream", "triton"):  # the gemv path has no SwiGLU form
            return None
    if impl == "stream":
        g, u = flat_gemm_stream.flat_gemm_multi(
            x.reshape(m, d),
            (w_gate.stack, w_up.stack),
            w_gate.index,
            out_dtype=jnp.float32,
            block_sizes=_stream_blocks(block_sizes, pdl),
            interpret=interpret,
        )  # [M, F] each
        return [(jax.nn.silu(g) * u).astype(x.dtype).reshape(*lead, f)]
    y = flat_gemm.flat_gemm_swiglu(
        x.reshape(m, d), w_gate.stack, w_up.stack, w_gate.index, impl=impl, block_sizes=block_sizes, interpret=interpret
    )
    return [y.reshape(*lead, f)]


def qkv_stream_fits(m: int, d: int, widths, dtype, blocks: flat_gemm_stream.StreamBlocks, *, dispatched: bool) -> bool:
    """Whether the three-weight stream kernel runs x [M, D] · (W_q, W_k, W_v) ([D, N_i]): widths and D in
    whole tiles, and, when `dispatched`, `kernels.dispatch` picks a kernel for the fused width ΣN_i, M is
    within the Mosaic kernel's limit and two pipeline stages fit (a long prefill chunk may not)."""
    if d % blocks.tile_k or any(n % blocks.tile_n for n in widths):
        return False
    if not dispatched:
        return True
    gemm = flat_gemm.BlockSizes(tile_n=blocks.tile_n, tile_k=blocks.tile_k)
    return (
        m <= dispatch.MOSAIC_MAX_M
        and _gemm_impl(m, sum(widths), d, dtype, gemm) is not None
        and blocks.max_stages(-(-m // 8) * 8, jnp.dtype(dtype).itemsize) >= 2
    )


def kernel_qkv(
    x,
    w_q,
    w_k,
    w_v,
    *biases,
    impl: str | None = None,
    gemm=None,
    block_sizes: flat_gemm_stream.StreamBlocks = flat_gemm_stream.StreamBlocks(),
    interpret: bool = False,
):
    """The `stacked_calls["qkv"]` hook: `model.qkv` as one `flat_gemm_multi` launch that reads x once
    and the three stacked weights in place. x [..., D]; w_q, w_k, w_v `StackedRef`s of [L, D, N_i]
    stacks; biases () or (b_q, b_k, b_v), added after the kernel as the model adds them. Returns
    [q, k, v] ([..., N_i]), or None (then the three dots go through `kernel_stacked_dot` one by one).

    `gemm(x [M, D], stacks, layer, *, out_dtype) -> tuple of [M, N_i]` defaults to the stream kernel.
    `impl=None` asks `kernels.dispatch` (via `_gemm_impl`, for the fused width ΣN_i); `impl="stream"`
    (tests, with an injected `gemm`) skips the dispatch and 16-bit checks, not the tile check.
    """
    weights = (w_q, w_k, w_v)
    if not all(isinstance(w, StackedRef) for w in weights) or len(biases) not in (0, 3):
        return None
    if any(x.dtype != w.stack.dtype for w in weights):
        return None
    d = w_q.stack.shape[1]
    widths = [w.stack.shape[2] for w in weights]  # N*H, K*H, K*H
    lead = x.shape[:-1]
    m = int(np.prod(lead, dtype=int))
    if impl not in (None, "stream"):
        raise ValueError(f"kernel_qkv impl must be None or 'stream', got {impl!r}")
    if not qkv_stream_fits(m, d, widths, x.dtype, block_sizes, dispatched=impl is None):
        return None
    if gemm is None:
        gemm = functools.partial(flat_gemm_stream.flat_gemm_multi, block_sizes=block_sizes, interpret=interpret)
    outs = gemm(x.reshape(m, d), tuple(w.stack for w in weights), w_q.index, out_dtype=x.dtype)
    outs = [y.reshape(*lead, n) for y, n in zip(outs, widths)]  # [..., N_i]
    if biases:
        outs = [
            y + (lax.dynamic_index_in_dim(b.stack, b.index, keepdims=False) if isinstance(b, StackedRef) else b)
            for y, b in zip(outs, biases)
        ]  # [..., N_i]
    return outs

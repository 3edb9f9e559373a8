"""The decode engine's use of the kernel-looping pass: our Transformer's forward, looped.

`LoopedForward` applies `looping.kernel_loop` to the model's forward function. The per-layer
weights are packed once (stacked to [L, ...]) when the engine is built, the per-layer KV caches once
when a cache is created, and both stay packed: every step reads the stacks directly, with no
per-step stacking or copying. One plan is traced per input shape (prefill and decode differ).

Modes (`LOOP_MODES`): "slice" (the scan slices the stacks), "whole" (the body takes row i with
`dynamic_index_in_dim`), "inplace" ("whole" plus the in-place hooks: the layer's `x @ W` dots read
W[i] in place with `kernels.flat_gemm` where `kernels.dispatch` picks a kernel (`kernel_stacked_dot`),
the model's `swiglu` call runs as one two-weight kernel (`kernel_swiglu`), its `qkv` call as one
three-weight stream kernel (`kernel_qkv`), its `rms_norm` calls as one kernel each (`kernel_rms_norm`),
under tensor parallelism the attention's all-reduce, residual add and the MLP's input norm as one
all-reduce kernel (`kernel_residual_norm`),
the KV cache is written in place in the scan carry, and attention (the model's `sdpa` call) reads
layer i of the stacked cache in place with `kernels.decode_attention` (`kernel_attention`); for one new
token per sequence, the model's `qkv_attend` call (projections, RoPE, cache write, attention) runs as
the q·k·v GEMM, one epilogue kernel (`kernels.qkv_rope`: split sum, bias, RoPE, the cache rows
written in place) and the attention kernel (`kernel_qkv_attend`); prefill, with more tokens, goes
through the `qkv` and `sdpa` hooks and the in-place cache writes inside that call). Quantized weights
take the same shape through `kernels.quant_gemm_stream`: q·k·v in one launch into the same epilogue
and attention, gate/up in one launch, every other quantized dot one launch (`kernel_quant_dot`).
`default_loop_mode()` (the engine's default) picks "inplace" on a GPU and "slice" elsewhere: on a
GPU XLA copies each W[i] out of its stack before a dot.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxdecode.cache import KVCache
from jaxdecode.config import ModelConfig, TensorParallel, get_preset
from jaxdecode.looping import (
    LoopPlan,
    LoopReport,
    Packed,
    SplitSum,
    StackedRef,
    kernel_loop,
    outside_runs,
    takes_split_sums,
)
from jaxdecode.model import Hook, Transformer
from kernels import (
    allreduce,
    decode_attention,
    dispatch,
    flat_gemm,
    flat_gemm_stream,
    qkv_rope,
    quant_gemm,
    quant_gemm_stream,
    rms_norm,
)

# Argument and output positions of `forward` below that the plan packs.
_PARAMS, _K, _V = 0, 3, 4
_PACKED_OUTPUTS = {1: _K, 2: _V}  # the new K and V caches come back packed like the inputs


LOOP_MODES = ("slice", "whole", "inplace")


def default_loop_mode() -> str:
    return "inplace" if jax.default_backend() == "gpu" else "slice"


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
    interpret: bool = False,
):
    """The `stacked_dot` hook of the engine: x [M, K] · stack[index] ([L, K, N]) with the stack
    read in place by `kernels.flat_gemm`, or None (the caller then runs the plain dot).

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
            x, (stack,), index, block_sizes=_stream_blocks(block_sizes), interpret=interpret
        )[0]
    if impl in ("gemv", "triton"):  # batch-major partials: left unsummed for a hook that adds them itself
        parts = flat_gemm.flat_gemm_partials(x, stack, index, impl=impl, block_sizes=block_sizes, interpret=interpret)
        return SplitSum(parts, (m, n), x.dtype)  # parts [splits, M, N] f32
    return flat_gemm.flat_gemm(x, stack, index, impl=impl, block_sizes=block_sizes, interpret=interpret)


def _quantized_weights(refs, count: int):
    """The leaves of `count` quantized weights as the hooks receive them (codes, scales(, offsets) each,
    `StackedRef`s of [L, N, K] and [L, K/G, N] stacks), grouped per weight; None for dense weights,
    biases among the leaves, or a leaf count that does not split evenly into weights. Formats that differ
    between the weights (group size, dtypes) are left to the kernel's own shape check."""
    if not refs or len(refs) % count or not all(isinstance(r, StackedRef) and r.stack.ndim == 3 for r in refs):
        return None
    per = len(refs) // count
    weights = [tuple(refs[i : i + per]) for i in range(0, len(refs), per)]
    if per not in (2, 3) or any(not jnp.issubdtype(w[0].stack.dtype, jnp.integer) for w in weights):
        return None
    return weights


def _on_hopper_16bit(x) -> bool:
    return dispatch.gpu_kind() in ("H100", "H200") and x.dtype in (jnp.bfloat16, jnp.float16)


def _stream_arrays(weights):
    """(codes, scales, offsets or None) stacks per weight, for `kernels.quant_gemm_stream`."""
    return tuple((w[0].stack, w[1].stack, w[2].stack if len(w) == 3 else None) for w in weights)


@outside_runs
def kernel_quant_dot(
    x,
    codes,
    scales,
    *offsets,
    impl: str | None = None,
    block_sizes: quant_gemm.QuantBlocks = quant_gemm.QuantBlocks(),
    stream_blocks: quant_gemm_stream.QuantStreamBlocks = quant_gemm_stream.QuantStreamBlocks(),
    interpret: bool = False,
):
    """The `stacked_calls["quant_dot"]` hook: x [..., K] times layer i of a quantized weight stack, codes
    [L, N, K] and scales (offsets) [L, K/G, N] read in place; outside the looped runs, a plain quantized
    weight (codes [N, K]: the output projection). impl "stream" (the default for M <= 64 on Hopper:
    `kernels.quant_gemm_stream`, every SM busy to the end) or "mosaic" (`kernels.quant_gemm`, one tile
    per CTA, M up to 256). Returns [y [..., N]], or None (the call then runs as written: XLA
    dequantizes and dots): off Hopper, activations that are not 16-bit, M past the kernels' limits, or
    shapes they do not tile. An explicit `impl` (tests: with `interpret=True`) skips the device and
    dtype checks, not the tiling."""
    refs = (codes, scales, *offsets)
    stacked = all(isinstance(r, StackedRef) for r in refs)
    plain = not any(isinstance(r, StackedRef) for r in refs) and codes.ndim == 2
    if not (stacked or plain) or len(offsets) > 1 or isinstance(x, StackedRef):
        return None
    arrays = [r.stack for r in refs] if stacked else list(refs)  # [L, ...] stacks, or one layer's arrays
    index = codes.index if stacked else None
    *lead, k = x.shape
    m = int(np.prod(lead, dtype=int))
    n, groups = arrays[0].shape[-2], arrays[1].shape[-2]
    if impl is None:
        if not _on_hopper_16bit(x):
            return None
        impl = "stream" if m <= quant_gemm_stream.MAX_M else "mosaic"
    if m > dispatch.MOSAIC_MAX_M:
        return None
    weight = (arrays[0], arrays[1], arrays[2] if offsets else None)
    try:
        if impl == "stream":
            (y,) = quant_gemm_stream.quant_gemm_multi(
                x.reshape(m, k), (weight,), index, group=k // groups, block_sizes=stream_blocks, interpret=interpret
            )  # [M, N]
        else:
            y = quant_gemm.quant_gemm(
                x.reshape(m, k),
                *weight,
                index,
                group=k // groups,
                impl=impl,
                block_sizes=block_sizes,
                interpret=interpret,
            )  # [M, N]
    except quant_gemm.UntiledShape:  # a shape or dtype the kernel does not tile: XLA runs the call
        return None
    return [y.reshape(*lead, n)]


def _kernel_swiglu_quantized(x, weights, impl, blocks, interpret):
    """`kernel_swiglu` for quantized gate and up: one `quant_gemm_multi` launch (x read once, both
    stacks in place), then silu(g)·u in f32, rounded once. None where the kernel declines."""
    if impl is None and not _on_hopper_16bit(x):
        return None
    if impl not in (None, "stream"):
        return None
    *lead, d = x.shape
    m = int(np.prod(lead, dtype=int))
    group = d // weights[0][1].stack.shape[1]
    try:
        g, u = quant_gemm_stream.quant_gemm_multi(
            x.reshape(m, d),
            _stream_arrays(weights),
            weights[0][0].index,
            group=group,
            out_dtype=jnp.float32,
            block_sizes=blocks,
            interpret=interpret,
        )  # [M, F] each
    except quant_gemm.UntiledShape:
        return None
    return [(jax.nn.silu(g) * u).astype(x.dtype).reshape(*lead, g.shape[-1])]


def _stream_blocks(block_sizes: flat_gemm.BlockSizes) -> flat_gemm_stream.StreamBlocks:
    """The Stream-K kernel's tiles for a dispatch decision made with `block_sizes`' tiles."""
    return flat_gemm_stream.StreamBlocks(tile_n=block_sizes.tile_n, tile_k=block_sizes.tile_k)


def kernel_swiglu(
    x,
    w_gate,
    w_up,
    *quantized,
    impl: str | None = None,
    block_sizes: flat_gemm.BlockSizes = flat_gemm.BlockSizes(),
    quant_blocks: quant_gemm_stream.QuantStreamBlocks = quant_gemm_stream.QuantStreamBlocks(),
    interpret: bool = False,
):
    """The `stacked_calls["swiglu"]` hook: `model.swiglu` as one `kernels.flat_gemm_swiglu` call that
    reads x once and both stacked weights in place (one launch instead of two GEMMs and the
    elementwise product). x [..., D]; w_gate, w_up `StackedRef`s of [L, D, F] stacks. Returns
    [y [..., F]], or None (then the two dots go through `kernel_stacked_dot` one by one). The
    kernel computes silu·mul in f32 before one rounding; the model rounds g and u first. Quantized
    weights arrive as their leaves (codes, scales(, offsets) each): both go to one
    `kernels.quant_gemm_stream` launch (impl None on Hopper, or "stream"); where it declines, their
    dots go to `kernel_quant_dot` one by one.
    """
    if quantized:
        weights = _quantized_weights((w_gate, w_up, *quantized), 2)
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
            block_sizes=_stream_blocks(block_sizes),
            interpret=interpret,
        )  # [M, F] each
        return [(jax.nn.silu(g) * u).astype(x.dtype).reshape(*lead, f)]
    y = flat_gemm.flat_gemm_swiglu(
        x.reshape(m, d), w_gate.stack, w_up.stack, w_gate.index, impl=impl, block_sizes=block_sizes, interpret=interpret
    )
    return [y.reshape(*lead, f)]


def _qkv_stream_fits(m: int, d: int, widths, dtype, blocks: flat_gemm_stream.StreamBlocks, *, dispatched: bool) -> bool:
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
    if not _qkv_stream_fits(m, d, widths, x.dtype, block_sizes, dispatched=impl is None):
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


def kernel_qkv_attend(
    x,
    k_cache,
    v_cache,
    positions,
    cos,
    sin,
    w_q,
    w_k,
    w_v,
    *biases,
    impl: str | None = None,
    partials=None,
    gemm_blocks: flat_gemm_stream.StreamBlocks = flat_gemm_stream.StreamBlocks(),
    attention_blocks: decode_attention.BlockSizes = decode_attention.BlockSizes(),
    quant_blocks: quant_gemm_stream.QuantStreamBlocks = quant_gemm_stream.QuantStreamBlocks(),
    epilogue_backend: str = "triton",
    interpret: bool = False,
):
    """The `stacked_calls["qkv_attend"]` hook: `model.qkv_attend` for one new token per sequence as three
    kernels: the q·k·v Stream-K GEMM reading the three stacked weights in place (its raw split
    partials), their epilogue (`kernels.qkv_rope.qkv_rope_write`: split sum, bias, RoPE, q laid out as
    the attention kernel's rows, the new k and v rows written into the carried cache stacks in place),
    and the synchronized attention on the stacks (`decode_attention_sync_rows`). XLA would run the
    epilogue as three kernels at batch 1 (q's RoPE and padding, two cache writes) and five at batch 8.

    x [B, 1, D]; k_cache, v_cache `StackedRef`s of the carried [L, B, S, K, H] stacks; positions [B, 1];
    cos, sin [B, 1, H]; w_* and biases (() or three) `StackedRef`s of [L, D, N_i] and [L, N_i] stacks.
    Returns [out [B, 1, N, H], k_cache', v_cache'] with the caches as refs of the updated stacks, or
    None (the call is then evaluated as written, where the `qkv`, `attend` and `sdpa` hooks apply):
    for T > 1, dtypes that differ or are not 16-bit, shapes the kernels do not tile, and, with
    impl=None, where `kernels.dispatch` picks XLA or the async attention kernel. `partials(x [M, D],
    stacks, layer) -> (partials, schedule)` defaults to `flat_gemm_stream.stream_partials`; tests inject
    a jnp stand-in and pass impl="stream" (which skips the dispatch and 16-bit checks, not the tiling).

    Quantized weights arrive as their leaves (codes, scales(, offsets) each, no biases): the q·k·v GEMM
    is then `kernels.quant_gemm_stream` (`quant_blocks`), whose partials have the same layout.
    epilogue_backend: the epilogue kernel's, "triton" or "mosaic" (`kernels.qkv_rope`).
    """
    if impl not in (None, "stream"):
        raise ValueError(f"kernel_qkv_attend impl must be None or 'stream', got {impl!r}")
    weights = (w_q, w_k, w_v)
    refs = (*weights, *biases)
    quantized = _quantized_weights(refs, 3)
    if quantized is not None:
        weights, biases = tuple(w[0] for w in quantized), ()  # the codes stand for their weights below
    if (
        not all(isinstance(w, StackedRef) for w in refs)
        or len(biases) not in (0, 3)
        or any(isinstance(a, StackedRef) for a in (x, positions, cos, sin))
        or getattr(k_cache, "origin", None) is None
        or getattr(v_cache, "origin", None) is None
    ):
        return None
    batch, tokens, d = x.shape
    kv_heads, head_dim = k_cache.stack.shape[-2:]
    widths = [w.stack.shape[1 if quantized else 2] for w in weights]  # N*H, K*H, K*H
    heads = widths[0] // head_dim
    dense = () if quantized else refs  # quantized arrays have their own dtypes
    if tokens != 1 or any(a.stack.dtype != x.dtype for a in (*dense, k_cache, v_cache)):
        return None
    group = heads // kv_heads
    rows = decode_attention.query_rows(1, group)  # q's rows per kv head, as the attention kernel lays them out
    if quantized:
        tile_n = quant_blocks.resolved(widths, len(quantized[0]) == 3).tile_n
        fits = (impl is not None or _on_hopper_16bit(x)) and batch <= quant_gemm_stream.MAX_M
        if partials is None:
            group_size = d // quantized[0][1].stack.shape[1]
            partials = lambda x2, _, layer: quant_gemm_stream.quant_stream_partials(  # noqa: E731
                x2, _stream_arrays(quantized), layer, group=group_size, cfg=quant_blocks, interpret=interpret
            )
    else:
        tile_n = gemm_blocks.tile_n
        fits = _qkv_stream_fits(batch, d, widths, x.dtype, gemm_blocks, dispatched=impl is None)
    if not fits or not qkv_rope.fits(heads, kv_heads, head_dim, tile_n, rows, impl=epilogue_backend):
        return None
    q_spec = jax.ShapeDtypeStruct((batch, 1, heads, head_dim), x.dtype)
    if _attention_impl(q_spec, k_cache, v_cache, "sync" if impl else None, attention_blocks) != "sync":
        return None
    if partials is None:
        partials = functools.partial(flat_gemm_stream.stream_partials, cfg=gemm_blocks, interpret=interpret)
    try:
        parts, sched = partials(x.reshape(batch, d), tuple(w.stack for w in weights), weights[0].index)
    except quant_gemm.UntiledShape:  # the quantized kernel does not tile these weights
        return None
    q_rows, k_stack, v_stack = qkv_rope.qkv_rope_write(
        parts,
        sched.written(),
        cos[:, 0],
        sin[:, 0],
        positions[:, 0],
        k_cache.stack,
        v_cache.stack,
        k_cache.index,
        tuple(b.stack for b in biases),
        heads=heads,
        tile_n=tile_n,
        rows=rows,
        impl=epilogue_backend,
        interpret=interpret,
    )
    out = decode_attention.decode_attention_sync_rows(
        q_rows,
        k_stack,
        v_stack,
        positions[:, -1].astype(jnp.int32),
        group=group,
        layer=k_cache.index,
        block_sizes=attention_blocks,
        length_offset=1,
        interpret=interpret,
    )
    return [out, StackedRef(k_stack, k_cache.index, k_cache.origin), StackedRef(v_stack, v_cache.index, v_cache.origin)]


MAX_ATTENTION_ROWS = 64  # T·G query rows per kv head the attention kernel takes (decode, short chunks)


def _attention_impl(q, k_cache, v_cache, impl: str | None, block_sizes: decode_attention.BlockSizes) -> str | None:
    """The attention kernel the hooks run on the stacked caches ("sync" or "async": `impl`, or the
    dispatch table's choice when it is None), or None where they decline: caches that are not refs
    of stacks, prefill-sized T·G, a cache length the kernel would pad (a copy of the stack), and,
    with impl=None, where `kernels.dispatch` says "xla" (off Hopper) or q is not 16-bit."""
    if not (isinstance(k_cache, StackedRef) and isinstance(v_cache, StackedRef)):
        return None
    _, tokens, heads, _ = q.shape
    cache_len, kv_heads = k_cache.stack.shape[2], k_cache.stack.shape[3]
    if tokens * (heads // kv_heads) > MAX_ATTENTION_ROWS or cache_len % block_sizes.block_k:
        return None
    if impl is None:
        impl = dispatch.choose_attention().impl
        if impl == "xla" or q.dtype not in (jnp.bfloat16, jnp.float16):
            return None
    return impl


def kernel_attention(
    q,
    k_cache,
    v_cache,
    positions,
    *,
    impl: str | None = None,
    block_sizes: decode_attention.BlockSizes = decode_attention.BlockSizes(),
    interpret: bool = False,
):
    """The `stacked_calls["sdpa"]` hook of the engine: `model.sdpa` with the cache read in place.

    q [B, T, N, H]; k_cache, v_cache `StackedRef`s of the carried [L, B, S, K, H] stacks at layer i
    (already holding this step's new rows); positions [B, T], contiguous per sequence, so the kernel's
    lengths are positions[:, -1] + 1 (added inside the kernel: `length_offset=1`). Returns
    [out [B, T, N, H]], or None (the caller then runs `sdpa` on the materialized rows): for
    prefill-sized T·G, for a cache length the kernel would have to pad (a copy of the stack), and,
    with `impl=None`, where `kernels.dispatch` says "xla" (off Hopper) or the dtype is not 16-bit.
    The synchronized kernel is the default choice on the H200 (kernels/tables/h200.json); "async"
    runs with φ = 0 and its exact fallback.
    """
    impl = _attention_impl(q, k_cache, v_cache, impl, block_sizes)
    if impl is None:
        return None
    last = positions[:, -1].astype(jnp.int32)  # [B]: the kernel adds 1 (lengths), not a kernel of XLA's
    kw = dict(layer=k_cache.index, block_sizes=block_sizes, length_offset=1, interpret=interpret)
    if impl == "async":
        out, _ = decode_attention.decode_attention_async(q, k_cache.stack, v_cache.stack, last, 0.0, **kw)
    else:
        out = decode_attention.decode_attention_sync(q, k_cache.stack, v_cache.stack, last, **kw)
    return [out.astype(q.dtype)]


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


def kernel_rms_norm(
    x,
    weight,
    eps,
    *,
    impl: str | None = None,
    backend: str = "triton",
    num_warps: int = 4,
    interpret: bool = False,
):
    """The `stacked_calls["rms_norm"]` hook: `model.rms_norm` as one `kernels.rms_norm` launch that
    reads the layer's norm weight in place (XLA runs a norm as two kernels, a reduction and a scale).
    x [..., D]; weight a `StackedRef` of the [L, D] stack; eps the model's (a constant of the traced
    layer). Returns [y [..., D]], or None (the call is then evaluated as written): when eps is not a
    constant, and, with `impl=None`, for inputs that are not 16-bit or on a device without a tuned
    kernel table (like the other kernels: measured on the H200 only). backend: the kernel's, "triton" or
    "mosaic" (`kernels.rms_norm`)."""
    if (
        not isinstance(weight, StackedRef)
        or isinstance(x, StackedRef)
        or x.dtype != weight.stack.dtype
        or (eps := _constant_eps(eps)) is None
    ):
        return None
    if not _norm_kernel_runs(x.dtype, impl, "kernel_rms_norm"):
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
    backend: str = "triton",
    num_warps: int = 16,
    interpret: bool = False,
):
    """The `stacked_calls["residual_norm"]` hook on one device: `model.residual_norm` (the attention's
    residual add, then the MLP's input norm) as one `kernels.rms_norm.residual_rms_norm` launch that
    also adds the o projection's split-K partials (block_out a `SplitSum` from the GEMV), the norm
    weight read in place. XLA would run the split sum and the add as one fusion, then the norm kernel.

    x [..., D]; block_out a `SplitSum` of x's shape and dtype; weight a `StackedRef` of the [L, D]
    stack; eps the model's (a constant); comm empty (one device). Returns [s, normed], or None (the
    call is then evaluated as written, block_out summed first): for a block_out that is not a
    `SplitSum`, and with `impl=None` for inputs that are not 16-bit or on a device without a tuned
    kernel table. `impl="triton"` (tests, with `interpret=True`) skips those two checks. backend: the
    kernel's, "triton" or "mosaic" (`kernels.rms_norm`).
    """
    if (
        not isinstance(block_out, SplitSum)
        or not isinstance(weight, StackedRef)
        or comm
        or isinstance(x, (StackedRef, SplitSum))
        or block_out.shape != x.shape
        or not x.dtype == block_out.dtype == weight.stack.dtype
        or (eps := _constant_eps(eps)) is None
    ):
        return None
    if not _norm_kernel_runs(x.dtype, impl, "kernel_split_residual_norm"):
        return None
    dim = x.shape[-1]
    s, normed = rms_norm.residual_rms_norm(
        block_out.partials,
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


def _spec(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


class LoopedForward:
    """forward(params, tokens, positions, cache) with the layers run as one `lax.scan`."""

    def __init__(
        self,
        graphdef,
        params,
        cfg: ModelConfig,
        *,
        mode: str = "slice",
        stacked_dot: Callable | None = None,
        hooks: Mapping[Hook | str, Callable | None] | None = None,
    ):
        if mode not in LOOP_MODES:
            raise ValueError(f"loop mode must be one of {LOOP_MODES}, got {mode!r}")
        self.cfg = cfg
        self.mode = mode
        self.index_mode = "slice" if mode == "slice" else "whole"
        self._stacked_dot = (stacked_dot or kernel_stacked_dot) if mode == "inplace" else None
        # in place: the model's named calls in `kernel_calls` go to kernels (`jaxdecode.looping.inplace`)
        self._calls = kernel_calls(None, hooks) if mode == "inplace" else None
        self._forward = lambda params, tokens, positions, k, v: nnx.merge(graphdef, params)(tokens, positions, k, v)
        self._param_specs = jax.tree.map(_spec, params)
        self._plans: dict[tuple, LoopPlan] = {}

    def plan(self, batch: int, tokens: int, cache_len: int, cache_dtype) -> LoopPlan:
        """The plan for one input shape, traced from shape specs on first use."""
        key = (batch, tokens, cache_len, jax.numpy.dtype(cache_dtype).name)
        if key not in self._plans:
            cfg = self.cfg
            int_spec = jax.ShapeDtypeStruct((batch, tokens), jax.numpy.int32)
            kv = [jax.ShapeDtypeStruct((batch, cache_len, cfg.n_kv_heads, cfg.head_dim), cache_dtype)] * cfg.n_layers
            self._plans[key] = kernel_loop(
                self._forward,
                self._param_specs,
                int_spec,
                int_spec,
                kv,
                kv,
                index_mode=self.index_mode,
                packed_outputs=_PACKED_OUTPUTS,
                stacked_dot=self._stacked_dot,
                stacked_calls=self._calls,
            )
        return self._plans[key]

    def finds_runs(self) -> bool:
        """Whether the pass finds consecutive equal layers to loop (not in a one-layer model, nor where
        every layer's weights are quantized differently)."""
        return bool(self.plan(1, 1, 1, jax.numpy.float32).layouts)

    def pack_params(self, params) -> Packed:
        return Packed.pack(params, self.plan(1, 1, 1, jax.numpy.float32).layouts[_PARAMS])

    def pack_cache(self, cache: KVCache) -> KVCache:
        batch, length = cache.k[0].shape[:2]
        layouts = self.plan(batch, 1, length, cache.k[0].dtype).layouts
        return KVCache(Packed.pack(cache.k, layouts[_K]), Packed.pack(cache.v, layouts[_V]))

    def forward(self, params: Packed, tokens, positions, cache: KVCache):
        stack = cache.k.stacks[0]  # [L, B, S, K, H]
        plan = self.plan(tokens.shape[0], tokens.shape[1], stack.shape[2], stack.dtype)
        logits, k, v = plan.looped(params, tokens, positions, cache.k, cache.v)
        return logits, KVCache(k, v)

    def report(self, batch: int = 1, cache_len: int = 1024, cache_dtype=jax.numpy.float32) -> LoopReport:
        return self.plan(batch, 1, cache_len, cache_dtype).report


def model_loop_report(name: str) -> LoopReport:
    """What the pass does to the decode step of a preset (traced from shapes; no weights are made)."""
    cfg = get_preset(name)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract)
    return LoopedForward(graphdef, params, cfg, mode="slice").report()

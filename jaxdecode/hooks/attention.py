"""The in-place loop's attention hooks: for one new token the q·k·v GEMM, its epilogue (RoPE, the cache
rows written in place) and the attention kernel (`kernel_qkv_attend`); attention over layer i of the
stacked cache otherwise (`kernel_attention`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxdecode.hooks.gemm import codes_permuted, on_hopper_16bit, qkv_stream_fits, quantized_weights, stream_arrays
from jaxdecode.looping import StackedRef
from kernels import decode_attention, dispatch, flat_gemm_stream, qkv_rope, quant_gemm, quant_gemm_stream


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
    epilogue_backend: str = "mosaic",
    attention_backend: str = "mosaic",
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
    epilogue_backend, attention_backend: the epilogue's and the attention's kernels, "mosaic" (the
    default; shapes Mosaic GPU does not tile are declined) or "triton" (`kernels.qkv_rope`,
    `kernels.decode_attention`).
    """
    if impl not in (None, "stream"):
        raise ValueError(f"kernel_qkv_attend impl must be None or 'stream', got {impl!r}")
    weights = (w_q, w_k, w_v)
    refs = (*weights, *biases)
    quantized = quantized_weights(refs, 3)
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
        bits = quant_gemm.code_bits(quantized[0][0].stack.dtype)
        tile_n = quant_blocks.resolved(widths, stream_arrays(quantized)[0][2] is not None, bits).tile_n
        fits = (impl is not None or on_hopper_16bit(x)) and batch <= quant_gemm_stream.MAX_M
        if partials is None:
            group_size = d // quantized[0][1].stack.shape[1]
            partials = lambda x2, _, layer: quant_gemm_stream.quant_stream_partials(  # noqa: E731
                x2,
                stream_arrays(quantized),
                layer,
                group=group_size,
                cfg=quant_blocks,
                permuted_codes=codes_permuted(quantized),
                interpret=interpret,
            )
    else:
        tile_n = gemm_blocks.tile_n
        fits = qkv_stream_fits(batch, d, widths, x.dtype, gemm_blocks, dispatched=impl is None)
    if not fits or not qkv_rope.fits(heads, kv_heads, head_dim, tile_n, rows, impl=epilogue_backend):
        return None
    q_spec = jax.ShapeDtypeStruct((batch, 1, heads, head_dim), x.dtype)
    if (
        _attention_impl(q_spec, k_cache, v_cache, "sync" if impl else None, attention_blocks, attention_backend)
        != "sync"
    ):
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
        backend=attention_backend,
        interpret=interpret,
    )
    return [out, StackedRef(k_stack, k_cache.index, k_cache.origin), StackedRef(v_stack, v_cache.index, v_cache.origin)]


MAX_ATTENTION_ROWS = 64  # T·G query rows per kv head the attention kernel takes (decode, short chunks)


def _attention_impl(
    q, k_cache, v_cache, impl: str | None, block_sizes: decode_attention.BlockSizes, backend: str
) -> str | None:
    """The attention kernel the hooks run on the stacked caches ("sync" or "async": `impl`, or the
    dispatch table's choice when it is None), or None where they decline: caches that are not refs
    of stacks, prefill-sized T·G, a cache length the kernel would pad (a copy of the stack), the
    synchronized kernel on Mosaic GPU (`backend`) for a shape or dtype it does not tile, and, with
    impl=None, where `kernels.dispatch` says "xla" (off Hopper) or q is not 16-bit."""
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
    rows = decode_attention.query_rows(tokens, heads // kv_heads)
    if (
        impl == "sync"
        and backend == "mosaic"
        and not decode_attention.mosaic_fits(q.shape[-1], q.dtype, block_sizes, rows)
    ):
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
    backend: str = "mosaic",
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
    runs with φ = 0 and its exact fallback (Pallas-Triton); backend picks the synchronized kernel's,
    "mosaic" (the default: it declines the shapes Mosaic GPU does not tile) or "triton".
    """
    impl = _attention_impl(q, k_cache, v_cache, impl, block_sizes, backend)
    if impl is None:
        return None
    last = positions[:, -1].astype(jnp.int32)  # [B]: the kernel adds 1 (lengths), not a kernel of XLA's
    kw = dict(layer=k_cache.index, block_sizes=block_sizes, length_offset=1, interpret=interpret)
    if impl == "async":
        out, _ = decode_attention.decode_attention_async(q, k_cache.stack, v_cache.stack, last, 0.0, **kw)
    else:
        out = decode_attention.decode_attention_sync(q, k_cache.stack, v_cache.stack, last, backend=backend, **kw)
    return [out.astype(q.dtype)]

"""Split-K decode attention with FlashDecoding++'s asynchronous softmax (unified max value φ).

softmax(x)_i = e^{x_i-φ} / Σ_j e^{x_j-φ} holds for any φ. So every split of the cache computes its
partial numerator Σ e^{x-φ}·v and denominator Σ e^{x-φ} on its own, and one final reduction adds
them: there is no running max and no rescale between splits (FlashDecoding++, arXiv 2311.01282 §3).
A row is unsafe when its logits leave the window around φ: then e^{x-φ} overflows or the denominator
underflows. Each row's denominator l = Σ e^{x-φ} lies in [e^{max-φ}, S·e^{max-φ}], so checking
lo <= log(l) <= hi (and a finite output) after the fact catches both; those rows are recomputed with
the synchronized kernel (online softmax, the FlashDecoding scheme), so the result is always right.
Only the (sequence, kv head) programs that hold a flagged row do work in the second launch.

Layout: q [B, T, N, H], cache k/v [B, S, K, H], lengths [B] = valid cache entries, the T new tokens
included (query t sits at position lengths-T+t and sees positions <= its own). Any S works: the
wrapper pads S up to a multiple of splits·block_k (only when it is not one already) and the padded
positions are masked by length like every position past `lengths`. With `layer=i` the cache
arguments are stacks [L, B, S, K, H] (a looped decode's carried cache) and the kernels read layer i
in place: they get the whole stack and index it with i (no BlockSpec slice, so nothing is copied).
Rows of one program are the T·G query rows that share one kv head, r = t·G + g, padded to a power
of two >= 16.

What runs where: both kernels here are `pl.pallas_call` kernels. On the GPU they lower through
Pallas-Triton, which jax 0.11 deprecates. The synchronized kernel and its combine also have a Mosaic
GPU form (mosaic.py: wgmma with the cache block as the 64-row side, TMA from the stacked cache),
picked by `backend="mosaic"` in `decode_attention_sync`, `decode_attention_sync_rows` and
`combine.combine_splits`; the async kernel's port is open debt. On the CPU the Triton bodies run with
`interpret=True` and the Mosaic ones under Mosaic GPU's interpreter; that is what CI tests.
On an H200 the fallback's second launch costs more per call than the unified max saves, even when no
row is flagged; without it the async kernel ties the sync one (docs/log/2026-11-30.md, kernel tables), so
the dispatch table picks the synchronized kernel there (kernels/tables/h200.json).

This file holds the two kernel bodies, their pallas_call wrapper over the grid (B, K, splits), the
jitted ops and the jnp reference; the tunables and row layout are in layout.py, the split combine
in combine.py, the Mosaic GPU kernels in mosaic.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels.decode_attention import mosaic
from kernels.decode_attention.combine import combine_fits, combine_partials, combine_rows
from kernels.decode_attention.layout import BlockSizes, check_backend, from_rows, pad_cache, split_layout, to_rows

_NEG = -1e30  # finite "minus infinity" for the synchronized kernel's running max


@dataclasses.dataclass(frozen=True)
class SoftmaxWindow:
    """Safe window for log(Σ e^{x-φ}) relative to φ. e^88 overflows f32 and e^-87 is subnormal; the
    margins keep Σ e^{x-φ}·v finite for |v| up to ~1e9 and the largest term a normal float."""

    lo: float = -60.0
    hi: float = 60.0


class AsyncInfo(NamedTuple):
    recomputed: jax.Array  # [B, T, N] bool: row left the window and came from the synchronized kernel
    lse: jax.Array  # [B, T, N] f32: log Σ e^{x} of each row (for calibrating φ)


# ---------------------------------------------------------------------------------------------
# Kernel bodies


def _row_limits(length, *, rows: int, group: int, tokens: int):
    """Exclusive end position of each row's visible cache: causal over the T new tokens."""
    t = jnp.minimum(jnp.arange(rows, dtype=jnp.int32) // group, tokens - 1)  # [R]
    return length - (tokens - 1 - t)  # [R]


def _num_blocks(length, split_start, split_len: int, block_k: int):
    n = (length - split_start + block_k - 1) // block_k
    return jnp.clip(n, 0, split_len // block_k)


def _split_loader(row_ref, split_len: int):
    """load(ref, start, size) -> rows [size, H] of this program's split of the cache.

    Without `row_ref` the k/v refs are the split's own block [S/splits, H] (cut by the BlockSpec).
    With it they are the whole stacked cache [L·B, S, K, H], read in place: `row_ref` holds this
    sequence's row of the stack (layer·B + b), and the kv head and split come from the program ids.
    """
    if row_ref is None:
        return lambda ref, start, size: ref[pl.ds(start, size), :]
    row, head, base = row_ref[()], pl.program_id(1), pl.program_id(2) * split_len
    return lambda ref, start, size: ref[row, pl.ds(base + start, size), head, :]


def _block(q, load, k_ref, v_ref, i, split_start, row_end, *, block_k: int, sm_scale: float):
    """Block i of a split: scores s [R, bk] (f32), the visibility mask [R, bk], and v [bk, H]."""
    pos = split_start + i * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [bk]
    k = load(k_ref, i * block_k, block_k)  # [bk, H]
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * sm_scale  # [R, bk]
    v = load(v_ref, i * block_k, block_k)  # [bk, H]
    return s, pos[None, :] < row_end[:, None], v


def async_kernel(
    *refs, sm_scale: float, block_k: int, group: int, tokens: int, split_len: int, stacked: bool, length_offset: int
):
    """refs: [row_ref] (stacked only), then
    inputs  len_ref [] int32 (the length less `length_offset`), phi_ref [] f32 (the unified max
            value φ), q_ref [R, H],
            k_ref, v_ref ([S/splits, H], or the whole stack [L·B, S, K, H] when stacked);
    outputs acc_ref [R, H] f32 (Σ e^{x-φ}·v over this split), l_ref [R] f32 (Σ e^{x-φ})."""
    row_ref, refs = (refs[0], refs[1:]) if stacked else (None, refs)
    len_ref, phi_ref, q_ref, k_ref, v_ref, acc_ref, l_ref = refs
    load = _split_loader(row_ref, split_len)
    rows, head_dim = q_ref.shape
    split_start = pl.program_id(2) * split_len
    length, phi = len_ref[()] + length_offset, phi_ref[()]
    row_end = _row_limits(length, rows=rows, group=group, tokens=tokens)  # [R]
    q = q_ref[...]  # [R, H]

    def body(i, carry):
        acc, l = carry  # [R, H], [R]
        s, mask, v = _block(q, load, k_ref, v_ref, i, split_start, row_end, block_k=block_k, sm_scale=sm_scale)
        p = jnp.where(mask, jnp.exp(s - phi), 0.0)  # [R, bk]
        acc = acc + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return acc, l + p.sum(axis=1)

    n = _num_blocks(length, split_start, split_len, block_k)
    init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.zeros((rows,), jnp.float32))
    acc, l = lax.fori_loop(0, n, body, init)
    acc_ref[...] = acc
    l_ref[...] = l


def sync_kernel(
    *refs,
    sm_scale: float,
    block_k: int,
    group: int,
    tokens: int,
    split_len: int,
    stacked: bool,
    length_offset: int,
    gated: bool,
):
    """refs: [row_ref] (stacked only), then
    inputs  len_ref [] int32 (as in `async_kernel`), active_ref [] int32 (only when `gated`: 0 skips
            the program, for rows needing no recompute), q_ref [R, H], k_ref, v_ref (as there);
    outputs acc_ref [R, H] f32 (Σ e^{x-m}·v), l_ref [R] f32 (Σ e^{x-m}), m_ref [R] f32 (running max)."""
    row_ref, refs = (refs[0], refs[1:]) if stacked else (None, refs)
    len_ref, refs = refs[0], refs[1:]
    active_ref, refs = (refs[0], refs[1:]) if gated else (None, refs)
    q_ref, k_ref, v_ref, acc_ref, l_ref, m_ref = refs
    load = _split_loader(row_ref, split_len)
    rows, head_dim = q_ref.shape
    split_start = pl.program_id(2) * split_len
    length = len_ref[()] + length_offset
    row_end = _row_limits(length, rows=rows, group=group, tokens=tokens)  # [R]
    q = q_ref[...]  # [R, H]

    def body(i, carry):
        acc, l, m = carry  # [R, H], [R], [R]
        s, mask, v = _block(q, load, k_ref, v_ref, i, split_start, row_end, block_k=block_k, sm_scale=sm_scale)
        s = jnp.where(mask, s, _NEG)
        m_next = jnp.maximum(m, s.max(axis=1))  # the synchronization FlashDecoding++ removes
        correction = jnp.exp(m - m_next)  # [R]
        p = jnp.where(mask, jnp.exp(s - m_next[:, None]), 0.0)  # [R, bk]
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return correction[:, None] * acc + pv, correction * l + p.sum(axis=1), m_next

    n = _num_blocks(length, split_start, split_len, block_k)
    if gated:
        n = jnp.where(active_ref[()] != 0, n, 0)
    init = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.full((rows,), _NEG, jnp.float32),
    )
    acc, l, m = lax.fori_loop(0, n, body, init)
    acc_ref[...] = acc
    l_ref[...] = l
    m_ref[...] = m


# ---------------------------------------------------------------------------------------------
# pallas_call wrapper


def attention_call(
    kernel,
    scalars,
    q,
    k,
    v,
    layer,
    *,
    num_out: int,
    sm_scale,
    group,
    tokens,
    length_offset,
    cfg,
    interpret,
    poison,
    **kernel_kw,
):
    """Runs `kernel` over the grid (B, K, splits); returns the per-split partial outputs.

    k, v come padded by `pad_cache`: [B, S_pad, K, H], or stacks [L, B, S, K, H] read at row
    `layer` in place (the kernel gets the whole stack and indexes it; no BlockSpec cuts it).
    poison=True hands the kernel NaN-filled output buffers (aliased inputs), so a partial the kernel
    fails to write shows up as NaN.
    """
    batch, kv_heads, rows, head_dim = q.shape  # [B, K, R, H]
    cache_len = k.shape[-3]
    splits, _ = split_layout(batch, kv_heads, cache_len, cfg)
    split_len = cache_len // splits
    per_seq = pl.BlockSpec((None,), lambda b, h, s: (b,))  # [B] -> []
    per_head = pl.BlockSpec((None, None), lambda b, h, s: (b, h))  # [B, K] -> []
    stacked = layer is not None
    if stacked:
        k, v = (x.reshape(-1, *x.shape[2:]) for x in (k, v))  # [L·B, S, K, H]: a free reshape
        kv_rows = jnp.asarray(layer, jnp.int32) * batch + jnp.arange(batch, dtype=jnp.int32)  # [B]
        scalars = (kv_rows, *scalars)
        kv_spec = pl.BlockSpec()  # the whole stack
    else:
        kv_spec = pl.BlockSpec((None, split_len, None, head_dim), lambda b, h, s: (b, s, h, 0))
    in_specs = [per_seq if x.ndim == 1 else per_head for x in scalars] + [
        pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),
        kv_spec,
        kv_spec,
    ]
    out_shape = [jax.ShapeDtypeStruct((batch, kv_heads, splits, rows, head_dim), jnp.float32)]
    out_specs = [pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0))]
    for _ in range(num_out - 1):
        out_shape.append(jax.ShapeDtypeStruct((batch, kv_heads, splits, rows), jnp.float32))
        out_specs.append(pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)))
    inputs = [*scalars, q, k, v]
    aliases = {}
    body = functools.partial(
        kernel,
        sm_scale=sm_scale,
        block_k=cfg.block_k,
        group=group,
        tokens=tokens,
        split_len=split_len,
        stacked=stacked,
        length_offset=length_offset,
        **kernel_kw,
    )
    n_in = len(inputs)
    if poison:
        inputs += [jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shape[:num_out]]
        in_specs += out_specs[:num_out]
        aliases.update({n_in + i: i for i in range(num_out)})
        unpoisoned = body
        body = lambda *refs: unpoisoned(*refs[:n_in], *refs[n_in + num_out :])  # drop aliased inputs
    return pl.pallas_call(
        body,
        out_shape=out_shape,
        grid=(batch, kv_heads, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        input_output_aliases=aliases,
        compiler_params=None
        if interpret
        else pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=kernel.__name__,
    )(*inputs)


# ---------------------------------------------------------------------------------------------
# Public ops


def _check(q, k, v, lengths, layer):
    batch, _, heads, head_dim = q.shape
    if k.ndim != (4 if layer is None else 5):
        raise ValueError(
            f"cache must be [B, S, K, H], or [L, B, S, K, H] with a layer index; got "
            f"{k.shape} with layer={'None' if layer is None else 'given'}"
        )
    if k.shape != v.shape or k.shape[-4] != batch or k.shape[-1] != head_dim:
        raise ValueError(f"cache shapes {k.shape}, {v.shape} do not match q {q.shape}")
    if heads % k.shape[-2]:
        raise ValueError(f"query heads {heads} not a multiple of kv heads {k.shape[-2]}")
    if lengths.shape != (batch,):
        raise ValueError(f"lengths must have shape ({batch},), got {lengths.shape}")


def _prepare(q, k, v, lengths, layer, sm_scale, block_sizes, interpret, poison, length_offset=0):
    """Checks, q as rows [B, K, R, H], the cache padded to whole blocks, and the kernels' keywords."""
    _check(q, k, v, lengths, layer)
    _, tokens, heads, head_dim = q.shape
    kv_heads = k.shape[-2]
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    k, v = pad_cache(k, v, block_sizes, layer is not None)  # [B, S_pad, K, H]
    kw = dict(
        sm_scale=sm_scale,
        group=heads // kv_heads,
        tokens=tokens,
        cfg=block_sizes,
        interpret=interpret,
        poison=poison,
        length_offset=length_offset,
    )
    return to_rows(q, kv_heads), k, v, lengths.astype(jnp.int32), kw


def _sync_kernel(
    backend, q_rows, k, v, layer, lengths, *, sm_scale, group, tokens, length_offset, cfg, interpret, poison
):
    """The synchronized kernel's partials acc [B, K, splits, R, H], l, m [B, K, splits, R] on `backend`,
    every program running (no gate input: even a constant array of ones costs a broadcast kernel per
    call, per layer in a looped decode, on the GPU)."""
    kw = dict(sm_scale=sm_scale, group=group, tokens=tokens, length_offset=length_offset, interpret=interpret)
    if check_backend(backend) == "triton":
        return attention_call(
            sync_kernel, (lengths,), q_rows, k, v, layer, num_out=3, gated=False, cfg=cfg, poison=poison, **kw
        )
    if layer is None:  # [B, S, K, H] -> a stack of one layer [1, B, S, K, H]: a free reshape
        k, v, layer = k[None], v[None], 0
    batch, kv_heads = q_rows.shape[:2]
    splits, _ = split_layout(batch, kv_heads, k.shape[2], cfg)
    return mosaic.sync_call(
        layer, lengths, q_rows, k, v, splits=splits, block_k=cfg.block_k, stages=cfg.num_stages, poison=poison, **kw
    )


def _sync_partials(q_rows, k, v, layer, lengths, active, **kw):
    """The synchronized kernel's partials combined in jnp: o [B, K, R, H] and log Σ e^x [B, K, R].
    `active` [B, K] gates the programs (the recompute fallback), or None: all run, with no gate."""
    scalars = (lengths,) if active is None else (lengths, active)
    acc, l, m = attention_call(sync_kernel, scalars, q_rows, k, v, layer, num_out=3, gated=active is not None, **kw)
    return combine_partials(acc, l, m)


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "window", "block_sizes", "recompute", "length_offset", "interpret", "poison")
)
def decode_attention_async(
    q: jax.Array,  # [B, T, N, H]
    k: jax.Array,  # [B, S, K, H]
    v: jax.Array,  # [B, S, K, H]
    lengths: jax.Array,  # [B] int32
    phi: jax.Array | float,  # [] f32 unified max value (may be traced: one per layer)
    *,
    layer: jax.Array | int | None = None,
    sm_scale: float | None = None,
    window: SoftmaxWindow = SoftmaxWindow(),
    block_sizes: BlockSizes = BlockSizes(),
    recompute: bool = True,
    length_offset: int = 0,
    interpret: bool = False,
    poison: bool = False,
) -> tuple[jax.Array, AsyncInfo]:
    """Decode attention with one unified max φ; rows outside the window are recomputed.

    Any S works: an S that is not a multiple of splits·block_k is padded (one copy of the cache) and
    masked by length. With `layer` (an int32 scalar, may be traced), k and v are stacked caches
    [L, B, S, K, H] and layer `layer` is read in place (S must then be a multiple of block_k): the
    looped decode's attention. The kernels see `lengths + length_offset` valid entries: the looped
    decode passes each sequence's last position with offset 1, so no add runs per layer outside the
    kernel. poison=True (tests) runs the kernels on NaN-filled output buffers.

    Equivalent to the following JAX code (ignoring the returned AsyncInfo):

      s = jnp.einsum("BTKGH,BSKH->BTKGS", q.reshape(B, T, K, G, H), k) * sm_scale
      s = jnp.where(visible, s, -jnp.inf)   # visible: pos <= lengths - T + t
      o = jnp.einsum("BTKGS,BSKH->BTKGH", jax.nn.softmax(s, axis=-1), v).reshape(B, T, N, H)
    """
    q_rows, k, v, lengths, kw = _prepare(
        q, k, v, lengths, layer, sm_scale, block_sizes, interpret, poison, length_offset
    )
    batch, tokens = q.shape[:2]
    group = kw["group"]
    phi_b = jnp.broadcast_to(jnp.asarray(phi, jnp.float32), (batch,))  # [B]
    acc, l = attention_call(async_kernel, (lengths, phi_b), q_rows, k, v, layer, num_out=2, **kw)
    l = l.sum(axis=2)  # [B, K, R]: the one final reduction
    o = acc.sum(axis=2) / l[..., None]  # [B, K, R, H]
    log_l = jnp.log(l)  # [B, K, R], relative to φ
    safe = (log_l >= window.lo) & (log_l <= window.hi) & jnp.isfinite(o).all(axis=-1)
    safe = safe.at[:, :, tokens * group :].set(True)  # padded rows
    lse = log_l + phi_b[:, None, None]
    if recompute:
        active = (~safe).any(axis=2).astype(jnp.int32)  # [B, K]
        o_sync, lse_sync = _sync_partials(q_rows, k, v, layer, lengths, active, **kw)
        o = jnp.where(safe[..., None], o, o_sync)
        lse = jnp.where(safe, lse, lse_sync)
    info = AsyncInfo(recomputed=from_rows(~safe, tokens, group), lse=from_rows(lse, tokens, group))
    return from_rows(o, tokens, group).astype(q.dtype), info


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "block_sizes", "length_offset", "interpret", "poison", "backend")
)
def decode_attention_sync(
    q: jax.Array,  # [B, T, N, H]
    k: jax.Array,  # [B, S, K, H]
    v: jax.Array,  # [B, S, K, H]
    lengths: jax.Array,  # [B] int32
    *,
    layer: jax.Array | int | None = None,
    sm_scale: float | None = None,
    block_sizes: BlockSizes = BlockSizes(),
    length_offset: int = 0,
    interpret: bool = False,
    poison: bool = False,
    backend: str = "triton",
):
    """Split-K decode attention with the synchronized (online, running-max) softmax.

    Any S works (padded and masked as in `decode_attention_async`); `layer`, `length_offset` and
    poison as there. backend: "triton" (Pallas-Triton) or "mosaic" (Mosaic GPU, Hopper: block_k and H
    multiples of 64, bf16 or f16) for both the kernel and its split combine.

    Equivalent to the following JAX code:

      s = jnp.einsum("BTKGH,BSKH->BTKGS", q.reshape(B, T, K, G, H), k) * sm_scale
      s = jnp.where(visible, s, -jnp.inf)   # visible: pos <= lengths - T + t
      o = jnp.einsum("BTKGS,BSKH->BTKGH", jax.nn.softmax(s, axis=-1), v).reshape(B, T, N, H)
    """
    q_rows, k, v, lengths, kw = _prepare(
        q, k, v, lengths, layer, sm_scale, block_sizes, interpret, poison, length_offset
    )
    acc, l, m = _sync_kernel(backend, q_rows, k, v, layer, lengths, **kw)
    return combine_rows(
        acc,
        l,
        m,
        tokens=kw["tokens"],
        group=kw["group"],
        out_dtype=q.dtype,
        cfg=block_sizes,
        interpret=interpret,
        poison=poison,
        backend=backend,
    )


@functools.partial(
    jax.jit, static_argnames=("group", "sm_scale", "block_sizes", "length_offset", "interpret", "poison", "backend")
)
def decode_attention_sync_rows(
    q_rows: jax.Array,  # [B, K, R, H]
    k: jax.Array,  # [L, B, S, K, H]
    v: jax.Array,  # [L, B, S, K, H]
    lengths: jax.Array,  # [B] int32
    *,
    group: int,
    layer: jax.Array | int,
    sm_scale: float | None = None,
    block_sizes: BlockSizes = BlockSizes(),
    length_offset: int = 0,
    interpret: bool = False,
    poison: bool = False,
    backend: str = "triton",
):
    """`decode_attention_sync` for one token per sequence, with q already laid out as the kernel's rows
    q_rows [B, K, R, H] (row g < group is query head h·group + g of kv head h; rows past `group` are
    zero), as `kernels.qkv_rope.qkv_rope_write` writes them, and the stacked cache [L, B, S, K, H] read
    at `layer` in place. Returns o [B, 1, K·group, H] in q_rows' dtype. backend as in
    `decode_attention_sync` (the mosaic kernel takes R in multiples of 8). With block_sizes.combine "fused" and
    the mosaic backend, the combine runs inside the attention launch (`mosaic.sync_combine_call`)."""
    batch, kv_heads, rows, head_dim = q_rows.shape
    if k.ndim != 5 or k.shape != v.shape or k.shape[1] != batch or k.shape[3:] != (kv_heads, head_dim):
        raise ValueError(
            f"q_rows [B, K, R, H] = {list(q_rows.shape)} needs stacked caches [L, B, S, K, H] with "
            f"those B, K, H; got {list(k.shape)}, {list(v.shape)}"
        )
    if not 0 < group <= rows or lengths.shape != (batch,):
        raise ValueError(f"group must be in 1..{rows} and lengths [B] = [{batch}]; got {group}, {list(lengths.shape)}")
    k, v = pad_cache(k, v, block_sizes, stacked=True)
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    if (
        block_sizes.combine == "fused"
        and check_backend(backend) == "mosaic"
        and combine_fits(1, group, head_dim, block_sizes, backend, rows=rows)
    ):
        splits, _ = split_layout(batch, kv_heads, k.shape[2], block_sizes)
        o = mosaic.sync_combine_call(
            layer,
            lengths.astype(jnp.int32),
            q_rows,
            k,
            v,
            splits=splits,
            block_k=block_sizes.block_k,
            stages=block_sizes.num_stages,
            sm_scale=sm_scale,
            group=group,
            out_dtype=q_rows.dtype,
            length_offset=length_offset,
            interpret=interpret,
            poison=poison,
        )  # [B, K, G, H]
        return o.reshape(batch, 1, kv_heads * group, head_dim)  # [B, 1, N, H]: a free reshape
    acc, l, m = _sync_kernel(
        backend,
        q_rows,
        k,
        v,
        layer,
        lengths.astype(jnp.int32),
        sm_scale=sm_scale,
        group=group,
        tokens=1,
        length_offset=length_offset,
        cfg=block_sizes,
        interpret=interpret,
        poison=poison,
    )
    return combine_rows(
        acc,
        l,
        m,
        tokens=1,
        group=group,
        out_dtype=q_rows.dtype,
        cfg=block_sizes,
        interpret=interpret,
        poison=poison,
        backend=backend,
    )


def calibrate_phi(
    row_stats, *, coverage: float = 0.9999, window: SoftmaxWindow = SoftmaxWindow()
) -> tuple[float, float]:
    """φ from observed per-row statistics (max logits or log-sum-exps of real prompts).

    Centers φ on the central `coverage` mass of the observations, so that rows seen in calibration
    stay inside the window with the most margin on both sides. Returns (φ, fraction of the observed
    rows that the window around φ covers). The caller stores φ per model or per layer.
    """
    x = np.asarray(row_stats, np.float64).ravel()
    x = x[np.isfinite(x)]
    if x.size == 0:
        raise ValueError("calibrate_phi needs at least one finite observation")
    tail = (1.0 - coverage) / 2
    lo, hi = np.quantile(x, [tail, 1.0 - tail])
    phi = float((lo + hi) / 2)
    inside = ((x - phi) >= window.lo) & ((x - phi) <= window.hi)
    return phi, float(inside.mean())


# ---------------------------------------------------------------------------------------------
# Reference


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def decode_attention_reference(
    q: jax.Array,  # [B, T, N, H]
    k: jax.Array,  # [B, S, K, H]
    v: jax.Array,  # [B, S, K, H]
    lengths: jax.Array,  # [B] int32
    *,
    sm_scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Plain softmax attention in f32. Returns (o [B, T, N, H] in q.dtype, lse [B, T, N] f32)."""
    batch, tokens, heads, head_dim = q.shape
    cache_len, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    qg = q.reshape(batch, tokens, kv_heads, group, head_dim).astype(jnp.float32)  # [B,T,K,G,H]
    s = jnp.einsum("BTKGH,BSKH->BTKGS", qg, k.astype(jnp.float32)) * sm_scale
    pos = jnp.arange(cache_len)  # [S]
    last = lengths[:, None] - tokens + jnp.arange(tokens)[None, :]  # [B, T]
    visible = pos[None, None, :] <= last[:, :, None]  # [B, T, S]
    s = jnp.where(visible[:, :, None, None, :], s, -jnp.inf)  # [B, T, K, G, S]
    lse = jax.nn.logsumexp(s, axis=-1)  # [B, T, K, G]
    o = jnp.einsum("BTKGS,BSKH->BTKGH", jnp.exp(s - lse[..., None]), v.astype(jnp.float32))
    return (o.reshape(batch, tokens, heads, head_dim).astype(q.dtype), lse.reshape(batch, tokens, heads))

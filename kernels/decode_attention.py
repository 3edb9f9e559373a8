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

What runs where: both kernels are `pl.pallas_call` kernels. On the GPU they lower through
Pallas-Triton, which jax 0.11 deprecates; a Mosaic GPU port (as kernels/flat_gemm.py has) is open
debt. On the CPU the same kernel bodies run with `interpret=True`; that is what CI tests.
Measured on an H200 (benchmarks/KERNELS_RESULTS.md): the second launch of the fallback costs
10-15 µs per call even when no row is flagged; without it the async kernel ties the sync one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# The kernel bodies and the pallas_call wrapper live in decode_attention_kernels; BlockSizes (and the
# private _to_rows, _attention_call that tests use) are re-exported from here.
from kernels.decode_attention_kernels import (
    BlockSizes,
    _async_kernel,
    _attention_call,
    _from_rows,
    _pad_cache,
    _sync_kernel,
    _sync_partials,
    _to_rows,
    combine_rows,
    query_rows,  # noqa: F401 (re-exported: the looped decode's hooks lay q out the same way)
)


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
    k, v = _pad_cache(k, v, block_sizes, layer is not None)  # [B, S_pad, K, H]
    kw = dict(
        sm_scale=sm_scale,
        group=heads // kv_heads,
        tokens=tokens,
        cfg=block_sizes,
        interpret=interpret,
        poison=poison,
        length_offset=length_offset,
    )
    return _to_rows(q, kv_heads), k, v, lengths.astype(jnp.int32), kw


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
    acc, l = _attention_call(_async_kernel, (lengths, phi_b), q_rows, k, v, layer, num_out=2, **kw)
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
    info = AsyncInfo(recomputed=_from_rows(~safe, tokens, group), lse=_from_rows(lse, tokens, group))
    return _from_rows(o, tokens, group).astype(q.dtype), info


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_sizes", "length_offset", "interpret", "poison"))
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
):
    """Split-K decode attention with the synchronized (online, running-max) softmax.

    Any S works (padded and masked as in `decode_attention_async`); `layer`, `length_offset` and
    poison as there.

    Equivalent to the following JAX code:

      s = jnp.einsum("BTKGH,BSKH->BTKGS", q.reshape(B, T, K, G, H), k) * sm_scale
      s = jnp.where(visible, s, -jnp.inf)   # visible: pos <= lengths - T + t
      o = jnp.einsum("BTKGS,BSKH->BTKGH", jax.nn.softmax(s, axis=-1), v).reshape(B, T, N, H)
    """
    q_rows, k, v, lengths, kw = _prepare(
        q, k, v, lengths, layer, sm_scale, block_sizes, interpret, poison, length_offset
    )
    # Every (sequence, kv head) program runs, so the kernel takes no gate input: even a constant
    # array of ones costs a broadcast kernel per call (per layer in a looped decode) on the GPU.
    acc, l, m = _attention_call(_sync_kernel, (lengths,), q_rows, k, v, layer, num_out=3, gated=False, **kw)
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
    )


@functools.partial(
    jax.jit, static_argnames=("group", "sm_scale", "block_sizes", "length_offset", "interpret", "poison")
)
def decode_attention_sync_rows(
    q_rows,
    k,
    v,
    lengths,
    *,
    group: int,
    layer,
    sm_scale: float | None = None,
    block_sizes: BlockSizes = BlockSizes(),
    length_offset: int = 0,
    interpret: bool = False,
    poison: bool = False,
):
    """`decode_attention_sync` for one token per sequence, with q already laid out as the kernel's rows
    q_rows [B, K, R, H] (row g < group is query head h·group + g of kv head h; rows past `group` are
    zero), as `kernels.qkv_rope.qkv_rope_write` writes them, and the stacked cache [L, B, S, K, H] read
    at `layer` in place. Returns o [B, 1, K·group, H] in q_rows' dtype."""
    batch, kv_heads, rows, head_dim = q_rows.shape
    if k.ndim != 5 or k.shape != v.shape or k.shape[1] != batch or k.shape[3:] != (kv_heads, head_dim):
        raise ValueError(
            f"q_rows [B, K, R, H] = {list(q_rows.shape)} needs stacked caches [L, B, S, K, H] with "
            f"those B, K, H; got {list(k.shape)}, {list(v.shape)}"
        )
    if not 0 < group <= rows or lengths.shape != (batch,):
        raise ValueError(f"group must be in 1..{rows} and lengths [B] = [{batch}]; got {group}, {list(lengths.shape)}")
    k, v = _pad_cache(k, v, block_sizes, stacked=True)
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    acc, l, m = _attention_call(
        _sync_kernel,
        (lengths.astype(jnp.int32),),
        q_rows,
        k,
        v,
        layer,
        num_out=3,
        gated=False,
        sm_scale=sm_scale,
        group=group,
        tokens=1,
        cfg=block_sizes,
        interpret=interpret,
        poison=poison,
        length_offset=length_offset,
    )
    return combine_rows(
        acc, l, m, tokens=1, group=group, out_dtype=q_rows.dtype, cfg=block_sizes, interpret=interpret, poison=poison
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

"""The synchronized decode attention's split combine: per-split partials (acc, l, m) -> o.

Four parts: the kernel body (`_combine_kernel`), its wrapper for one token (`combine_splits`, with
`combine_fits` saying which shapes it takes), the op that picks it or the jnp form (`combine_rows`),
and the pure-jnp combine (`combine_partials`), which is also the reference.

Two backends for the kernel: "triton" (the pallas_call below) and "mosaic" (`mosaic.combine_call`:
Mosaic GPU, the partials' transpose in the WGMMA_TRANSPOSED layout). Both read the partials either
attention backend writes, so the two kernels need not share a backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels.decode_attention import mosaic
from kernels.decode_attention.layout import BlockSizes, check_backend, from_rows

# ---------------------------------------------------------------------------------------------
# Kernel body


def _combine_kernel(acc_ref, l_ref, m_ref, o_ref, *, splits: int):
    """One (sequence, kv head, column block) program: acc_ref [splits, G, C], l_ref, m_ref [splits, G]
    (f32 partials), o_ref [G, C]. The splits are a static loop (each load an independent power-of-two
    block), rescaled to their common max and summed in split order, then divided: `combine_partials`."""
    m = [m_ref[s] for s in range(splits)]  # [G] each
    m_all = functools.reduce(jnp.maximum, m)
    o = jnp.zeros(o_ref.shape, jnp.float32)
    l = jnp.zeros(m_all.shape, jnp.float32)
    for s in range(splits):
        correction = jnp.exp(m[s] - m_all)  # [G]
        l = l + correction * l_ref[s]
        o = o + correction[:, None] * acc_ref[s]
    o_ref[...] = (o / l[:, None]).astype(o_ref.dtype)


# ---------------------------------------------------------------------------------------------
# pallas_call wrapper


def combine_fits(
    tokens: int, group: int, head_dim: int, cfg: BlockSizes, backend: str = "triton", rows: int | None = None
) -> bool:
    """Whether `combine_splits` takes this shape: one token and, for "triton", a power-of-two group (Triton's
    blocks) and head-dim columns that split into `cfg.combine_cols`-wide blocks; for "mosaic", any group
    whose rows, rounded up to 8, lie within the partials' R `rows`, and H in 64-column blocks."""
    if check_backend(backend) == "mosaic":
        return tokens == 1 and head_dim % 64 == 0 and (rows is None or -(-group // 8) * 8 <= rows)
    return (
        tokens == 1
        and group & (group - 1) == 0
        and head_dim % cfg.combine_cols == 0
        and cfg.combine_cols & (cfg.combine_cols - 1) == 0
    )


def combine_splits(
    acc,
    l,
    m,
    *,
    group: int,
    out_dtype,
    cfg: BlockSizes,
    interpret: bool = False,
    poison: bool = False,
    backend: str = "triton",
):
    """The synchronized kernel's partials acc [B, K, splits, R, H], l, m [B, K, splits, R] (one token:
    rows 0..G-1 are the heads of a kv head) -> o [B, 1, N, H] in out_dtype, in one Pallas kernel over
    (B, K, H / combine_cols) ("triton") or (B, K, H / 64) ("mosaic"). poison=True (tests) starts from a
    NaN-filled output.

    Each program reads a few KB with plain loads (the Mosaic one writes its rows by TMA); wgmma has
    nothing to do here. It replaces XLA's three small kernels (exp, reduce, slice) per call with one.
    A loop over the splits (lax.fori_loop) measured slower than XLA's three kernels, so the splits are
    a static loop in both backends (see docs/log/)."""
    batch, kv_heads, splits, _, head_dim = acc.shape
    if check_backend(backend) == "mosaic":
        o = mosaic.combine_call(acc, l, m, group=group, out_dtype=out_dtype, interpret=interpret, poison=poison)
        return o.reshape(batch, 1, kv_heads * group, head_dim)  # [B, K, G, H] -> [B, 1, N, H]: a free reshape
    cols = cfg.combine_cols
    grid = (batch, kv_heads, head_dim // cols)
    in_specs = [
        pl.BlockSpec((None, None, splits, group, cols), lambda b, h, c: (b, h, 0, 0, c)),
        pl.BlockSpec((None, None, splits, group), lambda b, h, c: (b, h, 0, 0)),
        pl.BlockSpec((None, None, splits, group), lambda b, h, c: (b, h, 0, 0)),
    ]
    out_spec = pl.BlockSpec((None, None, group, cols), lambda b, h, c: (b, h, 0, c))
    out_shape = jax.ShapeDtypeStruct((batch, kv_heads, group, head_dim), out_dtype)
    body, inputs, aliases = functools.partial(_combine_kernel, splits=splits), [acc, l, m], {}
    if poison:
        inputs.append(jnp.full(out_shape.shape, jnp.nan, out_dtype))
        in_specs.append(out_spec)
        aliases = {3: 0}
        unpoisoned = body
        body = lambda a, b, c, _, o: unpoisoned(a, b, c, o)  # noqa: E731
    o = pl.pallas_call(
        body,
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_spec,
        input_output_aliases=aliases,
        interpret=interpret,
        name="combine_splits",
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=1, num_stages=1),
    )(*inputs)
    return o.reshape(batch, 1, kv_heads * group, head_dim)  # [B, K, G, H] -> [B, 1, N, H]: a free reshape


# ---------------------------------------------------------------------------------------------
# Op


def combine_rows(
    acc,
    l,
    m,
    *,
    tokens: int,
    group: int,
    out_dtype,
    cfg: BlockSizes,
    interpret: bool = False,
    poison: bool = False,
    backend: str = "triton",
):
    """Partials -> o [B, T, N, H] in out_dtype: by `combine_splits` on `backend` where cfg.combine is
    "kernel" (or "fused", whose own form only `decode_attention_sync_rows` runs) and it fits, else in jnp
    (`combine_partials`, then `from_rows`)."""
    if cfg.combine in ("kernel", "fused") and combine_fits(
        tokens, group, acc.shape[-1], cfg, backend, rows=acc.shape[3]
    ):
        return combine_splits(
            acc, l, m, group=group, out_dtype=out_dtype, cfg=cfg, interpret=interpret, poison=poison, backend=backend
        )
    o, _ = combine_partials(acc, l, m)
    return from_rows(o, tokens, group).astype(out_dtype)


# ---------------------------------------------------------------------------------------------
# Reference


def combine_partials(acc, l, m):
    """Per-split partials acc [B, K, splits, R, H], l, m [B, K, splits, R] (f32) -> o [B, K, R, H]
    and log Σ e^x [B, K, R]: each split rescaled to the max over all splits, then summed."""
    m_all = m.max(axis=2, keepdims=True)  # [B, K, 1, R]
    correction = jnp.exp(m - m_all)  # [B, K, splits, R]
    l = (correction * l).sum(axis=2)  # [B, K, R]
    o = (correction[..., None] * acc).sum(axis=2) / l[..., None]  # [B, K, R, H]
    return o, jnp.log(l) + m_all[:, :, 0]

"""The q·k·v projection's epilogue as one kernel: sum the GEMM's split partials, add the bias, rotate q
and k (RoPE), lay q out as the attention kernel's rows, and write k and v into the stacked KV cache.

In a looped decode step (one token per sequence), what follows the q·k·v GEMM is a handful of
elementwise work on [B, (N + 2K)·H] values and two single-row cache writes. XLA runs it as three
kernels per layer on the GPU (q's RoPE and row padding, then one in-place write per cache), each a
launch around a few KB, or five at batch 8 (a transpose first, and the writes as scatters).
This kernel does all of it in one launch over (sequence, kv head, role): one program per query
head, one for the key head and one for the value head, each with a few loads before its stores.
On an H200 (Llama-3.1-8B decode) it takes about a third of the time of XLA's three kernels per
layer (see docs/log/). A first version with one program per kv head, its heads one after another,
gained nothing end to end.

Inputs, as `kernels.flat_gemm_stream.stream_partials` leaves them: partials [P, (N + 2K)·H, M8] f32
(P slots of tile_n-column tiles, column m the m-th sequence) and which (slot, tile) pairs hold a
partial sum, `written` [P, T]; unwritten slots hold anything (NaN included) and are never added.
Values follow the model (`jaxdecode.model.qkv_attend`) in order of operations: the slots are summed
in f32 and rounded to the cache's dtype (the GEMM's output); the bias is added and rounded; q and
k are rotated in f32 (rotate-half form) and rounded once more. The new rows go to position
positions[b], clamped to [0, S - 1] as `dynamic_update_slice` clamps, of layer `layer` of the stacks,
which are updated in place (outputs aliased to the inputs). q comes back as rows [B, K, R, H]: row
g < G of kv head h is query head h·G + g, rows G..R-1 are zero (`decode_attention_sync_rows` reads it).

Backend: Pallas-Triton, like the attention kernel it feeds. Each program loads a few strided
columns of the partials and stores single rows at data-dependent positions of a 5-D stack; there is
no TMA or wgmma work for Mosaic GPU here. It runs in interpret mode on the CPU (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def fits(heads: int, kv_heads: int, head_dim: int, tile_n: int, rows: int) -> bool:
    """Whether the kernel takes this shape: half a head inside one GEMM tile (so one `written` flag
    covers it), a power-of-two half head (Triton's loads) and the G query heads within R rows."""
    half = head_dim // 2
    return (
        head_dim % 2 == 0
        and half & (half - 1) == 0
        and tile_n % half == 0
        and heads % kv_heads == 0
        and heads // kv_heads <= rows
    )


def _kernel(layer_ref, pos_ref, *refs, heads: int, kv_heads: int, tile_n: int, biased: bool, table: bool):
    """One (sequence b, kv head h, role r) program: r < G rotates query head h·G + r into row r of q;
    r = G rotates the key head and writes it into the k stack, and zeroes q's rows G..R-1; r = G + 1
    writes the value head into the v stack. refs: written_ref [P, T] int32 (when `table`; without it every
    slot is written), part_ref [P, C, M8] f32, cos_ref, sin_ref [B, H] f32, (bias stacks [L, N·H], [L, K·H],
    [L, K·H] when biased), the two input stacks (aliased, unread), then q_ref [R, H] (this kv head's
    rows), k_ref, v_ref [L, B, S, K, H].
    A program makes two loads per slot and at most two stores, after all its loads."""
    written_ref, refs = (refs[0], refs[1:]) if table else (None, refs)
    part_ref, cos_ref, sin_ref, *biases, _, _, q_ref, k_ref, v_ref = refs
    b, h, role = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slots = part_ref.shape[0]
    rows, head_dim = q_ref.shape
    half = head_dim // 2
    group = heads // kv_heads
    layer = layer_ref[()]
    dtype = k_ref.dtype
    bq, bk, bv = biases if biased else (None, None, None)

    def value(column, bias_ref, bias_column):
        """Half a head's columns [column, column + half): the written slots summed in slot order, rounded,
        plus the bias (rounded again), as f32."""
        tile = column // tile_n
        total = jnp.zeros((half,), jnp.float32)
        for p in range(slots):
            part = part_ref[p, pl.ds(column, half), b]
            total = total + (part if written_ref is None else jnp.where(written_ref[p, tile] != 0, part, 0.0))
        y = total.astype(dtype)
        if bias_ref is not None:
            y = (y.astype(jnp.float32) + bias_ref[layer, pl.ds(bias_column, half)].astype(jnp.float32)).astype(dtype)
        return y.astype(jnp.float32)

    def rotated(start, bias_ref, bias_start):
        """A head's two halves rotated (rotate-half: [x_lo, x_hi]·cos + [-x_hi, x_lo]·sin), rounded."""
        lo, hi = value(start, bias_ref, bias_start), value(start + half, bias_ref, bias_start + half)
        cos_lo, cos_hi = cos_ref[b, pl.ds(0, half)], cos_ref[b, pl.ds(half, half)]
        sin_lo, sin_hi = sin_ref[b, pl.ds(0, half)], sin_ref[b, pl.ds(half, half)]
        return (lo * cos_lo + -hi * sin_lo).astype(dtype), (hi * cos_hi + lo * sin_hi).astype(dtype)

    def write_row(ref, lo, hi):  # ref[layer, b, pos, h, :], pos clamped as dynamic_update_slice clamps
        pos = jnp.minimum(jnp.maximum(pos_ref[b], 0), ref.shape[2] - 1)
        ref[layer, b, pos, h, pl.ds(0, half)] = lo
        ref[layer, b, pos, h, pl.ds(half, half)] = hi

    @pl.when(role < group)
    def _():
        q_head = h * group + role
        lo, hi = rotated(q_head * head_dim, bq, q_head * head_dim)
        q_ref[role, pl.ds(0, half)] = lo
        q_ref[role, pl.ds(half, half)] = hi

    @pl.when(role == group)
    def _():
        lo, hi = rotated(heads * head_dim + h * head_dim, bk, h * head_dim)
        write_row(k_ref, lo, hi)
        zeros = jnp.zeros((head_dim,), dtype)
        for g in range(group, rows):
            q_ref[g, :] = zeros

    @pl.when(role == group + 1)
    def _():
        start = (heads + kv_heads) * head_dim + h * head_dim
        write_row(
            v_ref,
            value(start, bv, h * head_dim).astype(dtype),
            value(start + half, bv, h * head_dim + half).astype(dtype),
        )


@functools.partial(jax.jit, static_argnames=("written", "heads", "tile_n", "rows", "interpret", "poison"))
def _qkv_rope_write(
    partials, written, cos, sin, positions, k_stack, v_stack, layer, biases, *, heads, tile_n, rows, interpret, poison
):
    written = np.asarray(written, bool).reshape(len(written), -1)
    slots, columns, m8 = partials.shape
    _, batch, _, kv_heads, head_dim = k_stack.shape
    if k_stack.shape != v_stack.shape or k_stack.dtype != v_stack.dtype:
        raise ValueError(
            f"the k and v stacks must match, got {k_stack.dtype}{list(k_stack.shape)} and "
            f"{v_stack.dtype}{list(v_stack.shape)}"
        )
    if columns != (heads + 2 * kv_heads) * head_dim or m8 < batch or columns % tile_n:
        raise ValueError(
            f"partials [P, (heads + 2K)·H, M8 >= B] = [*, {(heads + 2 * kv_heads) * head_dim}, >= {batch}] "
            f"in tiles of {tile_n}, got {list(partials.shape)}"
        )
    if written.shape != (slots, columns // tile_n):
        raise ValueError(f"written must be [P, T] = [{slots}, {columns // tile_n}], got {list(written.shape)}")
    if cos.shape != (batch, head_dim) or sin.shape != cos.shape or positions.shape != (batch,):
        raise ValueError(
            f"cos, sin must be [B, H] = [{batch}, {head_dim}] and positions [B]; got {list(cos.shape)}, "
            f"{list(sin.shape)}, {list(positions.shape)}"
        )
    if not fits(heads, kv_heads, head_dim, tile_n, rows):
        raise ValueError(
            f"qkv_rope_write takes half heads inside one tile of {tile_n} columns, a power-of-two "
            f"half head and G <= rows; got heads={heads}, K={kv_heads}, H={head_dim}, rows={rows}"
        )
    if len(biases) not in (0, 3):
        raise ValueError(f"biases must be () or three stacks (q, k, v), got {len(biases)}")
    table = not written.all()
    body = functools.partial(_kernel, heads=heads, kv_heads=kv_heads, tile_n=tile_n, biased=bool(biases), table=table)
    whole = pl.BlockSpec()
    inputs = [
        jnp.asarray(layer, jnp.int32),
        positions.astype(jnp.int32),
        *([jnp.asarray(written, jnp.int32)] if table else []),
        partials,
        cos.astype(jnp.float32),
        sin.astype(jnp.float32),
        *biases,
        k_stack,
        v_stack,
    ]
    in_specs = [pl.BlockSpec((), lambda b, h, r: ())] + [whole] * (len(inputs) - 1)
    q_spec = pl.BlockSpec((None, None, rows, head_dim), lambda b, h, r: (b, h, 0, 0))
    q_shape = jax.ShapeDtypeStruct((batch, kv_heads, rows, head_dim), k_stack.dtype)
    n_in = len(inputs)
    aliases = {n_in - 2: 1, n_in - 1: 2}  # the stacks, written in place
    if poison:
        inputs.append(jnp.full(q_shape.shape, jnp.nan, q_shape.dtype))
        in_specs.append(q_spec)
        aliases[n_in] = 0
        unpoisoned = body
        body = lambda *refs: unpoisoned(*refs[:n_in], *refs[n_in + 1 :])  # noqa: E731
    return pl.pallas_call(
        body,
        out_shape=[
            q_shape,
            jax.ShapeDtypeStruct(k_stack.shape, k_stack.dtype),
            jax.ShapeDtypeStruct(v_stack.shape, v_stack.dtype),
        ],
        grid=(batch, kv_heads, heads // kv_heads + 2),
        in_specs=in_specs,
        out_specs=[q_spec, whole, whole],
        input_output_aliases=aliases,
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="qkv_rope_write",
    )(*inputs)


def qkv_rope_write(
    partials,
    written,
    cos,
    sin,
    positions,
    k_stack,
    v_stack,
    layer,
    biases=(),
    *,
    heads: int,
    tile_n: int,
    rows: int = 16,
    interpret: bool = False,
    poison: bool = False,
):
    """(q_rows [B, K, rows, H], k_stack, v_stack): see the module docstring.

    partials [P, (heads + 2K)·H, M8] f32 (column b: sequence b; M8 >= B); written [P, T] (a host array
    of bools, T = columns / tile_n: a static property of the GEMM's schedule); cos, sin [B, H] f32 (the
    token's angles, halves repeated); positions [B] int32; k_stack, v_stack [L, B, S, K, H] (updated in
    place); layer an int32 scalar; biases () or the three stacks [L, heads·H], [L, K·H], [L, K·H].
    poison=True (tests) starts q from NaN. Where every slot is written the kernel takes no table (as an
    input it would be a constant that XLA rebuilds with a broadcast kernel inside the layer loop).
    """
    written = np.asarray(written, bool)
    if written.ndim != 2:
        raise ValueError(f"written must be a [P, T] array of the GEMM's written slots, got shape {list(written.shape)}")
    return _qkv_rope_write(
        partials,
        tuple(map(tuple, written.tolist())),
        cos,
        sin,
        positions,
        k_stack,
        v_stack,
        layer,
        tuple(biases),
        heads=heads,
        tile_n=tile_n,
        rows=rows,
        interpret=interpret,
        poison=poison,
    )


def qkv_rope_write_reference(
    partials,
    written,
    cos,
    sin,
    positions,
    k_stack,
    v_stack,
    layer,
    biases=(),
    *,
    heads: int,
    tile_n: int,
    rows: int = 16,
):
    """What the model computes, in jnp: the partials combined as `flat_gemm_stream.combine` does, q, k, v
    rounded, biased, rotated (`jaxdecode.model.apply_rope` written out), the rows written with
    `dynamic_update_slice` per sequence, and q laid out as rows (`kernels.decode_attention.layout.to_rows`)."""
    _, batch, _, kv_heads, head_dim = k_stack.shape
    dtype = k_stack.dtype
    mask = jnp.repeat(jnp.asarray(written, bool), tile_n, axis=1)[:, :, None]  # [P, C, 1]
    y = jnp.where(mask, partials, 0.0).sum(axis=0)[:, :batch].T.astype(dtype)  # [B, C]
    if biases:
        y = y + jnp.concatenate([b[layer] for b in biases])
    q, k, v = jnp.split(y, [heads * head_dim, (heads + kv_heads) * head_dim], axis=1)

    def rope(x):  # x [B, n, H]
        half = head_dim // 2
        rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        out = x.astype(jnp.float32) * cos[:, None] + rotated.astype(jnp.float32) * sin[:, None]
        return out.astype(dtype)

    q = rope(q.reshape(batch, heads, head_dim)).reshape(batch, kv_heads, heads // kv_heads, head_dim)
    k = rope(k.reshape(batch, kv_heads, head_dim))
    v = v.reshape(batch, kv_heads, head_dim)
    q_rows = jnp.pad(q, ((0, 0), (0, 0), (0, rows - heads // kv_heads), (0, 0)))
    for b in range(batch):
        at = (layer, b, positions[b], 0, 0)
        k_stack = jax.lax.dynamic_update_slice(k_stack, k[b][None, None, None], at)
        v_stack = jax.lax.dynamic_update_slice(v_stack, v[b][None, None, None], at)
    return q_rows, k_stack, v_stack

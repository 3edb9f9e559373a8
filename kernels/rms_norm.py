"""RMSNorm of a few rows in one kernel, reading the layer's norm weight in place from its stack.

The looped decode normalizes x [M, D] twice per layer (before q·k·v and before gate·up). XLA runs
each norm as two kernels on the GPU, a reduction and then the scale, because a reduction is the
root of its fusion; at batch 1 each is a launch around a few KB of data. This kernel does
both in one launch per norm, and takes the stacked weights [L, D] with the layer index, so no row
of the stack is sliced out first.

Values follow `jaxdecode.model.RMSNorm` exactly in order of operations: in float32, r = rsqrt(mean(x²)
+ eps); x·r is rounded to x's dtype, then multiplied by the weight and rounded again. Only the
order of the sum of squares differs (blocks of D here), so results can differ by one rounding step.

Backend: Pallas-Triton. The kernel is a one-row reduction and a scale, launch-bound at these sizes;
Triton expresses it with a plain `sum` over a block. Mosaic GPU would need the row laid out over a
warpgroup and a cross-warp reduction written by hand, for no gain at a few KB per call. It runs in
interpret mode on the CPU (tests).

`residual_rms_norm` is the attention block's end on one GPU in the same launch: the o projection's
split-K partial sums (the GEMV's [splits, M, D] f32), their rounding, the residual add and the
MLP's input norm. XLA ran the first three as one fusion and the norm as this file's first kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def chunk_size(dim: int, cap: int = 4096) -> int:
    """The largest power of two that divides `dim`, at most `cap`: Triton loads power-of-two blocks."""
    return min(dim & -dim, cap)


# ---------------------------------------------------------------------------------------------
# Kernel bodies


def _norm_kernel(layer_ref, x_ref, w_ref, o_ref, *, eps: float, chunk: int):
    """x_ref [D] (one row), w_ref [L, D] (the whole stack), o_ref [D]."""
    dim = x_ref.shape[0]
    layer = layer_ref[()]
    steps = dim // chunk

    def sum_squares(i, acc):
        x = x_ref[pl.ds(i * chunk, chunk)].astype(jnp.float32)
        return acc + jnp.sum(x * x)

    total = lax.fori_loop(0, steps, sum_squares, jnp.zeros((), jnp.float32))
    r = lax.rsqrt(total / dim + eps)

    def scale(i, carry):
        cols = pl.ds(i * chunk, chunk)
        normed = (x_ref[cols].astype(jnp.float32) * r).astype(x_ref.dtype)  # the model's first rounding
        o_ref[cols] = (normed.astype(jnp.float32) * w_ref[layer, cols].astype(jnp.float32)).astype(o_ref.dtype)
        return carry

    lax.fori_loop(0, steps, scale, 0)


def _residual_kernel(layer_ref, p_ref, r_ref, w_ref, s_ref, o_ref, *, eps: float, chunk: int):
    """p_ref [splits, D] (one row's f32 partials), r_ref [D], w_ref [L, D] (the whole stack); s_ref, o_ref [D].
    The row stays in registers between the sum of squares and the scale: chunks are a static loop."""
    splits, dim = p_ref.shape
    layer = layer_ref[()]
    sums = []
    total = jnp.zeros((), jnp.float32)
    for start in range(0, dim, chunk):
        cols = pl.ds(start, chunk)
        part = p_ref[0, cols]
        for split in range(1, splits):  # in split order, as `residual_rms_norm_reference` sums
            part = part + p_ref[split, cols]
        block_out = part.astype(s_ref.dtype)  # the projection's rounding
        s = (r_ref[cols].astype(jnp.float32) + block_out.astype(jnp.float32)).astype(s_ref.dtype)  # the add's
        s_ref[cols] = s
        s32 = s.astype(jnp.float32)
        sums.append(s32)
        total = total + jnp.sum(s32 * s32)
    r = lax.rsqrt(total / dim + eps)
    for i, start in enumerate(range(0, dim, chunk)):
        cols = pl.ds(start, chunk)
        normed = (sums[i] * r).astype(o_ref.dtype)  # the model's first rounding, then the weight's
        o_ref[cols] = (normed.astype(jnp.float32) * w_ref[layer, cols].astype(jnp.float32)).astype(o_ref.dtype)


# ---------------------------------------------------------------------------------------------
# pallas_call wrappers


def _norm_call(x, weights, layer, *, eps: float, num_warps: int, interpret: bool, poison: bool) -> jax.Array:
    """The pallas_call of `rms_norm`: one program per row of x [M, D]; weights [L, D] whole."""
    rows, dim = x.shape
    layer = jnp.asarray(layer, jnp.int32)
    body = functools.partial(_norm_kernel, eps=eps, chunk=chunk_size(dim))
    in_specs = [
        pl.BlockSpec((), lambda m: ()),  # the layer index
        pl.BlockSpec((None, dim), lambda m: (m, 0)),  # one row of x
        pl.BlockSpec(),
    ]  # the whole weight stack
    inputs = [layer, x, weights]
    out_spec = pl.BlockSpec((None, dim), lambda m: (m, 0))
    if poison:
        inputs.append(jnp.full(x.shape, jnp.nan, x.dtype))
        in_specs.append(out_spec)
        unpoisoned = body
        body = lambda layer_ref, x_ref, w_ref, _, o_ref: unpoisoned(layer_ref, x_ref, w_ref, o_ref)  # noqa: E731
    return pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(rows,),
        in_specs=in_specs,
        out_specs=out_spec,
        input_output_aliases={3: 0} if poison else {},
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="rms_norm",
    )(*inputs)


def _residual_call(
    partials, residual, weights, layer, *, eps: float, num_warps: int, interpret: bool, poison: bool
) -> tuple[jax.Array, jax.Array]:
    """The pallas_call of `residual_rms_norm`: one program per row; weights [L, D] whole."""
    splits, rows, dim = partials.shape
    layer = jnp.asarray(layer, jnp.int32)
    body = functools.partial(_residual_kernel, eps=eps, chunk=chunk_size(dim))
    row_spec = pl.BlockSpec((None, dim), lambda m: (m, 0))
    in_specs = [
        pl.BlockSpec((), lambda m: ()),  # the layer index
        pl.BlockSpec((splits, None, dim), lambda m: (0, m, 0)),  # one row's partials
        row_spec,  # one row of the residual
        pl.BlockSpec(),
    ]  # the whole weight stack
    inputs = [layer, partials, residual, weights]
    out_shape = jax.ShapeDtypeStruct(residual.shape, residual.dtype)
    if poison:
        inputs += [jnp.full(residual.shape, jnp.nan, residual.dtype)] * 2
        in_specs += [row_spec, row_spec]
        unpoisoned = body
        body = lambda layer_ref, p_ref, r_ref, w_ref, _a, _b, s_ref, o_ref: unpoisoned(  # noqa: E731
            layer_ref, p_ref, r_ref, w_ref, s_ref, o_ref
        )
    return pl.pallas_call(
        body,
        out_shape=(out_shape, out_shape),
        grid=(rows,),
        in_specs=in_specs,
        out_specs=(row_spec, row_spec),
        input_output_aliases={4: 0, 5: 1} if poison else {},
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="residual_rms_norm",
    )(*inputs)


# ---------------------------------------------------------------------------------------------
# Public ops


@functools.partial(jax.jit, static_argnames=("eps", "num_warps", "interpret", "poison"))
def rms_norm(
    x: jax.Array,  # [M, D]
    weights: jax.Array,  # [L, D]
    layer: jax.Array | int,  # int32 scalar, may be traced
    *,
    eps: float,
    num_warps: int = 4,
    interpret: bool = False,
    poison: bool = False,
) -> jax.Array:
    """weights[layer] * (x / sqrt(mean(x², axis=-1) + eps)) for x [M, D] and a stack weights [L, D].

    The weight row is read in place (the kernel gets the whole stack and the index). poison=True
    (tests) hands the kernel a NaN-filled output buffer, so an unwritten element shows as NaN.
    """
    if x.ndim != 2 or weights.ndim != 2 or weights.shape[1] != x.shape[1]:
        raise ValueError(f"rms_norm takes x [M, D] and weights [L, D], got {x.shape} and {weights.shape}")
    if x.dtype != weights.dtype:
        raise ValueError(f"x and weights must share a dtype, got {x.dtype} and {weights.dtype}")
    return _norm_call(x, weights, layer, eps=eps, num_warps=num_warps, interpret=interpret, poison=poison)


@functools.partial(jax.jit, static_argnames=("eps", "num_warps", "interpret", "poison"))
def residual_rms_norm(
    partials: jax.Array,  # [splits, M, D] f32
    residual: jax.Array,  # [M, D]
    weights: jax.Array,  # [L, D]
    layer: jax.Array | int,  # int32 scalar, may be traced
    *,
    eps: float,
    num_warps: int = 16,
    interpret: bool = False,
    poison: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """(s, rms_norm(s) · weights[layer]) for s = residual + Σ partials: partials [splits, M, D] f32 (a GEMM's
    split-K partial sums), residual [M, D], weights a stack [L, D] read in place. One program per row.

    Equivalent to the following JAX code (the model's o projection, residual add and `rms_norm`):

      block_out = partials.sum(axis=0).astype(residual.dtype)   # the splits summed in order
      s = residual + block_out
      return s, rms_norm(s, weights[layer], eps)

    poison=True (tests) hands the kernel NaN-filled output buffers, so an unwritten element shows as NaN.
    One program reads the row's partials alone (64 KB for Llama's o GEMV at batch 1), so it takes 16 warps
    to keep enough loads in flight: in Llama-3.1-8B decode on the H200 at batch 1, 4 warps were slower than
    XLA's fusion and the norm kernel, 16 never slower (A/B runs; see docs/log/).
    """
    if (
        partials.ndim != 3
        or residual.ndim != 2
        or weights.ndim != 2
        or partials.shape[1:] != residual.shape
        or weights.shape[1] != residual.shape[1]
    ):
        raise ValueError(
            f"residual_rms_norm takes partials [splits, M, D], residual [M, D] and weights [L, D], got "
            f"{partials.shape}, {residual.shape} and {weights.shape}"
        )
    if partials.dtype != jnp.float32 or residual.dtype != weights.dtype:
        raise ValueError(
            f"partials must be float32 and residual and weights share a dtype, got {partials.dtype}, "
            f"{residual.dtype} and {weights.dtype}"
        )
    return _residual_call(
        partials, residual, weights, layer, eps=eps, num_warps=num_warps, interpret=interpret, poison=poison
    )


# ---------------------------------------------------------------------------------------------
# References


def rms_norm_reference(x: jax.Array, weights: jax.Array, layer: int, *, eps: float) -> jax.Array:
    """What `jaxdecode.model.RMSNorm` computes with weight weights[layer], in jnp."""
    x32 = x.astype(jnp.float32)
    normed = (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return weights[layer] * normed


def residual_rms_norm_reference(partials, residual, weights, layer: int, *, eps: float):
    """What `residual_rms_norm` computes, in jnp: the splits summed in order, then the model's ops."""
    total = partials[0]
    for split in range(1, partials.shape[0]):
        total = total + partials[split]
    s = residual + total.astype(residual.dtype)
    return s, rms_norm_reference(s, weights, layer, eps=eps)

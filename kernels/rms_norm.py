"""RMSNorm of a few rows in one kernel, reading the layer's norm weight in place from its stack.

The looped decode normalizes x [M, D] twice per layer (before q·k·v and before gate·up). XLA runs
each norm as two kernels on the GPU, a reduction and then the scale, because a reduction is the
root of its fusion; at batch 1 each is a 1-2 µs launch around a few KB of data. This kernel does
both in one launch per norm, and takes the stacked weights [L, D] with the layer index, so no row
of the stack is sliced out first.

Values follow `jaxdecode.model.RMSNorm` exactly in order of operations: in float32, r = rsqrt(mean(x²)
+ eps); x·r is rounded to x's dtype, then multiplied by the weight and rounded again. Only the
order of the sum of squares differs (blocks of D here), so results can differ by one rounding step.

Backend: Pallas-Triton. The kernel is a one-row reduction and a scale, launch-bound at these sizes;
Triton expresses it with a plain `sum` over a block. Mosaic GPU would need the row laid out over a
warpgroup and a cross-warp reduction written by hand, for no gain at a few KB per call. It runs in
interpret mode on the CPU (tests).
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


def _kernel(layer_ref, x_ref, w_ref, o_ref, *, eps: float, chunk: int):
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


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "poison"))
def rms_norm(x: jax.Array, weights: jax.Array, layer: jax.Array | int, *, eps: float,
             interpret: bool = False, poison: bool = False) -> jax.Array:
  """weights[layer] * (x / sqrt(mean(x², axis=-1) + eps)) for x [M, D] and a stack weights [L, D].

  The weight row is read in place (the kernel gets the whole stack and the index). poison=True
  (tests) hands the kernel a NaN-filled output buffer, so an unwritten element shows as NaN.
  """
  if x.ndim != 2 or weights.ndim != 2 or weights.shape[1] != x.shape[1]:
    raise ValueError(f"rms_norm takes x [M, D] and weights [L, D], got {x.shape} and {weights.shape}")
  if x.dtype != weights.dtype:
    raise ValueError(f"x and weights must share a dtype, got {x.dtype} and {weights.dtype}")
  rows, dim = x.shape
  layer = jnp.asarray(layer, jnp.int32)
  body = functools.partial(_kernel, eps=eps, chunk=chunk_size(dim))
  in_specs = [pl.BlockSpec((), lambda m: ()),  # the layer index
              pl.BlockSpec((None, dim), lambda m: (m, 0)),  # one row of x
              pl.BlockSpec()]  # the whole weight stack
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
      compiler_params=None if interpret else pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="rms_norm",
  )(*inputs)


def rms_norm_reference(x: jax.Array, weights: jax.Array, layer: int, *, eps: float) -> jax.Array:
  """What `jaxdecode.model.RMSNorm` computes with weight weights[layer], in jnp."""
  x32 = x.astype(jnp.float32)
  normed = (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
  return weights[layer] * normed

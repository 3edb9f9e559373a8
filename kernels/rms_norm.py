"""RMSNorm of a few rows in one kernel, reading the layer's norm weight in place from its stack.

The looped decode normalizes x [M, D] twice per layer (before q·k·v and before gate·up). XLA runs
each norm as two kernels on the GPU, a reduction and then the scale, because a reduction is the
root of its fusion; at batch 1 each is a 1-2 µs launch around a few KB of data. This kernel does
both in one launch per norm, and takes the stacked weights [L, D] with the layer index, so no row
of the stack is sliced out first. With `residual=h` it also does the residual add before the norm
(the attention block's output added to the stream, `model.residual_norm`): it returns s = x + h,
rounded once as XLA adds two 16-bit values, and the norm of s, one launch instead of two.

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


def _kernel(layer_ref, x_ref, *refs, eps: float, chunk: int, residual: bool):
  """x_ref [D] (one row), then h_ref [D] when `residual`, w_ref [L, D] (the whole stack); outputs
  s_ref [D] (x + h) when `residual`, o_ref [D] (the norm of x, or of x + h)."""
  if residual:
    h_ref, w_ref, s_ref, o_ref = refs
  else:
    (w_ref, o_ref), h_ref = refs, None
  dim = x_ref.shape[0]
  layer = layer_ref[()]
  steps = dim // chunk

  def row(cols):  # the row the norm reads: x, or x + h rounded to x's dtype (one f32 add, one rounding)
    x = x_ref[cols]
    if h_ref is None:
      return x.astype(jnp.float32)
    s = (x.astype(jnp.float32) + h_ref[cols].astype(jnp.float32)).astype(x_ref.dtype)
    return s.astype(jnp.float32)

  def sum_squares(i, acc):
    cols = pl.ds(i * chunk, chunk)
    x = row(cols)
    if h_ref is not None:
      s_ref[cols] = x.astype(s_ref.dtype)
    return acc + jnp.sum(x * x)

  total = lax.fori_loop(0, steps, sum_squares, jnp.zeros((), jnp.float32))
  r = lax.rsqrt(total / dim + eps)

  def scale(i, carry):
    cols = pl.ds(i * chunk, chunk)
    normed = (row(cols) * r).astype(x_ref.dtype)  # the model's first rounding
    o_ref[cols] = (normed.astype(jnp.float32) * w_ref[layer, cols].astype(jnp.float32)).astype(o_ref.dtype)
    return carry

  lax.fori_loop(0, steps, scale, 0)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "poison"))
def rms_norm(x: jax.Array, weights: jax.Array, layer: jax.Array | int, *, eps: float,
             residual: jax.Array | None = None, interpret: bool = False, poison: bool = False):
  """weights[layer] * (x / sqrt(mean(x², axis=-1) + eps)) for x [M, D] and a stack weights [L, D].
  With `residual` h [M, D]: (s, the norm of s) for s = x + h, as `x + h` then `rms_norm` compute them.

  The weight row is read in place (the kernel gets the whole stack and the index). poison=True
  (tests) hands the kernel NaN-filled output buffers, so an unwritten element shows as NaN.
  """
  if x.ndim != 2 or weights.ndim != 2 or weights.shape[1] != x.shape[1]:
    raise ValueError(f"rms_norm takes x [M, D] and weights [L, D], got {x.shape} and {weights.shape}")
  if x.dtype != weights.dtype:
    raise ValueError(f"x and weights must share a dtype, got {x.dtype} and {weights.dtype}")
  if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
    raise ValueError(f"the residual must have x's shape and dtype {x.dtype}{list(x.shape)}, got "
                     f"{residual.dtype}{list(residual.shape)}")
  rows, dim = x.shape
  layer = jnp.asarray(layer, jnp.int32)
  with_residual = residual is not None
  row_spec = pl.BlockSpec((None, dim), lambda m: (m, 0))  # one row of [M, D]
  in_specs = [pl.BlockSpec((), lambda m: ()),  # the layer index
              row_spec, *([row_spec] if with_residual else []),  # x (and h)
              pl.BlockSpec()]  # the whole weight stack
  inputs = [layer, x, *([residual] if with_residual else []), weights]
  outputs = 2 if with_residual else 1
  body = functools.partial(_kernel, eps=eps, chunk=chunk_size(dim), residual=with_residual)
  aliases = {}
  if poison:
    first = len(inputs)
    inputs += [jnp.full(x.shape, jnp.nan, x.dtype)] * outputs
    in_specs += [row_spec] * outputs
    aliases = {first + i: i for i in range(outputs)}
    unpoisoned = body
    body = lambda *refs: unpoisoned(*refs[:first], *refs[first + outputs:])  # noqa: E731
  out = pl.pallas_call(
      body,
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)] * outputs,
      grid=(rows,),
      in_specs=in_specs,
      out_specs=[row_spec] * outputs,
      input_output_aliases=aliases,
      compiler_params=None if interpret else pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="add_rms_norm" if with_residual else "rms_norm",
  )(*inputs)
  return tuple(out) if with_residual else out[0]


def rms_norm_reference(x: jax.Array, weights: jax.Array, layer: int, *, eps: float,
                       residual: jax.Array | None = None):
  """What `jaxdecode.model.RMSNorm` computes with weight weights[layer], in jnp; with `residual` h,
  (x + h, that norm of x + h), as `model.residual_norm` computes them on one device."""
  if residual is not None:
    s = x + residual
    return s, rms_norm_reference(s, weights, layer, eps=eps)
  x32 = x.astype(jnp.float32)
  normed = (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
  return weights[layer] * normed

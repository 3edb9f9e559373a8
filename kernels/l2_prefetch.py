"""Prefetch a layer's weights into the GPU's L2 cache while the GPU does something else.

A decode layer alternates between phases that stream weights from HBM (the four projections) and
phases that barely touch HBM: the glue kernels between them (norms, RoPE, cache writes, the
attention's split combine), attention over a short context, and, with tensor parallelism, the
all-reduces. During those phases the HBM read bandwidth, the resource a decode step is bound by, sits
idle. The Kernel Looping paper hides them on the SN40L by streaming layer i+1's weights while layer i
computes; the GPU analogue here is to start the next projection's weight reads early into L2 (50 MB
on an H100/H200), so that the projection then finds part or all of its weights there.

`prefetch_l2(x, stacks, layer)` returns x unchanged and, as a side effect, asks the TMA units of
`ctas` CTAs to prefetch `stacks[j][layer]` (each [K, N], read in place from its [L, K, N] stack)
into L2 (`plgpu.async_prefetch`, PTX `cp.async.bulk.prefetch.tensor`), in boxes of at most 256 × 256.
The prefetches are hints: the kernel does not wait for them, and nothing depends on them for its
values. x passes through (a copy of a few KB) only so that XLA places the kernel where its result is
used, after x is computed: jax 0.11's `plgpu.kernel` has no side-effecting form and no aliasing.

`limit_bytes` caps how much is prefetched (an equal share per stack, the first whole row blocks of
each): L2 holds at most about 50 MB, and what does not fit would only evict what was fetched first.

Backend: Mosaic GPU (TMA prefetch). In interpret mode the prefetch is a no-op and only the copy
runs, which is what the CPU tests check.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

BOX = 256  # TMA's largest box side (elements)
MAX_COPY_ELEMENTS = 65536  # the pass-through x: one CTA copies it through registers


def box_plan(shape_kn: tuple[int, int], budget_bytes: int, itemsize: int) -> tuple[int, int, int, int]:
  """(box_k, box_n, row_boxes, col_boxes) that cover the first rows of a [K, N] weight within
  `budget_bytes`: boxes of box_k × box_n elements, row_boxes × col_boxes of them (0 rows when not
  even one row of boxes fits)."""
  k, n = shape_kn
  box_n = next(b for b in (BOX, 128, 64, 32, 16, 8) if n % b == 0) if n % 8 == 0 else 0
  box_k = min(BOX, k)
  if box_n == 0 or k % box_k:
    raise ValueError(f"prefetch_l2 takes weights [K, N] with N a multiple of 8 and K a multiple of "
                     f"{box_k}; got [{k}, {n}]")
  col_boxes = n // box_n
  row_bytes = box_k * n * itemsize
  row_boxes = min(k // box_k, max(budget_bytes, 0) // row_bytes)
  return box_k, box_n, row_boxes, col_boxes


def _kernel(layer_ref, x_ref, *refs, plans, ctas: int):
  """layer_ref [1] int32; x_ref [M, D]; refs: the stacks [L, K, N], then the output [M, D]."""
  *stacks, out_ref = refs
  layer = layer_ref[0]
  cta = lax.axis_index("cta")

  @pl.when(cta == 0)
  def _copy():
    out_ref[...] = x_ref[...]

  for stack, (box_k, box_n, row_boxes, col_boxes) in zip(stacks, plans, strict=True):
    total = row_boxes * col_boxes
    for j in range(-(-total // ctas)):  # the boxes cta, cta + ctas, ... of this stack
      box = cta + j * ctas
      row, col = box // col_boxes, box % col_boxes
      plgpu.async_prefetch(stack.at[layer, pl.ds(row * box_k, box_k), pl.ds(col * box_n, box_n)],
                           predicate=box < total)


@functools.partial(jax.jit, static_argnames=("limit_bytes", "ctas", "interpret"))
def prefetch_l2(x: jax.Array, stacks: Sequence[jax.Array], layer: jax.Array | int, *,
                limit_bytes: int | None = None, ctas: int = 32, interpret: bool = False) -> jax.Array:
  """x, after asking for `stacks[j][layer]` (stacks [L, K, N]) to be prefetched into L2, up to
  `limit_bytes` in all (default: everything). x [M, D] of at most MAX_COPY_ELEMENTS elements."""
  if x.ndim != 2 or x.size > MAX_COPY_ELEMENTS or x.size % 128:
    raise ValueError(f"prefetch_l2 passes through x [M, D] with a multiple of 128 and at most "
                     f"{MAX_COPY_ELEMENTS} elements; got {x.shape}")
  if not stacks or any(s.ndim != 3 for s in stacks):
    raise ValueError(f"prefetch_l2 takes stacked weights [L, K, N]; got {[s.shape for s in stacks]}")
  plans = _plans(stacks, limit_bytes)
  kernel = functools.partial(_kernel, plans=tuple(plans), ctas=ctas)
  return plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid=(ctas,),
      grid_names=("cta",),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )(jnp.asarray(layer, jnp.int32).reshape(1), x, *stacks)


def _plans(stacks: Sequence[jax.Array], limit_bytes: int | None) -> tuple[tuple[int, int, int, int], ...]:
  """The box plan of each stack: all of it, or with `limit_bytes` an equal share of it per stack (the
  first rows of each, so that weights a kernel reads side by side, like gate and up, start alike)."""
  share = None if limit_bytes is None else limit_bytes // len(stacks)
  return tuple(box_plan(s.shape[1:], s[0].size * s.dtype.itemsize if share is None else share, s.dtype.itemsize)
               for s in stacks)


def prefetched_bytes(stacks: Sequence[jax.Array], limit_bytes: int | None = None) -> int:
  """How many bytes `prefetch_l2` asks for with these stacks and limit."""
  return sum(box_k * rows * s.shape[2] * s.dtype.itemsize
             for s, (box_k, _, rows, _) in zip(stacks, _plans(stacks, limit_bytes)))

"""Ask L2 for the next weights while the GPU's memory bus would idle: one launch, the activations passed through.

A decode layer alternates GEMMs that read at the bus's rate with small kernels that barely read
(the q·k·v epilogue, attention over a short cache, split combines, norms): about 20 µs per layer at
batch 1 in which HBM is idle. The SN40L's kernel looping streams the next operator's weights during
that time; a GPU runs one kernel after another, and a kernel cannot read a weight the next kernel
owns. What it can do is ask the L2 for it: `cp.async.bulk.prefetch.tensor` (TMA's prefetch, Hopper)
starts a read into L2 and completes on its own, after the issuing kernel has exited. So this kernel
issues TMA prefetches of `stack[layer]`'s first rows (the next GEMM's weight, read in place from its
stack) spread over every SM, one box each at a time, and copies x to its output: x's consumer then
runs after it, which places the prefetch in the step's stream of kernels. The GEMM that follows reads
the prefetched part from L2 (the H200's is 50 MB), so the bytes are read once, in time the bus was idle.

Values: the output equals x exactly; the prefetch is a hint that changes no value. Tested on the CPU
with Mosaic GPU's interpreter (`interpret=True`; the prefetch is a no-op there), compiled on Hopper.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

BOX = 256  # TMA's box: at most 256 elements along each dimension
MAX_X_BYTES = 64 * 1024  # x passes through one CTA's SMEM


def prefetch_boxes(shape: tuple[int, ...], itemsize: int, max_bytes: int | None) -> tuple[int, int, int]:
    """(box rows, box columns, boxes) covering the first rows of one [R, C] layer of a stack, at most
    `max_bytes` (None: the whole layer), whole rows of boxes; columns a multiple of 16 bytes."""
    rows, cols = shape
    box_cols = min(cols, BOX)
    box_rows = min(rows, BOX)
    if cols % box_cols or rows % box_rows or (box_cols * itemsize) % 16:
        raise ValueError(f"a [{rows}, {cols}] layer of {itemsize}-byte elements does not split into TMA boxes")
    row_bytes = box_rows * cols * itemsize  # one row of boxes
    box_rows_total = rows // box_rows
    if max_bytes is not None:
        box_rows_total = max(0, min(box_rows_total, max_bytes // row_bytes))
    return box_rows, box_cols, box_rows_total * (cols // box_cols)


def fits(stack) -> bool:
    """`prefetch_l2` takes this stack: [L, R, C] of whole-byte elements (not int4), each layer whole TMA boxes."""
    dtype = jnp.dtype(stack.dtype)
    bits = jnp.finfo(dtype).bits if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).bits
    if stack.ndim != 3 or bits % 8:
        return False
    try:
        prefetch_boxes(stack.shape[1:], dtype.itemsize, None)
    except ValueError:
        return False
    return True


def _kernel(layer_gmem, x_gmem, stack_gmem, *refs, box_rows: int, box_cols: int, boxes: int, ctas: int):
    """CTA c prefetches boxes c, c + C, ... of stack[layer]; CTA 0 also copies x to o through SMEM."""
    *_, o_gmem = refs  # `after`'s arrays are never read
    c = lax.axis_index("c")
    layer = layer_gmem[0]
    per_row = stack_gmem.shape[2] // box_cols
    for j in range(math.ceil(boxes / ctas)):
        b = c + j * ctas

        @pl.when(b < boxes)
        def _():
            r, col = b // per_row, b % per_row
            plgpu.async_prefetch(stack_gmem.at[layer, pl.ds(r * box_rows, box_rows), pl.ds(col * box_cols, box_cols)])

    @pl.when(c == 0)
    def _():
        def scope(x_smem, barrier):  # TMA moves at most 256 rows a copy
            chunks = [pl.ds(r, min(BOX, x_gmem.shape[0] - r)) for r in range(0, x_gmem.shape[0], BOX)]
            for rows in chunks:
                plgpu.copy_gmem_to_smem(x_gmem.at[rows], x_smem.at[rows], barrier)
            plgpu.barrier_wait(barrier)
            for rows in chunks:
                plgpu.copy_smem_to_gmem(x_smem.at[rows], o_gmem.at[rows])
            plgpu.wait_smem_to_gmem(0)

        chunks = -(-x_gmem.shape[0] // BOX)
        pl.run_scoped(scope, plgpu.SMEM(x_gmem.shape, x_gmem.dtype), plgpu.Barrier(num_arrivals=chunks))


def default_ctas() -> int:
    """One CTA per SM (132 on an H200); 8 off the GPU (interpret mode)."""
    dev = jax.devices()[0]
    return int(getattr(dev, "core_count", 0) or 8) if dev.platform == "gpu" else 8


@functools.partial(jax.jit, static_argnames=("max_bytes", "ctas", "interpret"))
def prefetch_l2(
    x: jax.Array,  # [M, D]: passed through
    stack: jax.Array,  # [L, R, C]: the weight stack whose layer `layer` the next kernel reads
    layer,
    *after: jax.Array,
    max_bytes: int | None = None,
    ctas: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """x, after a kernel that asked L2 for the first `max_bytes` (None: all) of stack[layer]. The kernel
    takes `after`'s arrays without reading them, so it runs after the kernels that produce them."""
    if stack.ndim != 3 or x.ndim != 2:
        raise ValueError(f"prefetch_l2 takes x [M, D] and a stack [L, R, C], got {x.shape} and {stack.shape}")
    if x.nbytes > MAX_X_BYTES:
        raise ValueError(f"prefetch_l2 passes x through SMEM: {x.shape} {x.dtype} is over {MAX_X_BYTES} bytes")
    box_rows, box_cols, boxes = prefetch_boxes(stack.shape[1:], stack.dtype.itemsize, max_bytes)
    # x as rows TMA can copy: 128 elements (or x's own rows where they do not divide)
    width = 128 if x.size % 128 == 0 else x.shape[1]
    if width > BOX:
        raise ValueError(f"prefetch_l2 copies x in rows of at most {BOX} elements, got {x.shape}")
    ctas = ctas or default_ctas()
    kernel = functools.partial(_kernel, box_rows=box_rows, box_cols=box_cols, boxes=boxes, ctas=ctas)
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((x.size // width, width), x.dtype),
        grid=(ctas,),
        grid_names=("c",),
        interpret=plgpu.InterpretGPUParams(uninitialized_memory="nan") if interpret else False,
    )(jnp.asarray(layer, jnp.int32).reshape(1), x.reshape(-1, width), stack, *after)
    return out.reshape(x.shape)

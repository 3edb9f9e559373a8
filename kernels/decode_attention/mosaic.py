"""Mosaic GPU kernels of the synchronized split-K decode attention and of its split combine.

Same contract as the Pallas-Triton `sync_kernel` and `combine_splits`: one program per (sequence b,
kv head h, split of the cache), q as the T·G rows of kv head h (`layout.to_rows`), the cache read in
place at layer `layer` of the stacks [L, B, S, K, H], and per-split partials acc [R, H], l [R],
m [R] (f32) that either combine reads.

Why wgmma with swapped operands: a program's rows are R = 16 or so (T·G padded), but wgmma's M side
is 64 rows per warpgroup. With q as the 64-row side 3/4 or more of every MMA would be padding, so
the cache block takes that side instead:

  Sᵀ [bk, R] = K_block [bk, H] · qᵀ [H, R]       (A = K tile in SMEM, B = q tile transposed)
  Oᵀ [H, R] += V_blockᵀ [H, bk] · Pᵀ [bk, R]      (A = V tile transposed, B = P through SMEM)

R is the narrow wgmma N side (a multiple of 8). The softmax runs on Sᵀ in registers, so its row
statistics are reductions over axis 0 (across the warpgroup's warps, through the reduction scratch)
and broadcasts along axis 1. P is stored transposed (Pᵀ [R, bk]: bk is the 128-byte swizzled minor
dimension that V's tile also has, and wgmma needs both operands' swizzles to match). Oᵀ and the
statistics are stored straight to GMEM from registers, Oᵀ through a transposed view in the
WGMMA_TRANSPOSED layout, so no SMEM is held for the output. CUDA-core math on WG-strided arrays was
the alternative; it cannot broadcast a row statistic along H (strided broadcasts add leading axes
only), and on the tensor cores the two products cost little next to the cache read.

The K and V blocks come in by TMA from views `k.at[layer·B + b, pl.ds(pos, bk), pl.ds(h·H, H)]` of the
whole stack seen as [L·B, S, K·H] (a free reshape; the Triton kernel's row layer·B + b), in `stages`
buffers (at most the split's blocks): the next blocks' copies are in flight while a block is computed.
One warpgroup issues the copies and computes; at H = 128 and R = 16 a program holds about 40 KB of
SMEM with one stage (a split of one block, the usual case at batch 1), so five share an SM like the
Triton kernel's programs, and 72 KB with two.

The combine takes the same transposed view: a program (b, h, 64 head-dim columns) loads each
split's accᵀ [64, C] (C = the G output rows rounded up to 8) from GMEM in the WGMMA_TRANSPOSED
layout, where the per-row weights e^{m_s - max m} broadcast along axis 0, sums the splits in split
order, and writes the G rows through SMEM by TMA.

Both kernels lower with Lane semantics (the layouts above are set explicitly) and run on the CPU
under Mosaic GPU's interpreter. Bodies are functions of refs (`sync_body`, `combine_body`) apart from their
`plgpu.kernel` wrappers (`sync_call`, `combine_call`), so a persistent kernel can run them as phases:
`sync_combine_call` runs both in one launch, the last split of each kv head combining once the others signal it
(opt-in, `BlockSizes(combine="fused")`: slower than two launches, docs/kernels.md).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.decode_attention.layout import BlockSizes
from kernels.grid_sync import fence_global

_NEG = -1e30  # finite "minus infinity" for the running max, as in the Triton kernel
_LOG2E = math.log2(math.e)
_COLS = 64  # head-dim columns per combine program: the WGMMA layout's 64-row tile of accᵀ


def fits(head_dim: int, dtype, block_sizes: BlockSizes, rows: int = 16) -> bool:
    """Whether the kernels take this shape: block_k and H multiples of 64 (wgmma's M side), R rows a
    multiple of 8 up to 256 (its N side), a 16-bit cache."""
    return (
        block_sizes.block_k % 64 == 0
        and head_dim % 64 == 0
        and rows % 8 == 0
        and 8 <= rows <= 256
        and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    )


def _swizzled(shape, dtype):
    """SMEM for a wgmma operand: (8, minor) tiles, the minor dimension swizzled over up to 128 bytes."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = min(128, shape[-1] * itemsize)
    tiling = plgpu.TilingTransform((8, swizzle // itemsize))
    return plgpu.SMEM(shape, dtype, transforms=(tiling, plgpu.SwizzleTransform(swizzle)))


def _params(interpret: bool, name: str) -> dict:
    return dict(
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane, approx_math=True),
        # The interpreter's GMEM outputs start as NaN, so an element a kernel leaves unwritten shows.
        interpret=plgpu.InterpretGPUParams(uninitialized_memory="nan") if interpret else None,
        kernel_name=name,
    )


# ---------------------------------------------------------------------------------------------
# Kernel bodies


def sync_scratch(rows: int, head_dim: int, block_k: int, stages: int, dtype):
    """The SMEM and barriers `sync_body` takes: q, the K and V stages, Pᵀ; q's, K's and V's barriers."""
    return (
        _swizzled((rows, head_dim), dtype),
        _swizzled((stages, block_k, head_dim), dtype),
        _swizzled((stages, block_k, head_dim), dtype),
        _swizzled((rows, block_k), dtype),
        plgpu.Barrier(),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
    )


def sync_body(
    b,
    h,
    split,
    layer,
    length,
    # GMEM
    q_gmem,  # [B, K, R, H]
    k_gmem,  # [L·B, S, K·H]
    v_gmem,  # [L·B, S, K·H]
    acc_gmem,  # [B, K, splits, R, H] f32 out: Σ e^{x-m}·v
    l_gmem,  # [B, K, splits, R] f32 out: Σ e^{x-m}
    m_gmem,  # [B, K, splits, R] f32 out: the running max (natural log units)
    scratch,  # `sync_scratch`
    *,
    block_k: int,
    split_len: int,
    sm_scale: float,
    group: int,
    tokens: int,
):
    """One (sequence b, kv head h, split) program of the online-softmax attention over `length`
    valid cache positions of layer `layer` (scalars). The softmax runs in base 2 (e^x = 2^{x·log2 e},
    the scale folded into sm_scale); m is written back in natural units, so a split that sees no
    position has l = 0 and m = -1e30·ln 2, which the combine weighs by e^{m - max m} = 0."""
    q_smem, k_smem, v_smem, pt_smem, q_bar, k_bars, v_bars = scratch
    rows, head_dim = q_smem.shape
    stages = k_smem.shape[0]
    split_start = split * split_len
    n = jnp.clip(lax.div(length - split_start + block_k - 1, block_k), 0, split_len // block_k)

    row, cols = layer * q_gmem.shape[0] + b, pl.ds(h * head_dim, head_dim)

    def fetch(i, slot):
        # A view of the stack at (layer·B + b, block i, head h's columns): the TMA reads layer `layer` in
        # place. One squeezed index keeps the tiled copy at rank 5, so Mosaic GPU need not collapse the
        # squeezed (layer, b, h) into one overlapping-stride TMA dimension, which [L, B, S, K, H] needs.
        pos = pl.ds(split_start + i * block_k, block_k)
        plgpu.copy_gmem_to_smem(k_gmem.at[row, pos, cols], k_smem.at[slot], k_bars.at[slot])
        plgpu.copy_gmem_to_smem(v_gmem.at[row, pos, cols], v_smem.at[slot], v_bars.at[slot])

    plgpu.copy_gmem_to_smem(q_gmem.at[b, h], q_smem, q_bar)
    for i in range(stages):
        pl.when(i < n)(functools.partial(fetch, i, i))
    plgpu.barrier_wait(q_bar)
    scale = sm_scale * _LOG2E
    wgmma_layout = plgpu.Layout.WGMMA

    def step(i, carry):
        acc, l, m = carry  # [H, R], [R], [R]
        slot = lax.rem(i, stages)
        plgpu.barrier_wait(k_bars.at[slot])

        def qk(s_ref):
            plgpu.wgmma(s_ref, k_smem.at[slot], q_smem.T)
            return s_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((block_k, rows), jnp.float32)) * scale  # [bk, R]
        # Row r = t·G + g (query t of T) sees positions < length - (T-1-t), i.e. pos + #{j in 1..T-1 :
        # r < j·G} < length; padded rows count as the last query, like the Triton kernel's rows.
        pos = plgpu.broadcasted_iota(jnp.int32, (block_k, rows), 0, layout=wgmma_layout)
        pos = pos + (split_start + i * block_k)
        if tokens > 1:
            r = plgpu.broadcasted_iota(jnp.int32, (block_k, rows), 1, layout=wgmma_layout)
            for j in range(1, tokens):
                pos = pos + jnp.where(r < j * group, 1, 0)
        mask = pos < length
        s = jnp.where(mask, s, _NEG)
        m_next = jnp.maximum(m, s.max(axis=0))  # [R]
        correction = jnp.exp2(m - m_next)  # [R]
        p = jnp.where(mask, jnp.exp2(s - lax.broadcast_in_dim(m_next, s.shape, [1])), 0.0)  # [bk, R]
        l = correction * l + p.sum(axis=0)
        pt_smem.T[...] = plgpu.layout_cast(p, plgpu.Layout.WGMMA_TRANSPOSED).astype(pt_smem.dtype)
        plgpu.commit_smem()  # the wgmma reads Pᵀ through the async proxy
        acc = acc * lax.broadcast_in_dim(correction, acc.shape, [1])
        plgpu.barrier_wait(v_bars.at[slot])

        def pv(o_ref):
            plgpu.wgmma(o_ref, v_smem.at[slot].T, pt_smem.T)
            return o_ref[...]

        acc = acc + pl.run_scoped(pv, plgpu.ACC((head_dim, rows), jnp.float32))
        # Both wgmmas are done with this slot (their results were read): refill it.
        pl.when(i + stages < n)(lambda: fetch(i + stages, slot))
        return acc, l, m_next

    init = (
        plgpu.layout_cast(jnp.zeros((head_dim, rows), jnp.float32), wgmma_layout),
        plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), wgmma_layout.reduce(0)),
        plgpu.layout_cast(jnp.full((rows,), _NEG, jnp.float32), wgmma_layout.reduce(0)),
    )
    acc, l, m = lax.fori_loop(0, n, step, init)
    acc_gmem.at[b, h, split].T[...] = plgpu.layout_cast(acc, plgpu.Layout.WGMMA_TRANSPOSED)
    l_gmem.at[b, h, split][...] = l
    m_gmem.at[b, h, split][...] = m * (1 / _LOG2E)


def combine_scratch(rows_out: int, dtype):
    """The SMEM `combine_body` takes: the output rows [C, 64] before their TMA."""
    return (plgpu.SMEM((rows_out, _COLS), dtype),)


def combine_body(
    b,
    h,
    col,
    # GMEM
    acc_gmem,  # [B, K, splits, R, H] f32
    l_gmem,  # [B, K, splits, R] f32
    m_gmem,  # [B, K, splits, R] f32
    o_gmem,  # [B, K, G, H] out
    scratch,  # `combine_scratch`
):
    """One (sequence b, kv head h, 64-column block `col`) program: the splits rescaled to their common
    max and summed in split order, then divided (`combine.combine_partials`)."""
    (o_smem,) = scratch
    rows_out = o_smem.shape[0]  # C: G rounded up to the layout's 8 columns
    group = o_gmem.shape[2]
    splits = acc_gmem.shape[2]
    layout = plgpu.Layout.WGMMA_TRANSPOSED
    cols = pl.ds(col * _COLS, _COLS)
    stat = lambda ref, s: plgpu.load(ref.at[b, h, s, pl.ds(0, rows_out)], layout=layout.reduce(0), optimized=False)
    m = [stat(m_gmem, s) for s in range(splits)]  # [C] each
    m_all = functools.reduce(jnp.maximum, m)
    o = l = None
    for s in range(splits):
        correction = jnp.exp(m[s] - m_all)  # [C]
        acc = plgpu.load(acc_gmem.at[b, h, s, pl.ds(0, rows_out), cols].T, layout=layout, optimized=False)  # [64, C]
        term = lax.broadcast_in_dim(correction, acc.shape, [1]) * acc
        o = term if o is None else o + term
        l = correction * stat(l_gmem, s) if l is None else l + correction * stat(l_gmem, s)
    o = o / lax.broadcast_in_dim(l, o.shape, [1])
    o_smem.T[...] = o.astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, group)], o_gmem.at[b, h, :, cols])
    plgpu.wait_smem_to_gmem(0)


# ---------------------------------------------------------------------------------------------
# plgpu.kernel wrappers


def _outputs(shapes, poison: bool):
    """(out_type, refs): the kernel's outputs, or with poison NaN-filled refs it writes into (plgpu.kernel
    takes no input_output_aliases in jax 0.11; a ref operand is discharged to an aliased output)."""
    if not poison:
        return shapes, ()
    return (), tuple(jax.new_ref(jnp.full(s.shape, jnp.nan, s.dtype)) for s in shapes)


def _sync_setup(q_rows, k, v, splits: int, block_k: int, stages: int, sm_scale: float, group: int, tokens: int):
    """What `sync_call` and `sync_combine_call` share: the checks, the stacks as [L·B, S, K·H] views, the
    program's SMEM, its body and the partials' shapes (acc [B, K, splits, R, H], l, m [B, K, splits, R])."""
    batch, kv_heads, rows, head_dim = q_rows.shape
    cache_len = k.shape[2]
    split_len = cache_len // splits
    if cache_len % (splits * block_k):
        raise ValueError(f"cache length {cache_len} is not a multiple of {splits} splits x block_k={block_k}")
    if block_k % 64 or head_dim % 64 or rows % 8 or not 8 <= rows <= 256:
        raise ValueError(
            f"the mosaic attention takes block_k and H in multiples of 64 (wgmma's M side) and R rows in "
            f"multiples of 8 up to 256 (its N side); got block_k={block_k}, H={head_dim}, R={rows}"
        )
    if not q_rows.dtype == k.dtype == v.dtype or jnp.dtype(k.dtype) not in map(jnp.dtype, (jnp.bfloat16, jnp.float16)):
        raise ValueError(f"the mosaic attention takes bf16 or f16 q and cache alike; got {q_rows.dtype}, {k.dtype}")
    stages = max(1, min(stages, split_len // block_k))
    k, v = (x.reshape(-1, cache_len, kv_heads * head_dim) for x in (k, v))  # [L·B, S, K·H]: a free reshape
    scratch = sync_scratch(rows, head_dim, block_k, stages, k.dtype)
    body = functools.partial(
        sync_body, block_k=block_k, split_len=split_len, sm_scale=sm_scale, group=group, tokens=tokens
    )
    shapes = (
        jax.ShapeDtypeStruct((batch, kv_heads, splits, rows, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((batch, kv_heads, splits, rows), jnp.float32),
        jax.ShapeDtypeStruct((batch, kv_heads, splits, rows), jnp.float32),
    )
    return k, v, scratch, body, shapes


def sync_call(
    layer,
    lengths,
    q_rows,
    k,
    v,
    *,
    splits: int,
    block_k: int,
    stages: int,
    sm_scale: float,
    group: int,
    tokens: int,
    length_offset: int,
    interpret: bool = False,
    poison: bool = False,
):
    """Partials acc [B, K, splits, R, H], l, m [B, K, splits, R] (f32) of the synchronized attention
    over the grid (B, K, splits). layer [] int32; lengths [B] int32 (`length_offset` added in the
    kernel); q_rows [B, K, R, H]; k, v [L, B, S, K, H] read at `layer` in place, S a multiple of
    splits·block_k. poison=True starts the outputs NaN-filled."""
    batch, kv_heads = q_rows.shape[:2]
    k, v, scratch, body, shapes = _sync_setup(q_rows, k, v, splits, block_k, stages, sm_scale, group, tokens)

    def kernel(layer_gmem, len_gmem, *gmem):  # gmem: q, k, v, acc, l, m
        b = lax.axis_index("b")
        scalars = (b, lax.axis_index("h"), lax.axis_index("s"), layer_gmem[0], len_gmem[b] + length_offset)
        pl.run_scoped(lambda *refs: body(*scalars, *gmem, refs), *scratch)

    out_type, refs = _outputs(shapes, poison)
    outs = plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(batch, kv_heads, splits),
        grid_names=("b", "h", "s"),
        **_params(interpret, "decode_attention_sync_mosaic"),
    )(jnp.asarray(layer, jnp.int32).reshape(1), lengths, q_rows, k, v, *refs)
    return tuple(jax.freeze(r) for r in refs) if poison else outs


def _combine_rows_out(group: int, rows: int, head_dim: int) -> int:
    """The combine's output rows C (G rounded up to the layout's 8 columns), after checking that it takes H (in
    64-column blocks) and G (C within the partials' R rows)."""
    rows_out = -(-group // 8) * 8
    if head_dim % _COLS or rows_out > rows:
        raise ValueError(
            f"the mosaic combine takes H in multiples of {_COLS} and G <= R rounded up to 8; got H={head_dim}, "
            f"G={group}, R={rows}"
        )
    return rows_out


def sync_combine_call(
    layer,
    lengths,
    q_rows,
    k,
    v,
    *,
    splits: int,
    block_k: int,
    stages: int,
    sm_scale: float,
    group: int,
    out_dtype,
    length_offset: int,
    interpret: bool = False,
    poison: bool = False,
):
    """o [B, K, G, H] in out_dtype: `sync_call` and `combine_call` for one token as one launch over the grid
    (B, K, splits). Each program writes its split's partials as `sync_call` does; program splits - 1 of
    (b, h) then waits on a global semaphore that every other split of (b, h) signals once its partials are
    written, and combines them (`combine_body`, each 64-column block in turn). One launch fewer per layer:
    the combine is a tail of the kernel, not a kernel of its own.

    The waiting program cannot hold up a program it waits on: the grid's last axis (the split) is CUDA's
    slowest block index, so the other splits of (b, h) come earlier in launch order, and `split_layout`
    keeps the grid within one wave (`BlockSizes.max_programs`). Interpreted (Mosaic GPU's interpreter has no
    GMEM semaphores) the programs run one after another in grid order, so split splits - 1 of (b, h) runs
    after the others and combines without waiting: the same data flow and arithmetic."""
    batch, kv_heads, rows, head_dim = q_rows.shape
    rows_out = _combine_rows_out(group, rows, head_dim)
    k, v, scratch, body, partial_shapes = _sync_setup(q_rows, k, v, splits, block_k, stages, sm_scale, group, 1)

    def kernel(layer_gmem, len_gmem, q_gmem, k_gmem, v_gmem, o_gmem, acc_gmem, l_gmem, m_gmem):
        b, h, s = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
        scalars = (b, h, s, layer_gmem[0], len_gmem[b] + length_offset)
        partials = (acc_gmem, l_gmem, m_gmem)
        pl.run_scoped(lambda *refs: body(*scalars, q_gmem, k_gmem, v_gmem, *partials, refs), *scratch)
        last = s == splits - 1
        if not interpret and splits > 1:
            written = pl.get_global(plgpu.SemaphoreType.REGULAR((batch * kv_heads,)))  # per (b, h)
            fence_global()  # this program's partials, stored by every thread, before the signal

            @pl.when(~last)
            def _():
                pl.semaphore_signal(written.at[b * kv_heads + h], 1)

            @pl.when(last)
            def _():
                pl.semaphore_wait(written.at[b * kv_heads + h], splits - 1)  # back to zero for the next call
                fence_global()

        @pl.when(last)
        def _():
            if not interpret:  # the o GEMM after it may start now (if it waits: `StreamBlocks.pdl`)
                plgpu.griddepcontrol_launch_dependents()
            for col in range(head_dim // _COLS):
                pl.run_scoped(
                    lambda *refs, col=col: combine_body(b, h, col, *partials, o_gmem, refs),
                    *combine_scratch(rows_out, out_dtype),
                )

    shapes = (jax.ShapeDtypeStruct((batch, kv_heads, group, head_dim), out_dtype), *partial_shapes)
    out_type, refs = _outputs(shapes, poison)
    outs = plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(batch, kv_heads, splits),
        grid_names=("b", "h", "s"),
        **_params(interpret, "decode_attention_fused_mosaic"),
    )(jnp.asarray(layer, jnp.int32).reshape(1), lengths, q_rows, k, v, *refs)
    return jax.freeze(refs[0]) if poison else outs[0]


def combine_call(acc, l, m, *, group: int, out_dtype, interpret: bool = False, poison: bool = False):
    """The partials acc [B, K, splits, R, H], l, m [B, K, splits, R] (one token: rows 0..G-1 are the
    heads of a kv head) -> o [B, K, G, H] in out_dtype, over the grid (B, K, H / 64)."""
    batch, kv_heads, splits, rows, head_dim = acc.shape
    rows_out = _combine_rows_out(group, rows, head_dim)

    def kernel(*gmem):  # acc, l, m, o
        if not interpret:  # the o GEMM after it may start now (if it waits: `StreamBlocks.pdl`), to load weights
            plgpu.griddepcontrol_launch_dependents()
        indices = (lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("c"))
        pl.run_scoped(lambda *refs: combine_body(*indices, *gmem, refs), *combine_scratch(rows_out, out_dtype))

    out_type, refs = _outputs((jax.ShapeDtypeStruct((batch, kv_heads, group, head_dim), out_dtype),), poison)
    out = plgpu.kernel(
        kernel,
        out_type=out_type[0] if out_type else (),
        grid=(batch, kv_heads, head_dim // _COLS),
        grid_names=("b", "h", "c"),
        **_params(interpret, "combine_splits_mosaic"),
    )(acc, l, m, *refs)
    return jax.freeze(refs[0]) if poison else out

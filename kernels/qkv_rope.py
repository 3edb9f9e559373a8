"""The q·k·v projection's epilogue as one kernel: sum the GEMM's split partials, add the bias, rotate q
and k (RoPE), lay q out as the attention kernel's rows, and write k and v into the stacked KV cache.

In a looped decode step (one token per sequence), what follows the q·k·v GEMM is a handful of
elementwise work on [B, (N + 2K)·H] values and two single-row cache writes. XLA runs it as three
kernels per layer on the GPU (q's RoPE and row padding, then one in-place write per cache), each a
launch around a few KB, or five at batch 8 (a transpose first, and the writes as scatters).
This kernel does all of it in one launch over (sequence, kv head, role): one program per query
head, one for the key head and one for the value head, each with a few loads before its stores
(the Mosaic GPU kernel takes 8 sequences a program, see below).
On an H200 (Llama-3.1-8B decode) it takes about a third of the time of XLA's three kernels per
layer (see docs/log/). A first version with one program per kv head, its heads one after another,
gained nothing end to end.

Inputs, as `kernels.flat_gemm_stream.stream_partials` leaves them: partials [P, M, (N + 2K)·H] f32
(P slots of tile_n-column tiles, row m the m-th sequence; M may be padded to M8) and which (slot, tile) pairs hold a
partial sum, `written` [P, T]; unwritten slots hold anything (NaN included) and are never added.
Values follow the model (`jaxdecode.model.qkv_attend`) in order of operations: the slots are summed
in f32 and rounded to the cache's dtype (the GEMM's output); the bias is added and rounded; q and
k are rotated in f32 (rotate-half form) and rounded once more. The new rows go to position
positions[b], clamped to [0, S - 1] as `dynamic_update_slice` clamps, of layer `layer` of the stacks,
which are updated in place (outputs aliased to the inputs). q comes back as rows [B, K, R, H]: row
g < G of kv head h is query head h·G + g, rows G..R-1 are zero (`decode_attention_sync_rows` reads it).

Backends (`impl`):
- "triton" (the default): Pallas-Triton, like the attention kernel it feeds; the programs above, one
  warp each, load a few strided columns of the partials and store single rows at data-dependent
  positions of the 5-D stacks. Tested with `interpret=True` on the CPU.
- "mosaic": Mosaic GPU (`plgpu.kernel`, Hopper), one warpgroup per (kv head, role, chunk of 8
  sequences). Its registers hold arrays of whole 128-thread rounds, which a head row is not always
  (SmolLM2: H = 64, and 192 elements for its 3 kv heads), so a program works on [8, H/2] arrays: 8
  sequences are the 8 rows of a partial tile. TMA brings the written slots' tiles [8, H/2] f32
  (rows past M filled with zeros), the cos and sin rows and the bias into shared memory;
  the results are staged as rows in shared memory and leave by TMA, one copy per row. A TMA copy
  takes the cache position as a scalar index, writes a row of any length and is issued by one thread,
  where plain stores would need whole rounds of the warpgroup. The stacks go in as refs
  (`jax.new_ref`), whose discharge aliases each to an output of the call, so they are updated in place
  as with pallas_call's input_output_aliases (plgpu.kernel takes no aliases in jax 0.11). Tested with
  Mosaic GPU's interpreter on the CPU and lowered for CUDA on any host; the compiled test needs Hopper.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as pltriton

from kernels import flat_gemm_stream


def fits(heads: int, kv_heads: int, head_dim: int, tile_n: int, rows: int, *, impl: str = "triton") -> bool:
    """Whether the kernel takes this shape: half a head inside one GEMM tile (so one `written` flag
    covers it), the G query heads within R rows, and a half head of a power of two (Triton's loads) or
    of a multiple of 16 (Mosaic GPU: a [CHUNK, H/2] array is a whole number of 128-thread rounds)."""
    half = head_dim // 2
    return (
        head_dim % 2 == 0
        and (half & (half - 1) == 0 if impl == "triton" else half % 16 == 0)
        and tile_n % half == 0
        and heads % kv_heads == 0
        and heads // kv_heads <= rows
    )


def _kernel(layer_ref, pos_ref, *refs, heads: int, kv_heads: int, tile_n: int, biased: bool, table: bool):
    """One (sequence b, kv head h, role r) program: r < G rotates query head h·G + r into row r of q;
    r = G rotates the key head and writes it into the k stack, and zeroes q's rows G..R-1; r = G + 1
    writes the value head into the v stack. refs: written_ref [P, T] int32 (when `table`; without it every
    slot is written), part_ref [P, M, C] f32, cos_ref, sin_ref [B, H] f32, (bias stacks [L, N·H], [L, K·H],
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
            part = part_ref[p, b, pl.ds(column, half)]
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


CHUNK = 8  # sequences per Mosaic GPU program: the rows of one partial tile, 8 f32 of each column


def _mosaic_body(
    h,  # kv head
    role,  # r < G: query head h·G + r; G: key head h; G + 1: value head h
    chunk,  # sequences [CHUNK·chunk, CHUNK·chunk + CHUNK)
    layer_gmem,  # [1] int32
    pos_gmem,  # [B] int32
    written_gmem,  # [P, T] int32, or None: every slot written
    part_gmem,  # [P, M, C] f32
    cos_gmem,  # [B, H] f32
    sin_gmem,  # [B, H] f32
    bias_gmems,  # () or ([L, N·H], [L, K·H], [L, K·H])
    k_gmem,  # [L, B, S, K, H], written in place
    v_gmem,  # [L, B, S, K, H], written in place
    q_gmem,  # [B, K, R, H]
    scratch,
    *,
    heads: int,
    tile_n: int,
):
    """One head (role) of CHUNK sequences, as a function of refs (a phase of a larger kernel could call it
    with its own indices and scratch). TMA brings the head's partial tiles [CHUNK, H/2] f32 (the written
    slots only), the sequences' cos, sin rows [CHUNK, H] and the bias (one row copy per sequence: the
    registers' strided layout has no broadcast over a leading dimension of fewer than 128 elements) into
    SMEM. Registers hold [CHUNK, H/2] arrays, one element per thread and register; the results are staged
    as rows [CHUNK, H] in SMEM and leave as one TMA copy per row, the cache rows at their data-dependent
    positions."""
    parts_smem, rope_smem, bias_smem, out_smem, zeros_smem, part_bars, rope_bar, bias_bar = scratch
    slots = part_gmem.shape[0]
    batch, cache_len, kv_heads, head_dim = k_gmem.shape[1:]
    rows = q_gmem.shape[2]
    half, group = head_dim // 2, heads // kv_heads
    dtype = k_gmem.dtype
    layer = layer_gmem[0]
    b0 = chunk * CHUNK
    # the head's first column in the partials: q heads, then k heads, then v heads
    head = jnp.where(role < group, h * group + role, jnp.where(role == group, heads + h, heads + kv_heads + h))
    col = head * head_dim

    def if_written(flag, fn):  # fn() where the slot's tile is written (always, without a table)
        if flag is None:
            fn()
        else:
            pl.when(flag)(fn)

    # loads: partial tiles of the written slots (the flag of each half's tile), cos and sin, the bias row
    flags = [[None] * 2 for _ in range(slots)]
    for p in range(slots):
        for j in range(2):
            if written_gmem is not None:
                flags[p][j] = written_gmem[p, lax.div(col + j * half, tile_n)] != 0
            src = part_gmem.at[p, pl.ds(b0, CHUNK), pl.ds(col + j * half, half)]  # rows past M: zeros
            dst = parts_smem.at[p, j]
            if_written(flags[p][j], functools.partial(plgpu.copy_gmem_to_smem, src, dst, part_bars.at[2 * p + j]))
    for i, table in enumerate((cos_gmem, sin_gmem)):  # rows past B: TMA fills them with zeros
        plgpu.copy_gmem_to_smem(table.at[pl.ds(b0, CHUNK)], rope_smem.at[i], rope_bar)
    if bias_gmems:
        for r, (bias_gmem, start) in enumerate(zip(bias_gmems, (h * group + role, h, h))):

            @pl.when(role < group if r == 0 else role == group + r - 1)
            def _():
                # whole SMEM rows: a copy moves a multiple of 128 bytes (the columns past the head are
                # unused, past the end of the stack TMA fills them with zeros)
                src = bias_gmem.at[layer, pl.ds(start * head_dim, bias_smem.shape[1])]
                for i in range(CHUNK):
                    plgpu.copy_gmem_to_smem(src, bias_smem.at[i], bias_bar)

    for p in range(slots):
        for j in range(2):
            if_written(flags[p][j], functools.partial(plgpu.barrier_wait, part_bars.at[2 * p + j]))
    plgpu.barrier_wait(rope_bar)
    if bias_gmems:
        plgpu.barrier_wait(bias_bar)

    strided = plgpu.Layout.WG_STRIDED((CHUNK, half), vec_size=1)
    load = lambda ref: plgpu.load(ref, layout=strided)  # noqa: E731

    def value(j):
        """Half j of the head, [CHUNK, H/2]: the written slots summed in slot order, rounded, plus the bias
        (rounded again), as f32."""
        total = jnp.zeros((CHUNK, half), jnp.float32)
        for p in range(slots):
            part = load(parts_smem.at[p, j])  # [CHUNK, H/2]
            total = total + (part if flags[p][j] is None else jnp.where(flags[p][j], part, 0.0))
        y = total.astype(dtype)
        if bias_gmems:
            bias = load(bias_smem.at[:, pl.ds(j * half, half)])
            y = (y.astype(jnp.float32) + bias.astype(jnp.float32)).astype(dtype)
        return y.astype(jnp.float32)

    lo, hi = value(0), value(1)

    @pl.when(role <= group)
    def _():  # rotate-half: [x_lo, x_hi]·cos + [-x_hi, x_lo]·sin, rounded
        cos_lo, cos_hi = load(rope_smem.at[0, :, pl.ds(0, half)]), load(rope_smem.at[0, :, pl.ds(half, half)])
        sin_lo, sin_hi = load(rope_smem.at[1, :, pl.ds(0, half)]), load(rope_smem.at[1, :, pl.ds(half, half)])
        out_smem[:, pl.ds(0, half)] = (lo * cos_lo + -hi * sin_lo).astype(dtype)
        out_smem[:, pl.ds(half, half)] = (hi * cos_hi + lo * sin_hi).astype(dtype)

    @pl.when(role == group + 1)
    def _():
        out_smem[:, pl.ds(0, half)] = lo.astype(dtype)
        out_smem[:, pl.ds(half, half)] = hi.astype(dtype)

    if zeros_smem is not None:
        zeros_smem[...] = jnp.zeros(zeros_smem.shape, dtype)
    plgpu.commit_smem()

    # stores: one row per sequence; the cache rows at positions clamped as dynamic_update_slice clamps
    for i in range(CHUNK):
        b = b0 + i
        row = out_smem.at[i, pl.ds(0, head_dim)]

        @pl.when((b < batch) & (role < group))
        def _():
            plgpu.copy_smem_to_gmem(row, q_gmem.at[b, h, role])

        @pl.when((b < batch) & (role >= group))
        def _():
            pos = jnp.minimum(jnp.maximum(pos_gmem[b], 0), cache_len - 1)

            @pl.when(role == group)
            def _():
                plgpu.copy_smem_to_gmem(row, k_gmem.at[layer, b, pos, h])
                if zeros_smem is not None:  # q's rows G..R-1
                    src = zeros_smem.at[pl.ds(0, rows - group)]
                    plgpu.copy_smem_to_gmem(src, q_gmem.at[b, h, pl.ds(group, rows - group)])

            @pl.when(role == group + 1)
            def _():
                plgpu.copy_smem_to_gmem(row, v_gmem.at[layer, b, pos, h])

    plgpu.wait_smem_to_gmem(0)


def _mosaic_call(inputs, biases, k_stack, v_stack, q_shape, *, heads, tile_n, interpret, poison):
    """plgpu.kernel over (kv head, role, chunk of sequences). The stacks go in as refs (`jax.new_ref`):
    the kernel writes their rows, and discharging the refs aliases each stack to an output of the call, as
    pallas_call's input_output_aliases does (plgpu.kernel takes no aliases argument in jax 0.11)."""
    layer, positions, written, partials, cos, sin = inputs
    slots, m_rows, _ = partials.shape
    batch, kv_heads, rows, head_dim = q_shape.shape
    group = heads // kv_heads
    dtype = k_stack.dtype
    # a splat stored to SMEM goes as 8-byte vectors from each of 128 threads: whole rounds of them
    round_elems = 128 * max(1, 8 // jnp.dtype(dtype).itemsize)
    zero_unit = round_elems // np.gcd(head_dim, round_elems)

    bias_dtype = biases[0].dtype if biases else dtype

    def padded(dt):  # a row's length in SMEM: TMA copies start at 128-byte aligned addresses and move 128·n bytes
        size = jnp.dtype(dt).itemsize
        return -(-head_dim * size // 128) * 128 // size

    def kernel(*refs):
        *ins, k_ref, v_ref, q_ref = refs
        layer_ref, pos_ref, *ins = ins
        written_ref, ins = (ins[0], ins[1:]) if written is not None else (None, ins)
        part_ref, cos_ref, sin_ref, *bias_refs = ins

        def scoped(*scratch):
            if rows == group:
                scratch = (*scratch[:4], None, *scratch[4:])
            _mosaic_body(
                lax.axis_index("h"),
                lax.axis_index("r"),
                lax.axis_index("c"),
                layer_ref,
                pos_ref,
                written_ref,
                part_ref,
                cos_ref,
                sin_ref,
                tuple(bias_refs),
                k_ref,
                v_ref,
                q_ref,
                scratch,
                heads=heads,
                tile_n=tile_n,
            )

        pl.run_scoped(
            scoped,
            plgpu.SMEM((slots, 2, CHUNK, head_dim // 2), jnp.float32),  # partial tiles
            plgpu.SMEM((2, CHUNK, head_dim), jnp.float32),  # cos, sin
            plgpu.SMEM((CHUNK, padded(bias_dtype)), bias_dtype),  # the bias row, once per sequence
            plgpu.SMEM((CHUNK, padded(dtype)), dtype),  # the rows out
            # q's padding rows, R - G rows rounded up to whole rounds of stores
            *([plgpu.SMEM((-(-(rows - group) // zero_unit) * zero_unit, head_dim), dtype)] if rows > group else []),
            plgpu.Barrier(num_arrivals=1, num_barriers=2 * slots),
            plgpu.Barrier(num_arrivals=2),
            plgpu.Barrier(num_arrivals=CHUNK),
        )

    k_ref, v_ref = jax.new_ref(k_stack), jax.new_ref(v_stack)
    operands = [jnp.asarray(layer, jnp.int32).reshape(1), positions]
    operands += [written] if written is not None else []
    operands += [partials, cos, sin, *biases, k_ref, v_ref]
    q_ref = jax.new_ref(jnp.full(q_shape.shape, jnp.nan, q_shape.dtype)) if poison else None
    q = plgpu.kernel(
        kernel,
        out_type=() if poison else q_shape,
        grid=(kv_heads, group + 2, -(-m_rows // CHUNK)),
        grid_names=("h", "r", "c"),
        # Lane semantics: the arrays' layouts are the explicit strided ones above, not inferred.
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        # The interpreter's GMEM outputs start as NaN, so q's rows show any element left unwritten.
        interpret=plgpu.InterpretGPUParams(uninitialized_memory="nan") if interpret else None,
        kernel_name="qkv_rope_write_mosaic",
    )(*operands, *([q_ref] if poison else []))
    q = jax.freeze(q_ref) if poison else q
    return q, jax.freeze(k_ref), jax.freeze(v_ref)


@functools.partial(jax.jit, static_argnames=("written", "heads", "tile_n", "rows", "impl", "interpret", "poison"))
def _qkv_rope_write(
    partials,
    written,
    cos,
    sin,
    positions,
    k_stack,
    v_stack,
    layer,
    biases,
    *,
    heads,
    tile_n,
    rows,
    impl,
    interpret,
    poison,
):
    written = np.asarray(written, bool).reshape(len(written), -1)
    slots, m_rows, columns = partials.shape
    _, batch, _, kv_heads, head_dim = k_stack.shape
    if k_stack.shape != v_stack.shape or k_stack.dtype != v_stack.dtype:
        raise ValueError(
            f"the k and v stacks must match, got {k_stack.dtype}{list(k_stack.shape)} and "
            f"{v_stack.dtype}{list(v_stack.shape)}"
        )
    if columns != (heads + 2 * kv_heads) * head_dim or m_rows < batch or columns % tile_n:
        raise ValueError(
            f"partials [P, M >= B, (heads + 2K)·H] = [*, >= {batch}, {(heads + 2 * kv_heads) * head_dim}] "
            f"in tiles of {tile_n}, got {list(partials.shape)}"
        )
    if written.shape != (slots, columns // tile_n):
        raise ValueError(f"written must be [P, T] = [{slots}, {columns // tile_n}], got {list(written.shape)}")
    if cos.shape != (batch, head_dim) or sin.shape != cos.shape or positions.shape != (batch,):
        raise ValueError(
            f"cos, sin must be [B, H] = [{batch}, {head_dim}] and positions [B]; got {list(cos.shape)}, "
            f"{list(sin.shape)}, {list(positions.shape)}"
        )
    if impl not in ("triton", "mosaic"):
        raise ValueError(f"impl must be 'triton' or 'mosaic', got {impl!r}")
    if not fits(heads, kv_heads, head_dim, tile_n, rows, impl=impl):
        raise ValueError(
            f"qkv_rope_write takes half heads inside one tile of {tile_n} columns, a half head of a power "
            f"of two (triton) or a multiple of 16 (mosaic) and G <= rows; got heads={heads}, K={kv_heads}, "
            f"H={head_dim}, rows={rows}, impl={impl}"
        )
    if len(biases) not in (0, 3):
        raise ValueError(f"biases must be () or three stacks (q, k, v), got {len(biases)}")
    table = not written.all()
    q_shape = jax.ShapeDtypeStruct((batch, kv_heads, rows, head_dim), k_stack.dtype)
    # both kernels' inputs: layer, positions, the table of written slots (None: every slot written), ...
    head = (
        jnp.asarray(layer, jnp.int32),
        positions.astype(jnp.int32),
        jnp.asarray(written, jnp.int32) if table else None,
        partials,
        cos.astype(jnp.float32),
        sin.astype(jnp.float32),
    )
    if impl == "mosaic":
        return _mosaic_call(
            head, biases, k_stack, v_stack, q_shape, heads=heads, tile_n=tile_n, interpret=interpret, poison=poison
        )
    body = functools.partial(_kernel, heads=heads, kv_heads=kv_heads, tile_n=tile_n, biased=bool(biases), table=table)
    whole = pl.BlockSpec()
    inputs = [a for a in head if a is not None] + [*biases, k_stack, v_stack]
    in_specs = [pl.BlockSpec((), lambda b, h, r: ())] + [whole] * (len(inputs) - 1)
    q_spec = pl.BlockSpec((None, None, rows, head_dim), lambda b, h, r: (b, h, 0, 0))
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
    impl: str = "triton",
    interpret: bool = False,
    poison: bool = False,
):
    """(q_rows [B, K, rows, H], k_stack, v_stack): see the module docstring.

    partials [P, M, (heads + 2K)·H] f32 (row b: sequence b; M >= B); written [P, T] (a host array
    of bools, T = columns / tile_n: a static property of the GEMM's schedule); cos, sin [B, H] f32 (the
    token's angles, halves repeated); positions [B] int32; k_stack, v_stack [L, B, S, K, H] (updated in
    place); layer an int32 scalar; biases () or the three stacks [L, heads·H], [L, K·H], [L, K·H].
    impl: "triton" (Pallas-Triton) or "mosaic" (Mosaic GPU, Hopper); see the module docstring.
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
        impl=impl,
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
    y = flat_gemm_stream.sum_written(partials, written, tile_n, batch).astype(dtype)  # [B, C]
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

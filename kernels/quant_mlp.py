"""A decoder layer's MLP at decode, down(silu(x·gate) · (x·up)), as one persistent Mosaic GPU kernel over
quantized stacks: kernel looping inside the kernel, for the MLP block.

Why one kernel. Each GEMM launch pays a fixed cost that no streaming rate recovers: its pipeline fills
from HBM's latency, its last units drain through the conversion, and the partial sums leave through a
combine kernel (plus SwiGLU's elementwise kernel) before the next launch can start filling again. Here
the down projection's weights need nothing from the gate/up phase, so the memory warpgroup starts
streaming them while the gate/up phase drains; only down's x (h = silu(g)·u) waits.

Two phases in one grid of C CTAs (one per SM, all resident: a CTA takes ~220 KiB of shared memory), each
laid out as `kernels.quant_gemm_stream` lays out one call (units of tile_n weight rows by tile_k columns,
tile-major, C contiguous equal runs), through one TMA pipeline whose ring of stages runs on across the
phase boundary:
- phase A, gate and up (tiles of gate first, then of up): each compute warpgroup adds its partial sum of
  a tile's rows into an f32 accumulator gu [2F, M8] in HBM with a TMA reduce-add, and, once its stores
  are complete, signals the tile's counter (a GMEM semaphore) for its rows;
- the fixups: h's column block j (tile_k columns, which are gate tile j and up tile j when tile_n =
  tile_k) belongs to CTA j mod C. Each of its compute warpgroups waits for its rows' counters of both
  tiles, loads g and u, forms silu(g)·u in f32, rounds it to x's dtype (as the model rounds h) and stores
  it to h [M8, F] transposed (a strided read of the staged rows), then signals block j ready;
- phase B, down: the memory warpgroup issues down's weight copies into free stages as soon as the
  stages free up, and each unit's x copy (h's columns of its k-step) up to stages - 1 units later, after
  waiting for that block's ready semaphore; down's partial sums add into y [D, M8] f32 the same way.
Nothing waits in a cycle: phase A waits on no other CTA, a fixup waits on phase A only, phase B on
fixups only. The conversion, scaling and wgmma of a unit are `quant_gemm_stream`'s scale_in="w" path
(codes scaled and offset in x's dtype, one f32 accumulator); gate and up take `gate_up_feed`'s int4
feed, down the natural-order "shuffle" feed (h is made here, in its natural order).

Status: exact in Mosaic GPU's interpreter (one CTA), and compiled on an H200 on 1, 4 and 132 CTAs (M 1
and 8; each group's wgmma completes before the next group's conversion: `mma_from_registers`). Slower
than the two launches it replaces (docs/kernels.md), so not in the default hook table.

Mosaic GPU's interpreter has no GMEM semaphores: interpreted, the kernel runs on one CTA, whose own
fixups are awaited through a shared-memory barrier instead (the data flow and arithmetic are the same;
the cross-CTA signalling is tested compiled, on Hopper).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels import flat_gemm_stream, quant_gemm
from kernels.grid_sync import fence_global
from kernels.quant_feeds import relabel_as_wgmma
from kernels.quant_gemm import UntiledShape, code_bits, load_width, mma_from_registers, permute_k, smem_transforms
from kernels.quant_gemm_stream import copy_weight_unit

MAX_M = 8  # batch rows: the fixup's h block [M8, 64] per warpgroup and the accumulators are sized for M8 = 8
TILE = 256  # weight rows per unit (4 compute warpgroups of 64) = h's columns per fixup block = down's tile_k
WGS = 4


@dataclasses.dataclass(frozen=True)
class QuantMLPBlocks:
    """Tunables. ctas=None: one CTA per SM of the device."""

    stages: int = 4  # units in flight per CTA (>= 2); cut to what fits in smem_bytes
    gate_up_feed: str = "relabel"  # int4 gate/up: "relabel" (x permuted once in the wrapper) or "shuffle"
    ctas: int | None = None
    smem_bytes: int = 220 * 1024


@dataclasses.dataclass(frozen=True)
class _Phase:
    sched: flat_gemm_stream.Schedule
    feed: str  # "relabel", "shuffle" (int4) or "int8"


@dataclasses.dataclass(frozen=True)
class _Layout:
    a: _Phase  # gate, up
    b: _Phase  # down
    group: int
    stages: int
    arrays: int  # per weight: codes, scales (, offsets)
    ctas: int
    interpret: bool

    @property
    def gw(self) -> int:  # columns of one group inside a unit
        return min(self.group, TILE)


def fixup_count(c, blocks: int, ctas: int):
    """How many of h's blocks CTA c finishes: blocks c, c + C, ... below `blocks` (none when c >= blocks).
    The select matters: lax.div truncates toward zero, so (blocks - 1 - c) // C + 1 alone gives a CTA past
    the last block one block, whose semaphores do not exist (this hung every grid wider than the blocks)."""
    return lax.select(c < blocks, lax.div(blocks - 1 - c, ctas) + 1, 0)


def _kernel(layer_gmem, x_gmem, *refs, lay: _Layout):
    """One CTA: its run of gate/up units, its fixup blocks, its run of down units. Compiled, the
    semaphores are global (shared by every CTA; scratch semaphores would be each CTA's own) and persist
    across calls: every signal of a call is waited off (decremented) within the call, so each call
    finds them at zero."""
    if lay.interpret:
        return _body(layer_gmem, x_gmem, *refs, None, None, lay=lay)
    tiles_g = lay.a.sched.tiles[0]
    counters = pl.get_global(plgpu.SemaphoreType.REGULAR((2 * tiles_g * WGS,)))  # per gate/up tile, warpgroup
    ready = pl.get_global(plgpu.SemaphoreType.REGULAR((tiles_g,)))  # per h block
    return _body(layer_gmem, x_gmem, *refs, counters, ready, lay=lay)


def _body(layer_gmem, x_gmem, *refs, lay: _Layout):
    n_in = 3 * lay.arrays
    gate, up, down = (refs[i : i + lay.arrays] for i in range(0, n_in, lay.arrays))
    gu_acc, y_acc, h_gmem = refs[n_in : n_in + 3]  # aliased accumulators (zeros) and the h output
    *scratch, counters, ready = refs[n_in + 3 :]  # semaphores (None interpreted)
    x_smem, c_smem, *group_smems, out_smem, h_smem, produced, consumed, loaded = scratch[: 7 + lay.arrays - 1]
    if lay.interpret:
        fixed, w_stage = scratch[7 + lay.arrays - 1 :]  # the one CTA's fixups done; the wgmma LHS staging
    m8 = x_smem.shape[1]
    cdt = x_gmem.dtype
    rows = TILE // WGS
    bits = code_bits(c_smem.dtype)
    cw = load_width(lay.gw, bits)
    upcast = plgpu.Layout.WGMMA_UPCAST_4X if bits == 4 else plgpu.Layout.WGMMA_UPCAST_2X
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    layer = layer_gmem[0]
    c = lax.axis_index("c")
    wg = lax.axis_index("wg")
    stages = lay.stages
    a, b = lay.a.sched, lay.b.sched
    tiles_g = a.tiles[0]  # gate tiles = up tiles = h blocks

    def run(sched):  # this CTA's units [u0, u1) of a phase and their count (0 for a CTA past its units)
        u0 = c * sched.units_per_cta
        u1 = lax.min(u0 + sched.units_per_cta, sched.units)
        return u0, u1, lax.max(u1 - u0, 0)

    a0, a1, na = run(a)
    b0, b1, nb = run(b)
    total = na + nb

    def unit_of(s):  # global step s -> (phase, unit)
        return s < na, lax.select(s < na, a0 + s, b0 + s - na)

    # ---- memory warpgroup

    def issue_weights(s, slot):
        in_a, u = unit_of(s)

        def copy(phase_weights, sched, u):
            t, kk = lax.div(u, sched.ks), lax.rem(u, sched.ks)
            tile = (TILE, TILE, lay.group)
            copy_weight_unit(phase_weights, sched.tiles, t, kk, layer, tile, c_smem, group_smems, slot, produced)

        @pl.when(in_a)
        def _():
            copy((gate, up), a, u)

        @pl.when(jnp.logical_not(in_a))
        def _():
            copy((down,), b, u)

    def issue_x_a(s):
        kk = lax.rem(a0 + s, a.ks)
        src = x_gmem.at[pl.ds(0, m8), pl.ds(kk * TILE, TILE)]  # rows past M: TMA's out-of-bounds zeros
        plgpu.copy_gmem_to_smem(src, x_smem.at[lax.rem(s, stages)], produced.at[lax.rem(s, stages)])

    def issue_x_b(s):
        kk = lax.rem(b0 + s - na, b.ks)  # down's k-step = h's block
        if lay.interpret:

            @pl.when(s == na)
            def _():
                plgpu.barrier_wait(fixed.at[0])  # the one CTA's fixups are all done
        else:
            pl.semaphore_wait(ready.at[kk], WGS)  # one x copy per down unit
            fence_global()
        src = h_gmem.at[:, pl.ds(kk * TILE, TILE)]
        plgpu.copy_gmem_to_smem(src, x_smem.at[lax.rem(s, stages)], produced.at[lax.rem(s, stages)])

    lag = stages - 1  # down's x copies trail its weight copies by this many steps (they wait on fixups)

    @pl.when(wg == WGS)
    def _memory():
        def step(s, carry):
            slot = lax.rem(s, stages)

            # first: a compute warpgroup releases unit s - stages once unit s - stages + 1 = s - lag is issued
            @pl.when(s - lag >= na)
            def _():
                issue_x_b(s - lag)

            @pl.when(s >= stages)
            def _():
                plgpu.barrier_wait(consumed.at[slot])  # unit s - stages is done with the slot

            issue_weights(s, slot)

            @pl.when(s < na)
            def _():
                issue_x_a(s)

            return carry

        lax.fori_loop(0, total, step, None)
        lax.fori_loop(lax.max(na, total - lag), total, lambda s, carry: (issue_x_b(s), carry)[1], None)
        # observe the last consumption of every slot (Mosaic GPU's interpreter checks that a waiter saw each phase)
        lax.fori_loop(
            lax.max(total - stages, 0),
            total,
            lambda s, cr: (plgpu.barrier_wait(consumed.at[lax.rem(s, stages)]), cr)[1],
            None,
        )

    # ---- compute warpgroups

    offsets = len(group_smems) > 1

    def convert(chunk, feed):  # codes [rows, cw] in their upcast layout -> x's dtype, the wgmma operand
        if feed == "relabel":
            return permute_k(chunk.astype(cdt)) if lay.interpret else relabel_as_wgmma(chunk.astype(cdt))
        return plgpu.layout_cast(chunk, plgpu.Layout.WGMMA).astype(cdt)

    def per_row(slot, r0, g, which):  # scales (0) or offsets (1) of the unit's group g: [rows] in x's dtype
        grow = g if lay.group <= TILE else 0
        return plgpu.load(group_smems[which].at[slot, grow, pl.ds(r0, rows)], layout=row_layout).astype(cdt)

    def unit(s, acc, r0, feed, first):  # acc += this warpgroup's rows of step s; releases step s - 1's stage
        slot = lax.rem(s, stages)
        plgpu.barrier_wait(produced.at[slot])
        c_rows = c_smem.at[slot, pl.ds(r0, rows)]
        gw = lay.gw
        for ci in range(TILE // cw):
            chunk = convert(plgpu.load(c_rows.at[:, pl.ds(ci * cw, cw)], layout=upcast), feed)
            for gj in range(cw // gw):
                g = ci * (cw // gw) + gj
                w = chunk[:, gj * gw : (gj + 1) * gw]
                w = w * lax.broadcast_in_dim(per_row(slot, r0, g, 0), w.shape, [0])
                if offsets:
                    w = w + lax.broadcast_in_dim(per_row(slot, r0, g, 1), w.shape, [0])
                x_t = x_smem.at[slot, :, pl.ds(g * gw, gw)].T
                mma_from_registers(acc, w, x_t, lay.interpret, w_stage.at[wg] if lay.interpret else None)  # completes
        # unit s's wgmmas are done; its stage is released with the next unit's (or at the segment's end)

        @pl.when(s > first)
        def _():
            plgpu.barrier_arrive(consumed.at[lax.rem(s - 1, stages)])

    def phase(sched, feed, u0, u1, n, s_base, acc_gmem):
        """This warpgroup's segments of one phase (steps s_base + 0..n-1): each tile's partial sum added
        into acc_gmem by a TMA reduce-add. Returns the count of segments."""
        r0 = wg * rows
        t_first = lax.div(u0, sched.ks)
        segments = lax.select(n > 0, lax.div(u1 - 1, sched.ks) - t_first + 1, 0)

        def segment(i, carry):
            j_start, flushes = carry
            t = t_first + i
            j_end = lax.min((t + 1) * sched.ks, u1) - u0

            def body(acc):
                lax.fori_loop(
                    j_start, j_end, lambda j, cr: (unit(s_base + j, acc, r0, feed, s_base + j_start), cr)[1], None
                )  # every unit's wgmmas complete on return
                plgpu.barrier_arrive(consumed.at[lax.rem(s_base + j_end - 1, stages)])
                return acc[...]

            part = pl.run_scoped(body, plgpu.ACC((rows, m8), jnp.float32))  # [rows, M8]
            buf = lax.rem(flushes, 2)
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the flush two back has left buf
            out_smem.at[wg, buf][...] = part
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                out_smem.at[wg, buf],
                acc_gmem.at[pl.ds(t * TILE + r0, rows)],
                reduction_op=None if lay.interpret else "add",
            )
            return j_end, flushes + 1

        lax.fori_loop(0, segments, segment, (jnp.int32(0), jnp.int32(0)))  # (first step, flushes so far)
        return segments

    def signal_tiles(sched, u0, segments):  # every reduce-add of this warpgroup is complete: count them
        t_first = lax.div(u0, sched.ks)

        def one(i, carry):
            pl.semaphore_signal(counters.at[(t_first + i) * WGS + wg], 1)
            return carry

        lax.fori_loop(0, segments, one, None)

    def covering(sched, t):  # how many CTAs' runs cover tile t (each signals once per warpgroup)
        first = lax.div(t * sched.ks, sched.units_per_cta)
        last = lax.div((t + 1) * sched.ks - 1, sched.units_per_cta)
        return last - first + 1

    def fixup(j):  # h[:, j·TILE + r0 : + rows] = silu(g) · u of this warpgroup's rows of block j
        r0 = wg * rows
        if not lay.interpret:
            pl.semaphore_wait(counters.at[j * WGS + wg], covering(a, j))
            pl.semaphore_wait(counters.at[(tiles_g + j) * WGS + wg], covering(a, tiles_g + j))
            fence_global()
        for k, t in enumerate((j, tiles_g + j)):
            plgpu.copy_gmem_to_smem(gu_acc.at[pl.ds(t * TILE + r0, rows)], out_smem.at[wg, k], loaded.at[wg])
        plgpu.barrier_wait(loaded.at[wg])
        strided = plgpu.Layout.WG_STRIDED((m8, rows), vec_size=1)
        g = plgpu.load(out_smem.at[wg, 0].T, layout=strided)  # [M8, rows] f32
        u = plgpu.load(out_smem.at[wg, 1].T, layout=strided)
        h_smem.at[wg][...] = (g / (1.0 + jnp.exp(-g)) * u).astype(h_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(h_smem.at[wg], h_gmem.at[:, pl.ds(j * TILE + r0, rows)])
        plgpu.wait_smem_to_gmem(0)
        if not lay.interpret:
            fence_global()
            pl.semaphore_signal(ready.at[j], b.tiles[0])  # one for each down unit of block j

    @pl.when(wg < WGS)
    def _compute():
        seg_a = phase(a, lay.a.feed, a0, a1, na, 0, gu_acc)
        plgpu.wait_smem_to_gmem(0)  # the gate/up reduce-adds are complete (and out_smem is free)
        if not lay.interpret:
            fence_global()
            signal_tiles(a, a0, seg_a)
        blocks = fixup_count(c, tiles_g, lay.ctas)
        lax.fori_loop(0, blocks, lambda i, carry: (fixup(c + i * lay.ctas), carry)[1], None)
        if lay.interpret:
            plgpu.barrier_arrive(fixed.at[0])
        phase(b, lay.b.feed, b0, b1, nb, na, y_acc)
        plgpu.wait_smem_to_gmem(0)


# ---------------------------------------------------------------------------------------------
# Wrapper


def _check(x, gate, up, down, group: int, cfg: QuantMLPBlocks) -> None:
    m, d = x.shape
    for name, w in (("gate", gate), ("up", up), ("down", down)):
        h = jax.ShapeDtypeStruct((m, w[0].shape[-1]), x.dtype)  # down's input: only its shape is read
        quant_gemm.check_shapes(x if name != "down" else h, *w, group, None)
    kinds = {tuple(None if a is None else a.dtype for a in w) for w in (gate, up, down)}
    if len(kinds) != 1:
        raise UntiledShape(f"gate, up and down must share their codes', scales' and offsets' dtypes, got {kinds}")
    f = gate[0].shape[-2]
    if up[0].shape[-2] != f or down[0].shape[-2] != d or down[0].shape[-1] != f:
        raise UntiledShape(
            f"gate {gate[0].shape}, up {up[0].shape} and down {down[0].shape} codes do not make an MLP on D={d}"
        )
    if x.dtype not in quant_gemm.X_DTYPES:
        raise UntiledShape(f"the kernel takes bf16 or f16 x, got {x.dtype}")
    if m > MAX_M:
        raise UntiledShape(f"the fused MLP takes M <= {MAX_M}, got M={m}")
    if d % TILE or f % TILE:
        raise UntiledShape(f"D={d} and F={f} must be multiples of {TILE}")
    if group % 32 or TILE % min(group, TILE) or (group > TILE and group % TILE):
        raise UntiledShape(f"group size {group} must be a multiple of 32 that tiles {TILE} columns")
    if cfg.gate_up_feed not in ("relabel", "shuffle"):
        raise UntiledShape(f"gate_up_feed must be 'relabel' or 'shuffle', got {cfg.gate_up_feed!r}")


@functools.partial(jax.jit, static_argnames=("group", "block_sizes", "permuted_codes", "interpret"))
def quant_mlp(
    x: jax.Array,  # [M, D]
    gate,  # (codes [L, F, D], scales [L, D/G, F], offsets or None)
    up,
    down,  # (codes [L, D, F], scales [L, F/G, D], offsets or None)
    layer: jax.Array | int,
    *,
    group: int,
    block_sizes: QuantMLPBlocks = QuantMLPBlocks(),
    permuted_codes: bool = False,
    interpret: bool = False,
):
    """down(silu(x·gate) · (x·up)) for layer `layer` of quantized stacks, one kernel launch: [M, D] in x's dtype.
    permuted_codes: int4 codes stored in `quant_gemm.permute_k` order (as `jaxdecode.quantized` keeps them).

    Equivalent to the following JAX code, up to the kernel's rounding of each scaled weight to x's dtype
    and its f32 sums in another order (h is rounded to x's dtype, as the model rounds it):

      g, u = (quant_gemm.quant_gemm_reference(x, *w, layer, group=group, out_dtype=jnp.float32) for w in (gate, up))
      h = (jax.nn.silu(g) * u).astype(x.dtype)
      quant_gemm.quant_gemm_reference(h, *down, layer, group=group)
    """
    return quant_mlp_stages(
        x,
        gate,
        up,
        down,
        layer,
        group=group,
        block_sizes=block_sizes,
        permuted_codes=permuted_codes,
        interpret=interpret,
    )[0]


@functools.partial(jax.jit, static_argnames=("group", "block_sizes", "permuted_codes", "interpret"))
def quant_mlp_stages(
    x: jax.Array,  # [M, D]
    gate,  # (codes [L, F, D], scales [L, D/G, F], offsets or None)
    up,
    down,  # (codes [L, D, F], scales [L, F/G, D], offsets or None)
    layer: jax.Array | int,
    *,
    group: int,
    block_sizes: QuantMLPBlocks = QuantMLPBlocks(),
    permuted_codes: bool = False,
    interpret: bool = False,
):
    """`quant_mlp`'s launch, with what each phase left in HBM: (y [M, D] in x's dtype, h [M, F] in x's
    dtype, gate's and up's f32 sums [M, 2F]), so a test can tell which phase went wrong."""
    gate, up, down = (tuple(w) for w in (gate, up, down))
    _check(x, gate, up, down, group, block_sizes)
    m, d = x.shape
    f = gate[0].shape[-2]
    m8 = 8
    bits = code_bits(gate[0].dtype)
    arrays = 2 if gate[2] is None else 3
    ctas = 1 if interpret else (block_sizes.ctas or flat_gemm_stream.default_ctas())
    blocks = flat_gemm_stream.StreamBlocks(tile_n=TILE, tile_k=TILE)
    sched_a = flat_gemm_stream.schedule(d, (f, f), blocks, ctas)
    sched_b = flat_gemm_stream.schedule(f, (d,), blocks, ctas)
    groupwise = [a for a in gate[1:] if a is not None]
    group_rows = max(1, TILE // group)
    stage_bytes = TILE * (m8 * x.dtype.itemsize + TILE * bits // 8)
    stage_bytes += sum(group_rows * TILE * a.dtype.itemsize for a in groupwise)
    fixed_bytes = WGS * 2 * (TILE // WGS) * m8 * 4 + WGS * m8 * (TILE // WGS) * x.dtype.itemsize
    fit = (block_sizes.smem_bytes - fixed_bytes) // stage_bytes
    if fit < 2:
        raise UntiledShape(f"two stages of {stage_bytes} bytes do not fit in smem_bytes={block_sizes.smem_bytes}")
    stages = max(2, min(block_sizes.stages, fit))
    if permuted_codes and bits == 8:
        raise UntiledShape("permuted_codes applies to int4 codes only")
    feed_a = "int8" if bits == 8 else block_sizes.gate_up_feed
    # down's x is h, made in the kernel in its own order: stored-permuted codes are relabelled back
    feed_b = "int8" if bits == 8 else "relabel" if permuted_codes else "shuffle"
    lay = _Layout(_Phase(sched_a, feed_a), _Phase(sched_b, feed_b), group, stages, arrays, ctas, interpret)
    x_in = permute_k(x) if (feed_a == "relabel") != permuted_codes else x
    if not flat_gemm_stream.tma_reads_unpadded(m):
        x_in = jnp.pad(x_in, ((0, m8 - m), (0, 0)))
    gu_acc = jax.new_ref(jnp.zeros((2 * f, m8), jnp.float32))
    y_acc = jax.new_ref(jnp.zeros((d, m8), jnp.float32))
    cw = load_width(min(group, TILE), bits)
    scratch = [
        plgpu.SMEM((stages, m8, TILE), x.dtype, transforms=smem_transforms(min(group, TILE), 16)),
        plgpu.SMEM((stages, TILE, TILE), gate[0].dtype, transforms=smem_transforms(cw, bits)),
        *(plgpu.SMEM((stages, group_rows, TILE), a.dtype) for a in groupwise),
        plgpu.SMEM((WGS, 2, TILE // WGS, m8), jnp.float32),  # flush double buffer; the fixup's g and u
        plgpu.SMEM((WGS, m8, TILE // WGS), x.dtype),  # the fixup's h block
        plgpu.Barrier(num_arrivals=1 + arrays, num_barriers=stages),  # produced: x and the weight's arrays
        plgpu.Barrier(num_arrivals=WGS, num_barriers=stages),  # consumed
        plgpu.Barrier(num_arrivals=2, num_barriers=WGS),  # loaded: a fixup's g and u rows
    ]
    if interpret:
        scratch += [
            plgpu.Barrier(num_arrivals=WGS, num_barriers=1),  # fixed: the one CTA's fixups
            plgpu.SMEM((WGS, TILE // WGS, min(group, TILE)), x.dtype),  # the interpreter's wgmma LHS
        ]
    h = plgpu.kernel(
        functools.partial(_kernel, lay=lay),
        out_type=jax.ShapeDtypeStruct((m8, f), x.dtype),
        scratch_types=tuple(scratch),
        grid=(ctas,),
        grid_names=("c",),
        num_threads=WGS + 1,
        thread_name="wg",
        kernel_name="quant_mlp",
        interpret=plgpu.InterpretGPUParams(uninitialized_memory="nan") if interpret else None,
    )(
        jnp.asarray(layer, jnp.int32).reshape(1),
        x_in,
        *(a for w in (gate, up, down) for a in w if a is not None),
        gu_acc,
        y_acc,
    )
    return y_acc[...][:, :m].T.astype(x.dtype), h[:m], gu_acc[...][:, :m].T

"""The quantized MLP as one launch in which each CTA owns columns of h: gate/up, SwiGLU and down with no wait
on another CTA (`quant_mlp_owned`).

Why. A quantized GEMM launch pays a fixed cost that no streaming rate recovers (the first burst's latency, the
last stages' compute, launch and teardown; docs/kernels.md), and the MLP is two GEMM launches plus SwiGLU's and
down's combine kernels. `kernels.quant_mlp` ran it as one launch of two Stream-K phases, and measured slower
than the launches it replaced: every down unit needs an h block that needs gate/up partials from every CTA that
covers it, so down waits on the slowest CTA through semaphores in HBM. Here nothing crosses CTAs until y: CTA c
owns h blocks c, c + C, ... of BLOCK = 128 columns, and for each
  - phase A: gate's and up's BLOCK rows of the block over all of D (D / 128 units of [256 rows, 128 columns]:
    gate's rows, then up's), into f32 accumulators in registers: no split-K, so no partials;
  - SwiGLU: h = silu(g) · u from the accumulators (up's warpgroups hand theirs over in SMEM), rounded to x's
    dtype as the model rounds it, then to int8 per row over the block (one group of down's K), in SMEM;
  - phase B: down's rows against the block (D / 256 units of [256 rows, 128 columns]), each unit's [256, M]
    f32 product added into y in HBM by a TMA reduce-add.
One ring of weight stages carries both phases, so the memory warpgroup streams down's weights while gate/up
drains (they do not depend on h). Every product is an s8 wgmma: x rounded to int8 per row and group of 128 as
`kernels.quant_gemm_stream`'s "s8" feed rounds it (each CTA rounds all of x once, while its first weights
land, x's 64-row chunks streaming through two staging slots), int4 codes + 8 (`quant_feeds.s8_as_wgmma`) or int8
codes straight from SMEM, scaled per unit in f32.

The cost is balance: F / 128 blocks over C CTAs (112 blocks for Llama-3.1-8B's 14336 on 132 SMs: 20 idle;
224 for 70B's 28672: 92 CTAs do two), against the launches and combines it removes, which are most of what an
int4 MLP loses against its bytes; whether fewer SMs still saturate HBM decides it. y's adds arrive in no fixed
order, so its f32 sums can differ in the last bits from call to call.

Takes G = 128 (gate's and up's groups along D, down's along F), D a multiple of 256, F of 128, M <= 8, int4 codes
stored in `quant_gemm.permute_k` order (as `jaxdecode.quantized` keeps them) or int8 codes, one format for all
three weights. Tested through Mosaic GPU's interpreter (whose TMA has no reduce-add: there each block writes
a slot of its own, summed after the call) and lowered for CUDA on any host; the compiled test needs Hopper.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels import flat_gemm_stream
from kernels.quant_feeds import S8_BIAS, permute_s8, round_rows_to_s8, s8_as_wgmma
from kernels.quant_gemm import (
    UntiledShape,
    check_shapes,
    code_bits,
    mma_from_registers,
    mma_from_smem,
    smem_transforms,
)
from kernels.quant_gemm_stream import quant_gemm_s8_reference

BLOCK = 128  # h columns a CTA owns at a time: one group of down's K, so h rounds to int8 inside the CTA
GROUP = 128  # the one group size taken, along D (gate, up) and F (down)
WGS = 4  # compute warpgroups: 64 rows of a unit each (gate 0-1 and up 2-3 in phase A)
UNIT_ROWS = WGS * 64  # weight rows per unit
MAX_M = 8  # batch rows: wgmma's narrowest N


@dataclasses.dataclass(frozen=True)
class OwnedMLPBlocks:
    """Tunables. ctas=None: one CTA per SM of the device."""

    stages: int = 6  # units in flight per CTA (>= 2); cut to what fits in smem_bytes
    ctas: int | None = None
    smem_bytes: int = 220 * 1024  # H200: 227 KiB per block


@dataclasses.dataclass(frozen=True)
class _Layout:
    d: int  # x's width (gate's and up's K, down's N)
    f: int  # h's width
    m8: int  # x's rows padded to 8
    ctas: int
    stages: int
    bits: int  # codes' bits
    offsets: bool
    interpret: bool

    @property
    def blocks(self) -> int:  # h blocks
        return self.f // BLOCK

    @property
    def ka(self) -> int:  # phase A units of a block: one group of x each
        return self.d // GROUP

    @property
    def kb(self) -> int:  # phase B units of a block: 256 of down's rows each
        return self.d // UNIT_ROWS

    @property
    def x_rows(self) -> int:  # rows (group, m) of the rounded x, whole 64-row chunks
        return -(-self.ka * self.m8 // 64) * 64

    @property
    def x_chunks(self) -> int:  # 64-row chunks of x, each copied into a staging slot and rounded by a warpgroup
        return self.x_rows // 64

    @property
    def x_slots(self) -> int:  # staging slots x's chunks cycle through: x as copied never needs to fit whole
        return min(2, self.x_chunks)

    @property
    def consts(self) -> int:  # per-row constants of rounded activations: scale, bias term (, Σx for offsets)
        return 2 + self.offsets


def owned_blocks(c, blocks: int, ctas: int):
    """How many h blocks CTA c owns: blocks c, c + C, ... below `blocks` (none when c >= blocks; lax.div
    truncates toward zero, so the select is needed)."""
    return lax.select(c < blocks, lax.div(blocks - 1 - c, ctas) + 1, 0)


def _kernel(layer_gmem, x_gmem, *refs, lay: _Layout):
    arrays = 2 + lay.offsets
    gate, up, down = (refs[i : i + arrays] for i in range(0, 3 * arrays, arrays))
    y_gmem, *scratch = refs[3 * arrays :]  # [D, M8] f32 (reduce-added) or, interpreted, [blocks, D, M8]
    w_stage = scratch.pop() if lay.interpret else None  # [WGS, 64, 128] int8: the interpreter's wgmma LHS
    xs_smem, xq_smem, xc_smem, c_smem, *group_smems = scratch[: 4 + arrays - 1]
    u_smem, hs_smem, hq_smem, hc_smem, out_smem = scratch[4 + arrays - 1 : 9 + arrays - 1]
    produced, consumed, x_ready, x_free, xq_ready, u_ready, h_stored, h_ready, b_done = scratch[9 + arrays - 1 :]
    m8, bits, stages = lay.m8, lay.bits, lay.stages
    cdt = x_gmem.dtype
    upcast = plgpu.Layout.WGMMA_UPCAST_4X
    row_layout = plgpu.Layout.WGMMA.reduce(1)  # a [64] vector along the accumulator's rows
    col_layout = plgpu.Layout.WGMMA.reduce(0)  # an [M8] vector along its columns
    layer = layer_gmem[0]
    c = lax.axis_index("c")
    wg = lax.axis_index("wg")
    owned = owned_blocks(c, lay.blocks, lay.ctas)
    per_block = lay.ka + lay.kb
    total = owned * per_block  # this CTA's units

    # ---- memory warpgroup: x once, then every unit's weights through the ring

    def issue(s, slot):
        i, r = lax.div(s, per_block), lax.rem(s, per_block)
        blk = c + i * lay.ctas

        @pl.when(r < lay.ka)
        def _():  # phase A: gate's then up's rows of the block, x's group r
            for half, (codes, *groupwise) in enumerate((gate, up)):
                rows = pl.ds(blk * BLOCK, BLOCK)
                plgpu.copy_gmem_to_smem(
                    codes.at[layer, rows, pl.ds(r * GROUP, GROUP)], c_smem.at[slot, half], produced.at[slot]
                )
                for a, a_smem in zip(groupwise, group_smems):
                    plgpu.copy_gmem_to_smem(a.at[layer, pl.ds(r, 1), rows], a_smem.at[slot, half], produced.at[slot])

        @pl.when(r >= lay.ka)
        def _():  # phase B: down's rows t·256.. against the block (down's group blk)
            t = r - lay.ka
            codes, *groupwise = down
            for half in range(2):
                rows = pl.ds(t * UNIT_ROWS + half * BLOCK, BLOCK)
                plgpu.copy_gmem_to_smem(
                    codes.at[layer, rows, pl.ds(blk * BLOCK, BLOCK)], c_smem.at[slot, half], produced.at[slot]
                )
                for a, a_smem in zip(groupwise, group_smems):
                    plgpu.copy_gmem_to_smem(a.at[layer, pl.ds(blk, 1), rows], a_smem.at[slot, half], produced.at[slot])

    per_chunk = 64 // m8  # x's groups in a 64-row chunk

    def issue_x_chunk(ch):  # x's groups of chunk ch as rows (group, m); rows past M: TMA's out-of-bounds zeros
        for j in range(per_chunk):
            kk = min(ch * per_chunk + j, lay.ka - 1)  # past the last group: it again, rounded and never read
            src = x_gmem.at[pl.ds(0, m8), pl.ds(kk * GROUP, GROUP)]
            plgpu.copy_gmem_to_smem(src, xs_smem.at[ch % lay.x_slots, pl.ds(j * m8, m8)], x_ready.at[ch])

    @pl.when(wg == WGS)
    def _memory():
        @pl.when(total > 0)
        def _():
            for ch in range(lay.x_slots):
                issue_x_chunk(ch)

        lax.fori_loop(0, lax.min(total, stages), lambda s, carry: (issue(s, s), carry)[1], None)

        @pl.when(total > 0)
        def _():
            for ch in range(lay.x_slots, lay.x_chunks):  # once a warpgroup has rounded the chunk in the slot
                plgpu.barrier_wait(x_free.at[ch % lay.x_slots])
                issue_x_chunk(ch)
            if lay.interpret:  # the slots' last releases, seen by their waiter
                for ch in range(max(lay.x_chunks - lay.x_slots, 0), lay.x_chunks):
                    plgpu.barrier_wait(x_free.at[ch % lay.x_slots])

        def refill(s, carry):
            slot = lax.rem(s, stages)
            plgpu.barrier_wait(consumed.at[slot])  # every compute warpgroup is done with unit s - stages
            issue(s, slot)
            return carry

        lax.fori_loop(stages, total, refill, None)
        if lay.interpret:  # Mosaic GPU's interpreter wants every phase of a barrier seen by all that wait on it
            drain = lambda s, carry: (plgpu.barrier_wait(consumed.at[lax.rem(s, stages)]), carry)[1]  # noqa: E731
            lax.fori_loop(lax.max(total - stages, 0), total, drain, None)

    # ---- compute warpgroups

    def round_x():  # the CTA's x, all its groups, 64 rows (group, m) per chunk and warpgroup
        for ch in range(lay.x_chunks):

            @pl.when(wg == ch % WGS)
            def _():
                plgpu.barrier_wait(x_ready.at[ch])
                src = xs_smem.at[ch % lay.x_slots]
                round_rows_to_s8(src, xq_smem, xc_smem, pl.ds(ch * 64, 64), bits=bits, interpret=lay.interpret)
                plgpu.barrier_arrive(x_free.at[ch % lay.x_slots])  # its values are in registers now

        @pl.when(wg == 0)
        def _():  # h's staging rows past M8 stay zero for every block
            hs_smem[...] = plgpu.layout_cast(jnp.zeros(hs_smem.shape, cdt), plgpu.Layout.WGMMA)

        plgpu.commit_smem()  # the rounded x, visible to wgmma (the async proxy)
        plgpu.barrier_arrive(xq_ready)
        plgpu.barrier_wait(xq_ready)  # every compute warpgroup's chunks

    half, r_off = lax.div(wg, 2), lax.rem(wg, 2) * 64  # this warpgroup's 64 rows of a unit's [2, 128] halves

    def unit(s, x_t, x_consts, total_):
        """total_ [64, M8] f32 + this warpgroup's rows of unit s against x_t [128, M8] (int8, SMEM), whose
        constants are the [M8] refs x_consts."""
        slot = lax.rem(s, stages)
        plgpu.barrier_wait(produced.at[slot])
        codes = c_smem.at[slot, half, pl.ds(r_off, 64)]  # [64, 128]

        def scope(acc):  # (codes + 8)ᵀ · xqᵀ for int4, codesᵀ · xqᵀ for int8, complete on return
            if bits == 8:
                mma_from_smem(acc, codes, x_t)
            else:
                w = plgpu.load(codes, layout=upcast)
                w = permute_s8(w.astype(jnp.int8) + S8_BIAS) if lay.interpret else s8_as_wgmma(w)
                mma_from_registers(acc, w, x_t, lay.interpret, w_stage.at[wg] if lay.interpret else None)
            per_row = [plgpu.load(a.at[slot, half, 0, pl.ds(r_off, 64)], layout=row_layout) for a in group_smems]
            xc = [plgpu.load(r, layout=col_layout) for r in x_consts]
            return acc[...], [v.astype(jnp.float32) for v in per_row], xc

        part, (scales, *offs), xc = pl.run_scoped(scope, plgpu.ACC((64, m8), jnp.int32))
        plgpu.barrier_arrive(consumed.at[slot])  # the scales are in registers now
        cols = lambda v: lax.broadcast_in_dim(v, (64, m8), [1])  # noqa: E731
        dot = part.astype(jnp.float32) * cols(xc[0]) + cols(xc[1])  # s_x · Σ (c + 8) xq - 8 s_x Σ xq
        total_ = total_ + dot * lax.broadcast_in_dim(scales, dot.shape, [0])
        if offs:
            total_ = total_ + cols(xc[2]) * lax.broadcast_in_dim(offs[0], dot.shape, [0])
        return total_

    def consts_of(ref, rows):  # the rounded activations' constants of `rows`: [M8] refs
        return [ref.at[i, rows] for i in range(lay.consts)]

    def swiglu(i, sums):
        """h of block i from this warpgroup's sums (gate's rows in warpgroups 0-1, up's in 2-3), rounded to int8
        into hq_smem and hc_smem; every compute warpgroup returns once they are ready."""

        @pl.when(wg >= 2)
        def _():
            u_smem.at[wg - 2][...] = sums  # up's rows, for the gate warpgroup of the same columns
            plgpu.barrier_arrive(u_ready)

        @pl.when(wg < 2)
        def _():
            plgpu.barrier_wait(u_ready)
            u = plgpu.load(u_smem.at[wg], layout=plgpu.Layout.WGMMA)
            h = (sums / (1.0 + jnp.exp(-sums)) * u).astype(cdt)  # [64 columns of h, M8], the model's rounding

            @pl.when(i > 0)
            def _():
                plgpu.barrier_wait(b_done)  # every warpgroup is done with the last block's h

            for w in range(2):  # static column offsets into the staging rows

                @pl.when(wg == w)
                def _():
                    staged = hs_smem.at[pl.ds(0, m8), pl.ds(w * 64, 64)]  # [M8, 64]
                    staged.T[...] = plgpu.layout_cast(h.astype(jnp.float32), plgpu.Layout.WGMMA_TRANSPOSED).astype(cdt)

            plgpu.barrier_arrive(h_stored)

        @pl.when(wg == 0)
        def _():
            plgpu.barrier_wait(h_stored)  # both halves
            round_rows_to_s8(hs_smem, hq_smem, hc_smem, pl.ds(0, 64), bits=bits, interpret=lay.interpret)
            plgpu.commit_smem()
            plgpu.barrier_arrive(h_ready)

        plgpu.barrier_wait(h_ready)

    @pl.when((wg < WGS) & (total > 0))
    def _compute():
        round_x()
        zeros = plgpu.layout_cast(jnp.zeros((64, m8), jnp.float32), plgpu.Layout.WGMMA)

        def block(i, carry):
            blk = c + i * lay.ctas
            s0 = i * per_block

            def unit_a(kk, total_):
                rows = pl.ds(kk * m8, m8)
                x_t = xq_smem.at[rows].T
                return unit(s0 + kk, x_t, consts_of(xc_smem, rows), total_)

            swiglu(i, lax.fori_loop(0, lay.ka, unit_a, zeros))
            h_t = hq_smem.at[pl.ds(0, m8)].T
            h_consts = consts_of(hc_smem, pl.ds(0, m8))

            def unit_b(t, flushes):
                part = unit(s0 + lay.ka + t, h_t, h_consts, zeros)  # [64, M8]: rows t·256 + wg·64 of y
                buf = lax.rem(flushes, 2)
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the flush two back has left buf
                out_smem.at[wg, buf][...] = part
                plgpu.commit_smem()
                rows = pl.ds(t * UNIT_ROWS + wg * 64, 64)
                if lay.interpret:
                    plgpu.copy_smem_to_gmem(out_smem.at[wg, buf], y_gmem.at[blk, rows])
                else:
                    plgpu.copy_smem_to_gmem(out_smem.at[wg, buf], y_gmem.at[rows], reduction_op="add")
                return flushes + 1

            flushes = lax.fori_loop(0, lay.kb, unit_b, carry)
            plgpu.barrier_arrive(b_done)  # this warpgroup's wgmmas on h are complete
            return flushes

        lax.fori_loop(0, owned, block, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)
        if lay.interpret:  # the last block's b_done, seen by its waiters

            @pl.when(wg < 2)
            def _():
                plgpu.barrier_wait(b_done)


# ---------------------------------------------------------------------------------------------
# Wrapper


def _check(x, gate, up, down, group: int) -> None:
    """ValueError (shapes that disagree) or UntiledShape (what the kernel does not take), with the numbers."""
    m, d = x.shape
    f = gate[0].shape[-2]
    for name, w, k in (("gate", gate, d), ("up", up, d), ("down", down, f)):
        xk = jax.ShapeDtypeStruct((m, k), x.dtype)
        try:
            check_shapes(xk, *w, group, None)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    if up[0].shape != gate[0].shape or down[0].shape[-2:] != (d, f):
        raise ValueError(f"gate {gate[0].shape}, up {up[0].shape} and down {down[0].shape} disagree with x {x.shape}")
    formats = {tuple(None if a is None else a.dtype for a in w) for w in (gate, up, down)}
    if len(formats) > 1:
        raise UntiledShape(f"gate, up and down must share their codes', scales' and offsets' dtypes, got {formats}")
    if x.dtype not in (jnp.bfloat16, jnp.float16):
        raise UntiledShape(f"the kernel takes bf16 or f16 x, got {x.dtype}")
    if m > MAX_M:
        raise UntiledShape(f"the owned MLP takes M <= {MAX_M}, got M={m}")
    if group != GROUP:
        raise UntiledShape(f"the owned MLP takes groups of {GROUP}, got G={group}")
    if d % UNIT_ROWS or f % BLOCK:
        raise UntiledShape(f"D={d} must be a multiple of {UNIT_ROWS} and F={f} of {BLOCK}")


def _smem_bytes(refs) -> int:
    """Bytes of SMEM refs (int4 at half a byte), as their shapes say: the stages that fit follow from them."""
    bits = lambda dt: (jnp.iinfo if jnp.issubdtype(dt, jnp.integer) else jnp.finfo)(dt).bits  # noqa: E731
    return sum(math.prod(r.shape) * bits(r.dtype) // 8 for r in refs)


def _fixed_smem(lay: _Layout, x_dtype) -> tuple[list, list]:
    """The SMEM of x's rounding and of h: (what comes before the stages, what comes after them)."""
    x_part = [
        plgpu.SMEM((lay.x_slots, 64, GROUP), x_dtype, transforms=smem_transforms(GROUP, 16)),  # x's chunks as copied
        plgpu.SMEM((lay.x_rows, GROUP), jnp.int8, transforms=smem_transforms(GROUP, 8)),  # x rounded
        plgpu.SMEM((lay.consts, lay.x_rows), jnp.float32),  # its constants
    ]
    h_part = [
        plgpu.SMEM((2, 64, lay.m8), jnp.float32),  # up's rows, handed to gate's warpgroups
        plgpu.SMEM((64, BLOCK), x_dtype, transforms=smem_transforms(BLOCK, 16)),  # h as rows m (zero past M8)
        plgpu.SMEM((64, BLOCK), jnp.int8, transforms=smem_transforms(BLOCK, 8)),  # h rounded
        plgpu.SMEM((lay.consts, 64), jnp.float32),  # its constants
        plgpu.SMEM((WGS, 2, 64, lay.m8), jnp.float32),  # each warpgroup's y flushes, double-buffered
    ]
    return x_part, h_part


def _stage_smem(stages: int, codes_dtype, groupwise_dtypes) -> list:
    """The ring: per stage a unit's codes [2, 128, 128] and its scales (offsets) [2, 1, 128]."""
    bits = jnp.iinfo(codes_dtype).bits
    return [
        plgpu.SMEM((stages, 2, BLOCK, GROUP), codes_dtype, transforms=smem_transforms(GROUP, bits)),
        *(plgpu.SMEM((stages, 2, 1, BLOCK), dt) for dt in groupwise_dtypes),
    ]


@functools.partial(jax.jit, static_argnames=("group", "block_sizes", "interpret"))
def quant_mlp_owned(
    x: jax.Array,  # [M, D]
    gate,  # (codes [L, F, D], scales [L, D/G, F], offsets or None)
    up,
    down,  # (codes [L, D, F], scales [L, F/G, D], offsets or None)
    layer: jax.Array | int,
    *,
    group: int,
    block_sizes: OwnedMLPBlocks = OwnedMLPBlocks(),
    interpret: bool = False,
) -> jax.Array:
    """down(silu(x·gate) · (x·up)) of layer `layer` of quantized stacks in one launch: y [M, D] f32. int4 codes
    are taken in `quant_gemm.permute_k` order (as `jaxdecode.quantized` stores them), int8 codes in K order.

    Equivalent, up to the order of its f32 sums, to `quant_mlp_owned_reference` of the same weights with int4
    codes in their own order."""
    gate, up, down = (tuple(w) for w in (gate, up, down))
    _check(x, gate, up, down, group)
    m, d = x.shape
    f = gate[0].shape[-2]
    m8 = -(-m // 8) * 8
    ctas = block_sizes.ctas or flat_gemm_stream.default_ctas()
    offsets = gate[2] is not None
    bits = code_bits(gate[0].dtype)
    lay = _Layout(d, f, m8, ctas, block_sizes.stages, bits, offsets, interpret)
    x_part, h_part = _fixed_smem(lay, x.dtype)
    lhs = [plgpu.SMEM((WGS, 64, GROUP), jnp.int8)] if interpret else []  # the interpreter's wgmma LHS: SMEM only
    groupwise = [a.dtype for a in gate[1:] if a is not None]
    fixed_bytes = _smem_bytes(x_part + h_part + lhs)
    stage_bytes = _smem_bytes(_stage_smem(1, gate[0].dtype, groupwise))
    fit = (block_sizes.smem_bytes - fixed_bytes) // stage_bytes
    if fit < 2:
        raise UntiledShape(
            f"two stages of {stage_bytes} bytes do not fit in smem_bytes={block_sizes.smem_bytes} beside "
            f"{fixed_bytes} bytes of x and h at D={d}, M={m}"
        )
    lay = dataclasses.replace(lay, stages=max(2, min(block_sizes.stages, fit)))
    arrays = 2 + offsets
    barriers = [
        plgpu.Barrier(num_arrivals=2 * arrays, num_barriers=lay.stages),  # produced: two halves of each array
        plgpu.Barrier(num_arrivals=WGS, num_barriers=lay.stages),  # consumed
        plgpu.Barrier(num_arrivals=64 // m8, num_barriers=lay.x_chunks),  # x's chunk copied
        plgpu.Barrier(num_arrivals=1, num_barriers=lay.x_slots),  # x's staging slot free again
        plgpu.Barrier(num_arrivals=WGS),  # x rounded
        plgpu.Barrier(num_arrivals=2),  # up's rows handed over
        plgpu.Barrier(num_arrivals=2),  # h staged
        plgpu.Barrier(num_arrivals=1),  # h rounded
        plgpu.Barrier(num_arrivals=WGS),  # a block's down units done
    ]
    scratch = [*x_part, *_stage_smem(lay.stages, gate[0].dtype, groupwise), *h_part, *barriers, *lhs]
    x_in = x if flat_gemm_stream.tma_reads_unpadded(m) else jnp.pad(x, ((0, m8 - m), (0, 0)))
    ins = (jnp.asarray(layer, jnp.int32).reshape(1), x_in, *(a for w in (gate, up, down) for a in w if a is not None))
    kernel = functools.partial(
        plgpu.kernel,
        functools.partial(_kernel, lay=lay),
        scratch_types=tuple(scratch),
        grid=(ctas,),
        grid_names=("c",),
        num_threads=WGS + 1,
        thread_name="wg",
        kernel_name="quant_mlp_owned",
    )
    if interpret:  # no TMA reduce-add there: each block writes its own slot
        slots = kernel(
            out_type=jax.ShapeDtypeStruct((lay.blocks, d, m8), jnp.float32),
            interpret=plgpu.InterpretGPUParams(uninitialized_memory="nan"),
        )(*ins)
        return slots.sum(axis=0)[:, :m].T
    y = jax.new_ref(jnp.zeros((d, m8), jnp.float32))
    kernel(out_type=())(*ins, y)
    return y[...][:, :m].T


def quant_mlp_owned_reference(x, gate, up, down, layer, *, group: int) -> jax.Array:
    """What `quant_mlp_owned` computes, in f32 XLA ops: each GEMM as the s8 feed computes it
    (`quant_gemm_stream.quant_gemm_s8_reference`: x rounded to int8 per row and group), h = silu(g)·u rounded
    to x's dtype. Codes in their own K order; returns y [M, D] f32."""
    g, u = (quant_gemm_s8_reference(x, *w, layer, group=group) for w in (gate, up))
    h = (g / (1.0 + jnp.exp(-g)) * u).astype(x.dtype)
    return quant_gemm_s8_reference(h, *down, layer, group=group)

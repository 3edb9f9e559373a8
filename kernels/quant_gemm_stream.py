"""Stream-K flat GEMM over several quantized stacked weights, warp-specialized: the quantized decode GEMM.

The weights are `kernels.quant_gemm`'s format (codes [L, N, K] int4 / int8, scales and optional
offsets [L, K/G, N]; w = scales · codes + offsets) and the work is `kernels.flat_gemm_stream`'s:
units (tile t of tile_n weight rows, k-step) laid out tile-major over all the weights of one call
(q, k and v; gate and up; or one weight), each of C CTAs (C = the SM count) taking one contiguous,
equal run of units through one pipeline that never restarts, and writing a tile's partial sum
(batch-major, [M, tile_n] f32) to one of P slots where its run crosses the tile's end. The schedule and the
partials are `flat_gemm_stream`'s (`Schedule`, `combine`), so `kernels.qkv_rope`'s epilogue takes
the quantized q·k·v partials as it takes the bf16 ones.

Why a second design. The tile-per-CTA quantized kernel (`kernels/quant_gemm.py`) reads int4 codes at
about 43% of the read ceiling: one warpgroup per CTA waits on each TMA stage, converts the codes in
registers, waits on its wgmma, and only then releases the stage; the conversion and the waits sit
on one instruction stream per SM, and N / tile_n tiles leave the last wave part empty. Here a CTA
has a memory warpgroup that only issues TMA copies, `stages` units ahead, and 1 to 4 compute
warpgroups that each take 64 of a unit's rows (the wgmma M side), so several conversion streams run
while the copies for later units are in flight, and every SM works to the end of the call. Per group of
G columns a compute warpgroup loads its codes from SMEM in the layout Mosaic GPU upcasts from
(WGMMA_UPCAST_4X / 2X), converts them to x's dtype (exact) and feeds them to wgmma as the LHS:
yᵀ[rows, M8] += Wᵀ[rows, G] · xᵀ[G, M8]. The scales go one of two ways (`QuantStreamBlocks.scale_in`):
- "w": scaled and offset in registers (w = c · s + o, rounded to x's dtype), one accumulator;
- "acc": each group's product in an accumulator of its own, scaled by the group's f32 scales once per
  unit (exact); offsets times the group's Σx, which one more wgmma with an all-ones LHS gives.
A stage is released (a `consumed` barrier every compute warpgroup arrives on) once its wgmmas are done.
With int8 activations (feed "s8", the default where it applies: `resolve_blocks`) a CTA first rounds the x
of the k-steps it covers into SMEM, once, and each group's product is an s8 wgmma into an int32 accumulator,
scaled in f32 ("Int8 activations" below).
`QuantStreamBlocks.resolved` picks the placement and tile per format, from measurements (docs/kernels.md).

All weights of one call share K, G and the dtypes of their codes, scales and offsets (or have none). A weight
may carry two levels of scales (`kernels.superblocks`: the GGUF K-quants' int8 per group and float16 per
super-block of 256): each unit's stage then holds its groups' rows of the four arrays, and a compute warpgroup
multiplies the levels in f32 per group as it takes the group's scale and offset into registers.
Tested on the CPU through Mosaic GPU's interpreter, and lowered for CUDA on any host; compiled on Hopper.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels import flat_gemm_stream, quant_gemm, superblocks
from kernels.quant_feeds import (
    BIAS_BITS,
    S8_BIAS,
    biased_as_wgmma,
    permute_pairs,
    permute_s8,
    quantize_activations,
    relabel_as_wgmma,
    round_rows_to_s8,
    s8_as_wgmma,
)
from kernels.quant_gemm import (
    UntiledShape,
    code_bits,
    load_width,
    mma_from_registers,
    mma_from_smem,
    permute_k,
    smem_transforms,
    tile_k_fits,
)

MAX_M = 64  # batch rows: the x tile and the accumulators grow with M8 (prefill goes elsewhere)


@dataclasses.dataclass(frozen=True)
class QuantStreamBlocks:
    """Tunables. ctas=None: one CTA per SM of the device (132 on an H200)."""

    tile_n: int | None = None  # weight rows per unit, 64 per compute warpgroup; None: see `resolved`
    tile_k: int = 256  # reduction depth per unit: a multiple of G, or a divisor of it
    stages: int = 4  # units in flight per CTA (>= 2); cut to what fits in smem_bytes
    # units whose copies are issued and not yet landed, per CTA, at most; None: 2 for int4 codes, `stages` for int8
    # (`resolved`). With fewer outstanding a CTA's units land spread out rather than in one burst, which measured
    # faster for int4 launches and not for int8's (docs/kernels.md)
    in_flight: int | None = None
    compute_wgs: int | None = None  # 1 to 4 warpgroups converting codes and issuing wgmma; None: tile_n / 64
    # "acc": each group's codes · x into an accumulator of its own, scaled (and its offset times the group's
    # Σx added) in f32 per unit; "w": codes scaled and offset in registers, in x's dtype, one accumulator;
    # "auto": "w" for weights with offsets, "acc" otherwise (the faster of the two for each on an H200)
    scale_in: str = "auto"
    # int4 codes into wgmma's register operand: "biased" (bias + code in x's dtype by one lop3 per pair of
    # codes, columns in `permute_pairs` order; the bias comes off on the accumulators: scale_in="acc"),
    # "relabel" (Mosaic GPU's exact conversion, x's K order permuted within 32-column blocks so the upcast
    # registers are the operand as they are, `permute_k`), "shuffle" (Mosaic GPU's conversion and its
    # relayout: two warp shuffles and a byte permute per register) or "s8" (int8 activations: x rounded to
    # int8 per group inside the kernel, as `quantize_activations` does; codes + 8 as s8 by a lop3 per four
    # codes, an s8 wgmma into an int32 accumulator per group, scaled per unit; G a multiple of 128 dividing
    # tile_k, M8 dividing 64, codes in `permute_k` order or x permuted to it) or "auto" ("s8" where it
    # applies, else "relabel": `resolved`)
    int4_feed: str = "auto"
    # int8 codes: "s8" (x rounded to int8 inside the kernel as for int4; the codes go from SMEM straight into an
    # s8 wgmma, no conversion), "convert" (16-bit x, codes converted in registers) or "auto" (s8 where it applies)
    int8_feed: str = "auto"
    ctas: int | None = None
    smem_bytes: int = 220 * 1024  # H200: 227 KiB per block
    pdl: bool = False  # programmatic dependent launch: as `flat_gemm_stream.StreamBlocks.pdl`
    # a directory: Mosaic GPU's in-kernel profiler writes there a trace of the kernel's named regions (the
    # waits, units and flushes of every warpgroup of every CTA) at the call's first run; a diagnostic whose
    # buffer takes shared memory (`benchmarks/kernel_timeline.py` reads it)
    trace_dir: str = ""

    def resolved(self, ns, has_offsets: bool, bits: int = 4, s8_fits: bool = False) -> QuantStreamBlocks:
        """These blocks for weights of widths `ns` and codes of `bits`. int4_feed / int8_feed "auto": "s8" where
        `s8_fits` (the call's G, M and shared memory take it: `resolve_blocks` asks), else "relabel" / "convert".
        scale_in "auto": "acc" for biased and s8 int4 codes, else "w" for weights with offsets and "acc"
        otherwise; tile_n=None: the widest tile that divides every width, up to 256 rows under "w" and s8
        (four compute warpgroups: converting, scaling and offsetting int4 codes is what bounds it) and 128
        under "acc" (two: more measured slower); compute_wgs=None: one warpgroup per 64 rows; in_flight=None: 2 for
        int4 codes, unbounded (the ring's `stages`) for int8."""
        feed = ("s8" if s8_fits else "relabel") if self.int4_feed == "auto" else self.int4_feed
        feed8 = ("s8" if s8_fits else "convert") if self.int8_feed == "auto" else self.int8_feed
        biased = bits == 4 and feed == "biased"
        s8 = bits == 4 and feed == "s8"
        auto = "acc" if biased or s8 or not has_offsets else "w"
        scale_in = auto if self.scale_in == "auto" else self.scale_in
        widest = (256, 128) if scale_in == "w" or s8 else (128,)
        tile_n = self.tile_n or next((t for t in widest if all(n % t == 0 for n in ns)), 64)
        return dataclasses.replace(
            self,
            tile_n=tile_n,
            compute_wgs=self.compute_wgs or tile_n // 64,
            scale_in=scale_in,
            int4_feed=feed,
            int8_feed=feed8,
            in_flight=self.in_flight if self.in_flight is not None else (2 if bits == 4 else None),
        )

    def feed_for(self, bits: int) -> str:
        """The feed field that applies to codes of `bits`: int4_feed or int8_feed."""
        return self.int4_feed if bits == 4 else self.int8_feed

    def gemm_blocks(self) -> flat_gemm_stream.StreamBlocks:
        """The same units as `flat_gemm_stream` lays them out (its `schedule` and `combine` apply)."""
        return flat_gemm_stream.StreamBlocks(tile_n=self.tile_n, tile_k=self.tile_k, ctas=self.ctas)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The static shape of one call, derived once in the wrapper."""

    sched: flat_gemm_stream.Schedule
    tile_n: int
    tile_k: int
    group: int
    stages: int
    wgs: int
    groupwise: tuple[str, ...]  # the roles of a weight's arrays after its codes: "scales"(, "offsets")(, "super_...")
    scale_in: str
    feed: str  # int4 codes: "biased", "relabel", "shuffle" (x permuted to match); int8: "int8"; either: "s8"
    bias: int  # what a biased int4 code carries on top of its value (0 unless feed == "biased")
    m8: int  # x's rows padded to 8
    in_flight_asked: int | None = None  # `QuantStreamBlocks.in_flight` once resolved (None: no bound)
    pdl: bool = False  # weights first, then griddepcontrol.wait, then x (`flat_gemm_stream.pdl_prologue`)
    super_group: int = 0  # K per super-block of two-level scales (`kernels.superblocks`); 0: one level

    @property
    def in_flight(self) -> int:  # units whose copies are issued and not yet landed, at most: the ring's stages or fewer
        return self.stages if self.in_flight_asked is None else min(self.in_flight_asked, self.stages)

    @property
    def trace_regions(self) -> int:  # regions a warpgroup enters in one call, at most: two per unit and a few
        return 4 * self.sched.units_per_cta + 16

    @property
    def ks_held(self) -> int:  # s8: the k-steps of one CTA's units (consecutive, modulo ks), whose x it rounds
        return min(self.sched.units_per_cta, self.sched.ks)

    @property
    def x_rows(self) -> int:  # s8: rows (group, m) of the CTA's rounded x, whole 64-row chunks
        return -(-self.ks_held * self.group_rows * self.m8 // 64) * 64

    @property
    def gw(self) -> int:  # columns of one group inside a unit
        return min(self.group, self.tile_k)

    @property
    def group_rows(self) -> int:  # rows of the scales (offsets) tile: the unit's groups, or its one group
        return max(1, self.tile_k // self.group)

    @property
    def arrays(self) -> int:  # arrays per weight: the codes and the groupwise ones
        return 1 + len(self.groupwise)

    def rows_of(self, role: str) -> int:  # rows of an array's tile in a stage
        per = superblocks.values_per_row(role, self.group, self.super_group)
        return max(1, self.tile_k // per)


# ---------------------------------------------------------------------------------------------
# The kernel


def copy_weight_unit(weights, tiles, t, kk, layer, tile, c_smem, group_smems, slot, barrier, groups=None):
    """Start the TMA copies of one unit into stage `slot`, arriving on barrier[slot]: tile t of `weights`
    (each (codes [L, N, K], scales(, offsets) [L, K/G, N]) with `tiles` tiles, laid out tile-major), k-step
    kk; its codes [tile_n, tile_k] and the rows of its groups' scales (offsets). tile = (tile_n, tile_k, G);
    `groups`: K per row of each array after the codes, where they differ from G (two-level scales)."""
    tile_n, tile_k, group = tile
    ksl = pl.ds(kk * tile_k, tile_k)

    def rows(per):  # the rows of an array of one row per `per` values of K that the unit covers
        count = max(1, tile_k // per)
        return pl.ds(lax.div(kk * tile_k, per * count) * count, count)

    starts = np.cumsum((0,) + tuple(tiles))  # first tile of each weight
    for i, (codes, *groupwise) in enumerate(weights):

        @pl.when((t >= starts[i]) & (t < starts[i + 1]))
        def _():
            nsl = pl.ds((t - starts[i]) * tile_n, tile_n)
            plgpu.copy_gmem_to_smem(codes.at[layer, nsl, ksl], c_smem.at[slot], barrier.at[slot])
            for a, a_smem, per in zip(groupwise, group_smems, groups or [group] * len(groupwise)):
                plgpu.copy_gmem_to_smem(a.at[layer, rows(per), nsl], a_smem.at[slot], barrier.at[slot])


def _kernel(layer_gmem, x_gmem, *refs, lay: _Layout, interpret: bool):
    """One CTA: units [c·R, min((c+1)·R, U)); warpgroups 0..wgs-1 compute, warpgroup `wgs` copies."""
    sched = lay.sched
    s8 = lay.feed == "s8"
    n_w = len(sched.tiles) * lay.arrays
    weights = [refs[i : i + lay.arrays] for i in range(0, n_w, lay.arrays)]  # (codes, scales(, offsets)) each
    o_gmem, *scratch = refs[n_w:]
    w_stage = scratch.pop() if interpret else None  # [wgs, rows, gw]: the interpreter's wgmma LHS (SMEM only)
    if s8:  # x of the CTA's k-steps as copied [x_rows, G], rounded [x_rows, G] int8, constants [C, x_rows]
        xs_smem, xq_smem, xc_smem, c_smem, *group_smems, out_smem, produced, consumed, x_ready, xq_ready = scratch
        x_smem = None
    else:  # x per stage [stages, M8, tile_k]
        x_smem, c_smem, *group_smems, out_smem, produced, consumed = scratch
    m8 = lay.m8
    cdt = x_gmem.dtype
    tile_n, tile_k, gw, wgs = lay.tile_n, lay.tile_k, lay.gw, lay.wgs
    rows = tile_n // wgs  # rows of a unit per compute warpgroup
    bits = code_bits(c_smem.dtype)
    cw = load_width(gw, bits)  # codes columns per SMEM load: whole swizzle tiles
    upcast = plgpu.Layout.WGMMA_UPCAST_4X if bits == 4 else plgpu.Layout.WGMMA_UPCAST_2X
    row_layout = plgpu.Layout.WGMMA.reduce(1)  # a [rows] vector along the accumulator's rows
    ks, per_cta = sched.ks, sched.units_per_cta
    layer = layer_gmem[0]
    c = lax.axis_index("c")
    wg = lax.axis_index("wg")
    u0 = c * per_cta
    u1 = lax.min(u0 + per_cta, sched.units)
    nsteps = u1 - u0
    kk0 = lax.rem(u0, ks)  # s8: the first k-step the CTA holds; its units' k-steps follow modulo ks

    def held_group(j, g):  # s8: the row block (of M8 rows) of group g of the unit of local step j
        return lax.rem(lax.rem(u0 + j, ks) - kk0 + ks, ks) * lay.group_rows + g

    def issue_x(j, slot):  # copy x's part of the unit of local step j into `slot`
        if s8:  # the CTA's x once, at its first unit: each group of each held k-step as rows (group, m)
            if j == 0:
                for jk in range(lay.ks_held):
                    kk = lax.rem(kk0 + jk, ks)
                    for g in range(lay.group_rows):
                        src = x_gmem.at[pl.ds(0, m8), pl.ds(kk * tile_k + g * lay.group, lay.group)]
                        dst = xs_smem.at[pl.ds((jk * lay.group_rows + g) * m8, m8)]
                        plgpu.copy_gmem_to_smem(src, dst, x_ready)  # rows past M: zeros (out of bounds)
            return
        kk = lax.rem(u0 + j, ks)
        # x has M rows; the tile has M8: TMA fills the rows past M with zeros (out of bounds)
        src = x_gmem.at[pl.ds(0, m8), pl.ds(kk * tile_k, tile_k)]
        plgpu.copy_gmem_to_smem(src, x_smem.at[slot], produced.at[slot])

    def issue_weights(j, slot):  # the weight's arrays of the unit of local step j into `slot`
        u = u0 + j
        t, kk = lax.div(u, ks), lax.rem(u, ks)
        tile = (tile_n, tile_k, lay.group)
        groups = [superblocks.values_per_row(r, lay.group, lay.super_group) for r in lay.groupwise]
        copy_weight_unit(weights, sched.tiles, t, kk, layer, tile, c_smem, group_smems, slot, produced, groups)

    def issue(j, slot):
        issue_x(j, slot)
        issue_weights(j, slot)

    @pl.when(wg == wgs)
    def _memory():
        ahead = lay.in_flight
        with jax.named_scope("issue_first"):
            flat_gemm_stream.pdl_prologue(ahead, issue_weights, issue_x, nsteps, pdl=lay.pdl)  # the first units

        def refill(j, carry):
            slot = lax.rem(j, lay.stages)

            def wait_free():
                with jax.named_scope("wait_free"):
                    plgpu.barrier_wait(consumed.at[slot])  # every compute warpgroup is done with unit j - stages

            if ahead < lay.stages:  # the loop starts below `stages`: the first units' slots are free already
                with jax.named_scope("wait_landed"):
                    plgpu.barrier_wait(produced.at[lax.rem(j - ahead, lay.stages)])  # unit j - ahead has landed
                pl.when(j >= lay.stages)(wait_free)
            else:
                wait_free()
            with jax.named_scope("issue"):
                (issue_weights if s8 else issue)(j, slot)
            return carry

        lax.fori_loop(ahead, nsteps, refill, None)
        if interpret:  # Mosaic GPU's interpreter wants every phase of a barrier seen by all that wait on it
            drain = lambda j, carry: (plgpu.barrier_wait(consumed.at[lax.rem(j, lay.stages)]), carry)[1]  # noqa: E731
            lax.fori_loop(lax.max(nsteps - lay.stages, 0), nsteps, drain, None)
            if ahead < lay.stages:
                landed = lambda j, carry: (plgpu.barrier_wait(produced.at[lax.rem(j, lay.stages)]), carry)[1]  # noqa: E731
                lax.fori_loop(lax.max(nsteps - ahead, 0), nsteps, landed, None)

    @jax.named_scope("round_x")
    def round_x():  # s8: `quantize_activations` of the CTA's x, 64 rows (group, m) per chunk and warpgroup
        with jax.named_scope("wait_x"):
            plgpu.barrier_wait(x_ready)
        for ch in range(lay.x_rows // 64):

            @pl.when(wg == ch % wgs)
            def _():
                rsl = pl.ds(ch * 64, 64)
                round_rows_to_s8(xs_smem.at[rsl], xq_smem, xc_smem, rsl, bits=bits, interpret=interpret)

        plgpu.commit_smem()  # the rounded x and its constants, visible to wgmma (the async proxy)
        plgpu.barrier_arrive(xq_ready)
        with jax.named_scope("wait_xq"):
            plgpu.barrier_wait(xq_ready)  # every compute warpgroup's chunks

    role_smem = dict(zip(lay.groupwise, group_smems))
    offsets = "offsets" in role_smem

    @jax.named_scope("wait_stage")
    def wait_produced(slot):  # the unit's copies have landed in `slot`
        plgpu.barrier_wait(produced.at[slot])

    def x_operand(j, slot, g):  # xᵀ [gw, M8] of group g of the unit of local step j
        if s8:
            return xq_smem.at[pl.ds(held_group(j, g) * m8, m8)].T
        return x_smem.at[slot, :, pl.ds(g * gw, gw)].T

    def groups(j, slot, r0):  # yields (g, this warpgroup's codes of group g [rows, gw] in x's dtype, xᵀ [gw, M8])
        c_rows = c_smem.at[slot, pl.ds(r0, rows)]  # [rows, tile_k]
        if s8 and bits == 8:  # int8 codes are wgmma's operand as they sit in SMEM
            for g in range(tile_k // gw):
                yield g, c_rows.at[:, pl.ds(g * gw, gw)], x_operand(j, slot, g)
            return
        for ci in range(tile_k // cw):
            chunk = plgpu.load(c_rows.at[:, pl.ds(ci * cw, cw)], layout=upcast)  # [rows, cw]
            if s8:
                chunk = permute_s8(chunk.astype(jnp.int8) + S8_BIAS) if interpret else s8_as_wgmma(chunk)
            elif lay.feed == "biased":
                chunk = permute_pairs(chunk.astype(cdt)) + lay.bias if interpret else biased_as_wgmma(chunk, cdt)
            elif lay.feed == "relabel":
                chunk = permute_k(chunk.astype(cdt)) if interpret else relabel_as_wgmma(chunk.astype(cdt))
            else:
                chunk = plgpu.layout_cast(chunk, plgpu.Layout.WGMMA).astype(cdt)
            for gj in range(cw // gw):
                g = ci * (cw // gw) + gj  # group within the unit
                yield g, chunk[:, gj * gw : (gj + 1) * gw], x_operand(j, slot, g)

    def per_row(slot, r0, g, role: str):  # the role's row for group g: [rows] f32, row layout
        row = (g * gw) // lay.super_group if role.startswith("super") else (g if lay.group <= tile_k else 0)
        return plgpu.load(role_smem[role].at[slot, row, pl.ds(r0, rows)], layout=row_layout).astype(jnp.float32)

    def scale_offset(slot, r0, g, dtype):  # (scales, offsets or None) of group g: [rows] in dtype, f32 math
        row = functools.partial(per_row, slot, r0, g)
        s, o = superblocks.scale_offset(row, offsets, bool(lay.super_group))
        return s.astype(dtype), None if o is None else o.astype(dtype)

    def mma(acc, w, x_t):  # complete on return
        if s8 and bits == 8:
            mma_from_smem(acc, w, x_t)
        else:
            mma_from_registers(acc, w, x_t, interpret, w_stage.at[wg] if interpret else None)

    @jax.named_scope("unit")
    def unit_w(j, acc, r0):  # acc [rows, M8] += this warpgroup's rows of unit j, weights scaled in registers
        slot = lax.rem(j, lay.stages)
        wait_produced(slot)
        for g, w, x_t in groups(j, slot, r0):
            s, o = scale_offset(slot, r0, g, cdt)
            w = w * lax.broadcast_in_dim(s, w.shape, [0])
            if offsets:
                w = w + lax.broadcast_in_dim(o, w.shape, [0])
            mma(acc, w, x_t)  # complete on return: the unit's stage is free after its last group
        plgpu.barrier_arrive(consumed.at[slot])

    sums = offsets or lay.bias != 0  # a group's Σx is needed: for its offsets, or to take the bias off

    @jax.named_scope("unit")
    def unit_acc(j, total, r0):  # total [rows, M8] f32 + this warpgroup's rows of unit j, scaled per group
        slot = lax.rem(j, lay.stages)
        wait_produced(slot)
        ones = plgpu.layout_cast(jnp.ones((rows, gw), cdt), plgpu.Layout.WGMMA) if sums else None

        def scope(*accs):  # one accumulator per group (and one per group's Σx)
            groups_of = []
            for g, w, x_t in groups(j, slot, r0):
                mma(accs[g], w, x_t)  # (bias + codes)ᵀ · xᵀ
                if sums:
                    mma(accs[lay.group_rows + g], ones, x_t)  # every row: Σ_k∈g x[m, k]
                scales, offs = scale_offset(slot, r0, g, jnp.float32)
                groups_of.append((g, scales, offs))
            return [(accs[g][...], accs[lay.group_rows + g][...] if sums else None, s, o) for g, s, o in groups_of]

        parts = pl.run_scoped(scope, *[plgpu.ACC((rows, m8), jnp.float32)] * (lay.group_rows * (1 + sums)))
        plgpu.barrier_arrive(consumed.at[slot])  # the scales and offsets are in registers now
        for part, xsum, s, o in parts:  # codes · x = part - bias · Σx; + offsets · Σx
            if lay.bias:
                part = part - lay.bias * xsum
            total = total + part * lax.broadcast_in_dim(s, part.shape, [0])
            if o is not None:
                total = total + xsum * lax.broadcast_in_dim(o, part.shape, [0])
        return total

    @jax.named_scope("unit")
    def unit_s8(j, total, r0):  # total [rows, M8] f32 + this warpgroup's rows of unit j, int8 activations
        slot = lax.rem(j, lay.stages)
        wait_produced(slot)
        col_layout = plgpu.Layout.WGMMA.reduce(0)  # an [M8] vector along the accumulator's columns

        def scope(*accs):  # one int32 accumulator per group: (codes + 8)ᵀ · xqᵀ
            groups_of = []
            for g, w, x_t in groups(j, slot, r0):
                mma(accs[g], w, x_t)
                scales, offs = scale_offset(slot, r0, g, jnp.float32)
                gsl = pl.ds(held_group(j, g) * m8, m8)
                xc = [plgpu.load(xc_smem.at[i, gsl], layout=col_layout) for i in range(xc_smem.shape[0])]
                groups_of.append((g, scales, offs, xc))
            return [(accs[g][...], s, o, xc) for g, s, o, xc in groups_of]

        parts = pl.run_scoped(scope, *[plgpu.ACC((rows, m8), jnp.int32)] * lay.group_rows)
        plgpu.barrier_arrive(consumed.at[slot])  # the scales and constants are in registers now
        cols = lambda v: lax.broadcast_in_dim(v, (rows, m8), [1])  # noqa: E731
        for part, s, o, xc in parts:  # s_x · Σ (c + 8) xq - 8 s_x Σ xq, scaled per row; + offsets · Σx
            dot = part.astype(jnp.float32) * cols(xc[0]) + cols(xc[1])
            total = total + dot * lax.broadcast_in_dim(s, dot.shape, [0])
            if o is not None:
                total = total + cols(xc[2]) * lax.broadcast_in_dim(o, dot.shape, [0])
        return total

    @pl.when(wg < wgs)
    def _compute():
        if s8:
            pl.when(nsteps > 0)(round_x)
        r0 = wg * rows
        t_first = lax.div(u0, ks)

        def segment(g, j_start):  # this CTA's part of tile t_first + g
            t = t_first + g
            j_end = lax.min((t + 1) * ks, u1) - u0

            if lay.scale_in == "acc":
                zeros = plgpu.layout_cast(jnp.zeros((rows, m8), jnp.float32), plgpu.Layout.WGMMA)
                unit = unit_s8 if s8 else unit_acc
                part = lax.fori_loop(j_start, j_end, lambda j, total: unit(j, total, r0), zeros)  # [rows, M8]
            else:

                def run(acc):
                    lax.fori_loop(j_start, j_end, lambda j, carry: (unit_w(j, acc, r0), carry)[1], None)
                    return acc[...]

                part = pl.run_scoped(run, plgpu.ACC((rows, m8), jnp.float32))  # [rows, M8]
            with jax.named_scope("flush"):
                buf = lax.rem(g, 2)
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the flush two tiles back has left buf
                flat_gemm_stream.store_transposed(out_smem.at[wg, buf], part)
                plgpu.commit_smem()
                p = c - lax.div(t * ks, per_cta)  # this CTA's slot in tile t
                dst = o_gmem.at[p, pl.ds(0, m8), pl.ds(t * tile_n + r0, rows)]  # rows past M: dropped
                plgpu.copy_smem_to_gmem(out_smem.at[wg, buf], dst)
            return j_end

        segments = lax.div(u1 - 1, ks) - t_first + 1
        lax.fori_loop(0, segments, segment, jnp.int32(0))
        with jax.named_scope("drain"):
            plgpu.wait_smem_to_gmem(0)


# ---------------------------------------------------------------------------------------------
# Kernel wrapper


def _five(weight) -> tuple:
    """A weight as (codes, scales, offsets, super_scales, super_offsets), absent ones None."""
    weight = tuple(weight)
    return weight + (None,) * (1 + len(superblocks.ROLES) - len(weight))


def _roles(weight) -> tuple[str, ...]:
    return tuple(r for r, a in zip(superblocks.ROLES, weight[1:]) if a is not None)


def _super_group(weight) -> int:
    codes, scales, _, supers, _ = weight
    return 0 if supers is None else codes.shape[-1] // supers.shape[-2]


def _check(x, weights, group: int, cfg: QuantStreamBlocks) -> None:
    """UntiledShape / ValueError with the numbers for what the kernel cannot take."""
    m, k = x.shape
    if not weights:
        raise ValueError("quant_gemm_multi needs at least one weight")
    if cfg.in_flight is not None and cfg.in_flight < 1:
        raise ValueError(f"in_flight must be None or at least 1 unit, got {cfg.in_flight}")
    first = weights[0]
    dtypes = lambda w: [None if a is None else jnp.dtype(a.dtype) for a in w]  # noqa: E731
    for w in weights:
        codes, scales, offsets, supers, super_offsets = w
        if supers is None:
            quant_gemm.check_shapes(x, codes, scales, offsets, group, None)
        else:
            expanded = jax.eval_shape(superblocks.expand, scales, offsets, supers, super_offsets)
            quant_gemm.check_shapes(x, codes, *expanded, group, None)
            superblocks.check(scales, offsets, supers, super_offsets, "quant_gemm_multi")
        if dtypes(w) != dtypes(first) or _super_group(w) != _super_group(first):
            raise UntiledShape(
                "the weights of one call must share their arrays' dtypes and super-blocks, got "
                + ", ".join("/".join("-" if a is None else jnp.dtype(a.dtype).name for a in w) for w in weights)
            )
    if (sg := _super_group(first)) and (sg % group or (cfg.tile_k % sg and sg % cfg.tile_k)):
        raise UntiledShape(f"super-blocks of {sg} must hold whole groups (G={group}) and tile tile_k={cfg.tile_k}")
    if x.dtype not in quant_gemm.X_DTYPES:
        raise UntiledShape(f"the kernel takes bf16 or f16 x, got {x.dtype}")
    if m > MAX_M:
        raise UntiledShape(f"the quantized stream GEMM takes M <= {MAX_M}, got M={m}")
    if cfg.int4_feed not in ("biased", "relabel", "shuffle", "s8"):  # "auto" is resolved by now
        raise UntiledShape(f"int4_feed must be 'auto', 'biased', 'relabel', 'shuffle' or 's8', got {cfg.int4_feed!r}")
    bits = code_bits(first[0].dtype)
    feed = cfg.feed_for(bits)
    if cfg.int8_feed not in ("s8", "convert"):  # "auto" is resolved by now
        raise UntiledShape(f"int8_feed must be 'auto', 's8' or 'convert', got {cfg.int8_feed!r}")
    if feed == "s8" and (why := _s8_shape_error(cfg, group, -(-m // 8) * 8)):
        raise UntiledShape(f"int{bits}_feed='s8' needs {why}")
    if feed == "s8" and _super_group(first):
        raise UntiledShape("int8 activations (feed 's8') take one level of scales")
    if feed == "biased" and cfg.scale_in != "acc":
        raise UntiledShape(f"int4_feed='biased' needs scale_in='acc', got {cfg.scale_in!r}")
    if cfg.scale_in not in ("acc", "w", "auto"):
        raise UntiledShape(f"scale_in must be 'acc' or 'w', got {cfg.scale_in!r}")
    if cfg.compute_wgs not in (1, 2, 3, 4) or cfg.tile_n % (64 * cfg.compute_wgs):
        raise UntiledShape(f"tile_n={cfg.tile_n} must be 64 rows per compute warpgroup ({cfg.compute_wgs})")
    ns = [w[0].shape[1] for w in weights]
    if k % cfg.tile_k or any(n % cfg.tile_n for n in ns):
        raise UntiledShape(f"K={k} / N={ns} must be multiples of tile_k={cfg.tile_k} / tile_n={cfg.tile_n}")
    if not tile_k_fits(cfg.tile_k, group, bits):
        raise UntiledShape(f"tile_k={cfg.tile_k} does not tile G={group} for {first[0].dtype} codes")


def _s8_shape_error(cfg: QuantStreamBlocks, group: int, m8: int) -> str | None:
    """Why the s8 feed cannot take this call (None: it can): it rounds x in 64-row chunks of (group, row)."""
    if group % 128 or cfg.tile_k % group:
        return f"G a multiple of 128 dividing tile_k={cfg.tile_k}, got G={group}"
    if 64 % m8:
        return f"M8 (M rounded up to 8) dividing 64, got M8={m8}"
    if cfg.scale_in not in ("acc", "auto"):
        return f"scale_in='acc' (it scales its int32 accumulators), got {cfg.scale_in!r}"
    return None


def _plan(cfg: QuantStreamBlocks, x, weights, group: int, ctas: int) -> tuple[int, _Layout]:
    """(pipeline stages that fit in cfg.smem_bytes, the call's layout with cfg.stages) for resolved blocks.
    A stage holds a unit's weight (and, but for s8, its x); s8 holds the CTA's x once, copied and rounded."""
    m, k = x.shape
    m8 = -(-m // 8) * 8
    codes0, _, offsets0, _, _ = weights[0]
    bits = code_bits(codes0.dtype)
    sched = flat_gemm_stream.schedule(k, tuple(w[0].shape[1] for w in weights), cfg.gemm_blocks(), ctas)
    if bits == 8:
        feed = "s8" if cfg.int8_feed == "s8" else "int8"
    else:
        feed = cfg.int4_feed if group % 32 == 0 else "shuffle"  # whole 32-column blocks
    bias = BIAS_BITS[x.dtype][0] if feed == "biased" else 0
    lay = _Layout(
        sched,
        cfg.tile_n,
        cfg.tile_k,
        group,
        cfg.stages,
        cfg.compute_wgs,
        _roles(weights[0]),
        cfg.scale_in,
        feed,
        bias,
        m8,
        in_flight_asked=cfg.in_flight,
        super_group=_super_group(weights[0]),
    )
    stage_bytes = cfg.tile_k * cfg.tile_n * bits // 8
    groupwise = [a for a in weights[0][1:] if a is not None]
    stage_bytes += sum(lay.rows_of(r) * cfg.tile_n * a.dtype.itemsize for r, a in zip(lay.groupwise, groupwise))
    fixed = cfg.compute_wgs * 2 * (cfg.tile_n // cfg.compute_wgs) * m8 * 4  # the flush buffers
    if cfg.trace_dir:  # the profiler's buffer: 4 words a region, per warpgroup
        fixed += (cfg.compute_wgs + 1) * 4 * lay.trace_regions * 4
    if feed == "s8":
        fixed += lay.x_rows * (group * (x.dtype.itemsize + 1) + (2 + (offsets0 is not None)) * 4)
    else:
        stage_bytes += cfg.tile_k * m8 * x.dtype.itemsize
    return (cfg.smem_bytes - fixed) // stage_bytes, lay


def resolve_blocks(cfg: QuantStreamBlocks, x, weights, group: int, ctas: int | None = None) -> QuantStreamBlocks:
    """`cfg.resolved` for one call: x [M, K] and weights as `quant_stream_partials` takes them (arrays or
    ShapeDtypeStructs). int4_feed / int8_feed "auto" becomes "s8" where G and M8 take it and cfg.stages pipeline
    stages still fit beside the CTA's x, else "relabel" / "convert". Fewer stages starve the pipeline:
    Llama-3.1-8B's gate+up (x of 14 k-steps held, two stages left) measured far slower with s8 than relabelled
    (docs/kernels.md)."""
    weights = tuple(_five(w) for w in weights)
    codes0, _, offsets0, _, _ = weights[0]
    bits = code_bits(codes0.dtype)
    ns = [w[0].shape[1] for w in weights]
    ctas = ctas or cfg.ctas or flat_gemm_stream.default_ctas()
    s8_fits = False
    if cfg.feed_for(bits) == "auto":
        as_s8 = cfg.resolved(ns, offsets0 is not None, bits, s8_fits=True)
        m8 = -(-x.shape[0] // 8) * 8
        s8_fits = _s8_shape_error(as_s8, group, m8) is None and _plan(as_s8, x, weights, group, ctas)[0] >= cfg.stages
    return cfg.resolved(ns, offsets0 is not None, bits, s8_fits)


def quant_stream_partials(
    x, weights, layer, *, group: int, cfg: QuantStreamBlocks, permuted_codes: bool = False, interpret: bool = False
):
    """(partials [P, M or M8, T·tile_n] f32, schedule): the kernel's raw output, batch-major as
    `flat_gemm_stream.partial_rows` says, unwritten slots as they are.
    x [M, K] bf16/f16; weights: tuple of (codes [L, N_i, K], scales [L, K/G, N_i], offsets or None), each
    optionally followed by two-level scales' super_scales and super_offsets [L, K/S, N_i] (`kernels.superblocks`).
    permuted_codes: the codes' columns are in `permute_k` order (int4 codes in whole 32-column groups,
    as `jaxdecode.quantized` stores them), so the relabelling feed takes x as it is."""
    weights = tuple(_five(w) for w in weights)
    m, k = x.shape
    m8 = -(-m // 8) * 8
    codes0, _, offsets0, _, _ = weights[0]
    bits = code_bits(codes0.dtype)
    ctas = cfg.ctas or flat_gemm_stream.default_ctas()
    cfg = resolve_blocks(cfg, x, weights, group, ctas)
    _check(x, weights, group, cfg)
    gw = min(group, cfg.tile_k)
    fit, lay = _plan(cfg, x, weights, group, ctas)
    if fit < 2:
        raise UntiledShape(f"two pipeline stages do not fit in smem_bytes={cfg.smem_bytes} at M={m}, K={k}")
    lay = dataclasses.replace(lay, stages=max(2, min(cfg.stages, fit)), pdl=cfg.pdl and not interpret)
    sched, feed, stages, rows = lay.sched, lay.feed, lay.stages, cfg.tile_n // cfg.compute_wgs
    s8 = feed == "s8"
    if permuted_codes and (feed == "int8" or group % 32):
        raise UntiledShape(f"permuted_codes needs int4 codes in groups of 32 columns, got {bits}-bit codes, G={group}")
    if not (permuted_codes and feed in ("relabel", "s8")):  # these feeds read stored-permuted codes in x's order
        x = permute_k(x) if permuted_codes else x  # x in the codes' stored order, then in the feed's
        int4_s8 = permute_k if bits == 4 else lambda a: a  # int8 codes are in K order
        x = {"biased": permute_pairs, "relabel": permute_k, "s8": int4_s8}.get(feed, lambda a: a)(x)
    groupwise = [a for a in weights[0][1:] if a is not None]
    weight_stages = (
        plgpu.SMEM(
            (stages, cfg.tile_n, cfg.tile_k), codes0.dtype, transforms=smem_transforms(load_width(gw, bits), bits)
        ),
        *(plgpu.SMEM((stages, lay.rows_of(r), cfg.tile_n), a.dtype) for r, a in zip(lay.groupwise, groupwise)),
        plgpu.SMEM((cfg.compute_wgs, 2, m8, rows), jnp.float32),  # each compute warpgroup's flushes, batch-major
    )
    pipeline_barriers = (
        plgpu.Barrier(num_arrivals=(not s8) + lay.arrays, num_barriers=stages),  # produced: (x and) the weight's arrays
        plgpu.Barrier(num_arrivals=cfg.compute_wgs, num_barriers=stages),  # consumed: every compute warpgroup
    )
    if s8:  # the CTA's x as copied, rounded and its constants; x copied, x rounded by every compute warpgroup
        scratch = (
            plgpu.SMEM((lay.x_rows, group), x.dtype, transforms=smem_transforms(group, 8 * x.dtype.itemsize)),
            plgpu.SMEM((lay.x_rows, group), jnp.int8, transforms=smem_transforms(group, 8)),
            plgpu.SMEM((2 + (offsets0 is not None), lay.x_rows), jnp.float32),
            *weight_stages,
            *pipeline_barriers,
            plgpu.Barrier(num_arrivals=lay.ks_held * lay.group_rows),
            plgpu.Barrier(num_arrivals=cfg.compute_wgs),
        )
    else:
        x_stages = plgpu.SMEM((stages, m8, cfg.tile_k), x.dtype, transforms=smem_transforms(gw, 8 * x.dtype.itemsize))
        scratch = (x_stages, *weight_stages, *pipeline_barriers)
    if interpret:  # Mosaic GPU's interpreter takes wgmma operands from SMEM only, and scoped SMEM must be
        # shared by all warpgroups: each compute warpgroup stages its converted codes in its own row
        scratch += (plgpu.SMEM((cfg.compute_wgs, rows, gw), jnp.int8 if s8 else x.dtype),)
    out = plgpu.kernel(
        functools.partial(_kernel, lay=lay, interpret=interpret),
        out_type=jax.ShapeDtypeStruct(
            (sched.slots, flat_gemm_stream.partial_rows(m), sched.tile_count * cfg.tile_n), jnp.float32
        ),
        scratch_types=scratch,
        grid=(sched.ctas,),
        grid_names=("c",),
        num_threads=cfg.compute_wgs + 1,
        thread_name="wg",
        kernel_name="quant_gemm_stream",  # its own name in profiles (Mosaic GPU kernels are otherwise "anonymous")
        compiler_params=(
            plgpu.CompilerParams(profile_space=lay.trace_regions, profile_dir=cfg.trace_dir)
            if cfg.trace_dir and not interpret
            else None
        ),
        interpret=plgpu.InterpretGPUParams(uninitialized_memory="nan") if interpret else None,
    )(
        jnp.asarray(layer, jnp.int32).reshape(1),
        x if flat_gemm_stream.tma_reads_unpadded(m) else jnp.pad(x, ((0, m8 - m), (0, 0))),
        *(a for w in weights for a in w if a is not None),
    )
    return out, sched


# ---------------------------------------------------------------------------------------------
# Public op


@functools.partial(jax.jit, static_argnames=("group", "out_dtype", "block_sizes", "permuted_codes", "interpret"))
def quant_gemm_multi(
    x: jax.Array,  # [M, K]
    weights,  # tuple of (codes [L, N_i, K] or [N_i, K], scales [L, K/G, N_i] or [K/G, N_i], offsets or None[, two
    # levels' super_scales, super_offsets or None]: `kernels.superblocks`)
    layer: jax.Array | int | None = None,
    *,
    group: int,
    out_dtype=None,
    block_sizes: QuantStreamBlocks = QuantStreamBlocks(),
    permuted_codes: bool = False,
    interpret: bool = False,
):
    """(x · dequantize(codes, scales, offsets)[layer] for each weight) in one launch, each [M, N_i] in
    out_dtype (default x.dtype); f32 accumulation of weights rounded to x's dtype, one rounding at the end.
    permuted_codes: as `quant_stream_partials` (the reference then reads `permute_k(codes)`).

    Equivalent to the following JAX code, up to that rounding of each scaled weight:

      tuple(quant_gemm.quant_gemm_reference(x, c, *superblocks.expand(s, o, ss, so), layer, group=group,
                                            out_dtype=out_dtype) for c, s, o, ss, so in weights)
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    weights = tuple(_five(w) for w in weights)
    if all(w[0].ndim == 2 for w in weights):
        weights = tuple(tuple(None if a is None else a[None] for a in w) for w in weights)
        layer = 0
    elif layer is None:
        raise ValueError("stacked codes [L, N, K] need a layer index")
    partials, sched = quant_stream_partials(
        x, weights, layer, group=group, cfg=block_sizes, permuted_codes=permuted_codes, interpret=interpret
    )
    tile_n = partials.shape[2] // sched.tile_count
    y = flat_gemm_stream.combine(partials, sched, tile_n, x.shape[0])  # [M, ΣN] f32
    bounds = np.cumsum([w[0].shape[1] for w in weights])[:-1]
    return tuple(part.astype(out_dtype) for part in jnp.split(y, bounds, axis=1))


# ---------------------------------------------------------------------------------------------
# Reference


def quant_gemm_s8_reference(x, codes, scales, offsets=None, layer=None, *, group: int):
    """What the "s8" feed computes, in f32: x rounded to int8 per group (`quantize_activations`) times the
    dequantized codes and scales, plus the offsets times the exact x's group sums. x [M, K]; [L, N, K]
    stacks with `layer`. Returns [M, N] f32."""
    m, k = x.shape
    xq, consts = quantize_activations(x, group, offsets is not None)
    xd = (xq.astype(jnp.float32).reshape(m, k // group, group) * consts[:, 0].T[..., None]).reshape(m, k)
    y = quant_gemm.quant_gemm_reference(xd, codes, scales, None, layer, group=group, out_dtype=jnp.float32)
    if offsets is not None:
        off = offsets if layer is None else lax.dynamic_index_in_dim(offsets, layer, axis=0, keepdims=False)
        y = y + jnp.dot(consts[:, 2].T, off.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return y

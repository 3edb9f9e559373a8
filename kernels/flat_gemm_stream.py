"""Stream-K flat GEMM: one persistent pass over several stacked weights, every SM busy to the end.

A decode projection reads far more weight bytes than it computes with, so its time is the weight
read. The tile-per-CTA kernel of `kernels/flat_gemm.py` leaves bandwidth unused in two ways: N/64
tiles rarely divide into the 132 SMs (Llama's FFN has 224 tiles: two waves, the second 70% full),
and each CTA fills and drains its own short pipeline. Here the work is laid out as units
(weight tile n, k-step), tile-major over all the weights of the call (q, k and v; gate and up; or
one weight), and each of C CTAs (C = the SM count) takes one contiguous, equal run of units. A CTA
streams its run through one TMA pipeline that never restarts; where its run crosses the end of a
tile it writes the tile's partial sum to one of P slots and starts the next tile (Stream-K, Osama et
al. 2023). A tile is covered by at most P consecutive CTAs; the slot of CTA c in tile t is
c - first_cta(t). Which (slot, tile) pairs are written is static, so the combine is one XLA fusion: sum
the written slots, split the weights apart, apply the epilogue.

The partials are batch-major, [P, M, N] (`partial_rows`: M, or M8 where x is padded): the accumulator
yᵀ [tile_n, M8] is stored through a transposed view, so a consumer reads each sequence's row whole
and contiguous, no transpose follows, and at M < 8 only M rows leave the kernel (TMA drops the rows
past the array's end).

As in `flat_gemm`, the operands are swapped for wgmma: yᵀ[tile_n, M8] += W[l]ᵀ[tile_n, tile_k] ·
xᵀ[tile_k, M8], so weight rows fill the 64-row side and the batch (M8 = M rounded up to 8) is the
narrow side. Where it can (M <= 8 or a multiple of 8), x is not padded in memory: its TMA box has M8
rows and the copy fills the rows past M with zeros, which saves a pad fusion per call.
The layer index is read inside the kernel (`w.at[layer]`): stacked weights are never copied.

Tested on the CPU with Mosaic GPU's interpreter (`interpret=True`), compiled on Hopper.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclasses.dataclass(frozen=True)
class StreamBlocks:
    """Tunables. ctas=None: one CTA per SM of the device (132 on an H200)."""

    tile_n: int = 64  # weight columns per unit: the wgmma M side
    tile_k: int = 256  # reduction depth per unit (one pipeline step)
    stages: int = 4  # TMA stages in flight per CTA (>= 2); cut to what fits in smem_bytes
    ctas: int | None = None
    smem_bytes: int = 220 * 1024  # H200: 227 KiB per block
    # Programmatic dependent launch (Hopper): the kernel may start while the kernel before it runs, loads its
    # first `stages` weight tiles (weights and the layer index: written by no kernel of the step), then waits
    # for the previous kernel (`griddepcontrol.wait`) before it reads x or writes anything (`pdl_prologue`)
    pdl: bool = False

    def max_stages(self, m8: int, itemsize: int = 2) -> int:
        """The most pipeline stages whose x and weight tiles fit beside the [2, M8, tile_n] f32 flush buffer."""
        per_stage = self.tile_k * (m8 + self.tile_n) * itemsize
        return (self.smem_bytes - 2 * self.tile_n * m8 * 4) // per_stage


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The static Stream-K layout of one call: units, their split over CTAs, the partial-sum slots."""

    ks: int  # k-steps per tile
    tiles: tuple[int, ...]  # tiles per weight
    units_per_cta: int  # R: each CTA takes R consecutive units (the last one may take fewer)
    ctas: int  # C = ceil(units / R), every CTA has work
    slots: int  # P: the most CTAs that share one tile

    @property
    def tile_count(self) -> int:
        return sum(self.tiles)

    @property
    def units(self) -> int:
        return self.tile_count * self.ks

    def written(self) -> np.ndarray:
        """[P, T] bool: slot p of tile t holds a partial sum (CTA first_cta(t) + p covers part of t)."""
        t = np.arange(self.tile_count)
        first = t * self.ks // self.units_per_cta
        last = ((t + 1) * self.ks - 1) // self.units_per_cta
        return np.arange(self.slots)[:, None] <= (last - first)[None, :]


def schedule(k: int, ns: tuple[int, ...], cfg: StreamBlocks, ctas: int) -> Schedule:
    """Split the units (tile, k-step) of weights with N = ns over at most `ctas` CTAs."""
    ks = k // cfg.tile_k
    tiles = tuple(n // cfg.tile_n for n in ns)
    units = sum(tiles) * ks
    per_cta = -(-units // ctas)
    used = -(-units // per_cta)
    t = np.arange(sum(tiles))
    span = ((t + 1) * ks - 1) // per_cta - t * ks // per_cta + 1
    return Schedule(ks, tiles, per_cta, used, int(span.max()))


def default_ctas() -> int:
    """One CTA per SM: the device's core count (132 on an H200); 8 off the GPU (interpret mode)."""
    dev = jax.devices()[0]
    return int(getattr(dev, "core_count", 0) or 8) if dev.platform == "gpu" else 8


# ---------------------------------------------------------------------------------------------
# The kernel


def pdl_prologue(stages: int, issue_weights, issue_x, nsteps, *, pdl: bool) -> None:
    """The first `stages` units' copies: with `pdl` every weight copy first, then `griddepcontrol.wait` (the
    previous kernel done: x is written), then x's; without, unit by unit. `issue_weights(j, slot)` and
    `issue_x(j, slot)` copy unit j into `slot`, here slot j."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    order = ((issue_weights,), (issue_x,)) if pdl else ((issue_x, issue_weights),)
    for part, copies in enumerate(order):
        if part == 1:
            plgpu.griddepcontrol_wait()
        for j in range(stages):

            @pl.when(j < nsteps)
            def _():
                for copy in copies:
                    copy(j, j)


def _stream_kernel(layer_gmem, x_gmem, *refs, sched: Schedule, tile_n: int, tile_k: int, stages: int, pdl: bool):
    """One CTA: units [c·R, min((c+1)·R, U)) through one TMA pipeline, a partial sum per tile."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    *w_gmems, o_gmem = refs  # weights [L, K, N_i]; out [P, M or M8, T·tile_n] f32
    m8 = -(-x_gmem.shape[0] // 8) * 8  # x [M, K] (M <= 8 or a multiple of 8) or padded to [M8, K]
    ks, per_cta, units = sched.ks, sched.units_per_cta, sched.units
    starts = np.cumsum((0,) + sched.tiles)  # first tile of each weight
    layer = layer_gmem[0]
    c = lax.axis_index("c")
    u0 = c * per_cta
    u1 = lax.min(u0 + per_cta, units)
    nsteps = u1 - u0

    def scoped(x_smem, w_smem, out_smem, bars):
        def issue_x(j, slot):  # start loading x's part of the unit of local step j into `slot`
            kk = lax.rem(u0 + j, ks)
            # x has M rows; the tile has M8: TMA fills the rows past M with zeros (out of bounds)
            src = x_gmem.at[pl.ds(0, m8), pl.ds(kk * tile_k, tile_k)]
            plgpu.copy_gmem_to_smem(src, x_smem.at[slot], bars.at[slot])

        def issue_weights(j, slot):  # the weight tile of the unit of local step j into `slot`
            u = u0 + j
            t, kk = lax.div(u, ks), lax.rem(u, ks)
            ksl = pl.ds(kk * tile_k, tile_k)
            for i, w in enumerate(w_gmems):

                @pl.when((t >= starts[i]) & (t < starts[i + 1]))
                def _():
                    nsl = pl.ds((t - starts[i]) * tile_n, tile_n)
                    plgpu.copy_gmem_to_smem(w.at[layer, ksl, nsl], w_smem.at[slot], bars.at[slot])

        def issue(j, slot):
            issue_x(j, slot)
            issue_weights(j, slot)

        pdl_prologue(stages, issue_weights, issue_x, nsteps, pdl=pdl)

        def step(j, acc):
            slot = lax.rem(j, stages)
            plgpu.barrier_wait(bars.at[slot])
            plgpu.wgmma(acc, w_smem.at[slot].T, x_smem.at[slot].T)  # accᵀ += W tileᵀ · x tileᵀ
            plgpu.wgmma_wait(1)  # step j-1's wgmma is done: its buffers can take step j-1+stages

            @pl.when((j >= 1) & (j - 1 + stages < nsteps))
            def _():
                issue(j - 1 + stages, lax.rem(j - 1, stages))

            return acc

        t_first = lax.div(u0, ks)

        def segment(g, j_start):  # the CTA's part of tile t_first + g
            t = t_first + g
            j_end = lax.min((t + 1) * ks, u1) - u0

            def run(acc):
                lax.fori_loop(j_start, j_end, lambda j, _: (step(j, acc), None)[1], None)
                plgpu.wgmma_wait(0)
                return acc[...]

            part = pl.run_scoped(run, plgpu.ACC((tile_n, m8), jnp.float32))  # [tile_n, M8]
            buf = lax.rem(g, 2)
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the flush two tiles back has left buf
            store_transposed(out_smem.at[buf], part)
            plgpu.commit_smem()
            p = c - lax.div(t * ks, per_cta)  # this CTA's slot in tile t
            plgpu.copy_smem_to_gmem(out_smem.at[buf], o_gmem.at[p, pl.ds(0, m8), pl.ds(t * tile_n, tile_n)])
            return j_end

        segments = lax.div(u1 - 1, ks) - t_first + 1
        lax.fori_loop(0, segments, segment, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

    dtype = x_gmem.dtype
    pl.run_scoped(
        scoped,
        plgpu.SMEM((stages, m8, tile_k), dtype),
        plgpu.SMEM((stages, tile_k, tile_n), dtype),
        plgpu.SMEM((2, m8, tile_n), jnp.float32),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
    )


def stream_partials(x, ws, layer, cfg: StreamBlocks, interpret: bool):
    """(partials [P, partial_rows(M), T·tile_n] f32, schedule): the kernel's raw output, unwritten slots as
    they are."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m, k = x.shape
    m8 = -(-m // 8) * 8
    if m8 > 256:
        raise ValueError(f"the stream flat GEMM takes M <= 256 (the wgmma N side), got {m=}")
    ns = tuple(w.shape[2] for w in ws)
    for w in ws:
        if w.ndim != 3 or w.shape[1] != k or w.dtype != x.dtype:
            raise ValueError(f"weights must be [L, {k}, N] of {x.dtype}, got {w.shape} {w.dtype}")
    if k % cfg.tile_k or any(n % cfg.tile_n for n in ns):
        raise ValueError(f"K={k} / N={ns} must be multiples of tile_k={cfg.tile_k} / tile_n={cfg.tile_n}")
    sched = schedule(k, ns, cfg, cfg.ctas or default_ctas())
    fit = cfg.max_stages(m8, x.dtype.itemsize)
    if cfg.stages < 2 or fit < 2:  # step j refills the slot of step j-1: two slots is the least that works
        raise ValueError(
            f"the stream flat GEMM needs 2 pipeline stages, got stages={cfg.stages} and room for "
            f"{fit} in {cfg.smem_bytes} bytes of shared memory at M={m}"
        )
    stages = max(2, min(cfg.stages, fit, sched.units_per_cta))
    kernel = functools.partial(
        _stream_kernel, sched=sched, tile_n=cfg.tile_n, tile_k=cfg.tile_k, stages=stages, pdl=cfg.pdl and not interpret
    )
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((sched.slots, partial_rows(m), sched.tile_count * cfg.tile_n), jnp.float32),
        grid=(sched.ctas,),
        grid_names=("c",),
        # The interpreter's GMEM starts as NaN, so a slot the schedule calls written but the kernel
        # skipped shows up (tests check it).
        interpret=plgpu.InterpretGPUParams(uninitialized_memory="nan") if interpret else None,
    )(jnp.asarray(layer, jnp.int32).reshape(1), x if tma_reads_unpadded(m) else jnp.pad(x, ((0, m8 - m), (0, 0))), *ws)
    return out, sched


def tma_reads_unpadded(m: int) -> bool:
    """Whether the kernel can read x [M, K] as it is: its TMA box has M8 rows, and Mosaic GPU takes a
    GMEM dimension that is smaller than the 8-row tiling or a multiple of it (H200: M = 9..15, 17..23,
    ... fail to lower), so those M get one pad to M8 first."""
    return m <= 8 or m % 8 == 0


def partial_rows(m: int) -> int:
    """Rows of the partials for x [M, K]: M where the kernel reads x unpadded (its stores past M are
    dropped), else M8, the padded x's rows."""
    return m if tma_reads_unpadded(m) else -(-m // 8) * 8


def store_transposed(ref, part) -> None:
    """part [rows, M8] (wgmma's accumulator layout) into SMEM ref [M8, rows], the partials' batch-major order."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    ref.T[...] = plgpu.layout_cast(part, plgpu.Layout.WGMMA_TRANSPOSED)


def combine(partials, sched: Schedule, tile_n: int, m: int) -> jax.Array:
    """Sum the written slots: [P, M or M8, T·tile_n] -> y [M, T·tile_n] f32 (one XLA fusion)."""
    return sum_written(partials, sched.written(), tile_n, m)


def sum_written(partials, written, tile_n: int, m: int) -> jax.Array:
    """partials [P, >= M, T·tile_n] f32, written [P, T] (host bools) -> the written slots' sum [M, T·tile_n],
    added in slot order as the kernels that read partials add them (`kernels.qkv_rope`), so every path
    rounds alike; unwritten slots (NaN included) never enter."""
    written = np.asarray(written, bool)
    total = None
    for p in range(partials.shape[0]):
        mask = jnp.asarray(np.repeat(written[p], tile_n))  # [T·tile_n]
        term = jnp.where(mask, partials[p, :m], 0.0)
        total = term if total is None else total + term
    return total


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_sizes", "interpret"))
def flat_gemm_multi(
    x, ws, layer=None, *, out_dtype=None, block_sizes: StreamBlocks = StreamBlocks(), interpret: bool = False
):
    """(x [M, K] · w[layer] for w in ws) in one kernel launch, each [M, N_i] in out_dtype (default
    x.dtype). ws: a tuple of [L, K, N_i] stacks (layer: int32 scalar, may be traced) or [K, N_i].

    Equivalent to `flat_gemm_multi_reference`: f32 accumulation, one rounding at the end.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    ws = tuple(ws)
    if all(w.ndim == 2 for w in ws):
        ws, layer = tuple(w[None] for w in ws), 0
    elif layer is None:
        raise ValueError("stacked weights [L, K, N] need a layer index")
    partials, sched = stream_partials(x, ws, layer, block_sizes, interpret)
    y = combine(partials, sched, block_sizes.tile_n, x.shape[0])  # [M, ΣN] f32
    bounds = np.cumsum([w.shape[2] for w in ws])[:-1]
    return tuple(part.astype(out_dtype) for part in jnp.split(y, bounds, axis=1))


# ---------------------------------------------------------------------------------------------
# Reference


def flat_gemm_multi_reference(x, ws, layer=None, out_dtype=None):
    """(x [M, K] · w[layer] for w in ws), each [M, N_i] in f32 accumulation, cast to out_dtype
    (default x.dtype). ws: [L, K, N_i] stacks (then `layer` is needed) or [K, N_i] matrices."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    outs = []
    for w in ws:
        w_l = w if w.ndim == 2 else lax.dynamic_index_in_dim(w, layer, axis=0, keepdims=False)
        outs.append(jnp.dot(x, w_l, preferred_element_type=jnp.float32).astype(out_dtype))
    return tuple(outs)

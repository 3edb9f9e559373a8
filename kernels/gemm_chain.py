"""A chain of dependent GEMVs in one persistent launch: #26's question, asked of the smallest kernel that has it.

A decode step is a chain of GEMMs, each reading the output of the one before. Each is a launch of its own, and at a
launch boundary a GEMM pays its fixed cost: the grid starts, and no weight byte arrives before the first TMA
stage lands (docs/kernels.md, "What a launch's time is made of"). The SN40L keeps its pipelines full across
layers; the GPU counterpart is one persistent kernel whose phases meet at a grid barrier inside it, while its TMA
queue already streams the next phase's weights, which depend on nothing the barrier guards. Whether that barrier
costs less than a launch is what this kernel measures (`benchmarks/gemm_chain_bench.py`), before a whole layer is
built that way.

    x_0 = x;  x_{p+1} = x_p · w[first + p]  (p < phases), rounded to x's dtype;  returns every x_{p+1}

Shapes: w [L, D, D] with D = ctas · tile_n, so that each CTA owns one tile_n-column tile of every phase's output
over the whole of D: no split-K and no partial sums, and phase p's output is whole once every CTA has written its
tile. A CTA streams its [D, tile_n] weight column through `stages` TMA stages of [tile_k, tile_n]; a stage's x
part [M8, tile_k] is copied with it in phase 0, and in later phases only after the barrier (the phase's input is
being written by the other CTAs), while its weights go out as soon as the stage is free.

The barrier: each CTA, once its tile's store has landed, fences and signals every CTA's global semaphore (one
fence for all the signals: `semaphore_signal_parallel`), and before phase p + 1 waits for `ctas` signals on its
own, which the wait decrements back to zero, so the semaphores are clean for the next call.

Mosaic GPU's interpreter has no global semaphores: interpreted, the kernel runs one CTA (D = tile_n), where the
barrier has nothing to wait for. Tested there against `gemm_chain_reference`, and lowered for Hopper at the
benchmark's shapes; the barrier itself runs only on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels.flat_gemm_stream import default_ctas, store_transposed
from kernels.grid_sync import fence_global


@dataclasses.dataclass(frozen=True)
class ChainBlocks:
    """Tunables. ctas=None: one CTA per SM (132 on an H200); the width D must then be ctas · tile_n."""

    tile_n: int = 64  # output columns a CTA owns in every phase: the wgmma M side
    tile_k: int = 256  # reduction depth of one pipeline stage
    stages: int = 4  # TMA stages in flight (>= 2, <= the k-steps of a phase)
    ctas: int | None = None
    # the next phase's weight copies go out before the barrier (the point of the kernel); False holds them until
    # after it with x's, the control that tells the barrier's own cost from what streaming across it hides
    stream_across_barrier: bool = True


def _kernel(first_gmem, x_gmem, w_gmem, out_gmem, x_smem, w_smem, y_smem, bars, *, phases, ctas, ks, cfg, interpret):
    """One CTA: for each phase, its column tile over all of D, then the barrier (compiled, more than one CTA)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    tile_n, tile_k, stages = cfg.tile_n, cfg.tile_k, cfg.stages
    m8 = x_smem.shape[1]
    c = lax.axis_index("c")
    first = first_gmem[0]
    columns = pl.ds(c * tile_n, tile_n)
    total = phases * ks
    sems = None if interpret or ctas == 1 else pl.get_global(plgpu.SemaphoreType.REGULAR((ctas,)))

    def issue_weights(n, slot):  # the weights of step n (phase n // ks, k-step n % ks) into `slot`
        rows = pl.ds(lax.rem(n, ks) * tile_k, tile_k)
        plgpu.copy_gmem_to_smem(w_gmem.at[first + lax.div(n, ks), rows, columns], w_smem.at[slot], bars.at[slot])

    def issue_x(n, slot):  # step n's part of its phase's input: x, or the previous phase's output
        phase, rows = lax.div(n, ks), pl.ds(lax.rem(n, ks) * tile_k, tile_k)

        @pl.when(phase == 0)
        def _():
            plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(0, m8), rows], x_smem.at[slot], bars.at[slot])

        @pl.when(phase > 0)
        def _():
            src = out_gmem.at[lax.max(phase - 1, 0), pl.ds(0, m8), rows]
            plgpu.copy_gmem_to_smem(src, x_smem.at[slot], bars.at[slot])

    for n in range(stages):  # the prologue, all in phase 0 (stages <= ks), whose input is there from the start
        issue_weights(n, n)
        issue_x(n, n)

    def phase_body(p, carry):
        if sems is not None:

            @pl.when(p > 0)
            def _():
                pl.semaphore_wait(sems.at[c], ctas)  # every CTA's tile of phase p - 1 is in HBM
                fence_global()

        @pl.when(p > 0)
        def _():  # the x parts of this phase's first stages, whose weights went out during the last phase (or not)
            for d in range(stages - 1):
                n = p * ks + d
                if not cfg.stream_across_barrier:
                    issue_weights(n, lax.rem(n, stages))
                issue_x(n, lax.rem(n, stages))

        def run(acc):
            def step(kk, _):
                j = p * ks + kk
                slot = lax.rem(j, stages)
                plgpu.barrier_wait(bars.at[slot])
                plgpu.wgmma(acc, w_smem.at[slot].T, x_smem.at[slot].T)  # accᵀ += W tileᵀ · x tileᵀ
                plgpu.wgmma_wait(1)  # step j - 1's wgmma is done: its stage can take step j - 1 + stages
                n = j - 1 + stages

                @pl.when((j >= 1) & (n < total))
                def _():
                    free = lax.rem(j - 1, stages)
                    if cfg.stream_across_barrier:
                        issue_weights(n, free)  # weights depend on nothing the barrier guards

                    @pl.when(lax.div(n, ks) == p)
                    def _():
                        if not cfg.stream_across_barrier:
                            issue_weights(n, free)
                        issue_x(n, free)  # this phase's input is whole: copy it now, else after the barrier

            lax.fori_loop(0, ks, step, None)
            plgpu.wgmma_wait(0)
            return acc[...]

        part = pl.run_scoped(run, plgpu.ACC((tile_n, m8), jnp.float32))  # yᵀ [tile_n, M8]
        store_transposed(y_smem, part.astype(y_smem.dtype))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(y_smem, out_gmem.at[p, pl.ds(0, m8), columns])
        plgpu.wait_smem_to_gmem(0)  # landed, before anyone is told
        if sems is not None:

            @pl.when(p < phases - 1)  # the last phase's output is waited for by no one: no signal left over
            def _():
                fence_global()
                signals = [plgpu.SemaphoreSignal(sems.at[i], device_id=None) for i in range(ctas)]
                plgpu.semaphore_signal_parallel(*signals)

        return carry

    lax.fori_loop(0, phases, phase_body, None)


@functools.partial(jax.jit, static_argnames=("phases", "block_sizes", "interpret"))
def gemm_chain(x, w, first=0, *, phases: int, block_sizes: ChainBlocks = ChainBlocks(), interpret: bool = False):
    """[phases, M, D]: x [M, D] (M <= 8) times w[first], that times w[first + 1], ..., each product rounded to x's
    dtype, in one launch; w [L, D, D] in x's dtype with D = ctas · tile_n (`gemm_chain_reference`)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    cfg = block_sizes
    ctas = 1 if interpret else (cfg.ctas or default_ctas())
    m, d = x.shape
    if m > 8:
        raise ValueError(f"the GEMV chain takes M <= 8 rows, got {m}")
    if w.ndim != 3 or w.shape[1:] != (d, d) or w.dtype != x.dtype:
        raise ValueError(f"weights must be [L, {d}, {d}] of {x.dtype}, got {w.shape} {w.dtype}")
    if d != ctas * cfg.tile_n or d % cfg.tile_k:
        raise ValueError(
            f"D={d} must be ctas · tile_n = {ctas} · {cfg.tile_n} (each CTA owns one tile of every phase) and a "
            f"multiple of tile_k={cfg.tile_k}"
        )
    ks = d // cfg.tile_k
    if not 2 <= cfg.stages <= ks:
        raise ValueError(f"stages={cfg.stages} must be at least 2 and at most the {ks} k-steps of a phase")
    if not 1 <= phases <= w.shape[0]:  # first + phases <= L is the caller's: first may be traced
        raise ValueError(f"phases={phases} do not fit the {w.shape[0]} layers of w")
    m8 = 8
    kernel = functools.partial(_kernel, phases=phases, ctas=ctas, ks=ks, cfg=cfg, interpret=interpret)
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((phases, m, d), x.dtype),
        grid=(ctas,),
        grid_names=("c",),
        scratch_types=[
            plgpu.SMEM((cfg.stages, m8, cfg.tile_k), x.dtype),
            plgpu.SMEM((cfg.stages, cfg.tile_k, cfg.tile_n), x.dtype),
            plgpu.SMEM((m8, cfg.tile_n), x.dtype),
            plgpu.Barrier(num_arrivals=2, num_barriers=cfg.stages),
        ],
        interpret=plgpu.InterpretGPUParams(uninitialized_memory="nan") if interpret else None,
    )(jnp.asarray(first, jnp.int32).reshape(1), x, w)
    return out


def gemm_chain_reference(x, w, first=0, *, phases: int):
    """`gemm_chain` in XLA: each product in float32, rounded to x's dtype before the next."""
    outs = []
    for p in range(phases):
        x = jnp.dot(x, w[first + p], preferred_element_type=jnp.float32).astype(x.dtype)
        outs.append(x)
    return jnp.stack(outs)

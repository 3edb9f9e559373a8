"""Synchronization between the CTAs of one Mosaic GPU kernel through global memory: the fence that makes
a CTA's writes visible before the semaphore signal that announces them.

`pl.semaphore_signal` on a `pl.get_global` semaphore signals relaxed and fences after the atomic, so a
kernel that hands data to another CTA fences first (`fence_global`), then signals; the receiving CTA's
`pl.semaphore_wait` acquires. Used where phases of a layer meet inside one kernel instead of at a
kernel boundary (`kernels.quant_mlp`, `kernels.decode_attention`'s fused combine)."""

from __future__ import annotations

from jax.experimental.pallas import mosaic_gpu as plgpu


def fence_global() -> None:
    """Order this thread's earlier writes to global memory, by TMA (the async proxy) or by plain stores, before
    what it does next at GPU scope: `fence.proxy.async.global` then `fence.acq_rel.gpu`. Every thread that
    wrote calls it before the signal."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm

    @plgpu.inline_mgpu()
    def fence(_):
        llvm.inline_asm(
            ir.Type.parse("!llvm.void"), [], "fence.proxy.async.global; fence.acq_rel.gpu;", "", has_side_effects=True
        )

    fence()

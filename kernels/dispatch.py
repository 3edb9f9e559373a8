"""Heuristic dataflow (FlashDecoding++ §5): pick the implementation per (M, N, K) and GPU.

FlashDecoding++ profiles each [N, K] offline and stores two inflection points per shape: below M1
a CUDA-core GEMV wins, between M1 and M2 the flat GEMM, from M2 on the conventional GEMM (cuBLAS).
Here the points live in one table per GPU kind, `GEMM_TABLE`; the run-time rule is a lookup.
Everything off Hopper (the CPU included) falls back to the XLA reference, which is also the
right answer for shapes the kernels do not tile.
"""

from __future__ import annotations

import dataclasses

import jax

from kernels import flat_gemm


@dataclasses.dataclass(frozen=True)
class GemmPoints:
  """Inflection points for one GPU: M < m1 → gemv_impl; m1 <= M < m2 → flat GEMM; else XLA."""

  m1: int
  m2: int
  gemv_impl: str
  flat_impl: str
  looped_m2: int  # in a loop over stacked weights XLA copies W[l] first: the kernel wins longer
  source: str


# Measured on one H200 with benchmarks/kernels_bench.py (benchmarks/KERNELS_RESULTS.md, 2026-11-30).
# Called once per jit step, neither flat kernel nor the gemv beat XLA's dot at M = 1..64 on the
# Llama-3.1-8B shapes (all within ~10% of it), so M2 = 1: XLA everywhere. Inside a loop over stacked
# weights XLA copies W[l] out first, and the Mosaic kernel ran 1.7-2.6x faster than that scan
# (M = 1, 8, 32), so looped calls take the kernel up to the wgmma limit M = 256.
GEMM_TABLE: dict[str, GemmPoints] = {
    "H200": GemmPoints(m1=1, m2=1, gemv_impl="gemv", flat_impl="mosaic", looped_m2=257,
                       source="benchmarks/KERNELS_RESULTS.md, H200, 2026-11-30"),
}
GEMM_TABLE["H100"] = dataclasses.replace(GEMM_TABLE["H200"], source="assumed equal to H200")

ATTENTION_IMPL = {"H200": "async", "H100": "async"}


@dataclasses.dataclass(frozen=True)
class Choice:
  impl: str  # "mosaic" | "triton" | "gemv" | "xla" for GEMMs; "async" | "sync" | "xla" for attention
  reason: str


def gpu_kind(device: jax.Device | None = None) -> str | None:
  """'H200' / 'H100' / other device_kind string for CUDA GPUs; None for anything else."""
  device = device or jax.devices()[0]
  if device.platform != "gpu":
    return None
  kind = device.device_kind
  for name in ("H200", "H100"):
    if name in kind:
      return name
  return kind


def choose_gemm(m: int, n: int, k: int, *, looped: bool = False,
                device: jax.Device | None = None,
                block_sizes: flat_gemm.BlockSizes = flat_gemm.BlockSizes()) -> Choice:
  """Implementation for y[m, n] = x[m, k]·W[k, n]; `looped`: W is one layer of a stacked array
  indexed inside a loop (XLA would copy the slice first)."""
  kind = gpu_kind(device)
  if kind not in GEMM_TABLE:
    return Choice("xla", f"no table for device {kind or jax.devices()[0].platform}: XLA dot")
  points = GEMM_TABLE[kind]
  if n % block_sizes.tile_n or k % block_sizes.tile_k:
    return Choice("xla", f"{n=}, {k=} not multiples of tile_n={block_sizes.tile_n}, "
                         f"tile_k={block_sizes.tile_k}")
  m2 = points.looped_m2 if looped else points.m2
  if m < min(points.m1, m2):
    return Choice(points.gemv_impl, f"M={m} < M1={points.m1} on {kind} ({points.source})")
  if m < m2 and m <= 256:
    why = "looped: XLA would copy W[l]" if looped else f"M={m} < M2={m2}"
    return Choice(points.flat_impl, f"{why} on {kind} ({points.source})")
  return Choice("xla", f"M={m} >= M2={m2} on {kind}: cuBLAS ({points.source})")


def choose_attention(device: jax.Device | None = None) -> Choice:
  """Decode attention implementation for the device."""
  kind = gpu_kind(device)
  if kind not in ATTENTION_IMPL:
    return Choice("xla", f"no kernel for device {kind or jax.devices()[0].platform}: XLA einsum")
  return Choice(ATTENTION_IMPL[kind], f"{kind}: table ATTENTION_IMPL")

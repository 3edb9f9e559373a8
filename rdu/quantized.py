"""Our quantized GEMM kernel and the quantized decoder layer, as measured: the one place their constants
live (GPU mode "looped_inplace" on quantized weights, rdu.gpu).

A quantized layer streams its codes and scales (the traced graph's real bytes: int4 is half a byte an
element plus a scale and an offset per group) through `kernels.quant_gemm`, one kernel per projection
(q, k, v, o, gate, up, down: the fused q·k·v and SwiGLU kernels decline quantized weights), and XLA runs
the glue between them (pads, split-K epilogues, RoPE and the cache write unfused, transposes). So per
format:

- one GEMM kernel call costs `gemm_fixed_s` + bytes / (`gemm_efficiency` x read ceiling): the least-squares
  line through the kernel benchmark's GPU times (four projection shapes at M = 1 and 8);
- a layer runs `kernels_per_layer` kernels at M = 1 (`kernels_per_layer_batched` at M >= 2), counted in
  the decode step's profile, of which `gemm_kernels` are the GEMMs; each of the others costs
  `GPUSpec.quant_glue_kernel_s` (fitted on one measured step: rdu.fit.quant).

`measured_kernels(bench, ab)` derives the table from the two result files; tests/test_rdu_quant.py checks
`QUANT_KERNELS` against them, so a rewritten kernel is one re-measurement and one edit here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

QUANT_FORMATS = ("int4", "int8")
RESULTS = "benchmarks/results/2026-12-02"
BENCH_FILE = f"{RESULTS}/quant_gemm_h200.json"  # kernels/quant_gemm alone, per projection shape
STEP_FILE = f"{RESULTS}/ab_quant_8b_h200.jsonl"  # the whole quantized decode step, with its profile
BENCH_VARIANT = "default"  # the kernel configuration the engine runs
GEMM_KERNELS = 7  # q, k, v, o, gate, up, down: one kernel each


@dataclass(frozen=True)
class QuantKernels:
    fmt: str
    gemm_fixed_s: float  # one GEMM kernel's own cost beyond its bytes (launch, ramp, tail)
    gemm_efficiency: float  # bytes streamed / (time beyond the fixed cost), as a fraction of the read ceiling
    gemm_kernels: int
    kernels_per_layer: int  # at M = 1
    kernels_per_layer_batched: int  # at M >= 2 (the cache write becomes a scatter, more transposes)
    source: str

    def layer_kernels(self, batch: int) -> int:
        return self.kernels_per_layer if batch == 1 else self.kernels_per_layer_batched

    def gemm_s(self, nbytes: float, read_bw: float, calls: int = 1) -> float:
        """`calls` GEMM kernels that stream `nbytes` in all."""
        return calls * self.gemm_fixed_s + nbytes / (self.gemm_efficiency * read_bw)


_SOURCE = (
    f"{BENCH_FILE} (variant {BENCH_VARIANT!r}, GPU time per call from the profiler, one H200: least squares "
    f"over q/o, k/v, gate/up and down at M = 1 and 8, efficiency of that run's read ceiling) and "
    f"{STEP_FILE} (kernels_per_step of the quantized rows' profile: one layer's CUDA graph)"
)

# Values as `measured_kernels()` derives them from the files above (tests check they agree).
QUANT_KERNELS = {
    "int4": QuantKernels("int4", 2.921e-6, 0.5849, GEMM_KERNELS, 23, 26, _SOURCE),
    "int8": QuantKernels("int8", 2.167e-6, 0.6063, GEMM_KERNELS, 23, 26, _SOURCE),
}


def quant_format(dtypes) -> str | None:
    """The quantized format of a traced step from its inputs' dtypes (None: dense weights)."""
    present = set(dtypes)
    found = [f for f in QUANT_FORMATS if f in present]
    return found[0] if found else None


def measured_kernels(root: Path | str = ".") -> dict[str, QuantKernels]:
    """`QUANT_KERNELS` as the result files under `root` give it."""
    root = Path(root)
    bench = json.loads((root / BENCH_FILE).read_text())
    steps = [json.loads(line) for line in (root / STEP_FILE).read_text().splitlines() if line.strip()]
    ceiling = bench["read_ceiling_gb_s"] * 1e9
    out = {}
    for fmt in QUANT_FORMATS:
        rows = [r for r in bench["rows"] if r["impl"] == fmt and r["variant"] == BENCH_VARIANT]
        x = np.array([r["bytes"] for r in rows], dtype=np.float64)
        y = np.array([r["kernel_us"] for r in rows], dtype=np.float64) * 1e-6
        (fixed, per_byte), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x], 1), y, rcond=None)
        count = {
            r["batch"]: r["kernels_per_step"]
            for r in steps
            if r.get("variant") == f"quantize={fmt}" and r.get("model") == "llama-3.1-8b"
        }
        out[fmt] = QuantKernels(
            fmt,
            round(float(fixed), 9),
            round(float(1.0 / per_byte / ceiling), 4),
            GEMM_KERNELS,
            count[1],
            max(v for b, v in count.items() if b > 1),
            _SOURCE,
        )
    return out

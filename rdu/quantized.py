"""Our quantized GEMM kernel and the quantized decoder layer, as measured: the one place their constants
live (GPU mode "looped_inplace" on quantized weights, rdu.gpu).

A quantized layer streams its codes and scales (the traced graph's real bytes: int4 is half a byte an
element plus a scale and an offset per group) through `kernels.quant_gemm_stream` (Stream-K over the
stacked weights, warp-specialized), four launches a layer: q·k·v as one launch (N = q + k + v widths)
into the qkv_rope epilogue and the sync attention kernel, o, gate + up as one launch, down. XLA runs
the glue between them (norms, residual adds, converts, transposes). So per format:

- one GEMM launch costs `gemm_fixed_s` + bytes / (`gemm_efficiency` x read ceiling): the least-squares
  line through the main kernel's GPU time per call of the engine's variant (`ENGINE_VARIANT`) on the
  four launches the engine makes (`ENGINE_LAUNCHES`: the fused q·k·v and gate + up widths measured as
  one call each) at M = 1 and 8;
- a layer runs `kernels_per_layer` kernels at M = 1 (`kernels_per_layer_batched` at M >= 2), counted in
  the decode step's profile, of which `gemm_kernels` are the GEMM launches; each of the others costs
  `GPUSpec.quant_glue_kernel_s` (fitted on one measured step: rdu.fit.quant).

The batch-8 profile's per-step window is sound (one layer's kernels repeat `layers` times). The batch-1
window is not (benchmarks/gpu_trace.py takes a small XLA transpose for the LM head and shows a 22-kernel
window), so the batch-1 count comes from the trace's total kernel count instead: over the same number
of traced steps as the bf16 row of the same run (whose per-step count is sound), less the kernels
outside the layers (the batch-8 step's, beyond its layers).

`measured_kernels(root)` derives the table from the two result files; tests/test_rdu_quant.py checks
`QUANT_KERNELS` against them, so a rewritten kernel is one re-measurement and one edit here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

QUANT_FORMATS = ("int4", "int8")
RESULTS = "benchmarks/results/2026-12-02"
BENCH_FILE = f"{RESULTS}/quant_gemm_stream_h200.json"  # kernels/quant_gemm_stream alone, per launch shape
STEP_FILE = f"{RESULTS}/ab_quant_stream_8b_h200.jsonl"  # the whole quantized decode step, with its profile
# The kernel configuration the engine runs per format: int4 with offsets (--quantize int4) scales in the
# weights, 256-wide tiles, 4 compute warpgroups; int8 (no offsets) scales the accumulator, 128-wide, 2.
ENGINE_VARIANT = {"int4": "stream_4wg_w", "int8": "stream"}
# One layer's GEMM launches as the benchmark names them: q·k·v fused, o (the q/o shape), gate + up fused, down.
ENGINE_LAUNCHES = ("qkv", "q_o", "gate+up", "down")
STEP_MODEL = "llama-3.1-8b"
STEP_LAYERS = 32  # Llama-3.1-8B's decoder layers, the profile's repeat count
GEMM_NAME = "mosaic_gpu_kernel"  # the quantized GEMM's kernel name in the step profile (a suffix)


@dataclass(frozen=True)
class QuantKernels:
    fmt: str
    gemm_fixed_s: float  # one GEMM launch's own cost beyond its bytes (launch, ramp, tail)
    gemm_efficiency: float  # bytes streamed / (time beyond the fixed cost), as a fraction of the read ceiling
    gemm_kernels: int  # GEMM launches a layer
    kernels_per_layer: int  # at M = 1
    kernels_per_layer_batched: int  # at M >= 2 (more transposes around the GEMMs)
    source: str

    def layer_kernels(self, batch: int) -> int:
        return self.kernels_per_layer if batch == 1 else self.kernels_per_layer_batched

    def gemm_s(self, nbytes: float, read_bw: float, calls: int = 1) -> float:
        """`calls` GEMM kernels that stream `nbytes` in all."""
        return calls * self.gemm_fixed_s + nbytes / (self.gemm_efficiency * read_bw)


_SOURCE = (
    f"{BENCH_FILE} (kernels/quant_gemm_stream, the engine's variant per format {ENGINE_VARIANT}: main-kernel "
    f"GPU time per call from the profiler, one H200, least squares over the engine's launches "
    f"{', '.join(ENGINE_LAUNCHES)} at M = 1 and 8, efficiency of that run's read ceiling) and {STEP_FILE} "
    f"(kernels a layer: batch 8 from the profile's per-step window; batch 1 from the trace's total kernel "
    f"count over the bf16 row's traced steps, the batch-1 window being misdetected)"
)

# Values as `measured_kernels()` derives them from the files above (tests check they agree).
QUANT_KERNELS = {
    "int4": QuantKernels("int4", 4.705e-06, 0.7509, 4, 13, 15, _SOURCE),
    "int8": QuantKernels("int8", 4.185e-06, 0.9529, 4, 13, 15, _SOURCE),
}


def quant_format(dtypes) -> str | None:
    """The quantized format of a traced step from its inputs' dtypes (None: dense weights)."""
    present = set(dtypes)
    found = [f for f in QUANT_FORMATS if f in present]
    return found[0] if found else None


def layer_counts(steps: list[dict], fmt: str, layers: int = STEP_LAYERS) -> tuple[int, int, int]:
    """(GEMM launches, kernels at M = 1, kernels at M = 8) a layer, from the ab.py rows of one run."""
    rows = {(r.get("variant"), r["batch"]): r for r in steps if not r.get("summary") and r.get("model") == STEP_MODEL}
    b8 = rows[(f"quantize={fmt}", 8)]
    # The sound per-step window: every layer kernel appears `layers` times (the LM head GEMM once more).
    per_layer = {name: count // layers for name, count, _ in b8["top_kernels"] if count >= layers}
    batched = sum(per_layer.values())
    gemms = sum(v for name, v in per_layer.items() if name.endswith(GEMM_NAME))
    outside = b8["kernels_per_step"] - layers * batched
    # Batch 1: the trace's kernels over the traced steps the bf16 row of the same run shows.
    base = rows[("base", 1)]
    steps_traced = sum(base["streams"].values()) / base["kernels_per_step"]
    per_step = sum(rows[(f"quantize={fmt}", 1)]["streams"].values()) / steps_traced
    return gemms, round((per_step - outside) / layers), batched


def measured_kernels(root: Path | str = ".") -> dict[str, QuantKernels]:
    """`QUANT_KERNELS` as the result files under `root` give it."""
    root = Path(root)
    bench = json.loads((root / BENCH_FILE).read_text())
    steps = [json.loads(line) for line in (root / STEP_FILE).read_text().splitlines() if line.strip()]
    ceiling = bench["read_ceiling_gb_s"] * 1e9
    out = {}
    for fmt in QUANT_FORMATS:
        rows = [
            r
            for r in bench["rows"]
            if r["impl"] == fmt and r["variant"] == ENGINE_VARIANT[fmt] and r["shape"] in ENGINE_LAUNCHES
        ]
        assert {r["shape"] for r in rows} == set(ENGINE_LAUNCHES), (fmt, rows)
        x = np.array([r["bytes"] for r in rows], dtype=np.float64)
        y = np.array([r["kernel_us"] for r in rows], dtype=np.float64) * 1e-6
        (fixed, per_byte), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x], 1), y, rcond=None)
        gemms, single, batched = layer_counts(steps, fmt)
        out[fmt] = QuantKernels(
            fmt, round(float(fixed), 9), round(float(1.0 / per_byte / ceiling), 4), gemms, single, batched, _SOURCE
        )
    return out

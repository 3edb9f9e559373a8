"""Our quantized GEMM kernel and the quantized decoder layer, as measured: the one place their constants
live (GPU mode "looped_inplace" on quantized weights, rdu.gpu).

A quantized layer streams its codes and scales (the traced graph's real bytes: int4 is half a byte an
element plus a scale and an offset per group) through `kernels.quant_gemm_stream` (Stream-K over the
stacked weights, warp-specialized), four launches a layer: q·k·v as one launch (N = q + k + v widths)
into the qkv_rope epilogue and the sync attention kernel, o, gate + up as one launch, down. XLA runs
the glue between them (norms, residual adds, converts, transposes). So per format:

- one GEMM launch costs `gemm_fixed_s` + bytes / (`gemm_efficiency` x read ceiling): the least-squares
  line through the main kernel's GPU time per call of the engine's variant (`ENGINE_VARIANT`) at M = 1
  and 8 on the engine's launches the kernel benchmark measured (`FIT_LAUNCHES`: o and down; its run
  timed the fused q·k·v and gate + up only in part, for time). On the earlier runs that measured all four launches
  (`FULL_BENCH_FILES`) that line gives the four back within 3% (tests/test_rdu_quant.py);
- a layer runs `kernels_per_layer` kernels at M = 1 (`kernels_per_layer_batched` at M >= 2), counted in
  the decode step's profile, of which `gemm_kernels` are the GEMM launches; each of the others costs
  `GPUSpec.quant_glue_kernel_s` (fitted on one measured step: rdu.fit.quant).

The batch-8 profile's per-step window is sound (one layer's kernels repeat `layers` times). The batch-1
window is not (benchmarks/gpu_trace.py takes a small XLA transpose for the LM head and shows a 22-kernel
window), so the batch-1 count comes from the trace's total kernel count instead: over the same number
of traced steps as the bf16 row of the same run (whose per-step count is sound), less the kernels
outside the layers (the batch-8 step's, beyond its layers).

The step profile comes from an earlier run than the kernel benchmark: the kernels a layer launches did
not change since (the wait after each register-operand wgmma acts inside the GEMM kernel), and the later
step runs were not profiled.

`measured_kernels(root)` derives the table from the two result files; tests/test_rdu_quant.py checks
`QUANT_KERNELS` against them, so a rewritten kernel is one re-measurement and one edit here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

QUANT_FORMATS = ("int4", "int8")
# kernels/quant_gemm_stream alone, per launch shape
BENCH_FILE = "benchmarks/results/2026-12-04/quant_gemm_inflight_h200.json"
# the whole quantized decode step, with its profile
STEP_FILE = "benchmarks/results/2026-12-02/ab_quant_stream_8b_h200.jsonl"
# The engine's kernel configuration (`QuantStreamBlocks()`) in BENCH_FILE is "stream" for both formats, resolved per
# launch: int8 activations (the "s8" feeds: x rounded in the kernel, int32 accumulators scaled per unit, 256-wide
# tiles for int4, 128 for int8) where G, M and the held x allow (o, q·k·v, down at M <= 8), else 16-bit x (int4
# with offsets: scales in the weights, 256-wide, 4 compute warpgroups, codes relabelled; int8: scales on the
# accumulator, 128-wide, 2): gate + up, and int8's down. Each register-operand wgmma completes before the next
# conversion (docs/kernels.md).
# int4 launches hold at most two units' copies outstanding per CTA (`in_flight`; BENCH_FILE's "stream" is the
# unbounded schedule the int8 launches keep).
ENGINE_VARIANT = {"int4": "stream_inflight2", "int8": "stream"}
# One layer's GEMM launches as the benchmark names them: q·k·v fused, o (the q/o shape), gate + up fused, down.
ENGINE_LAUNCHES = ("qkv", "q_o", "gate+up", "down")
FIT_LAUNCHES = ENGINE_LAUNCHES  # BENCH_FILE measured all four
# Earlier runs of the four launches (file, engine variant per format): the check that FIT_LAUNCHES' line
# stands for all four.
FULL_BENCH_FILES = (
    ("benchmarks/results/2026-12-02/quant_gemm_stream_h200.json", {"int4": "stream_4wg_w", "int8": "stream"}),
    ("benchmarks/results/2026-12-02/quant_gemm_stream_relabel_h200.json", {"int4": "stream", "int8": "stream"}),
)
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
    f"{', '.join(FIT_LAUNCHES)} at M = 1 and 8, efficiency of that run's read ceiling) and {STEP_FILE} (kernels "
    f"a layer: batch 8 from the profile's per-step window; batch 1 from the trace's total kernel count over the "
    f"bf16 row's traced steps, the batch-1 window being misdetected)"
)

# Values as `measured_kernels()` derives them from the files above (tests check they agree).
QUANT_KERNELS = {
    "int4": QuantKernels("int4", 2.756e-06, 0.8088, 4, 13, 15, _SOURCE),
    "int8": QuantKernels("int8", 2.615e-06, 0.9223, 4, 13, 15, _SOURCE),
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


def gemm_line(bench: dict, fmt: str, variant: str, launches=FIT_LAUNCHES) -> tuple[float, float]:
    """(fixed s, efficiency of the run's read ceiling): least squares through a kernel benchmark's
    main-kernel time per call of `variant` on `launches` at every M it measured."""
    rows = [
        r
        for r in bench["rows"]
        if r["impl"] == fmt and r["variant"] == variant and r["shape"] in launches and r.get("kernel_us")
    ]
    assert {r["shape"] for r in rows} == set(launches), (fmt, variant, rows)
    x = np.array([r["bytes"] for r in rows], dtype=np.float64)
    y = np.array([r["kernel_us"] for r in rows], dtype=np.float64) * 1e-6
    (fixed, per_byte), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x], 1), y, rcond=None)
    return float(fixed), float(1.0 / per_byte / (bench["read_ceiling_gb_s"] * 1e9))


def measured_kernels(root: Path | str = ".") -> dict[str, QuantKernels]:
    """`QUANT_KERNELS` as the result files under `root` give it."""
    root = Path(root)
    bench = json.loads((root / BENCH_FILE).read_text())
    steps = [json.loads(line) for line in (root / STEP_FILE).read_text().splitlines() if line.strip()]
    out = {}
    for fmt in QUANT_FORMATS:
        fixed, efficiency = gemm_line(bench, fmt, ENGINE_VARIANT[fmt])
        gemms, single, batched = layer_counts(steps, fmt)
        out[fmt] = QuantKernels(fmt, round(fixed, 9), round(efficiency, 4), gemms, single, batched, _SOURCE)
    return out

"""Hardware parameters, all in one place, each with the source it comes from.

Every spec is a frozen dataclass; `spec.source(field)` returns the citation of one field and
`spec.table()` all of them. Papers are cited by the tags of /work/shared/reference/papers.md and
sim-anchors.md; "assumed" marks a value no public source gives, with the reasoning.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

GIB, TIB, MIB, KIB = 2**30, 2**40, 2**20, 2**10

# The stored fit of the free constants (rdu/fit/ writes it: `python -m rdu.fit`).
FITTED_PATH = Path(__file__).with_name("fitted.json")
CONSTANTS = ("published", "fitted")  # "published": the sourced/assumed values below (the default)


@functools.lru_cache(maxsize=1)
def load_fitted() -> dict:
    """The record of rdu/fitted.json: fitted constants, their fit rows, loss and per-row errors."""
    try:
        return json.loads(FITTED_PATH.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{FITTED_PATH} is missing: run `python -m rdu.fit` to write it") from None


def _check_constants(constants: str) -> None:
    if constants not in CONSTANTS:
        raise ValueError(f"constants must be one of {CONSTANTS}, got {constants!r}")


# The three published SN40L HBM bandwidths per socket (bytes/s): choose one with `sn40l(hbm_tb_s=...)`.
SN40L_HBM_CHOICES = {
    1.6: "successor paper 'Dataflow Is All You Need' (25.6 TB/s for 16 sockets)",
    1.8: "SN40L paper (arXiv 2405.07518) Table II",
    2.0: "SN40L paper §IV text ('about 2 TB/s per socket')",
}


class _Sourced:
    sources: tuple[tuple[str, str], ...]

    def source(self, name: str) -> str:
        return dict(self.sources)[name]

    def table(self) -> list[tuple[str, object, str]]:
        src = dict(self.sources)
        return [
            (f.name, getattr(self, f.name), src.get(f.name, ""))
            for f in fields(self)
            if f.name not in ("sources", "name")
        ]


@dataclass(frozen=True)
class RDUSpec(_Sourced):
    """One SN40L socket and the links between sockets."""

    name: str
    pcus: int
    pmus: int
    sram_bytes: int
    pmu_bytes: int
    hbm_bytes: int
    ddr_bytes: int
    bf16_flops: float  # per socket, dense
    hbm_bw: float  # bytes/s per socket, peak
    ddr_bw: float  # bytes/s per socket
    hbm_efficiency: float  # achieved / peak HBM bandwidth when streaming weights in a fused kernel
    call_s: float  # one kernel call: hardware-orchestrated launch + end-of-call sync (only their sum is seen)
    stage_latency_s: float  # one pipeline stage: a tile, or the carried activation, passing one stage
    p2p_bw: float  # bytes/s per socket, socket-to-socket streaming (all-reduce)
    p2p_hop_s: float  # one P2P write of a tile into a peer socket's PMU (AGCU protocol, SN40L §VII)
    max_sockets: int
    sources: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)

    @property
    def pcu_flops(self) -> float:
        return self.bf16_flops / self.pcus

    def pipeline_latency_s(self, depth: int) -> float:
        """Time for data to pass a pipeline of `depth` stages: the drain + fill a call boundary exposes,
        and the path the carried activation takes through a looped layer (one physical latency)."""
        return depth * self.stage_latency_s

    def allreduce_s(self, nbytes: float, p: int) -> float:
        """Exposed time of one all-reduce of `nbytes` over p sockets, streamed from the producing GEMM
        (SN40L §VII, DIAYN Fig. 5): each socket writes its partial sums of chunk j into socket j's PMUs
        as the GEMM produces them, the owner reduces and writes the sum back to every peer. Two hops
        whatever p, plus the message through each socket's link (2 (p-1)/p of it, an upper bound:
        all but the last tile overlap the GEMM)."""
        return 0.0 if p <= 1 else 2 * self.p2p_hop_s + 2 * (p - 1) / p * nbytes / self.p2p_bw

    @property
    def stream_bw(self) -> float:
        """Bytes/s one socket streams from HBM in a fused kernel: peak x efficiency."""
        return self.hbm_bw * self.hbm_efficiency


@dataclass(frozen=True)
class GPUSpec(_Sourced):
    name: str
    hbm_bytes: int
    bf16_flops: float  # dense spec
    achieved_flops: float  # measured large-matmul rate
    hbm_bw: float  # spec peak bytes/s
    read_bw: float  # measured or assumed achievable read ceiling
    copy_bw: float  # bytes (read + written) / s of a device-to-device copy
    gemv_efficiency: float  # matmul read bandwidth / read ceiling at M = 1 (XLA's matrix-vector path)
    gemm_efficiency: float  # the same at 2 <= M (cuBLAS flat GEMM); compute-bound past the ridge (M ~ 200)
    attention_efficiency: float  # decode attention (XLA einsum softmax) bandwidth / read ceiling
    kernel_overhead_s: float  # gap + launch per kernel when kernels are queued back to back
    eager_op_s: float  # host dispatch per op in PyTorch eager mode
    nvlink_bw: float  # bytes/s per GPU, one direction
    allreduce_latency_s: float  # small-message all-reduce across the GPUs of one node
    # Our looped in-place engine (GPU mode "looped_inplace", rdu.gpu): fractions of the spec peak.
    flat_gemm_efficiency: float = 0.64  # Mosaic flat GEMM over the stacked weights at M = 1
    flat_gemm_m_exponent: float = 0.034  # flat GEMM efficiency(M) = flat_gemm_efficiency * M ** -exponent
    split_k_efficiency: float = 0.79  # split-K decode attention over the stacked cache
    inplace_kernel_gap_s: float = 3e-6  # fixed cost per kernel inside the per-layer CUDA graph
    p2p_allreduce_s: float = 5.0e-6  # our peer-to-peer all-reduce kernel (2 GPUs, B·D <= 8192), in the decode
    quant_glue_kernel_s: float = 3e-6  # each kernel of a quantized layer besides its GEMMs (rdu.quantized)
    # GPU mode "fixed" (a serving stack's kernels, e.g. TensorRT-LLM): each kernel's fixed cost beyond its
    # bytes at the read ceiling, measured on Hopper (our batch-1 step profile).
    gemm_kernel_s: float = 3.8e-6  # a weight-streaming GEMM/GEMV at M = 1: time = this + bytes / read_bw
    small_kernel_s: float = 2.0e-6  # a kernel that moves few bytes (norm, RoPE, attention's own cost, residual)
    sources: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)

    def matmul_efficiency(self, m: int) -> float:
        """Achieved read-bandwidth fraction of a decode matmul with M = m rows (M = batch at T = 1).

        M = 1 runs XLA's matrix-vector code path; 2 <= M runs a GEMM whose bandwidth is flat in M
        (cuBLAS: 85-89% of read at M = 1..128). Past M ~ 200 the matmul is compute-bound, which the
        callers' max(bytes / bandwidth, flops / achieved_flops) models (cuBLAS M = 256: 2.71 TB/s)."""
        return self.gemv_efficiency if m == 1 else self.gemm_efficiency


def sn40l(hbm_tb_s: float = 1.8, constants: str = "published") -> RDUSpec:
    """The SN40L socket; `hbm_tb_s` picks one of the published HBM bandwidths (1.6, 1.8 or 2.0 TB/s).

    Default 1.8 TB/s: the chip paper's own Table II, the primary spec sheet. 1.6 TB/s is the figure the
    successor paper uses as "peak" for its roofline percentages, so `validate` quotes % of peak on it.
    `constants="fitted"` replaces the fitted constants (`SN40L_FITTED`) with those of rdu/fitted.json
    (fitted at 1.8 TB/s).
    """
    _check_constants(constants)
    if hbm_tb_s not in SN40L_HBM_CHOICES:
        raise ValueError(f"SN40L HBM bandwidth must be one of {sorted(SN40L_HBM_CHOICES)} TB/s, got {hbm_tb_s}")
    spec = _sn40l(hbm_tb_s)
    if constants == "published":
        return spec
    c = load_fitted()["sn40l"]["fitted"]
    note = "fitted (rdu/fitted.json, python -m rdu.fit) to the in-sample SN40L rows; prior: "
    src = dict(spec.sources)
    return replace(
        spec,
        name=spec.name + " fitted",
        **{k: c[k] for k in SN40L_FITTED},
        sources=tuple((k, note + v if k in SN40L_FITTED else v) for k, v in src.items()),
    )


def _sn40l(hbm_tb_s: float) -> RDUSpec:
    return RDUSpec(
        name=f"SN40L (HBM {hbm_tb_s} TB/s)",
        pcus=1040,
        pmus=1040,
        sram_bytes=520 * MIB,
        pmu_bytes=512 * KIB,
        hbm_bytes=64 * GIB,
        ddr_bytes=int(1.5 * TIB),
        bf16_flops=638e12,
        hbm_bw=hbm_tb_s * 1e12,
        ddr_bw=200e9,
        hbm_efficiency=0.85,
        call_s=3e-6,
        stage_latency_s=0.5e-6,
        p2p_bw=100e9,
        p2p_hop_s=1.5e-6,
        max_sockets=16,
        sources=(
            ("pcus", "SN40L paper Table II: 1040 PCUs"),
            ("pmus", "SN40L paper Table II: 1040 PMUs"),
            ("sram_bytes", "SN40L paper Table II / §IV: 520 MiB on-chip PMU SRAM"),
            ("pmu_bytes", "derived 520 MiB / 1040 PMUs = 512 KiB; successor paper also gives 512 KB/PMU"),
            ("hbm_bytes", "SN40L paper Table II: 64 GiB HBM"),
            ("ddr_bytes", "SN40L paper Table II: up to 1.5 TiB DDR per socket"),
            ("bf16_flops", "SN40L paper Table II: 638 BF16 TFLOP/s"),
            ("hbm_bw", SN40L_HBM_CHOICES[hbm_tb_s]),
            ("ddr_bw", "SN40L paper Table II / text: over 200 GB/s"),
            ("hbm_efficiency", "SN40L paper §VI-B: a fused decoder layer saturates close to 85% of HBM BW"),
            (
                "call_s",
                "prior 3 us, spread x/÷ 3: hardware-orchestrated launch (SN40L §IV-D; 'virtually zero "
                "kernel launch overheads', §VI-B) plus the end-of-call sync; no µs figure is published, "
                "and launch and sync reach the time only as a sum, so they are one constant",
            ),
            (
                "stage_latency_s",
                "prior 0.5 us per stage, spread x/÷ 3: no µs figure is published. One latency serves the "
                "call boundary (drain + fill, HBM idle: DIAYN Fig. 11) and the carried activation's "
                "path through a looped layer; the depth (53-56 stages a decoder layer, 8 the LM head) is "
                "read from the traced graph",
            ),
            ("p2p_bw", "assumed 100 GB/s per socket: SN40L P2P link bandwidth is NOT FOUND in any source"),
            (
                "p2p_hop_s",
                "prior 1.5 us, spread x/÷ 3: one P2P write of a tile into a peer's PMU, the AGCU "
                "protocol (SN40L §VII; DIAYN Fig. 5: the all-reduce streams from the down-projection GEMM "
                "into remote PMUs); NOT FOUND. Two hops per all-reduce, on the carried activation's path",
            ),
            ("max_sockets", "SambaRack SN40L-16 (KL paper: 8 and 16 sockets)"),
        ),
    )


H200 = GPUSpec(
    name="NVIDIA H200 SXM",
    hbm_bytes=141 * 10**9,
    bf16_flops=989e12,
    achieved_flops=784e12,
    hbm_bw=4.8e12,
    read_bw=4246e9,
    copy_bw=4275e9,
    gemv_efficiency=0.80,
    gemm_efficiency=0.87,
    attention_efficiency=0.71,
    kernel_overhead_s=3e-6,
    eager_op_s=5e-6,
    nvlink_bw=450e9,
    allreduce_latency_s=20e-6,
    sources=(
        ("hbm_bytes", "NVIDIA H200 datasheet: 141 GB HBM3e"),
        ("bf16_flops", "NVIDIA H200 datasheet: 989 TFLOP/s BF16 dense"),
        ("achieved_flops", "h200-anchors.md: 784 TFLOP/s, 8192^3 torch matmul"),
        ("hbm_bw", "NVIDIA H200 datasheet: 4.8 TB/s"),
        ("read_bw", "h200-anchors.md: 4246 GB/s measured read ceiling (sum over 4 GiB)"),
        ("copy_bw", "h200-anchors.md: 4275 GB/s device-to-device copy (read + written)"),
        (
            "gemv_efficiency",
            "BENCHMARKS.md kernels table: XLA unrolled 32 x [4096, 14336] at M=1, 80% of read; "
            "in the whole step XLA's M=1 path is slower (the fit lowers it on batch-1 rows)",
        ),
        (
            "gemm_efficiency",
            "h200-anchors.md: cuBLAS K=4096 N=14336 M=1..128 at 3.62-3.77 TB/s = 85-89% of read "
            "(M=256: 2.71 TB/s, compute-bound)",
        ),
        (
            "attention_efficiency",
            "docs/log/2026-11-30.md (kernel tables): XLA einsum decode attention, time vs "
            "K+V bytes over B1 S8192 / B1 S32768 / B32 S8192 (38.6, 71.5, 389 us) has slope "
            "3.06 TB/s = 71% of read (+28 us per call, the kernels' own overheads); "
            "h200-anchors.md's 26.5% is host-clock timed (rdu.anchors.CONFLICTS)",
        ),
        (
            "kernel_overhead_s",
            "assumed 3 us: gap between back-to-back queued CUDA kernels (launch ~2-4 us); not measured here",
        ),
        ("eager_op_s", "assumed 5 us: PyTorch eager host dispatch per op (commonly quoted 3-10 us)"),
        ("nvlink_bw", "NVIDIA H200 SXM: NVLink 900 GB/s bidirectional"),
        (
            "allreduce_latency_s",
            "measured on 2 NVLink H200s: one jitted psum of [B, 4096] bf16 in a "
            "chain of 100 took 16.7-22.5 us (B = 1, 8; NCCL_PROTO=LL, XLA's one-shot kernel "
            "and sync collectives did not beat it; benchmarks/results/2026-11-30/allreduce_variants.json, "
            "benchmarks/results/2026-11-30/tp_gpu_psum.json); 20 us taken",
        ),
        (
            "flat_gemm_efficiency",
            "docs/log/2026-11-30.md (kernel tables): ours_mosaic_loop over [32, 4096, 14336] at M=1, 3064 GB/s = "
            "0.64 of the 4.8 TB/s peak (the in-place mode's efficiencies are of the peak: the "
            "bench suite's KV-cache reads run past the jnp.sum ceiling)",
        ),
        (
            "flat_gemm_m_exponent",
            "docs/log/2026-11-30.md (kernel tables): the same loop at M=8, 2857 GB/s: ln(3064/2857) / ln 8 = 0.034",
        ),
        (
            "split_k_efficiency",
            "docs/log/2026-11-30.md (kernel tables): ours_async decode attention B32 S8192, 3814 GB/s = 0.79 of peak",
        ),
        (
            "inplace_kernel_gap_s",
            "assumed 3 us, as kernel_overhead_s: the fixed cost of each kernel inside the "
            "per-layer CUDA graph (its launch, ramp and drain; no gap between kernels)",
        ),
        (
            "quant_glue_kernel_s",
            "prior: assumed 3 us, as inplace_kernel_gap_s; fitted (rdu.fit.quant) on one measured quantized "
            "step, Llama-3.1-8B int4 batch 1 (benchmarks/results/2026-12-03/ab_int4_kernel_order_pdl_8b_h200.jsonl): "
            "each kernel of a quantized layer besides its four GEMM launches (the qkv_rope epilogue, the "
            "attention kernel, norms, residual adds and converts), a launch plus a few small reads",
        ),
        (
            "p2p_allreduce_s",
            "measured on 2 NVLink H200s: kernels.allreduce's barrier-free "
            "kernel (with the residual add) inside a TP2 Llama-3.1-8B batch-1 decode step (profiler, "
            "GPU 0) runs 3.7-4.2 us after attention and 5.4-6.5 us after the MLP, where it also waits "
            "for the slower GPU (benchmarks/results/2026-11-30/tp_profile_residual.json); their mean, 5.0 us, "
            "taken. H200 only: not measured on an H100",
        ),
        (
            "gemm_kernel_s",
            "measured: intercept of kernel time against weight bytes over the four projection kernels of "
            "our batch-1 step (benchmarks/results/2026-12-01/step_profile_b1.jsonl, one H200, per-step "
            "means: q·k·v 15.2 us for 50.3 MB, o 12.0 us for 33.6 MB, gate+up 56.4 us for 234.9 MB, down "
            "28.2 us for 117.4 MB); least squares: 3.8 us + bytes at 4.53 TB/s, about the read ceiling "
            "(4.25-4.46 TB/s). cuBLAS K=4096 N=14336 M=1 at 31-34 us (h200-anchors.md) agrees: 3.8 us + "
            "117.4 MB at 4.25 TB/s = 31.4 us. Launch, ramp, split-K reduction and tail: taken as a "
            "property of Hopper kernels, so also the H100's",
        ),
        (
            "small_kernel_s",
            "measured: median of the 8 other kernels of a layer in the same profile (per-step means: "
            "norms 2.1 and 3.8 us, RoPE + cache write 1.5, attention 4.8 at a 1k cache, split combine "
            "2.0, adds and a convert 1.3-2.0): 2.0 us",
        ),
    ),
)

H100 = replace(
    H200,
    name="NVIDIA H100 SXM",
    hbm_bytes=80 * 10**9,
    hbm_bw=3.35e12,
    read_bw=3.0e12,
    copy_bw=3.0e12,
    allreduce_latency_s=6.0e-6,
    sources=tuple(
        (k, v)
        for k, v in H200.sources
        if k not in ("hbm_bytes", "hbm_bw", "read_bw", "copy_bw", "achieved_flops", "allreduce_latency_s")
    )
    + (
        (
            "allreduce_latency_s",
            "8 GPUs, sourced: sgl-project/sglang PR #2904 (H100, TensorRT-LLM's custom one-shot "
            "all-reduce kernel, no CUDA graph) 5.7 us at 4 KB and 7.8 us at 32 KB on TP8; a [1, 4096] bf16 "
            "message is 8 KB: 6.0 us, linear between the two. TensorRT-LLM runs this kernel for small "
            "tensor-parallel all-reduces over NVLink; NCCL on 8 H100s takes 19.2-20.7 us at 128 B-16 KB "
            "(ByteDance-Seed/Triton-distributed issue #57), reported as the alternative "
            "(rdu.anchors.CONFLICTS['dgx_h100_allreduce_us']); our 2-GPU NCCL psum (20 us) is not an "
            "8-GPU figure",
        ),
        ("hbm_bytes", "NVIDIA H100 SXM datasheet: 80 GB HBM3"),
        ("hbm_bw", "NVIDIA H100 SXM datasheet: 3.35 TB/s"),
        ("read_bw", "KL/DIAYN papers count DGX H100 as 24 TB/s = 3.0 TB/s per GPU (papers.md §4)"),
        ("copy_bw", "taken equal to read_bw (no H100 measurement here)"),
        ("achieved_flops", "H200 measurement reused (same GH100 die and clocks)"),
        ("bf16_flops", "NVIDIA H100 SXM datasheet: 989 TFLOP/s BF16 dense"),
    ),
)

GPUS = {"h100": H100, "h200": H200}


# The SN40L constants of the time model; SN40L_FITTED are fitted (rdu.fit.sn40l, priors as their sources
# say), the others keep their sourced or assumed value.
SN40L_FREE = ("call_s", "stage_latency_s", "p2p_hop_s", "hbm_efficiency")
SN40L_FITTED = ("stage_latency_s", "p2p_hop_s")
GPU_FREE = ("kernel_overhead_s", "eager_op_s", "gemv_efficiency", "gemm_efficiency", "attention_efficiency")
INPLACE_FREE = ("inplace_kernel_gap_s", "flat_gemm_efficiency", "flat_gemm_m_exponent", "split_k_efficiency")
QUANT_FREE = ("quant_glue_kernel_s",)


def gpu(name: str, constants: str = "published") -> GPUSpec:
    """A GPU spec; `constants="fitted"` takes the free constants from rdu/fitted.json (fitted to our
    H200 rows: "gpu" for the XLA modes, "gpu_inplace" for looped_inplace, "gpu_quant" for its quantized
    layers; also used for the H100)."""
    _check_constants(constants)
    try:
        spec = GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}") from None
    if constants == "published":
        return spec
    rec = load_fitted()
    c = dict(rec["gpu"]["fitted"], **rec.get("gpu_inplace", {}).get("fitted", {}))
    c.update(rec.get("gpu_quant", {}).get("fitted", {}))
    keys = [k for k in GPU_FREE + INPLACE_FREE + QUANT_FREE if k in c]
    note = "fitted (rdu/fitted.json) to our H200 rows; published: "
    return replace(
        spec,
        name=spec.name + " fitted",
        **{k: c[k] for k in keys},
        sources=tuple((k, note + v if k in keys else v) for k, v in spec.sources),
    )

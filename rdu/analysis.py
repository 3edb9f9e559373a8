"""One run of trace -> map -> simulate for a preset: the numbers behind `jaxdecode rdu`, its --json, the
HTML report (rdu.viz) and the PNGs (rdu.plots). All three read the same `Analysis`, so they agree.

    a = analyze(get_preset("llama-3.1-8b"), batch=1, context=4096, sockets=[1, 2, 4, 8, 16])
    a.result          # the dict `jaxdecode rdu --json` prints
    a.lines           # the text lines it prints
    timeline(a.runs[0].mapping, a.runs[0].looped)   # kernel-call segments of one token, with HBM use
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rdu.gpu import gpu_estimate
from rdu.graph import DataflowGraph
from rdu.hardware import GPUSpec, RDUSpec, gpu, sn40l
from rdu.mapping import Mapping, ModelDoesNotFit, map_decode
from rdu.simulate import Estimate, simulate_rdu, socket_bytes
from rdu.trace import trace_decode_step

GPU_REPORT_MODES = ("xla", "scan_copy", "eager")


@dataclass
class SocketRun:
    sockets: int
    mapping: Mapping | None  # None: the model does not fit
    looped: Estimate | None
    unlooped: Estimate | None
    reason: str = ""

    @property
    def fits(self) -> bool:
        return self.mapping is not None


@dataclass
class Analysis:
    cfg: object
    batch: int
    context: int
    hw: RDUSpec
    gpu: GPUSpec
    graph: DataflowGraph  # the looped trace (what is mapped)
    unrolled: DataflowGraph  # the unrolled trace (what the GPU model counts kernels of)
    runs: list[SocketRun]
    gpu_estimates: dict[str, Estimate]
    result: dict = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)

    @property
    def fitting(self) -> list[SocketRun]:
        return [r for r in self.runs if r.fits]


def analyze(
    cfg,
    batch: int = 1,
    context: int = 4096,
    sockets=(1, 2, 4, 8, 16),
    *,
    hbm_tb_s: float = 1.8,
    gpu_name: str = "h200",
    constants: str = "published",
    n_gpus: int = 1,
    quantize: str | None = None,
) -> Analysis:
    """Trace the decode step of `cfg`, map it on each socket count, simulate looped and unlooped, and
    estimate the GPU (`n_gpus` tensor parallel); `constants` picks the published or the fitted free
    constants (rdu/fitted.json); `result` is the JSON object of `jaxdecode rdu --json`."""
    hw = sn40l(hbm_tb_s, constants)
    graph = trace_decode_step(cfg, batch, context, quantize=quantize)
    result = {
        "model": cfg.name,
        "batch": batch,
        "context": context,
        "hardware": hw.name,
        "constants": constants,
        "n_gpus": n_gpus,
        "gflop_per_step": graph.total_flops() / 1e9,
        "gb_per_step": graph.fused_bytes / 1e9,
        "sn40l": [],
    }
    lines = [
        f"{cfg.name} B={batch} S={context}: {graph.total_flops() / 1e9:.2f} GFLOP, "
        f"{graph.fused_bytes / 1e9:.2f} GB per step; {hw.name}; {constants} constants"
        + (" (rdu/fitted.json)" if constants == "fitted" else " (rdu/hardware.py)")
    ]
    runs = []
    for p in sockets:
        try:
            m = map_decode(graph, hw, p, batch=batch, kv_heads=cfg.n_kv_heads, dim=cfg.dim)
        except ModelDoesNotFit as e:
            lines.append(f"  {p:2d} sockets: does not fit: {e}")
            result["sn40l"].append({"sockets": p, "fits": False, "reason": str(e)})
            runs.append(SocketRun(p, None, None, None, str(e)))
            continue
        on, off = simulate_rdu(m, looped=True), simulate_rdu(m, looped=False)
        lines.append(
            f"  {p:2d} sockets: looped {on.ms_per_token:8.3f} ms ({on.tok_s:8.1f} tok/s, "
            f"{100 * on.fraction_of_roofline:4.1f}% of roofline, {on.calls_per_token} calls)  "
            f"unlooped {off.ms_per_token:8.3f} ms ({off.calls_per_token} calls)  "
            f"KL {off.per_token_s / on.per_token_s:.2f}x"
        )
        result["sn40l"].append(
            {
                "sockets": p,
                "fits": True,
                "looped": on.as_dict(),
                "unlooped": off.as_dict(),
                "kl_speedup": off.per_token_s / on.per_token_s,
            }
        )
        runs.append(SocketRun(p, m, on, off))
    spec = gpu(gpu_name, constants)
    unrolled = trace_decode_step(cfg, batch, context, looped=False, quantize=quantize)
    result["gpu"] = {}
    estimates = {}
    for mode in GPU_REPORT_MODES:
        e = gpu_estimate(unrolled, spec, batch=batch, dim=cfg.dim, kv_heads=cfg.n_kv_heads, mode=mode, n_gpus=n_gpus)
        fits = graph.fused_bytes / n_gpus <= spec.hbm_bytes
        note = "" if fits else f"  (does not fit {spec.hbm_bytes / 1e9:.0f} GB HBM per GPU)"
        lines.append(
            f"  {spec.name} x{n_gpus} {mode:9s}: {e.ms_per_token:8.3f} ms ({e.tok_s:8.1f} tok/s, "
            f"{e.calls_per_token} kernels per GPU){note}"
        )
        result["gpu"][mode] = e.as_dict()
        estimates[mode] = e
    return Analysis(cfg, batch, context, hw, spec, graph, unrolled, runs, estimates, result, lines)


@dataclass(frozen=True)
class Segment:
    """A stretch of one token step on one socket: `phase` is launch | body | comm | boundary.

    hbm is the HBM read rate during the stretch as a fraction of the socket's peak bandwidth.
    """

    start_s: float
    end_s: float
    kernel: str
    role: str
    call: int
    phase: str
    hbm: float


def timeline(m: Mapping, est: Estimate) -> list[Segment]:
    """The kernel calls of one decode token as back-to-back segments, following simulate_rdu's cost
    structure: per call launch, the body (streaming), then the pipeline latency it exposes (drain and
    fill, the all-reduce hops: HBM idle). The looped decoder pays launch and one fill, its first
    iteration, then L - 1 steady periods that stream the socket's bytes over max(latency, body + stall).
    """
    roles = {k.name: k for k in m.kernels}
    peak = m.hw.hbm_bw
    segs: list[Segment] = []
    t = 0.0

    def add(dt: float, kt, k, c: int, phase: str, nbytes: float = 0.0) -> None:
        nonlocal t
        rate = nbytes / dt / peak if dt > 0 else 0.0
        segs.append(Segment(t, t + dt, kt.name, k.role, c, phase, rate))
        t += dt

    for kt in est.kernels:
        k = roles[kt.name]
        nbytes = socket_bytes(k, m) * m.placement.hbm_fraction
        body = max(kt.memory_s, kt.compute_s)
        if k.is_layer and kt.calls == 1:  # the looped decoder kernel
            add(kt.launch_s, kt, k, 0, "launch")
            add(kt.boundary_s, kt, k, 0, "boundary")
            add(body, kt, k, 0, "body", nbytes)
            if kt.iterations > 1:
                add((kt.iterations - 1) * kt.iteration_s, kt, k, 0, "body", (kt.iterations - 1) * nbytes)
            continue
        for c in range(kt.calls):
            add(kt.launch_s, kt, k, c, "launch")
            for _ in range(kt.iterations):
                add(body, kt, k, c, "body", nbytes)
            add(kt.boundary_s, kt, k, c, "boundary")
    return segs


def mean_hbm(segs: list[Segment]) -> float:
    """Time-averaged HBM use over the segments, as a fraction of peak."""
    total = segs[-1].end_s - segs[0].start_s if segs else 0.0
    return sum((s.end_s - s.start_s) * s.hbm for s in segs) / total if total else 0.0

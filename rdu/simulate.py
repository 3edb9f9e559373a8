"""Per-token decode time on modeled SN40L sockets and on a modeled GPU, with one cost structure.

Every kernel call costs   launch + boundary + body, where the boundary (HBM idle) is the sync at the
end of the call plus the pipeline's drain and the next call's fill, one stage latency per stage of the
kernel's pipeline (its depth, from the traced graph: a decoder layer ~55 stages, the LM head 8),
and a body iteration costs max(memory, compute [+ communication]) where
- memory  = bytes per socket / streaming bandwidth (HBM at the fused-kernel efficiency; an HBM/DDR
  split streams as max(hbm part / hbm bw, ddr part / ddr bw), GenZ's offload rule),
- compute = the common stage time T of the PCU allocation (mapping.allocate),
- communication = tensor-parallel all-reduces per layer (alpha-beta, recursive halving/doubling:
  2 * alpha * ceil(log2 p) + 2 * (p-1)/p * bytes / link bw).

Kernel looping turns the L decoder calls into one call with L iterations: the launch and boundary
are paid once, and the next layer's weights stream while the current layer computes and reduces,
so an iteration costs max(memory, compute + communication). The all-reduces lie on the carried
activation's path, so looping cannot hide them: on 8-16 sockets they bound the iteration of every
model whose per-socket layer streams faster than two all-reduces (up to 8B at 16 sockets), which is
why looping gains less there than on one socket, where the call boundary is the only cost it removes. Without looping each of the L calls
pays launch + boundary + max(memory, compute + all-reduces inside the call) + the last all-reduce
(the one after down_proj ends the call; the one after o_proj overlaps the MLP's weight stream).

The GPU mode counts kernels from the same traced graph (one per op in eager mode, XLA-style fusion
otherwise) and charges each a fixed overhead, plus max(bytes at measured achieved bandwidths, FLOPs at
the achieved matmul rate); the matmul bandwidth depends on M = batch (`GPUSpec.matmul_efficiency`).
With n GPUs it models Megatron tensor parallelism (`gpu_kernel_terms`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from rdu.graph import DataflowGraph
from rdu.hardware import GPUSpec
from rdu.mapping import ALLREDUCES_PER_LAYER, STAGE_KINDS, Kernel, Mapping

GPU_MODES = ("xla", "eager", "scan_copy", "fixed", "looped_inplace")
EAGER_DATA_OPS = frozenset({"convert_element_type", "concatenate", "gather", "iota", "select_n", "cumsum"})


@dataclass
class KernelTime:
    name: str
    calls: int
    iterations: int
    launch_s: float
    boundary_s: float
    memory_s: float  # per iteration
    compute_s: float  # per iteration
    comm_s: float  # per iteration
    iteration_s: float
    total_s: float  # all calls of this kernel in one token step


@dataclass
class Estimate:
    target: str
    batch: int
    per_token_s: float  # one decode step (one token for each of the `batch` sequences)
    bytes_per_token: int  # whole model, all sockets
    flops_per_token: int
    peak_bw: float  # aggregate peak HBM bytes/s of the devices used
    calls_per_token: int
    kernels: list[KernelTime] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.batch / self.per_token_s

    @property
    def ms_per_token(self) -> float:
        return 1e3 * self.per_token_s

    @property
    def roofline_s(self) -> float:
        return self.bytes_per_token / self.peak_bw

    @property
    def fraction_of_roofline(self) -> float:
        return self.roofline_s / self.per_token_s

    def as_dict(self) -> dict:
        return {
            "target": self.target,
            "batch": self.batch,
            "ms_per_token": self.ms_per_token,
            "tok_s": self.tok_s,
            "bytes_per_token": self.bytes_per_token,
            "flops_per_token": self.flops_per_token,
            "fraction_of_roofline": self.fraction_of_roofline,
            "calls_per_token": self.calls_per_token,
            "kernels": [vars(k) for k in self.kernels],
        }


def allreduce_s(nbytes: float, p: int, latency_s: float, bw: float) -> float:
    """Alpha-beta all-reduce over p devices (recursive halving/doubling)."""
    if p <= 1:
        return 0.0
    return 2 * latency_s * math.ceil(math.log2(p)) + 2 * (p - 1) / p * nbytes / bw


def _socket_bytes(k: Kernel, m: Mapping) -> float:
    """Bytes one socket moves per iteration: weights sharded, KV sharded over kv heads, activations whole."""
    return k.weight_bytes / m.sockets + (k.cache_read_bytes + k.cache_write_bytes) / m.kv_shards + k.other_bytes


def simulate_rdu(m: Mapping, *, looped: bool = True, overheads: bool = True) -> Estimate:
    """Per-token decode time of a mapping, with or without kernel looping.

    `looped` is independent of how the graph was traced: an unrolled trace is looped by collapsing its
    L decoder calls into one call of L iterations, a looped trace is unlooped the other way.
    `overheads=False` drops launch and boundary costs (the roofline-style lower bound).
    """
    hw, p = m.hw, m.sockets
    times = []
    for k in m.kernels:
        launch, boundary = (hw.launch_s, hw.boundary_s(pipeline_depth(k, m))) if overheads else (0.0, 0.0)
        n = k.calls * k.iterations
        calls, iters = (1, n) if (k.is_layer and looped) else (n, 1) if k.is_layer else (k.calls, k.iterations)
        b = _socket_bytes(k, m)
        f = m.placement.hbm_fraction
        mem = max(f * b / hw.stream_bw, (1 - f) * b / hw.ddr_bw)
        alloc = m.allocations.get(k.name)
        compute = alloc.stage_time_s if alloc else k.flops / p / hw.bf16_flops
        if k.is_layer:
            comm = ALLREDUCES_PER_LAYER * allreduce_s(m.activation_bytes, p, hw.p2p_latency_s, hw.p2p_bw)
        elif k.role == "classifier":  # vocab-sharded logits: one all-gather = half an all-reduce
            comm = allreduce_s(k.other_bytes, p, hw.p2p_latency_s, hw.p2p_bw) / 2
        else:
            comm = 0.0
        if k.is_layer and looped:
            it = max(mem, compute + comm)  # next layer's weights prefetch during compute + all-reduce
        elif k.is_layer:
            # One call per layer: the all-reduces inside the call (after o_proj) overlap the rest of the
            # layer's weight stream; the last one (after down_proj) ends the call, with no stream left.
            tail = comm / ALLREDUCES_PER_LAYER
            it = max(mem, compute + comm - tail) + tail
        else:
            it = max(mem, compute) + comm
        total = calls * (launch + boundary) + calls * iters * it
        times.append(KernelTime(k.name, calls, iters, launch, boundary, mem, compute, comm, it, total))
    mode = "looped" if looped else "unlooped"
    return Estimate(
        f"{hw.name} x{p} {mode}",
        m.batch,
        sum(t.total_s for t in times),
        _model_bytes(m.kernels),
        m.graph.total_flops(),
        p * hw.hbm_bw,
        sum(t.calls for t in times),
        times,
    )


def pipeline_depth(k: Kernel, m: Mapping) -> int:
    """Stages of a kernel's pipeline (at least 1): a decoder layer's stages form one chain."""
    alloc = m.allocations.get(k.name)
    return max(1, len(alloc.stages)) if alloc else 1


def _model_bytes(kernels: list[Kernel]) -> int:
    return sum(k.calls * k.iterations * k.bytes for k in kernels)


def xla_kernel_count(nodes) -> int:
    """Kernels XLA launches for a list of leaf ops in program order: each matmul, gather and in-place
    update is its own kernel; runs of elementwise ops fuse into one kernel, which a reduction closes."""
    count, open_fusion = 0, False
    for n in nodes:
        if n.kind == "matmul" or n.kind == "memory" or n.op == "gather":
            count, open_fusion = count + 1, False
        elif n.kind in ("elementwise", "reduction"):
            if not open_fusion:
                count, open_fusion = count + 1, True
            if n.kind == "reduction":
                open_fusion = False
    return count


def eager_kernel_count(nodes) -> int:
    """Kernels an eager framework launches: one per computing op (views such as reshape are free)."""
    return sum(1 for n in nodes if n.kind in STAGE_KINDS or n.op in EAGER_DATA_OPS)


def gpu_allreduce_s(nbytes: float, p: int, gpu: GPUSpec) -> float:
    """One NCCL all-reduce of `nbytes` over p GPUs of one node: a fixed call latency plus the ring's
    2 (p-1)/p bytes through each GPU's NVLink (one direction)."""
    return 0.0 if p <= 1 else gpu.allreduce_latency_s + 2 * (p - 1) / p * nbytes / gpu.nvlink_bw


def gpu_allgather_s(nbytes: float, p: int, gpu: GPUSpec) -> float:
    """All-gather of a `nbytes` result sharded over p GPUs: latency plus (p-1)/p bytes per GPU."""
    return 0.0 if p <= 1 else gpu.allreduce_latency_s + (p - 1) / p * nbytes / gpu.nvlink_bw


@dataclass(frozen=True)
class GPUKernelTerms:
    """What one kernel of a traced step costs per GPU, before the free constants are applied."""

    count: int  # GPU kernels launched per call
    weight_bytes: float  # per GPU, read at the matmul efficiency
    kv_bytes: float  # KV cache read per GPU, at the attention efficiency
    other_bytes: float  # KV write + activations, at the read ceiling
    copy_bytes: float  # bytes (read + written) of the scan's weight copies, at the copy bandwidth
    compute_s: float  # FLOPs per GPU at the achieved matmul rate
    comm_s: float  # all-reduces (decoder layer) or the logits all-gather (classifier)


def gpu_kernel_terms(
    k: Kernel,
    gpu: GPUSpec,
    *,
    mode: str,
    n_gpus: int,
    kv_heads: int,
    activation_bytes: int,
    logits_bytes: int = 0,
    kernels_per_layer: int | None = None,
) -> GPUKernelTerms:
    """Tensor parallelism over `n_gpus` (Megatron): every weight (projections, MLP, the vocab-sharded LM
    head) is split n ways, the KV cache over min(n, kv_heads) shards (heads are replicated past that),
    activations are whole on every GPU; each layer all-reduces [B, D] twice, the classifier all-gathers
    the [B, V] logits."""
    if mode == "fixed" and k.is_layer:
        count = kernels_per_layer or 10
    elif k.role == "sampling":
        count = 1
    else:
        count = eager_kernel_count(k.nodes) if mode == "eager" else xla_kernel_count(k.nodes)
    kv_shards = min(n_gpus, kv_heads)
    w = k.weight_bytes / n_gpus
    if k.is_layer:
        comm = ALLREDUCES_PER_LAYER * gpu_allreduce_s(activation_bytes, n_gpus, gpu)
    elif k.role == "classifier":
        comm = gpu_allgather_s(logits_bytes, n_gpus, gpu)
    else:
        comm = 0.0
    return GPUKernelTerms(
        count,
        w,
        k.cache_read_bytes / kv_shards,
        k.cache_write_bytes / kv_shards + k.other_bytes,
        2 * w if (mode == "scan_copy" and k.is_layer) else 0.0,
        k.flops / n_gpus / gpu.achieved_flops,
        comm,
    )


def simulate_gpu(
    kernels: list[Kernel],
    gpu: GPUSpec,
    *,
    batch: int,
    mode: str = "xla",
    n_gpus: int = 1,
    kv_heads: int = 8,
    activation_bytes: int = 0,
    logits_bytes: int = 0,
    kernels_per_layer: int | None = None,
    flops: int = 0,
) -> Estimate:
    """Per-token decode time on `n_gpus` GPUs (tensor parallel) for the kernels of a traced step.

    A kernel call costs count * overhead + max(memory, compute) + communication, where memory reads the
    weights at `gpu.matmul_efficiency(batch)` (M = batch rows at one query token) and the KV cache at
    the attention efficiency, and compute is FLOPs / achieved rate (it binds past M ~ 200).
    mode: "xla" (XLA-style fusion, one dispatch per token), "eager" (one kernel per op, host dispatch
    per op), "scan_copy" ("xla" plus the copy XLA makes of every stacked layer weight before its matmul:
    one extra read and write of every weight), "fixed" (`kernels_per_layer` kernels per layer, e.g.
    10 for TensorRT-LLM per the DIAYN paper), "looped_inplace" (our engine: decoder layers as
    rdu.gpu_modes models them, embedding and LM head as "xla").
    """
    if mode not in GPU_MODES:
        raise ValueError(f"mode must be one of {GPU_MODES}, got {mode!r}")
    overhead = gpu.eager_op_s if mode == "eager" else gpu.kernel_overhead_s
    eff = gpu.matmul_efficiency(batch)
    times = []
    for k in kernels:
        n = k.calls * k.iterations
        if mode == "looped_inplace" and k.is_layer:
            from rdu.gpu_modes import inplace_layer_s, inplace_terms

            t = inplace_terms(k, gpu, n_gpus=n_gpus, kv_heads=kv_heads, activation_bytes=activation_bytes)
            mem, it = inplace_layer_s(t, gpu, batch)
            times.append(
                KernelTime(
                    k.name, t.kernels * n, 1, gpu.inplace_kernel_gap_s, 0.0, mem, t.compute_s, t.comm_s, it, n * it
                )
            )
            continue
        t = gpu_kernel_terms(
            k,
            gpu,
            mode="xla" if mode == "looped_inplace" else mode,
            n_gpus=n_gpus,
            kv_heads=kv_heads,
            activation_bytes=activation_bytes,
            logits_bytes=logits_bytes,
            kernels_per_layer=kernels_per_layer,
        )
        mem = (
            t.weight_bytes / (eff * gpu.read_bw)
            + t.kv_bytes / (gpu.attention_efficiency * gpu.read_bw)
            + t.other_bytes / gpu.read_bw
            + t.copy_bytes / gpu.copy_bw
        )
        it = t.count * overhead + max(mem, t.compute_s) + t.comm_s
        times.append(KernelTime(k.name, t.count * n, 1, overhead, 0.0, mem, t.compute_s, t.comm_s, it, n * it))
    return Estimate(
        f"{gpu.name} x{n_gpus} {mode}",
        batch,
        sum(t.total_s for t in times),
        _model_bytes(kernels),
        flops,
        n_gpus * gpu.hbm_bw,
        sum(t.calls for t in times),
        times,
    )


def gpu_estimate(
    graph: DataflowGraph,
    gpu: GPUSpec,
    *,
    batch: int,
    dim: int,
    kv_heads: int,
    mode: str = "xla",
    n_gpus: int = 1,
    itemsize: int = 2,
    **kw,
) -> Estimate:
    """`simulate_gpu` on the kernels of a traced decode step (the sampling kernel is left out: the
    measured GPU rows time the forward step plus sampling inside the same dispatch)."""
    from rdu.mapping import fuse

    all_kernels = fuse(graph)
    logits = sum(k.other_bytes for k in all_kernels if k.role == "sampling")  # [B, V] logits
    kernels = [k for k in all_kernels if k.role != "sampling"]
    return simulate_gpu(
        kernels,
        gpu,
        batch=batch,
        mode=mode,
        n_gpus=n_gpus,
        kv_heads=kv_heads,
        activation_bytes=batch * dim * itemsize,
        logits_bytes=logits,
        flops=graph.total_flops(),
        **kw,
    )


def with_peak(est: Estimate, peak_bw: float) -> Estimate:
    """The same estimate with another peak bandwidth for `fraction_of_roofline`."""
    return replace(est, peak_bw=peak_bw)

"""Per-token decode time on modeled SN40L sockets, and the `Estimate` every target reports.

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
why looping gains less there than on one socket, where the call boundary is the only cost it
removes. Without looping each of the L calls pays launch + boundary + max(memory, compute +
all-reduces inside the call) + the last all-reduce (the one after down_proj ends the call; the one
after o_proj overlaps the MLP's weight stream).

The GPU modes, on the same traced graph and the same `Estimate`, are in rdu/gpu.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rdu.mapping import ALLREDUCES_PER_LAYER, Kernel, Mapping


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


def socket_bytes(k: Kernel, m: Mapping) -> float:
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
        b = socket_bytes(k, m)
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
        model_bytes(m.kernels),
        m.graph.total_flops(),
        p * hw.hbm_bw,
        sum(t.calls for t in times),
        times,
    )


def pipeline_depth(k: Kernel, m: Mapping) -> int:
    """Stages of a kernel's pipeline (at least 1): a decoder layer's stages form one chain."""
    alloc = m.allocations.get(k.name)
    return max(1, len(alloc.stages)) if alloc else 1


def model_bytes(kernels: list[Kernel]) -> int:
    return sum(k.calls * k.iterations * k.bytes for k in kernels)

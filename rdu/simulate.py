"""Per-token decode time on modeled SN40L sockets, and the `Estimate` every target reports.

One pipeline-latency model serves call boundaries and the loop alike. A kernel call has
- a body: max(memory, compute), where memory = bytes per socket / streaming bandwidth (HBM at the
  fused-kernel efficiency; an HBM/DDR split streams as max(hbm part / hbm bw, ddr part / ddr bw),
  GenZ's offload rule) and compute = the common stage time T of the PCU allocation (mapping.allocate);
- a latency: the path data takes through the kernel's pipeline, depth x `stage_latency_s` (the depth
  from the traced graph: a decoder layer ~55 stages, the LM head 8), plus the exposed part of its
  all-reduces (`RDUSpec.allreduce_s`: streamed from the producing GEMM into peer PMUs, two hops each);
- a fixed `call_s` (hardware-orchestrated launch + end-of-call sync).

Unlooped, every call costs call_s + latency + body: a call's stages pull their weights as their input
arrives, so the stream waits while the previous call drains and this one fills (HBM idle: DIAYN Fig. 11).
Kernel looping makes the L decoder calls one call of L iterations: call_s and the first fill are paid
once, and each further iteration costs max(latency, body + stall): the next layer's weights stream into
free SRAM while the carried activation passes the pipeline (the pipelined outer loop), and only what the
free SRAM cannot hold (`Placement.prefetch_bytes`) waits, the stall max(0, latency - prefetch / bandwidth).
So a layer whose stream outlasts its latency runs at the streaming rate (70B on 8-16 sockets), and one
whose latency outlasts its stream is latency-bound (8B on 16 sockets: ~28 us of stages and all-reduce hops
against ~19 us of weights), which is why looping gains most where the two are about equal.

The GPU modes, on the same traced graph and the same `Estimate`, are in rdu/gpu.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rdu.mapping import ALLREDUCES_PER_LAYER, Kernel, Mapping


@dataclass
class KernelTime:
    name: str
    calls: int
    iterations: int
    launch_s: float  # call_s, per call
    boundary_s: float  # the pipeline latency (stages + all-reduce hops) each call exposes once
    memory_s: float  # per iteration
    compute_s: float  # per iteration
    comm_s: float  # per iteration
    iteration_s: float  # the body; for the looped decoder, the steady period max(latency, body + stall)
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


def socket_bytes(k: Kernel, m: Mapping) -> float:
    """Bytes one socket moves per iteration: weights sharded, KV sharded over kv heads, activations whole."""
    return k.weight_bytes / m.sockets + (k.cache_read_bytes + k.cache_write_bytes) / m.kv_shards + k.other_bytes


def comm_s(k: Kernel, m: Mapping) -> float:
    """Exposed communication of one iteration: a layer's two all-reduces of [B, D]; the classifier's
    vocab-sharded logits gathered once (one hop and half the bytes of an all-reduce)."""
    hw, p = m.hw, m.sockets
    if k.is_layer:
        return ALLREDUCES_PER_LAYER * hw.allreduce_s(m.activation_bytes, p)
    if k.role == "classifier":
        return hw.allreduce_s(k.other_bytes, p) / 2
    return 0.0


def simulate_rdu(m: Mapping, *, looped: bool = True, overheads: bool = True) -> Estimate:
    """Per-token decode time of a mapping, with or without kernel looping.

    `looped` is independent of how the graph was traced: an unrolled trace is looped by collapsing its
    L decoder calls into one call of L iterations, a looped trace is unlooped the other way.
    `overheads=False` drops call costs and every latency (the roofline-style lower bound).
    """
    hw, p = m.hw, m.sockets
    times = []
    for k in m.kernels:
        n = k.calls * k.iterations
        b = socket_bytes(k, m)
        f = m.placement.hbm_fraction
        mem = max(f * b / hw.stream_bw, (1 - f) * b / hw.ddr_bw)
        alloc = m.allocations.get(k.name)
        compute = alloc.stage_time_s if alloc else k.flops / p / hw.bf16_flops
        comm = comm_s(k, m)
        body = max(mem, compute)
        call, latency = (hw.call_s, hw.pipeline_latency_s(pipeline_depth(k, m)) + comm) if overheads else (0.0, 0.0)
        if k.is_layer and looped:
            stall = max(0.0, latency - m.placement.prefetch_bytes / hw.stream_bw)
            period = max(latency, body + stall)
            total = call + latency + body + (n - 1) * period
            times.append(KernelTime(k.name, 1, n, call, latency, mem, compute, comm, period, total))
        else:
            calls, iters = (n, 1) if k.is_layer else (k.calls, k.iterations)
            total = calls * (call + latency + iters * body)
            times.append(KernelTime(k.name, calls, iters, call, latency, mem, compute, comm, body, total))
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

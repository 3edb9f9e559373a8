"""GPU mode "looped_inplace": our engine's decode step, kernel by kernel.

The default engine loops the layers in one `lax.scan` and reads everything in place with Pallas kernels.
XLA's default command buffers capture the loop body (fusions and Pallas/Mosaic calls: 17 per layer in the
10:35 suite the model is fitted to, 13 in the 19:31 build at batch 1, 15 with TP2) as one
CUDA graph, launched once per layer; inside it kernels run back to back with no gap on one GPU (the ~4 us
between the per-layer graphs in profiler traces is not there untraced; BENCHMARKS.md). A 2-GPU program
shows ~0.45 us between its kernels, which this mode does not charge. Per layer it runs:

- one flat GEMM per group of projections that read the same input (one kernel for q, k, v, one
  SwiGLU kernel for gate + up) and one each for o and down, reading the stacked weights [L, K, N]: bytes / (flat GEMM efficiency(M) * peak), with
  efficiency(M) = flat_gemm_efficiency * M ** -flat_gemm_m_exponent (M = batch rows; our Mosaic
  kernel: 71% -> 66% of the jnp.sum ceiling from M = 1 to 8, KERNELS_RESULTS.md);
- one split-K decode attention kernel over the stacked cache: KV bytes / (split_k_efficiency * peak);
- the in-place KV-cache write and XLA's elementwise/reduction fusions between the kernels
  (norms, RoPE, residual adds), their bytes at the read ceiling;

and every kernel costs a fixed `inplace_kernel_gap_s` inside the per-layer graph: its own launch, ramp
and drain (a small kernel takes ~1.1-2 us however few bytes it moves), not a gap between kernels. The
layer time is kernels * that cost + max(memory, FLOPs / achieved rate) + all-reduces (tensor parallel,
as the "xla" mode). The embedding and the LM head run outside the loop as XLA ops and cost what the
"xla" mode says. Efficiencies are fractions of the spec peak (4.8 TB/s), not of the jnp.sum ceiling:
the measured cost of each extra KV byte from 1k to 8k context (bench suite of 10:31-10:36 UTC, batch 8
and 32) is 4.47-4.56 TB/s, above that run's ceiling (4.44 TB/s).
"""

from __future__ import annotations

from dataclasses import dataclass

from rdu.graph import DataflowGraph
from rdu.hardware import GPUSpec
from rdu.mapping import ALLREDUCES_PER_LAYER, Kernel

INPLACE_MODE = "looped_inplace"


@dataclass(frozen=True)
class InplaceTerms:
    """What one decoder layer of the looped in-place step costs per GPU, before the free constants."""

    kernels: int  # kernels launched per layer (flat GEMMs + attention + XLA fusions and scatters)
    gemms: int  # of which flat GEMM kernels
    gemm_bytes: float  # projection weights per GPU, at the flat GEMM efficiency
    kv_bytes: float  # KV cache read per GPU, at the split-K attention efficiency
    other_bytes: float  # KV write + activations, at the read ceiling
    compute_s: float  # FLOPs per GPU at the achieved matmul rate
    comm_s: float  # tensor-parallel all-reduces


def _is_attention(n) -> bool:
    return "sdpa" in n.scope


# Ops that pass a value on unchanged in content: a matmul reading x.reshape(...) reads x.
_VIEW_OPS = frozenset({"reshape", "convert_element_type", "squeeze", "expand_dims", "broadcast_in_dim", "copy"})


def _operand_values(g: DataflowGraph) -> dict[int, list]:
    """For every leaf node of `g` (by `id(node)`), the value each operand reads, resolved through call
    boundaries (a sub-graph's input is the caller's operand) and view ops: equal keys = the same tensor."""
    out: dict[int, list] = {}

    def visit(graph: DataflowGraph, env: dict[int, object]) -> None:
        operands: dict[int, dict[int, object]] = {}
        for e in graph.edges:
            if e.dst != -1:
                src = (
                    env.get(e.src_port, ("in", id(graph), e.src_port))
                    if e.src == -1
                    else (id(graph), e.src, e.src_port)
                )
                operands.setdefault(e.dst, {})[e.dst_port] = src
        for n in graph.nodes:  # program order: a view's result resolves to its operand
            ports = operands.get(n.id, {})
            if n.children:
                for c in n.children:
                    visit(c, ports)
            else:
                out[id(n)] = [ports.get(i) for i in range(len(n.inputs))]
                if n.op in _VIEW_OPS and 0 in ports:
                    for e in graph.edges:
                        if e.src == n.id and e.dst != -1:
                            operands.setdefault(e.dst, {})[e.dst_port] = ports[0]

    visit(g, {})
    return out


def inplace_kernel_counts(layer: DataflowGraph) -> tuple[int, int]:
    """(flat GEMM kernels, all kernels) of one traced layer: projection matmuls that read the same
    input tensor run as one kernel (q, k, v: `kernel_qkv`; gate, up: `kernel_swiglu`), every other
    projection (o, down) as its own; the attention ops (scope `sdpa`) are one kernel; the rest fuse
    as XLA does (`xla_kernel_count`)."""
    from rdu.simulate import xla_kernel_count

    nodes = [n for n, _ in layer.walk() if not n.children]
    values = _operand_values(layer)
    groups: list[set] = []
    for n in nodes:
        if n.kind == "matmul" and not _is_attention(n):
            reads = {v for v in values[id(n)] if v is not None}
            hit = [g for g in groups if g & reads]
            groups = [g for g in groups if not g & reads] + [reads.union(*hit)]
    gemms = len(groups)
    rest = xla_kernel_count([n for n in nodes if not _is_attention(n) and n.kind != "matmul"])
    return gemms, gemms + int(any(_is_attention(n) for n in nodes)) + rest


ALLREDUCE_IMPLS = ("psum", "kernel")


def inplace_terms(
    k: Kernel, gpu: GPUSpec, *, n_gpus: int = 1, kv_heads: int = 8, activation_bytes: int = 0, allreduce: str = "psum"
) -> InplaceTerms:
    """The terms of one decoder kernel (weights split n ways, KV over min(n, kv_heads) shards).

    Tensor-parallel all-reduces: "psum" charges NCCL's measured latency plus the ring's NVLink bytes
    (`gpu_allreduce_s`); "kernel" (2 GPUs; the engine picks it for activations of at most 8192
    elements) charges our peer-to-peer kernel's measured duration, `p2p_allreduce_s`, and no extra
    kernel slot: it also does the residual add, whose fusion the traced count already holds."""
    from rdu.simulate import gpu_allreduce_s

    if allreduce not in ALLREDUCE_IMPLS:
        raise ValueError(f"allreduce must be one of {ALLREDUCE_IMPLS}, got {allreduce!r}")
    if allreduce == "kernel" and n_gpus != 2:
        raise ValueError(f"the all-reduce kernel runs on 2 GPUs, got {n_gpus}")
    gemms, count = inplace_kernel_counts(k.graph)
    shards = min(n_gpus, kv_heads)
    if allreduce == "kernel":
        per_call = gpu.p2p_allreduce_s
    else:
        per_call = gpu_allreduce_s(activation_bytes, n_gpus, gpu)
    comm = ALLREDUCES_PER_LAYER * per_call
    return InplaceTerms(
        count,
        gemms,
        k.weight_bytes / n_gpus,
        k.cache_read_bytes / shards,
        k.cache_write_bytes / shards + k.other_bytes,
        k.flops / n_gpus / gpu.achieved_flops,
        comm,
    )


def flat_gemm_efficiency(gpu: GPUSpec, m: int) -> float:
    """Our flat GEMM's bandwidth / peak at M = m rows."""
    return gpu.flat_gemm_efficiency * m**-gpu.flat_gemm_m_exponent


def inplace_layer_s(t: InplaceTerms, gpu: GPUSpec, batch: int) -> tuple[float, float]:
    """(memory seconds, whole layer seconds) of one layer call."""
    mem = (
        t.gemm_bytes / (flat_gemm_efficiency(gpu, batch) * gpu.hbm_bw)
        + t.kv_bytes / (gpu.split_k_efficiency * gpu.hbm_bw)
        + t.other_bytes / gpu.read_bw
    )
    return mem, t.kernels * gpu.inplace_kernel_gap_s + max(mem, t.compute_s) + t.comm_s

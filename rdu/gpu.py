"""Every GPU mode of the cost model: per-token decode time on n GPUs from the kernels of a traced step.

The modes count kernels from the same traced graph as the SN40L model (rdu.simulate) and charge each
kernel call count * overhead + max(memory, FLOPs at the achieved matmul rate) + communication; with
n GPUs they model Megatron tensor parallelism (weights split n ways, the KV cache over min(n, kv heads)
shards, two all-reduces per layer, an all-gather of the logits).

- "xla": XLA-style fusion (`xla_kernel_count`), one dispatch per token; the matmul bandwidth depends
  on M = batch (`GPUSpec.matmul_efficiency`).
- "eager": one kernel per computing op (`eager_kernel_count`), host dispatch per op.
- "scan_copy": "xla" plus the copy XLA makes of every stacked layer weight before its matmul.
- "fixed": a serving stack's kernels, a given number per layer (10 for TensorRT-LLM per the DIAYN
  paper, its two all-reduces included); each kernel costs its measured fixed cost on Hopper
  (`gemm_kernel_s` for the weight GEMMs, `small_kernel_s` for the rest) and its bytes stream at the
  read ceiling. A per-token `step_s` adds what the serving runtime spends outside the kernels
  (rdu.targets.runtime_step_s says where its value comes from).
- "looped_inplace": our engine's decode step, kernel by kernel (below); embedding and LM head as "xla".

Mode "looped_inplace". The default engine loops the layers in one `lax.scan` and reads everything in
place with Pallas kernels. XLA's default command buffers capture the loop body (its fusions and
Pallas/Mosaic calls, some 13-17 per layer) as one CUDA graph, launched once per layer; inside it
kernels run back to back with no gap on one GPU (the gap between the per-layer graphs that profiler
traces show is not there untraced). A 2-GPU program shows a small gap between its kernels, which
this mode does not charge. Per layer it runs:

- one flat GEMM per group of projections that read the same input (one kernel for q, k, v, one
  SwiGLU kernel for gate + up) and one each for o and down, reading the stacked weights [L, K, N]:
  bytes / (flat GEMM efficiency(M) * peak), with efficiency(M) = flat_gemm_efficiency *
  M ** -flat_gemm_m_exponent (M = batch rows: our Mosaic kernel's share of the bandwidth falls slowly
  with M, docs/log/2026-11-30.md (kernel tables));
- one split-K decode attention kernel over the stacked cache: KV bytes / (split_k_efficiency * peak);
- the in-place KV-cache write and XLA's elementwise/reduction fusions between the kernels
  (norms, RoPE, residual adds), their bytes at the read ceiling;

and every kernel costs a fixed `inplace_kernel_gap_s` inside the per-layer graph: its own launch, ramp
and drain (a small kernel costs about as much however few bytes it moves), not a gap between kernels.
A quantized layer (int8/int4 inputs in the traced graph) runs other kernels: four quantized GEMM
launches (q·k·v as one, o, gate + up as one, down), each its measured fixed cost plus its real bytes
(codes and scales) at its measured share of the read ceiling, and the measured count of the other
kernels around them (the qkv_rope epilogue, attention, norms, XLA glue) at `quant_glue_kernel_s` each
(rdu.quantized holds those measurements); the output projection runs the same quantized kernel.
The layer time is kernels * that cost + max(memory, FLOPs / achieved rate) + all-reduces (tensor
parallel, as the "xla" mode). Efficiencies are fractions of the spec peak, not of the jnp.sum read
ceiling: in the bench suite each extra KV byte from 1k to 8k context (batch 8 and 32) costs less than
the read ceiling allows. The measurements behind these choices are in docs/log/.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxdecode.config import ALLREDUCE_IMPLS
from jaxdecode.model import Hook
from rdu.graph import DataflowGraph
from rdu.hardware import GPUSpec
from rdu.mapping import ALLREDUCES_PER_LAYER, STAGE_KINDS, Kernel, fuse
from rdu.quantized import QUANT_KERNELS, quant_format
from rdu.simulate import Estimate, KernelTime, model_bytes

GPU_MODES = ("xla", "eager", "scan_copy", "fixed", "looped_inplace")


EAGER_DATA_OPS = frozenset({"convert_element_type", "concatenate", "gather", "iota", "select_n", "cumsum"})


# ---------------------------------------------------------------------------------------------
# Kernel counts and communication


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


# ---------------------------------------------------------------------------------------------
# Modes xla, eager, scan_copy, fixed


@dataclass(frozen=True)
class GPUKernelTerms:
    """What one kernel of a traced step costs per GPU, before the free constants are applied."""

    count: int  # GPU kernels launched per call
    fixed_s: float  # mode "fixed": the kernels' own fixed costs (GEMMs and the rest; 0 in other modes)
    weight_bytes: float  # per GPU, read at the matmul efficiency (mode "fixed": at the read ceiling)
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
    the [B, V] logits.

    Mode "fixed": a layer runs `kernels_per_layer` kernels (default 10) counted on a tensor-parallel
    run, its `ALLREDUCES_PER_LAYER` all-reduce kernels included (charged as communication, and absent on
    one GPU); of the rest, the weight GEMMs are the traced layer's projections grouped by shared input
    (q, k, v one kernel, gate and up one: `inplace_kernel_counts`). The other kernels fuse as XLA's."""
    fixed_s = 0.0
    if k.role == "sampling":
        count = 1
    elif mode == "fixed":
        gemms = sum(1 for n in k.nodes if n.kind == "matmul")
        if k.is_layer:
            gemms = gemms if k.graph is None else inplace_kernel_counts(k.graph)[0]
            count = (kernels_per_layer or 10) - ALLREDUCES_PER_LAYER
            if count < gemms:
                raise ValueError(
                    f"{kernels_per_layer} kernels per layer leave {count} besides the {ALLREDUCES_PER_LAYER} "
                    f"all-reduces, fewer than the layer's {gemms} weight GEMMs"
                )
        else:
            count = xla_kernel_count(k.nodes)
        fixed_s = gemms * gpu.gemm_kernel_s + (count - gemms) * gpu.small_kernel_s
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
        fixed_s,
        w,
        k.cache_read_bytes / kv_shards,
        k.cache_write_bytes / kv_shards + k.other_bytes,
        2 * w if (mode == "scan_copy" and k.is_layer) else 0.0,
        k.flops / n_gpus / gpu.achieved_flops,
        comm,
    )


# ---------------------------------------------------------------------------------------------
# Mode looped_inplace


@dataclass(frozen=True)
class InplaceTerms:
    """What one decoder layer of the looped in-place step costs per GPU, before the free constants."""

    kernels: int  # kernels per layer at `inplace_kernel_gap_s` each (flat GEMMs, attention, XLA fusions)
    gemms: int  # of which flat GEMM kernels
    gemm_bytes: float  # projection weights per GPU, at the flat GEMM efficiency
    kv_bytes: float  # KV cache read per GPU, at the split-K attention efficiency
    other_bytes: float  # KV write + activations, at the read ceiling
    compute_s: float  # FLOPs per GPU at the achieved matmul rate
    comm_s: float  # tensor-parallel all-reduces
    # A quantized layer (then kernels = gemms = gemm_bytes = 0): its kernels, their fixed costs (GEMMs and
    # glue) and its codes and scales streamed by the quantized GEMMs (rdu.quantized).
    quant_kernels: int = 0
    quant_fixed_s: float = 0.0
    quant_mem_s: float = 0.0


def _is_attention(n) -> bool:
    return Hook.SDPA in n.scope  # the ops inside `model.sdpa`'s named scope


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
    projection (o, down) as its own; the attention ops (scope `Hook.SDPA`) are one kernel; the rest fuse
    as XLA does (`xla_kernel_count`)."""
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


def inplace_terms(
    k: Kernel,
    gpu: GPUSpec,
    *,
    n_gpus: int = 1,
    kv_heads: int = 8,
    activation_bytes: int = 0,
    allreduce: str = "psum",
    quant: str | None = None,
    batch: int = 1,
) -> InplaceTerms:
    """The terms of one decoder kernel (weights split n ways, KV over min(n, kv_heads) shards).

    `quant` ("int8" | "int4"): the layer's projections are quantized (`k.weight_bytes` are their codes and
    scales); its kernels are then `QUANT_KERNELS[quant]`'s, `batch` picking the count at M = 1 or M >= 2.

    Tensor-parallel all-reduces: "psum" charges NCCL's measured latency plus the ring's NVLink bytes
    (`gpu_allreduce_s`); "kernel" (2 GPUs; the engine picks it for activations of at most 8192
    elements) charges our peer-to-peer kernel's measured duration, `p2p_allreduce_s`, and no extra
    kernel slot: it also does the residual add, whose fusion the traced count already holds."""
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
    if quant is not None:
        q = QUANT_KERNELS[quant]
        n = q.layer_kernels(batch)
        return InplaceTerms(
            0,
            0,
            0.0,
            k.cache_read_bytes / shards,
            k.cache_write_bytes / shards + k.other_bytes,
            k.flops / n_gpus / gpu.achieved_flops,
            comm,
            n,
            q.gemm_kernels * q.gemm_fixed_s + (n - q.gemm_kernels) * gpu.quant_glue_kernel_s,
            k.weight_bytes / n_gpus / (q.gemm_efficiency * gpu.read_bw),
        )
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
        + t.quant_mem_s
        + t.kv_bytes / (gpu.split_k_efficiency * gpu.hbm_bw)
        + t.other_bytes / gpu.read_bw
    )
    fixed = t.kernels * gpu.inplace_kernel_gap_s + t.quant_fixed_s
    return mem, fixed + max(mem, t.compute_s) + t.comm_s


# ---------------------------------------------------------------------------------------------
# Every mode


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
    step_s: float = 0.0,
    quant: str | None = None,
) -> Estimate:
    """Per-token decode time on `n_gpus` GPUs (tensor parallel) for the kernels of a traced step.

    A kernel call costs count * overhead + max(memory, compute) + communication, where memory reads the
    weights at `gpu.matmul_efficiency(batch)` (M = batch rows at one query token) and the KV cache at
    the attention efficiency, and compute is FLOPs / achieved rate (it binds past M ~ 200).
    mode: "xla" (XLA-style fusion, one dispatch per token), "eager" (one kernel per op, host dispatch
    per op), "scan_copy" ("xla" plus the copy XLA makes of every stacked layer weight before its matmul:
    one extra read and write of every weight), "fixed" (a serving stack's `kernels_per_layer` kernels
    per layer, e.g. 10 for TensorRT-LLM per the DIAYN paper: each costs its fixed cost, `gpu_kernel_terms`,
    and the weights stream at the read ceiling), "looped_inplace" (our engine: decoder layers as this
    module's docstring says, embedding and LM head as "xla"). `step_s`: a per-token cost outside the
    kernels (a serving runtime's), added once. `quant` ("int8" | "int4"): the weights are quantized; in
    mode "looped_inplace" the layers and the output projection then run the quantized kernels.
    """
    if mode not in GPU_MODES:
        raise ValueError(f"mode must be one of {GPU_MODES}, got {mode!r}")
    overhead = gpu.eager_op_s if mode == "eager" else gpu.kernel_overhead_s
    eff = 1.0 if mode == "fixed" else gpu.matmul_efficiency(batch)
    times = []
    for k in kernels:
        n = k.calls * k.iterations
        if mode == "looped_inplace" and k.is_layer:
            t = inplace_terms(
                k, gpu, n_gpus=n_gpus, kv_heads=kv_heads, activation_bytes=activation_bytes, quant=quant, batch=batch
            )
            mem, it = inplace_layer_s(t, gpu, batch)
            calls = t.kernels + t.quant_kernels
            launch = gpu.inplace_kernel_gap_s if quant is None else t.quant_fixed_s / calls
            times.append(KernelTime(k.name, calls * n, 1, launch, 0.0, mem, t.compute_s, t.comm_s, it, n * it))
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
        # Our engine hands a quantized output projection to the quantized GEMM kernel.
        q = QUANT_KERNELS[quant] if (quant and mode == "looped_inplace" and k.role == "classifier") else None
        mem = (
            t.weight_bytes / ((q.gemm_efficiency if q else eff) * gpu.read_bw)
            + t.kv_bytes / (gpu.attention_efficiency * gpu.read_bw)
            + t.other_bytes / gpu.read_bw
            + t.copy_bytes / gpu.copy_bw
        )
        fixed = (t.fixed_s if mode == "fixed" else t.count * overhead) + (q.gemm_fixed_s if q else 0.0)
        it = fixed + max(mem, t.compute_s) + t.comm_s
        # A serving stack's layer also launches its all-reduce kernels (DIAYN counts them: 320 a token).
        calls = t.count + (ALLREDUCES_PER_LAYER if mode == "fixed" and k.is_layer and n_gpus > 1 else 0)
        launch = t.fixed_s / max(t.count, 1) if mode == "fixed" else overhead
        times.append(KernelTime(k.name, calls * n, 1, launch, 0.0, mem, t.compute_s, t.comm_s, it, n * it))
    if step_s:
        times.append(KernelTime("serving runtime, per token", 0, 1, step_s, 0.0, 0.0, 0.0, 0.0, step_s, step_s))
    return Estimate(
        f"{gpu.name} x{n_gpus} {mode}",
        batch,
        sum(t.total_s for t in times),
        model_bytes(kernels),
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
    measured GPU rows time the forward step plus sampling inside the same dispatch). Quantized weights
    are read off the graph's input dtypes."""
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
        **{"quant": quant_format(t.dtype for t in graph.inputs), **kw},
    )

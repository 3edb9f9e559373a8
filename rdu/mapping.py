"""Map a traced decode step onto SN40L sockets: kernels (sections), stages, PCU/PMU allocation, memory.

The steps follow what is public about SambaFlow (sim-anchors.md §3):

1. **Fusion into kernels.** A whole decoder layer is one kernel (SN40L paper §VI-B). A call that
   repeats (the layer `jit`), or a `scan` over it (the kernel-looped form), is the decoder kernel;
   the remaining top-level ops group by their top-level name scope (`embed`, `lm_head`), and a
   sampling kernel is added after the classifier: 4 calls per token when looped (KL paper, DIAYN).
2. **Stages.** Every leaf op of the kernel that computes (matmul, elementwise, reduction, in-place
   update) is a pipeline stage; pure data movement (reshape, broadcast, transpose, slice) becomes a
   PMU access pattern of the neighbouring stage (SN40L §III-A) and gets no stage.
3. **Allocation.** PCUs and PMUs per stage by binary search on a common stage time T (US 11,410,027):
   each stage gets ceil(work / (rate * T)) units, and T is the smallest time for which the sum fits.
   PCU work is FLOPs at one PCU's share of 638 TFLOP/s; PMU work is bytes streamed by the stage.
   **Capacity** comes first: every stage holds its output on chip, double-buffered (per socket:
   sharded tensors split over the sockets, the [B, D] residual whole), in whole PMUs of 512 KiB; the
   remaining PMUs are shared by bandwidth. Stages whose buffers leave fewer PMUs than stages are tiled
   along their output's largest axis (attention scores over the sequence, flash-style) until they fit;
   a stage that cannot be tiled further refuses the mapping (`ModelDoesNotFit`, with the numbers). The
   SRAM the buffers leave free is where the looped kernel prefetches the next layer's weights
   (`Placement.prefetch_bytes`; rdu.simulate charges the part of the layer's latency it cannot cover).
4. **Memory tiers.** Weights and the KV cache are sharded over the sockets (tensor parallelism; KV
   heads are replicated when there are more sockets than heads) and placed in HBM. Decode streams
   every weight every token, so by default the model must fit HBM: otherwise `ModelDoesNotFit` says
   by how much and how many sockets would do. With `allow_ddr=True` the overflow goes to DDR
   (SN40L §V-A spill) and is streamed from there.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from jaxdecode.model import Hook
from rdu.graph import SLICING_OPS, DataflowGraph, Node
from rdu.hardware import GIB, KIB, MIB, RDUSpec

STAGE_KINDS = frozenset({"matmul", "elementwise", "reduction", "memory"})
ALLREDUCES_PER_LAYER = 2  # Megatron tensor parallelism: after o_proj and after down_proj


class ModelDoesNotFit(ValueError):
    """The model (weights + KV cache) does not fit the memory of the sockets asked for."""


@dataclass
class Kernel:
    """One kernel (section): `calls` calls per token, each running the body `iterations` times.

    Traffic and FLOPs are per iteration of the body, for the whole model (not yet sharded).
    """

    name: str
    role: str  # embedding | decoder | classifier | sampling | other
    calls: int
    iterations: int
    flops: int
    weight_bytes: int  # read per iteration (not an in-place-updated input)
    cache_read_bytes: int  # read per iteration from inputs that are updated in place (KV cache)
    cache_write_bytes: int
    other_bytes: int  # activations in and out
    nodes: list[Node] = field(default_factory=list, repr=False)
    graph: DataflowGraph | None = field(default=None, repr=False)

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.cache_read_bytes + self.cache_write_bytes + self.other_bytes

    @property
    def is_layer(self) -> bool:
        return self.role == "decoder"


@dataclass
class Stage:
    name: str
    kind: str
    flops: int
    bytes: int
    buffer_bytes: float = 0.0  # per socket: its output on chip, double-buffered, before tiling
    max_tiles: int = 1  # the largest axis of its output: how far it can be tiled
    pcus: int = 0
    pmus: int = 0
    tiles: int = 1  # the output is produced and buffered in this many pieces

    @property
    def held_bytes(self) -> float:
        return self.buffer_bytes / self.tiles


@dataclass
class Allocation:
    stage_time_s: float  # the common stage time T of the binary search (compute only)
    pcus: int
    pmus: int
    stages: list[Stage]

    @property
    def buffer_bytes(self) -> float:
        """SRAM per socket the stages' double-buffered outputs hold."""
        return sum(s.held_bytes for s in self.stages)

    @property
    def critical_stage(self) -> Stage:
        return max(self.stages, key=lambda s: s.flops / max(s.pcus, 1))


@dataclass
class Placement:
    """Bytes per socket in each tier."""

    hbm_bytes: int
    ddr_bytes: int
    sram_buffer_bytes: int  # the decoder kernel's stage buffers (double-buffered outputs, after tiling)
    prefetch_bytes: int  # SRAM left for the next layer's weights while the carried activation passes
    layer_stream_bytes: int  # bytes one decoder iteration streams per socket (what a full prefetch needs)
    hbm_capacity: int
    ddr_capacity: int
    sram_capacity: int

    @property
    def hbm_fraction(self) -> float:
        total = self.hbm_bytes + self.ddr_bytes
        return self.hbm_bytes / total if total else 1.0


@dataclass
class Mapping:
    graph: DataflowGraph
    hw: RDUSpec
    sockets: int
    batch: int
    kernels: list[Kernel]
    allocations: dict[str, Allocation]
    placement: Placement
    kv_shards: int
    activation_bytes: int  # B * D * itemsize: one all-reduce message

    @property
    def layers(self) -> int:
        return sum(k.calls * k.iterations for k in self.kernels if k.is_layer)

    @property
    def calls_per_token(self) -> int:
        return sum(k.calls for k in self.kernels)


def _leaves(g: DataflowGraph) -> list[tuple[Node, int]]:
    return [(n, m) for n, m in g.walk() if not n.children]


def _kernel_from_graph(name: str, role: str, calls: int, iterations: int, g: DataflowGraph) -> Kernel:
    aliased = {a for a in g.output_alias if a is not None}
    cache_read = sum(r for i, r in enumerate(g.input_reads) if i in aliased)
    cache_write = sum(w for j, w in enumerate(g.output_writes) if g.output_alias[j] is not None)
    weights = sum(
        r for i, r in enumerate(g.input_reads) if i not in aliased and g.inputs[i].nbytes > _activation_max(g)
    )
    other = sum(g.input_reads) - cache_read - weights + sum(g.output_writes) - cache_write
    return Kernel(
        name,
        role,
        calls,
        iterations,
        g.total_flops(),
        weights,
        cache_read,
        cache_write,
        other,
        [n for n, _ in _leaves(g)],
        g,
    )


def _activation_max(g: DataflowGraph) -> int:
    """Inputs at most this size are activations (x, positions, cos/sin), not weights: the largest
    output that is not an in-place update (the layer's x out, or the logits)."""
    sizes = [o.nbytes for j, o in enumerate(g.outputs) if g.output_alias[j] is None]
    return max(sizes, default=0)


def fuse(graph: DataflowGraph) -> list[Kernel]:
    """Kernels of a decode step: decoder layer kernel(s), then the rest grouped by top-level scope."""
    counts: dict[str, int] = defaultdict(int)
    for n in graph.nodes:
        if n.kind == "call":
            counts[n.name] += 1
    kernels: list[Kernel] = []
    loose: dict[str, list[Node]] = {}
    layer_calls: list[Node] = []
    for n in graph.nodes:
        if n.op == "scan" and n.children and any(c.kind == "call" for c in n.children[0].nodes):
            body = n.children[0]
            layer = next(c for c in body.nodes if c.kind == "call")
            kernels.append(_kernel_from_graph(f"decoders_looped[{layer.name}]", "decoder", 1, n.trip_count, body))
        elif n.kind == "call" and counts[n.name] >= 2:
            layer_calls.append(n)
        else:
            top = n.scope.split("/")[0] or (list(loose)[-1] if loose else "other")
            loose.setdefault(top, []).append(n)
    if layer_calls:
        kernels.append(
            _kernel_from_graph(
                f"decoder[{layer_calls[0].name}]", "decoder", len(layer_calls), 1, layer_calls[0].children[0]
            )
        )
    for scope, nodes in loose.items():
        kernels.append(_loose_kernel(graph, scope, nodes))
    order = {"embedding": 0, "decoder": 1, "classifier": 2, "other": 3}
    kernels.sort(key=lambda k: order.get(k.role, 3))
    logits = max((o for o in graph.outputs), key=lambda o: o.nbytes if len(o.shape) == 3 else 0)
    kernels.append(Kernel("sampling", "sampling", 1, 1, logits.size, 0, 0, 0, logits.nbytes))
    return kernels


def _loose_kernel(graph: DataflowGraph, scope: str, nodes: list[Node]) -> Kernel:
    """Traffic of a group of top-level ops: graph inputs they read, graph outputs they write."""
    ids = {n.id for n in nodes}
    by_id = {n.id: n for n in nodes}
    role = {"embed": "embedding", "lm_head": "classifier"}.get(scope, "other")
    flops = sum(n.total_flops() for n in nodes)
    # Bytes of each graph input that *these* ops read: a gather (or a call that gathers) reads its rows,
    # anything else the whole input. A tied embedding table is read whole by the LM head's matmul but
    # only B rows by the embedding lookup, so graph.input_reads (the whole step's read) is not per kernel.
    partial: dict[int, int] = defaultdict(int)
    full: set[int] = set()
    for e in graph.edges:
        if e.src == -1 and e.dst in ids:
            r = _operand_read(by_id[e.dst], e.dst_port, e.tensor.nbytes)
            if r is None:
                full.add(e.src_port)
            else:
                partial[e.src_port] += r
    reads = {
        p: graph.input_reads[p] if p in full else min(graph.input_reads[p], partial[p]) for p in full | set(partial)
    }
    writes = sum(e.nbytes for e in graph.edges if e.src in ids and e.dst == -1)
    act = sum(e.nbytes for e in graph.edges if (e.src in ids) != (e.dst in ids) and e.src != -1 and e.dst != -1)
    weights = sum(r for p, r in reads.items() if graph.inputs[p].nbytes > 64 * 1024)
    other = sum(reads.values()) - weights + writes + act // 2
    # The final norm is the model's named call `Hook.RMS_NORM`: its ops count as they did when the norm was
    # written inline (the fitted GPU constants were fitted with that count). Other calls among loose
    # ops (the embedding's jitted gather) stay one node, as they always were.
    ops = [
        leaf
        for n in nodes
        for leaf in (
            [x for c in n.children for x, _ in c.walk() if not x.children]
            if n.kind == "call" and n.name == Hook.RMS_NORM
            else [n]
        )
    ]
    return Kernel(scope or "other", role, 1, 1, flops, weights, 0, 0, other, ops)


def _operand_read(node: Node, port: int, size: int) -> int | None:
    """Bytes `node` reads of its operand `port` (of `size` bytes) when only part of it is read, else None."""
    if node.op in SLICING_OPS and port == 0:
        return min(size, sum(o.nbytes for o in node.outputs))
    if node.op in ("jit", "pjit") and node.children and port < len(node.children[0].input_reads):
        r = node.children[0].input_reads[port]
        return r if r < size else None
    return None


def allocate(works: list[float], units: int, rate: float) -> tuple[float, list[int]]:
    """Binary search on a common stage time T (US 11,410,027): stage s gets max(1, ceil(w_s/(rate*T)))
    units; returns the smallest T (to 0.1%) whose total fits in `units`, and the units per stage."""
    if len(works) > units:
        raise ModelDoesNotFit(f"{len(works)} pipeline stages need at least {len(works)} units, only {units}")
    if not works or max(works) <= 0:
        return 0.0, [1] * len(works)

    def need(t: float) -> list[int]:
        return [max(1, math.ceil(w / (rate * t))) for w in works]

    lo, hi = sum(works) / (rate * units), max(works) / rate  # hi: one unit per stage always fits
    while hi - lo > 1e-3 * hi:
        mid = (lo + hi) / 2
        if sum(need(mid)) <= units:
            hi = mid
        else:
            lo = mid
    return hi, need(hi)


def stages_of(kernel: Kernel, sockets: int = 1, act_bytes: int = 0) -> list[Stage]:
    """The kernel's computing ops as stages, each with its on-chip output buffer per socket."""
    out = []
    for n in kernel.nodes:
        if n.kind not in STAGE_KINDS:
            continue
        # An in-place update (the KV cache write) holds only the rows it writes, not the cache it aliases.
        sizes = [n.bytes_written] if n.kind == "memory" else [o.nbytes for o in n.outputs]
        held = sum(x / (sockets if x > act_bytes else 1) for x in sizes)
        big = max(n.outputs, key=lambda o: o.nbytes, default=None)
        tiles = max(big.shape, default=1) if big is not None and n.kind != "memory" else 1
        out.append(Stage(f"{n.op}@{n.scope}", n.kind, n.flops, n.bytes_read + n.bytes_written, 2 * held, tiles))
    return out


def fit_buffers(stages: list[Stage], hw: RDUSpec, name: str) -> list[int]:
    """PMUs each stage's buffer needs; tiles the largest buffers until every stage keeps at least one PMU
    for streaming, or refuses the mapping with the numbers."""

    def need(s: Stage) -> int:
        return math.ceil(s.held_bytes / hw.pmu_bytes)

    room = hw.pmus - len(stages)
    while sum(map(need, stages)) > room:
        s = max(stages, key=need)
        if s.tiles >= s.max_tiles:
            raise ModelDoesNotFit(
                f"{name}: stage buffers need {sum(map(need, stages))} PMUs of {hw.pmu_bytes // KIB} KiB "
                f"({sum(x.held_bytes for x in stages) / MIB:.0f} MiB, double-buffered) and {len(stages)} "
                f"stages need one streaming PMU each, of {hw.pmus}; {s.name} holds {s.held_bytes / MIB:.1f} "
                f"MiB and is already tiled {s.tiles} ways along its largest axis"
            )
        s.tiles = min(s.max_tiles, 2 * s.tiles)
    return [need(s) for s in stages]


def _allocate_kernel(kernel: Kernel, hw: RDUSpec, sockets: int, act_bytes: int) -> Allocation | None:
    stages = stages_of(kernel, sockets, act_bytes)
    if not stages:
        return None
    flops = [s.flops / sockets for s in stages]
    t, pcus = allocate(flops, hw.pcus, hw.pcu_flops)
    held = fit_buffers(stages, hw, kernel.name)
    # The PMUs left after the buffers, shared by the bytes each stage streams (bandwidth share, same search).
    left = hw.pmus - sum(held)
    _, share = allocate([max(s.bytes, 1) / sockets for s in stages], left, hw.stream_bw / left)
    for s, c, h, b in zip(stages, pcus, held, share):
        s.pcus, s.pmus = c, h + b
    return Allocation(t, sum(pcus), sum(s.pmus for s in stages), stages)


def map_decode(
    graph: DataflowGraph,
    hw: RDUSpec,
    sockets: int,
    *,
    batch: int,
    kv_heads: int,
    dim: int,
    itemsize: int = 2,
    allow_ddr: bool = False,
) -> Mapping:
    """Fuse, allocate and place `graph` (a traced decode step) on `sockets` SN40L sockets (TP)."""
    if not 1 <= sockets <= hw.max_sockets:
        raise ValueError(f"sockets must be in 1..{hw.max_sockets}, got {sockets}")
    kernels = fuse(graph)
    kv_shards = min(sockets, kv_heads)
    weights = sum(k.calls * k.iterations * k.weight_bytes for k in kernels)
    # Capacity: the whole cache is resident (its read traffic is its size, S rows per layer).
    cache = sum(k.calls * k.iterations * k.cache_read_bytes for k in kernels)
    per_socket = weights / sockets + cache / kv_shards
    hbm = min(per_socket, hw.hbm_bytes)
    ddr = per_socket - hbm
    if (ddr > 0 and not allow_ddr) or ddr > hw.ddr_bytes:
        need = math.ceil((weights + cache) / hw.hbm_bytes)
        fit = next(
            (s for s in (1, 2, 4, 8, 16) if s >= need and weights / s + cache / min(s, kv_heads) <= hw.hbm_bytes), None
        )
        where = "HBM" if not allow_ddr else "HBM + DDR"
        raise ModelDoesNotFit(
            f"{graph.name}: {per_socket / GIB:.1f} GiB per socket (weights {weights / sockets / GIB:.1f} GiB + KV "
            f"cache {cache / kv_shards / GIB:.1f} GiB) on {sockets} socket(s) exceeds {where} "
            f"({hw.hbm_bytes / GIB:.0f} GiB HBM per socket); decode streams every weight every token, so "
            f"weights must be HBM-resident" + (f"; needs {fit} sockets" if fit else "; does not fit even on 16 sockets")
        )
    act = batch * dim * itemsize
    allocations = {k.name: a for k in kernels if (a := _allocate_kernel(k, hw, sockets, act)) is not None}
    layer = next((k for k in kernels if k.is_layer), None)
    buffers = allocations[layer.name].buffer_bytes if layer is not None and layer.name in allocations else 0
    stream = layer.weight_bytes / sockets + layer.cache_read_bytes / kv_shards if layer is not None else 0
    placement = Placement(
        int(hbm),
        int(ddr),
        int(buffers),
        int(hw.sram_bytes - buffers),
        int(stream),
        hw.hbm_bytes,
        hw.ddr_bytes,
        hw.sram_bytes,
    )
    return Mapping(graph, hw, sockets, batch, kernels, allocations, placement, kv_shards, act)

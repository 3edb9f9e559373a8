"""DataflowGraph, Node, Edge: a jaxpr as a hierarchical dataflow graph with costs per node.

A `DataflowGraph` holds the equations of one jaxpr as `Node`s and the values flowing between them as
`Edge`s. Equations with sub-jaxprs (jit, scan, cond, custom_jvp/vjp calls, while) become nodes whose
`children` hold the sub-graphs, so the hierarchy of the program is kept: a looped decode step is a
top-level graph with one `scan` node (trip count L) whose child holds one `jit` node (the layer).

Two byte counts are kept, because they answer different questions:

- **per-op bytes** (`Node.bytes_read`, `Node.bytes_written`): every operand read and every result
  written by each op, as an unfused interpreter (or XLA's pre-fusion cost analysis) counts them.
  Slicing and in-place updates count only the slice (`gather`, `dynamic_slice`, `scatter`,
  `dynamic_update_slice`).
- **fused bytes** (`DataflowGraph.input_reads`, `output_writes`): the traffic to main memory when the
  whole graph runs as one fused kernel: every input is read once (or only the slices taken of it),
  every output written once, intermediates stay on chip, and an output that is an in-place update of
  an input (the KV cache) writes only the updated rows. A scan multiplies its body's traffic by its
  trip count. This is what a decode step streams from HBM.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

# Ops that read only part of their first operand (the result's size) and ops that update their first
# operand in place (reading and writing only the update).
SLICING_OPS = frozenset({"gather", "dynamic_slice", "slice"})
INPLACE_OPS = frozenset({"scatter", "scatter-add", "scatter_add", "dynamic_update_slice"})


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str
    itemsize: float  # bytes per element: 0.5 for int4 (packed two to a byte on the device)

    @property
    def nbytes(self) -> int:
        return math.ceil(math.prod(self.shape) * self.itemsize)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


@dataclass
class Node:
    """One equation. `flops` and bytes are for one execution; `trip_count` runs of each child.

    kind: matmul | elementwise | reduction | data (reshape, slice, gather, ...) | memory (in-place
    update) | call (jit, custom_jvp/vjp) | loop (scan, while) | branch (cond).
    """

    id: int
    op: str
    kind: str
    scope: str  # full name stack, e.g. "layers/attention/sdpa"
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    flops: int = 0
    transcendentals: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    children: list[DataflowGraph] = field(default_factory=list)
    trip_count: int = 1
    name: str = ""  # callee name for jit nodes
    params: dict = field(default_factory=dict)  # small, printable params (dimension numbers, ...)

    def total_flops(self) -> int:
        """FLOPs of this node and everything under it (a cond counts its costliest branch)."""
        if not self.children:
            return self.flops
        sub = [c.total_flops() for c in self.children]
        return self.trip_count * (max(sub) if self.kind == "branch" else sum(sub))

    def total_op_bytes(self) -> int:
        if not self.children:
            return self.bytes_read + self.bytes_written
        sub = [c.total_op_bytes() for c in self.children]
        return self.trip_count * (max(sub) if self.kind == "branch" else sum(sub))


@dataclass(frozen=True)
class Edge:
    """A value from node `src` (-1: a graph input) to node `dst` (-1: a graph output)."""

    src: int
    dst: int
    tensor: TensorInfo
    src_port: int = 0  # output index of src, or input index of the graph when src == -1
    dst_port: int = 0  # input index of dst, or output index of the graph when dst == -1

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes


@dataclass
class DataflowGraph:
    """A traced jaxpr: nodes in program order, edges, inputs and outputs, and fused traffic.

    input_reads[i]: bytes of input i read when the graph runs as one fused kernel.
    output_writes[j]: bytes of output j written (only the update when it aliases an input).
    output_alias[j]: index of the input that output j updates in place, or None.
    """

    name: str
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    nodes: list[Node] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)
    input_reads: list[int] = field(default_factory=list)
    output_writes: list[int] = field(default_factory=list)
    output_alias: list[int | None] = field(default_factory=list)

    def total_flops(self) -> int:
        return sum(n.total_flops() for n in self.nodes)

    def total_transcendentals(self) -> int:
        return sum(_recurse(n, lambda m: m.transcendentals) for n in self.nodes)

    def total_op_bytes(self) -> int:
        """Bytes read plus written op by op, unfused (comparable to XLA's pre-fusion estimate)."""
        return sum(n.total_op_bytes() for n in self.nodes)

    @property
    def fused_bytes(self) -> int:
        """Main-memory traffic when the whole graph is one fused kernel."""
        return sum(self.input_reads) + sum(self.output_writes)

    def walk(self, multiplier: int = 1) -> Iterator[tuple[Node, int]]:
        """Every node at every depth with how many times it runs per call of this graph."""
        for n in self.nodes:
            yield n, multiplier
            for c in n.children:
                yield from c.walk(multiplier * n.trip_count)

    def find(self, op: str) -> list[Node]:
        return [n for n, _ in self.walk() if n.op == op]

    def scopes(self) -> set[str]:
        return {n.scope for n, _ in self.walk() if n.scope}

    def flops_by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for n, m in self.walk():
            if not n.children:
                out[n.kind] = out.get(n.kind, 0) + m * n.flops
        return out

    def summary(self, depth: int = 0, max_depth: int = 3) -> str:
        """An indented outline: call/loop nodes with their costs, leaf ops counted by kind."""
        pad = "  " * depth
        lines = [
            f"{pad}{self.name}: {len(self.nodes)} ops, {self.total_flops() / 1e9:.3f} GFLOP, "
            f"fused {self.fused_bytes / 1e9:.3f} GB"
        ]
        if depth < max_depth:
            for n in self.nodes:
                for c in n.children:
                    trip = f" x{n.trip_count}" if n.trip_count > 1 else ""
                    lines.append(f"{pad}  [{n.op}{trip} {n.name}] scope={n.scope!r}")
                    lines.append(c.summary(depth + 2, max_depth))
        return "\n".join(lines)


def _recurse(node: Node, leaf) -> int:
    if not node.children:
        return leaf(node)
    sub = [sum(_recurse(n, leaf) for n in c.nodes) for c in node.children]
    return node.trip_count * (max(sub) if node.kind == "branch" else sum(sub))

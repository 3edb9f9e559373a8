"""The dataflow graph of a traced decode step as collapsible HTML + SVG, generated in Python.

Hierarchy: every name scope is a `<details>` element; inside, program order is kept as a sequence of
segments: runs of ops directly in the scope (one SVG "strip", laid out by dependency level, edges
between them drawn) and nested scopes. A call or loop op is a node of its strip and its sub-graph is a
collapsed `<details>` right after the strip. Repeated layers are rendered once: the `scan` of the looped
trace shows its body once with its trip count, and in the unrolled trace a run of identical calls
(`layers_0 ... layers_79`) is folded into one node "x80" with one body. So an 80-layer model costs one
layer body, not 80.

Overlays: every node carries its per-token cost in three metrics (modeled time, FLOPs, bytes), colored
on a log scale; `data-c` holds the three colors and the page's selector switches between them.
Modeled time of an op is its roofline time alone on one socket (max(FLOPs / peak FLOP/s, op bytes /
streaming bandwidth), unfused); a call's time sums its body's.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, replace

from rdu.graph import DataflowGraph, Node
from rdu.hardware import RDUSpec

METRICS = ("time", "flops", "bytes")
RAMP = ("#fff3c4", "#fdd36a", "#fb9a3c", "#e4512b", "#a5162a")  # low -> high, readable under a text halo
ZERO = "#e8eaee"
W, H, GX, GY = 176, 34, 14, 26  # node box and gaps of a strip, px


def ramp(t: float) -> str:
    """The color at t in [0, 1] of RAMP, interpolated in RGB."""
    t = min(max(t, 0.0), 1.0) * (len(RAMP) - 1)
    i = min(int(t), len(RAMP) - 2)
    a, b = RAMP[i], RAMP[i + 1]
    f = t - i
    rgb = [round(int(a[k : k + 2], 16) * (1 - f) + int(b[k : k + 2], 16) * f) for k in (1, 3, 5)]
    return "#" + "".join(f"{c:02x}" for c in rgb)


def fmt_si(x: float, unit: str = "") -> str:
    for div, p in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g} {p}{unit}"
    return f"{x:.3g} {unit}".rstrip()


def fmt_time(s: float) -> str:
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    if s >= 1e-6:
        return f"{s * 1e6:.3g} µs"
    return f"{s * 1e9:.3g} ns"


FORMATS = {"time": fmt_time, "flops": lambda v: fmt_si(v, "FLOP"), "bytes": lambda v: fmt_si(v, "B")}


def op_time(n: Node, hw: RDUSpec) -> float:
    """Roofline time of one execution of `n` alone on one socket (calls: their bodies, times trips)."""
    if not n.children:
        return max(n.flops / hw.bf16_flops, (n.bytes_read + n.bytes_written) / hw.stream_bw)
    sub = [sum(op_time(c, hw) for c in g.nodes) for g in n.children]
    return n.trip_count * (max(sub) if n.kind == "branch" else sum(sub))


def costs(n: Node, hw: RDUSpec) -> dict[str, float]:
    return {"time": op_time(n, hw), "flops": float(n.total_flops()), "bytes": float(n.total_op_bytes())}


@dataclass
class Scale:
    """Log color scale per metric over per-token values."""

    lo: dict[str, float]
    hi: dict[str, float]

    @classmethod
    def of(cls, graphs: list[DataflowGraph], hw: RDUSpec) -> Scale:
        vals: dict[str, list[float]] = {m: [] for m in METRICS}
        for g in graphs:
            for n, mult in g.walk():
                for m, v in costs(n, hw).items():
                    if v > 0:
                        vals[m].append(v * mult)
        return cls({m: min(v, default=1.0) for m, v in vals.items()}, {m: max(v, default=1.0) for m, v in vals.items()})

    def color(self, metric: str, v: float) -> str:
        if v <= 0:
            return ZERO
        lo, hi = math.log(self.lo[metric]), math.log(self.hi[metric])
        return ramp((math.log(v) - lo) / (hi - lo) if hi > lo else 1.0)

    def colors(self, per_token: dict[str, float]) -> str:
        return " ".join(self.color(m, per_token[m]) for m in METRICS)


@dataclass
class Item:
    """A node to draw: `count` > 1 for a run of identical calls folded into one."""

    node: Node
    count: int = 1
    first_scope: str = ""
    last_scope: str = ""


def fold_repeats(g: DataflowGraph) -> tuple[list[Item], dict[int, int]]:
    """Items of `g` in program order with runs of >= 2 consecutive calls of the same callee folded; the
    map sends every folded node id to the id of its run's first node."""
    items: list[Item] = []
    alias: dict[int, int] = {}
    for n in g.nodes:
        prev = items[-1] if items else None
        if (
            prev
            and n.kind == "call"
            and n.children
            and prev.node.kind == "call"
            and prev.node.name == n.name
            and prev.node.op == n.op
        ):
            prev.count += 1
            prev.last_scope = n.scope
            alias[n.id] = prev.node.id
        else:
            items.append(Item(n, 1, n.scope, n.scope))
    return items, alias


def _rel(scope: str, base: str) -> str:
    if not base:
        return scope
    if scope == base:
        return ""
    return scope[len(base) + 1 :] if scope.startswith(base + "/") else scope


class GraphView:
    """Renders DataflowGraphs; `Scale` shared so that colors compare across the whole page."""

    def __init__(self, hw: RDUSpec, scale: Scale):
        self.hw, self.scale = hw, scale

    # ---- one graph: fold repeats, then segment by scope ----
    def graph(self, g: DataflowGraph, base: str, mult: int, depth: int = 0) -> str:
        items, alias = fold_repeats(g)
        for it in items:
            if it.count > 1:  # a folded run sits directly in the calling scope
                it.node = replace(it.node, scope=base)
        return self._segments(items, g, alias, base, mult, depth)

    def _segments(self, items: list[Item], g, alias, base: str, mult: int, depth: int) -> str:
        out, i = [], 0
        while i < len(items):
            key = _rel(items[i].node.scope, base).split("/")[0]
            j = i
            while j < len(items) and _rel(items[j].node.scope, base).split("/")[0] == key:
                j += 1
            run = items[i:j]
            if key:
                sub = f"{base}/{key}" if base else key
                inner = self._segments(run, g, alias, sub, mult, depth + 1)
                out.append(self._details(key, "scope", run, mult, inner, open_=depth < 1))
            else:
                out.append(self._strip(run, g, alias, mult))
                for it in run:
                    if it.node.children:
                        out.append(self._callee(it, mult))
            i = j
        return "\n".join(out)

    def _agg(self, run: list[Item], mult: int) -> dict[str, float]:
        tot = dict.fromkeys(METRICS, 0.0)
        for it in run:
            for m, v in costs(it.node, self.hw).items():
                tot[m] += v * mult * it.count
        return tot

    def _details(
        self, label: str, cls: str, run: list[Item], mult: int, inner: str, open_: bool, note: str = ""
    ) -> str:
        agg = self._agg(run, mult)
        n_ops = sum(1 for it in run for _ in _leaves(it.node))
        text = " · ".join(FORMATS[m](agg[m]) for m in METRICS)
        return (
            f'<details class="{cls}"{" open" if open_ else ""}><summary>'
            f'<span class="badge" data-c="{self.scale.colors(agg)}" style="background:'
            f'{self.scale.color("time", agg["time"])}"></span><b>{html.escape(label)}</b> '
            f'<span class="meta">{n_ops} ops · {text} per token{note}</span></summary>'
            f'<div class="body">{inner}</div></details>'
        )

    def _callee(self, it: Item, mult: int) -> str:
        n = it.node
        if it.count > 1:
            label = f"{n.name} ×{it.count}: identical calls {it.first_scope} … {it.last_scope}"
            note = (
                f" — one body shown; kernel looping turns these {it.count} calls into one scan (trip count {it.count})"
            )
            inner = "".join(self.graph(c, it.first_scope, mult * it.count) for c in n.children)
            return self._details(label, "repeat", [it], mult, inner, open_=False, note=note)
        if n.op in ("scan", "while"):
            label = f"looped kernel: {n.op} ×{n.trip_count} ({_callee_names(n)})"
            note = f" — one body shown; it runs {n.trip_count} times per token in one kernel call"
            cls = "loop"
        else:
            label, note, cls = f"{n.op} {n.name}", "", "call"
        sub_mult = mult * n.trip_count
        if len(n.children) == 1:
            inner = self.graph(n.children[0], n.scope, sub_mult)
        else:
            inner = "".join(
                self._details(c.name, "call", [Item(_wrap(c))], sub_mult, self.graph(c, n.scope, sub_mult), open_=False)
                for c in n.children
            )
        return self._details(label, cls, [it], mult, inner, open_=False, note=note)

    # ---- a strip: ops directly in one scope, layered by dependency ----
    def _strip(self, run: list[Item], g: DataflowGraph, alias: dict[int, int], mult: int) -> str:
        ids = {it.node.id for it in run}
        level: dict[int, int] = {}
        preds: dict[int, set[int]] = {i: set() for i in ids}
        edges: dict[tuple[int, int], str] = {}
        for e in g.edges:
            s, d = alias.get(e.src, e.src), alias.get(e.dst, e.dst)
            if s in ids and d in ids and s != d:
                preds[d].add(s)
                edges.setdefault((s, d), str(e.tensor))
        for it in run:
            level[it.node.id] = 1 + max((level[p] for p in preds[it.node.id] if p in level), default=-1)
        rows: dict[int, list[Item]] = {}
        for it in run:
            rows.setdefault(level[it.node.id], []).append(it)
        width = max(len(r) for r in rows.values())
        wpx = width * (W + GX) + GX
        pos: dict[int, tuple[float, float]] = {}
        for lv, r in rows.items():
            x0 = (wpx - len(r) * (W + GX) + GX) / 2
            for k, it in enumerate(r):
                pos[it.node.id] = (x0 + k * (W + GX), GY / 2 + lv * (H + GY))
        hpx = len(rows) * (H + GY)
        parts = [f'<svg class="strip" width="{wpx:.0f}" height="{hpx:.0f}" viewBox="0 0 {wpx:.0f} {hpx:.0f}">']
        for (s, d), tensor in edges.items():
            (x1, y1), (x2, y2) = pos[s], pos[d]
            x1, y1, x2 = x1 + W / 2, y1 + H, x2 + W / 2
            dy = max((y2 - y1) / 2, 8)
            parts.append(
                f'<path class="edge" d="M{x1:.0f} {y1:.0f}C{x1:.0f} {y1 + dy:.0f} {x2:.0f} {y2 - dy:.0f} '
                f'{x2:.0f} {y2:.0f}"><title>{html.escape(tensor)}</title></path>'
            )
        for it in run:
            parts.append(self._node(it, mult, *pos[it.node.id]))
        parts.append("</svg>")
        return "".join(parts)

    def _node(self, it: Item, mult: int, x: float, y: float) -> str:
        n = it.node
        c = costs(n, self.hw)
        runs = mult * it.count
        per_token = {m: v * runs for m, v in c.items()}
        if it.count > 1:
            label, cls = f"{n.name} ×{it.count}", "repeat"
        elif n.op in ("scan", "while"):
            label, cls = f"{n.op} ×{n.trip_count}", "loop"
        elif n.children:
            label, cls = f"{n.op} {n.name}", "call"
        else:
            label, cls = n.op, ""
        shape = str(n.outputs[0]) if n.outputs else ""
        if len(n.outputs) > 1:
            shape += f" +{len(n.outputs) - 1}"
        tip = [f"{label}  ({n.kind})", f"scope: {it.first_scope or n.scope or '(top)'}"]
        if it.count > 1:
            tip.append(f"{it.count} identical calls, {it.first_scope} … {it.last_scope}")
        tip += [
            f"in: {', '.join(map(str, n.inputs)) or '-'}",
            f"out: {', '.join(map(str, n.outputs)) or '-'}",
            f"runs per token: {runs}",
        ]
        tip += [f"{m}: {FORMATS[m](c[m])} per run, {FORMATS[m](per_token[m])} per token" for m in METRICS]
        fill = self.scale.color("time", per_token["time"])
        return (
            f'<g class="op {cls} k-{n.kind}" transform="translate({x:.0f},{y:.0f})" '
            f'data-c="{self.scale.colors(per_token)}"><title>{html.escape(chr(10).join(tip))}</title>'
            f'<rect width="{W}" height="{H}" rx="5" style="fill:{fill}"/>'
            f'<text x="7" y="14">{html.escape(_clip(label, 24))}</text>'
            f'<text x="7" y="28" class="shape">{html.escape(_clip(shape, 27))}</text></g>'
        )


def _clip(s: str, k: int) -> str:
    return s if len(s) <= k else s[: k - 1] + "…"


def _leaves(n: Node):
    if not n.children:
        yield n
        return
    for c in n.children:
        for m, _ in c.walk():
            if not m.children:
                yield m


def _callee_names(n: Node) -> str:
    names = [m.name for c in n.children for m in c.nodes if m.kind == "call"]
    return ", ".join(dict.fromkeys(names)) or n.name


def _wrap(g: DataflowGraph) -> Node:
    """A branch graph as a node, for the aggregate line of its <details>."""
    return Node(-1, "branch", "call", "", g.inputs, g.outputs, children=[g])

"""SVG of the mapping (the SN40L tile, PCUs and PMUs colored by the stage that owns them) and of the
timeline of one decode token (kernel calls looped and not, and HBM bandwidth over time).

The tile is drawn schematically: 2 dies, each 520 PCUs and 520 PMUs in 26 columns, PCU and PMU rows
alternating (the real tile interleaves them in a checkerboard with switches and AGCUs). Stages fill
units in order, as `mapping.allocate` counts them; unowned units are grey.
"""

from __future__ import annotations

import colorsys
import html
import math

from rdu.analysis import Segment, mean_hbm, timeline
from rdu.mapping import Allocation, Mapping
from rdu.simulate import Estimate
from rdu.viz_graph import fmt_si, fmt_time

COLS, CELL, DIE_GAP = 26, 11, 16
ROLE_COLORS = {
    "embedding": "#6f9ede",
    "decoder": "#f0903a",
    "classifier": "#4fae68",
    "sampling": "#a07cd6",
    "other": "#9aa0a6",
}
PHASE_COLORS = {"launch": "#2b2f36", "boundary": "#c3c8d0", "comm": "#4f63e0"}
KIND_SAT = {"matmul": 0.75, "elementwise": 0.45, "reduction": 0.6, "memory": 0.9}


def stage_color(i: int, kind: str, light: bool = False) -> str:
    hue = (i * 0.381966) % 1.0  # golden-ratio hues: neighbouring stages differ
    r, g, b = colorsys.hls_to_rgb(hue, 0.76 if light else 0.52, KIND_SAT.get(kind, 0.6))
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def _unit_rects(start: int, count: int, per_die: int, pmu: bool) -> list[tuple[int, int, int]]:
    """(x, y, width) px of units [start, start+count) of one kind, split at row ends."""
    out = []
    u, end = start, start + count
    while u < end:
        die, local = divmod(u, per_die)
        row, col = divmod(local, COLS)
        n = min(end - u, COLS - col, per_die - local)
        x = die * (COLS * CELL + DIE_GAP) + col * CELL
        y = (2 * row + (1 if pmu else 0)) * CELL
        out.append((x, y, n * CELL))
        u += n
    return out


def grid_svg(alloc: Allocation, mapping: Mapping, uid: str) -> str:
    hw = mapping.hw
    per_die = math.ceil(hw.pcus / 2)
    rows = math.ceil(per_die / COLS)
    wpx, hpx = 2 * COLS * CELL + DIE_GAP, 2 * rows * CELL
    parts = [
        f'<svg class="tile" width="{wpx}" height="{hpx + 16}" viewBox="0 0 {wpx} {hpx + 16}">',
        f'<defs><pattern id="cells-{uid}" width="{CELL}" height="{CELL}" patternUnits="userSpaceOnUse">'
        f'<path d="M{CELL} 0V{CELL}H0" fill="none" stroke="#fff" stroke-width="1"/></pattern></defs>',
    ]
    for die in range(2):
        x = die * (COLS * CELL + DIE_GAP)
        parts.append(f'<rect class="die" x="{x}" y="0" width="{COLS * CELL}" height="{hpx}" fill="#e9ebef"/>')
    pcu = pmu = 0
    for i, s in enumerate(alloc.stages):
        tip = html.escape(
            f"{s.name} ({s.kind}): {s.pcus} PCUs, {s.pmus} PMUs, {fmt_si(s.flops, 'FLOP')}, "
            f"{fmt_si(s.bytes, 'B')} streamed"
        )
        rects = [
            f'<rect x="{x}" y="{y}" width="{w}" height="{CELL}" fill="{stage_color(i, s.kind)}"/>'
            for x, y, w in _unit_rects(pcu, s.pcus, per_die, False)
        ]
        rects += [
            f'<rect x="{x}" y="{y}" width="{w}" height="{CELL}" fill="{stage_color(i, s.kind, True)}"/>'
            for x, y, w in _unit_rects(pmu, s.pmus, per_die, True)
        ]
        parts.append(f'<g class="stage"><title>{tip}</title>{"".join(rects)}</g>')
        pcu, pmu = pcu + s.pcus, pmu + s.pmus
    for die in range(2):
        x = die * (COLS * CELL + DIE_GAP)
        parts.append(
            f'<rect x="{x}" y="0" width="{COLS * CELL}" height="{hpx}" fill="url(#cells-{uid})" pointer-events="none"/>'
        )
        parts.append(
            f'<text x="{x}" y="{hpx + 12}" class="axis">die {die}: {per_die} PCU (dark) + {per_die} PMU (light)</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def stage_table(alloc: Allocation, sockets: int) -> str:
    rows = "".join(
        f'<tr><td><span class="sw" style="background:{stage_color(i, s.kind)}"></span></td>'
        f'<td class="name">{html.escape(s.name)}</td><td>{s.kind}</td><td>{s.pcus}</td><td>{s.pmus}</td>'
        f"<td>{fmt_si(s.flops / sockets, 'FLOP')}</td><td>{fmt_si(s.bytes / sockets, 'B')}</td></tr>"
        for i, s in enumerate(alloc.stages)
    )
    return (
        '<table class="stages"><thead><tr><th></th><th>stage (op@scope)</th><th>kind</th><th>PCUs</th>'
        "<th>PMUs</th><th>FLOP/socket</th><th>bytes/socket</th></tr></thead>"
        f"<tbody>{rows}</tbody></table>"
    )


def utilization(alloc: Allocation, mapping: Mapping, est: Estimate, kernel: str) -> str:
    hw = mapping.hw
    kt = next(k for k in est.kernels if k.name == kernel)
    busy = kt.compute_s / kt.iteration_s if kt.iteration_s else 0.0
    crit = alloc.critical_stage
    return (
        f"{alloc.pcus}/{hw.pcus} PCUs ({100 * alloc.pcus / hw.pcus:.1f}%) and {alloc.pmus}/{hw.pmus} PMUs "
        f"({100 * alloc.pmus / hw.pmus:.1f}%) allocated to {len(alloc.stages)} stages; common stage time "
        f"T = {fmt_time(alloc.stage_time_s)}; critical stage {html.escape(crit.name)} ({crit.pcus} PCUs). "
        f"Looped, each iteration takes {fmt_time(kt.iteration_s)} (memory {fmt_time(kt.memory_s)}, compute "
        f"{fmt_time(kt.compute_s)}, all-reduce {fmt_time(kt.comm_s)}): the PCUs compute "
        f"{100 * busy:.1f}% of the time. SRAM per socket: stage buffers {alloc.buffer_bytes / 2**20:.1f} MiB "
        f"({100 * alloc.buffer_bytes / hw.sram_bytes:.1f}% of {hw.sram_bytes / 2**20:.0f} MiB"
        + (f", {sum(s.tiles > 1 for s in alloc.stages)} stages tiled" if any(s.tiles > 1 for s in alloc.stages) else "")
        + f"); {mapping.placement.prefetch_bytes / 2**20:.0f} MiB free for the next layer's "
        f"{mapping.placement.layer_stream_bytes / 2**20:.1f} MiB."
    )


# ---- timeline ----


def _lane(
    segs: list[Segment], t0: float, t1: float, y: float, h: float, x0: float, wpx: float, ticks: bool = True
) -> list[str]:
    sx = wpx / (t1 - t0)
    out = []
    for s in segs:
        if s.end_s <= t0 or s.start_s >= t1:
            continue
        a, b = max(s.start_s, t0), min(s.end_s, t1)
        x, w = x0 + (a - t0) * sx, max((b - a) * sx, 0.4)
        fill = ROLE_COLORS.get(s.role, "#999") if s.phase == "body" else PHASE_COLORS[s.phase]
        cls = f"seg {s.phase}"
        tip = (
            f"<title>{html.escape(f'{s.kernel} call {s.call}: {s.phase} {fmt_time(s.end_s - s.start_s)}')}"
            f"{html.escape(f', HBM {100 * s.hbm:.0f}% of peak' if s.phase == 'body' else '')}</title>"
        )
        out.append(f'<rect class="{cls}" x="{x:.2f}" y="{y}" width="{w:.2f}" height="{h}" fill="{fill}">{tip}</rect>')
    return out


def _bw_path(segs: list[Segment], t0: float, t1: float, y: float, h: float, x0: float, wpx: float) -> str:
    sx = wpx / (t1 - t0)
    d = [f"M{x0:.2f} {y + h:.2f}"]
    for s in segs:
        if s.end_s <= t0 or s.start_s >= t1:
            continue
        a, b = max(s.start_s, t0), min(s.end_s, t1)
        yy = y + h * (1 - min(s.hbm, 1.0))
        d.append(f"L{x0 + (a - t0) * sx:.2f} {yy:.2f}L{x0 + (b - t0) * sx:.2f} {yy:.2f}")
    d.append(f"L{x0 + wpx:.2f} {y + h:.2f}Z")
    return "".join(d)


def _axis(t0: float, t1: float, y: float, x0: float, wpx: float) -> list[str]:
    span = t1 - t0
    step = 10 ** math.floor(math.log10(span / 5))
    for m in (1, 2, 5, 10):
        if span / (step * m) <= 8:
            step *= m
            break
    out = [f'<line x1="{x0}" y1="{y}" x2="{x0 + wpx}" y2="{y}" class="ax"/>']
    k = math.ceil(t0 / step)
    while k * step <= t1 + 1e-15:
        x = x0 + (k * step - t0) / span * wpx
        out.append(
            f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 4}" class="ax"/>'
            f'<text x="{x:.1f}" y="{y + 15}" class="axis" text-anchor="middle">{fmt_time(k * step)}</text>'
        )
        k += 1
    return out


def timeline_svg(mapping: Mapping, on: Estimate, off: Estimate) -> str:
    """Two lanes of kernel calls (looped, unlooped) and two HBM-bandwidth traces, on the full token and
    zoomed on the first three decoder calls of the unlooped run."""
    seg_on, seg_off = timeline(mapping, on), timeline(mapping, off)
    t_end = max(seg_on[-1].end_s, seg_off[-1].end_s)
    dec = [s for s in seg_off if s.role == "decoder"]
    period = (dec[-1].end_s - dec[0].start_s) / max(s.call for s in dec) if len(dec) > 1 else t_end
    z0 = max(dec[0].start_s - 0.15 * period, 0.0) if dec else 0.0
    z1 = min(z0 + 3.3 * period, t_end)
    x0, wpx, lh, bh = 92, 880, 16, 46
    eff = mapping.hw.hbm_efficiency
    parts: list[str] = []
    y = 4
    for title, t0, t1 in (("one token", 0.0, t_end), ("zoom: first 3 decoder calls", z0, z1)):
        parts.append(f'<text x="0" y="{y + 10}" class="ttl">{title}</text>')
        y += 16
        for name, segs in (("looped", seg_on), ("unlooped", seg_off)):
            parts.append(f'<text x="0" y="{y + 12}" class="lbl">{name}</text>')
            parts += _lane(segs, t0, t1, y, lh, x0, wpx)
            y += lh + 4
        for name, segs in (("HBM looped", seg_on), ("HBM unlooped", seg_off)):
            parts.append(
                f'<text x="0" y="{y + bh / 2 + 4}" class="lbl">{name}</text>'
                f'<rect x="{x0}" y="{y}" width="{wpx}" height="{bh}" class="bwbg"/>'
                f'<path class="bw {name.split()[1]}" d="{_bw_path(segs, t0, t1, y, bh, x0, wpx)}">'
                f"<title>{html.escape(f'{name}: mean {100 * mean_hbm(segs):.1f}% of peak HBM')}</title>"
                f'</path><line x1="{x0}" x2="{x0 + wpx}" y1="{y + bh * (1 - eff):.1f}" '
                f'y2="{y + bh * (1 - eff):.1f}" class="eff"/>'
            )
            y += bh + 4
        parts += _axis(t0, t1, y, x0, wpx)
        y += 30
    return (
        f'<svg class="timeline" viewBox="0 0 {x0 + wpx + 10} {y}" width="100%" '
        f'preserveAspectRatio="xMinYMin meet">' + "".join(parts) + "</svg>"
    )

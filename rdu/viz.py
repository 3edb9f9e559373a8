"""A self-contained HTML report of a modeled decode step: one file, no CDN, no server.

    html = report_html("llama-3.1-70b", batch=1, context=4096, sockets=(4, 8, 16))
    jaxdecode rdu --model llama-3.1-70b --sockets 4,8,16 --html report.html

Four parts, all from one `rdu.analysis.Analysis` (the numbers `jaxdecode rdu --json` prints, which the
page also embeds verbatim as `<script type="application/json" id="rdu-data">`):

1. summary: tok/s, % of roofline, kernel-looping speedup per socket count, and the GPU estimate;
2. the dataflow graph by name scope, collapsible, repeated layers folded (rdu.viz_graph);
3. the mapping: the SN40L tile's PCUs and PMUs colored by the stage that owns them (rdu.viz_chip);
4. the timeline of one token, looped and not, with HBM bandwidth over time (rdu.viz_chip).

SVG is generated here in Python; the inline script (rdu/assets/report.js) only switches overlays and
views, so the page stays small and fast for 80-layer models (one layer body is drawn, not 80).
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from rdu.analysis import Analysis, analyze
from rdu.viz_chip import PHASE_COLORS, ROLE_COLORS, grid_svg, stage_table, timeline_svg, utilization
from rdu.viz_graph import FORMATS, METRICS, GraphView, Scale

ASSETS = Path(__file__).parent / "assets"


def report_html(
    cfg_or_name,
    batch: int = 1,
    context: int = 4096,
    sockets=(1, 2, 4, 8, 16),
    *,
    hbm_tb_s: float = 1.8,
    gpu: str = "h200",
) -> str:
    """The HTML report of a preset (a ModelConfig or its name) on the given socket counts."""
    if isinstance(cfg_or_name, str):
        from jaxdecode.config import get_preset

        cfg_or_name = get_preset(cfg_or_name)
    return render_html(analyze(cfg_or_name, batch, context, list(sockets), hbm_tb_s=hbm_tb_s, gpu_name=gpu))


def render_html(a: Analysis) -> str:
    r = a.result
    title = f"{r['model']} decode on {r['hardware']}: B={r['batch']} S={r['context']}"
    data = json.dumps(r).replace("</", "<\\/")
    body = "\n".join(
        [
            f"<h1>{html.escape(title)}</h1>",
            f'<p class="sub"><span data-key="gflop_per_step" data-value="{r["gflop_per_step"]!r}">'
            f"{r['gflop_per_step']:.2f}</span> GFLOP and "
            f'<span data-key="gb_per_step" data-value="{r["gb_per_step"]!r}">'
            f"{r['gb_per_step']:.2f}</span> GB per decode step; {len(a.graph.find('dot_general'))} matmuls in the "
            f"looped trace; GPU: {html.escape(a.gpu.name)}.</p>",
            '<h2 id="summary">Summary</h2>',
            summary_table(a),
            '<h2 id="graph-h">Dataflow graph</h2>',
            graph_section(a),
            '<h2 id="mapping">Mapping on the SN40L tile</h2>',
            mapping_section(a),
            '<h2 id="timeline">Timeline of one decode token</h2>',
            timeline_section(a),
        ]
    )
    css = (ASSETS / "report.css").read_text()
    js = (ASSETS / "report.js").read_text()
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<style>{css}</style></head><body>\n{body}\n"
        f'<script type="application/json" id="rdu-data">{data}</script>\n'
        f"<script>{js}</script></body></html>\n"
    )


def _cell(key: str, value: float, text: str) -> str:
    return f'<td data-key="{key}" data-value="{value!r}">{text}</td>'


def summary_table(a: Analysis) -> str:
    """SN40L rows per socket count (looped, unlooped, speedup) and GPU rows; each number cell carries
    its JSON path (`data-key`) and exact value (`data-value`); the text is the rounded value."""
    r = a.result
    gpu_xla = r["gpu"]["xla"]["tok_s"]
    head = (
        '<tr><th class="l" rowspan="2">SN40L sockets</th><th colspan="4">looped (kernel looping)</th>'
        '<th colspan="4">unlooped (one call per layer)</th><th rowspan="2">KL speedup</th>'
        f'<th rowspan="2">looped vs {html.escape(a.gpu.name)} (XLA)</th></tr>'
        "<tr>" + "<th>ms/token</th><th>tok/s</th><th>% roofline</th><th>calls</th>" * 2 + "</tr>"
    )
    rows = []
    for i, row in enumerate(r["sn40l"]):
        if not row["fits"]:
            rows.append(
                f'<tr class="nofit"><td class="l">{row["sockets"]}</td><td class="l" colspan="10" '
                f'title="{html.escape(row["reason"])}">does not fit: {html.escape(row["reason"][:160])}'
                f"{'…' if len(row['reason']) > 160 else ''}</td></tr>"
            )
            continue
        cells = [f'<td class="l" data-key="sn40l.{i}.sockets" data-value="{row["sockets"]}">{row["sockets"]}</td>']
        for mode in ("looped", "unlooped"):
            e = row[mode]
            k = f"sn40l.{i}.{mode}"
            cells += [
                _cell(f"{k}.ms_per_token", e["ms_per_token"], f"{e['ms_per_token']:.3f}"),
                _cell(f"{k}.tok_s", e["tok_s"], f"{e['tok_s']:.1f}"),
                _cell(f"{k}.fraction_of_roofline", e["fraction_of_roofline"], f"{100 * e['fraction_of_roofline']:.1f}"),
                _cell(f"{k}.calls_per_token", e["calls_per_token"], str(e["calls_per_token"])),
            ]
        cells.append(_cell(f"sn40l.{i}.kl_speedup", row["kl_speedup"], f"{row['kl_speedup']:.2f}×"))
        vs = row["looped"]["tok_s"] / gpu_xla
        cells.append(f'<td class="derived" data-value="{vs!r}">{vs:.2f}×</td>')
        rows.append("<tr>" + "".join(cells) + "</tr>")
    gpu_rows = []
    for mode, e in r["gpu"].items():
        k = f"gpu.{mode}"
        gpu_rows.append(
            f'<tr><td class="l">{html.escape(a.gpu.name)} ×1, {mode}</td>'
            + _cell(f"{k}.ms_per_token", e["ms_per_token"], f"{e['ms_per_token']:.3f}")
            + _cell(f"{k}.tok_s", e["tok_s"], f"{e['tok_s']:.1f}")
            + _cell(f"{k}.fraction_of_roofline", e["fraction_of_roofline"], f"{100 * e['fraction_of_roofline']:.1f}")
            + _cell(f"{k}.calls_per_token", e["calls_per_token"], str(e["calls_per_token"]))
            + "</tr>"
        )
    gpu_head = '<tr><th class="l">GPU model</th><th>ms/token</th><th>tok/s</th><th>% roofline</th><th>kernels</th></tr>'
    note = (
        '<p class="note">% roofline: bytes per token ÷ (peak HBM bandwidth × sockets) ÷ modeled time. '
        "KL speedup: unlooped ÷ looped time. GPU modes: xla (fused, one dispatch per token), scan_copy "
        "(xla plus the copy XLA makes of each stacked layer weight), eager (one kernel per op).</p>"
    )
    return (
        f'<table class="summary" id="summary-sn40l">{head}{"".join(rows)}</table><br>'
        f'<table class="summary" id="summary-gpu">{gpu_head}{"".join(gpu_rows)}</table>{note}'
    )


def graph_section(a: Analysis) -> str:
    scale = Scale.of([a.graph, a.unrolled], a.hw)
    view = GraphView(a.hw, scale)
    legends = "".join(
        f'<span class="legend-range" data-metric="{m}"{"" if m == "time" else " hidden"}>'
        f'{FORMATS[m](scale.lo[m])} <span class="ramp"></span> {FORMATS[m](scale.hi[m])} per token</span>'
        for m in METRICS
    )
    options = "".join(
        f'<option value="{v}">{t}</option>'
        for v, t in (("time", "modeled time"), ("flops", "FLOPs"), ("bytes", "bytes (per op)"), ("kind", "op kind"))
    )
    toolbar = (
        f'<div class="toolbar"><label>color by <select id="overlay">{options}</select></label>{legends}'
        '<button id="expand-all">expand all</button><button id="collapse-all">collapse all</button></div>'
    )
    note = (
        '<p class="note">Each name scope is a collapsible block; inside, ops keep program order and '
        "edges join ops of the same block (hover a node for its shapes, dtypes and costs, an edge for "
        "its tensor). Orange dashed nodes are repeated layers: the looped trace runs one body "
        f"{a.cfg.n_layers} times in one <code>scan</code>; in the unrolled trace the {a.cfg.n_layers} "
        "identical calls are folded into one node. Colors are per-token totals on a log scale; modeled "
        "time of an op is its roofline time alone on one socket, unfused.</p>"
    )
    looped = view.graph(a.graph, "", 1)
    unrolled = view.graph(a.unrolled, "", 1)
    return (
        f'<div id="graph">{toolbar}{note}'
        f'<details class="root" open><summary><b>looped trace</b> <span class="meta">'
        f'{html.escape(a.graph.name)}: what is mapped</span></summary><div class="body">{looped}</div></details>'
        f'<details class="root"><summary><b>unrolled trace</b> <span class="meta">{html.escape(a.unrolled.name)}'
        f': {len(a.unrolled.nodes)} top-level ops</span></summary><div class="body">{unrolled}</div></details>'
        "</div>"
    )


def mapping_section(a: Analysis) -> str:
    fitting = a.fitting
    if not fitting:
        return '<p class="note">The model fits none of the socket counts asked for: no mapping to draw.</p>'
    kernels = [k.name for k in fitting[0].mapping.kernels if k.name in fitting[0].mapping.allocations]
    default = next((k.name for k in fitting[0].mapping.kernels if k.is_layer), kernels[0])
    sel_s = "".join(f'<option value="{r.sockets}">{r.sockets}</option>' for r in fitting)
    sel_k = "".join(
        f'<option value="{html.escape(k)}"{" selected" if k == default else ""}>{html.escape(k)}</option>'
        for k in kernels
    )
    views = []
    for r in fitting:
        for j, k in enumerate(kernels):
            alloc = r.mapping.allocations.get(k)
            if alloc is None:
                continue
            hidden = "" if (r is fitting[0] and k == default) else " hidden"
            views.append(
                f'<div class="gridview" data-s="{r.sockets}" data-k="{html.escape(k)}"{hidden}>'
                f'{grid_svg(alloc, r.mapping, f"s{r.sockets}k{j}")}<div class="gridinfo"><p><b>{html.escape(k)}'
                f"</b> on each of {r.sockets} socket(s). {utilization(alloc, r.mapping, r.looped, k)}</p>"
                f"<details><summary>{len(alloc.stages)} stages</summary>{stage_table(alloc, r.sockets)}</details>"
                "</div></div>"
            )
    return (
        '<p class="note">Each computing op of a kernel is a pipeline stage; PCUs (compute) and PMUs (memory) '
        "go to stages by a binary search on a common stage time. Weights are sharded over the sockets "
        "(tensor parallel), so every socket holds the same pipeline on its shard. Schematic layout: PCU and "
        "PMU rows alternate; hover a stage for its name and share.</p>"
        f'<div class="toolbar"><label>sockets <select id="grid-sockets">{sel_s}</select></label>'
        f'<label>kernel <select id="grid-kernel">{sel_k}</select></label></div>'
        f'<p id="grid-none" class="note" hidden>This kernel has no computing stage.</p>{"".join(views)}'
    )


def timeline_section(a: Analysis) -> str:
    keys = "".join(
        f'<span><span class="sw" style="background:{c}"></span> {role}</span>'
        for role, c in ROLE_COLORS.items()
        if role != "other"
    )
    keys += "".join(
        f'<span><span class="sw" style="background:{c}"></span> {ph}</span>' for ph, c in PHASE_COLORS.items()
    )
    out = [
        '<p class="note">Kernel calls of one decode token on one socket (all sockets run the same '
        "schedule): each call pays a launch (with its sync), its body, and the pipeline latency (drain and "
        "fill, the all-reduce hops) during which HBM idles. Unlooped, every layer is a call; looped, the "
        "layers are iterations of one call and the next weights stream while the activation passes the "
        "pipeline, so a steady iteration takes max(latency, body). The HBM "
        "traces are the read rate as a share of peak; the dashed line is the fused-kernel streaming "
        "efficiency.</p>",
        f'<div class="keys">{keys}</div>',
    ]
    for r in a.fitting:
        saved = r.unlooped.per_token_s - r.looped.per_token_s
        out.append(
            f'<details class="tl" open><summary><b>{r.sockets} socket(s)</b> <span class="meta">looped '
            f"{r.looped.ms_per_token:.3f} ms, unlooped {r.unlooped.ms_per_token:.3f} ms: looping saves "
            f"{saved * 1e3:.3f} ms per token</span></summary>"
            f"{timeline_svg(r.mapping, r.looped, r.unlooped)}</details>"
        )
    if not a.fitting:
        out.append('<p class="note">Nothing fits: no timeline.</p>')
    return "\n".join(out)

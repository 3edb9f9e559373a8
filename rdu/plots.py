"""Static PNGs of a modeled decode step (matplotlib, Agg backend): for papers and terminals.

    a = rdu.analysis.analyze(get_preset("llama-3.1-70b"), 1, 4096, [4, 8, 16])
    timeline_png(a, "timeline.png")   # kernel calls and HBM use over one token, looped vs unlooped
    scaling_png(a, "scaling.png")     # tok/s vs sockets, looped and unlooped, GPU estimate as a line
    report_png(a, "report.png")       # both in one figure (what `jaxdecode rdu --png` writes)

The numbers are those of the HTML report and of `jaxdecode rdu --json` (the same `Analysis`).
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from rdu.analysis import Analysis, SocketRun, mean_hbm, timeline  # noqa: E402
from rdu.viz_chip import PHASE_COLORS, ROLE_COLORS  # noqa: E402


def _pick(a: Analysis, sockets: int | None) -> SocketRun:
    runs = a.fitting
    if not runs:
        raise ValueError(f"{a.cfg.name} fits none of the socket counts {[r.sockets for r in a.runs]}: nothing to plot")
    if sockets is None:
        return runs[-1]
    for r in runs:
        if r.sockets == sockets:
            return r
    raise ValueError(f"no fitting run on {sockets} sockets; fitting: {[r.sockets for r in runs]}")


def draw_timeline(ax_calls, ax_bw, a: Analysis, sockets: int | None = None) -> None:
    r = _pick(a, sockets)
    for row, (name, est) in enumerate((("looped", r.looped), ("unlooped", r.unlooped))):
        segs = timeline(r.mapping, est)
        bars = [(s.start_s * 1e3, (s.end_s - s.start_s) * 1e3) for s in segs]
        colors = [ROLE_COLORS.get(s.role, "#999") if s.phase == "body" else PHASE_COLORS[s.phase] for s in segs]
        ax_calls.broken_barh(bars, (1 - row - 0.35, 0.7), facecolors=colors, edgecolor="white", linewidth=0.3)
        t = [x for s in segs for x in (s.start_s * 1e3, s.end_s * 1e3)]
        bw = [100 * s.hbm for s in segs for _ in (0, 1)]
        color = "#c8650f" if row == 0 else "#3a66b8"
        label = f"{name} (mean {100 * mean_hbm(segs):.0f}%)"
        if row == 0:  # looped on top, as a line: it has no dips to hide
            ax_bw.plot(t, bw, lw=1.6, color=color, label=label, zorder=3)
        else:
            ax_bw.fill_between(t, bw, lw=0.5, color=color, alpha=0.35, label=label, zorder=2)
    ax_calls.set_yticks([1, 0], ["looped", "unlooped"])
    ax_calls.set_title(f"{a.cfg.name} B={a.batch} S={a.context}: one decode token on {r.sockets} SN40L socket(s)")
    ax_bw.axhline(100 * a.hw.hbm_efficiency, ls="--", lw=0.7, color="k")
    ax_bw.set_ylabel("HBM read, % of peak")
    ax_bw.set_xlabel("time (ms)")
    ax_bw.set_ylim(0, 100)
    ax_bw.legend(loc="lower right", fontsize=8)


def draw_scaling(ax, a: Analysis) -> None:
    runs = a.fitting
    p = [r.sockets for r in runs]
    ax.plot(p, [r.looped.tok_s for r in runs], "o-", color="#c8650f", label="SN40L looped")
    ax.plot(p, [r.unlooped.tok_s for r in runs], "s--", color="#3a66b8", label="SN40L unlooped")
    for r in runs:
        ax.annotate(
            f"{r.unlooped.per_token_s / r.looped.per_token_s:.2f}×",
            (r.sockets, r.looped.tok_s),
            textcoords="offset points",
            xytext=(0, 6),
            ha="center",
            fontsize=8,
        )
    for mode, style in (("xla", ":"), ("eager", "-.")):
        e = a.gpu_estimates[mode]
        ax.axhline(e.tok_s, ls=style, lw=1, color="#4fae68", label=f"{a.gpu.name} ×1 {mode}")
    ax.set_xscale("log", base=2)
    ax.set_xticks([r.sockets for r in a.runs], [str(r.sockets) for r in a.runs])
    ax.set_xlabel("sockets")
    ax.set_ylabel("tok/s (all sequences of the batch)")
    ax.set_title("decode tok/s vs sockets (labels: kernel-looping speedup)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def timeline_png(a: Analysis, path: str, sockets: int | None = None) -> None:
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 4.5), sharex=True, height_ratios=(1, 1.6))
    draw_timeline(ax1, ax2, a, sockets)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def scaling_png(a: Analysis, path: str) -> None:
    _pick(a, None)
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    draw_scaling(ax, a)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report_png(a: Analysis, path: str, sockets: int | None = None) -> None:
    """Timeline (top) and tok/s vs sockets (bottom) in one PNG."""
    fig = plt.figure(figsize=(10, 9))
    grid = fig.add_gridspec(3, 1, height_ratios=(1, 1.6, 2.6))
    ax1 = fig.add_subplot(grid[0])
    ax2 = fig.add_subplot(grid[1], sharex=ax1)
    ax3 = fig.add_subplot(grid[2])
    draw_timeline(ax1, ax2, a, sockets)
    draw_scaling(ax3, a)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""The output side of `jaxdecode bench`: a line per row, the summary object and the plot."""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

import jax
import numpy as np


def device_name() -> str:
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", str(device))
    return kind + (f" ({platform.processor() or platform.machine()})" if device.platform == "cpu" else "")


def print_row(r: dict):
    ratio = f"  ours/peer {r['ours_over_peer']:.2f}x  agree {r['tokens_agree']}" if "ours_over_peer" in r else ""
    print(
        f"{r['model']:14} {r['system']:9} B{r['batch']:<3} ctx {r['context']:<6} first {r['first_call_s']:6.1f} s  "
        f"prefill {r['prefill_ms']:8.1f} ms  {r['ms_per_token']:8.3f} ms/token  {r['tok_s']:9.1f} tok/s  "
        f"{r['pct_roofline']:5.1f}% roof  (est {r['est_s']:.0f} s, took {r['wall_s']:.0f} s){ratio}",
        file=sys.stderr,
        flush=True,
    )


def summarize(
    rows: list[dict], *, skipped: list[str], errors: list[str], ceiling: float, wall_s: float, plot_path: str | None
) -> dict:
    """The last JSON object: hardware, versions, the ratio table (ours / peer, tok/s) per config."""
    ratios: dict[str, dict[str, float]] = {}
    for r in rows:
        if "ours_over_peer" in r:
            ratios.setdefault(f"{r['model']} B{r['batch']} ctx{r['context']}", {})[r["system"]] = r["ours_over_peer"]
    versions = {"jax": jax.__version__}
    for mod in ("torch", "transformers"):
        if mod in sys.modules:
            versions[mod] = sys.modules[mod].__version__
    return {
        "summary": True,
        "device": device_name(),
        "backend": jax.default_backend(),
        "versions": versions,
        "read_ceiling_gb_s": ceiling,
        "rows": len(rows),
        "ratios_ours_over_peer": ratios,
        "skipped": skipped,
        "errors": errors,
        "wall_s": round(wall_s, 1),
        "plot": plot_path,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def plot(rows: list[dict], path: Path) -> None:
    """tok/s (log scale) and % of the read ceiling per config, one bar per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys((r["model"], r["batch"], r["context"]) for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    by = {(r["model"], r["batch"], r["context"], r["system"]): r for r in rows}
    fig, axes = plt.subplots(2, 1, figsize=(max(6.0, 1.1 * len(configs) * max(1, len(systems)) / 3), 7), sharex=True)
    width = 0.8 / len(systems)
    x = np.arange(len(configs))
    for i, s in enumerate(systems):
        for ax, key in zip(axes, ("tok_s", "pct_roofline")):
            vals = [by[(*c, s)][key] if (*c, s) in by else 0.0 for c in configs]
            ax.bar(x + (i - (len(systems) - 1) / 2) * width, vals, width, label=s)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("tok/s (sum over batch)")
    axes[1].set_ylabel("% of read ceiling")
    axes[1].set_xticks(x, [f"{m}\nB{b} ctx {c}" for m, b, c in configs], fontsize=7)
    axes[0].legend(fontsize=7, ncol=len(systems), loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.suptitle(
        f"decode, {rows[0]['device']}, {rows[0]['dtype']}, read ceiling {rows[0]['read_ceiling_gb_s']:.0f} GB/s"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

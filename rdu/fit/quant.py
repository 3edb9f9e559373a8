"""The quantized rows of GPU mode "looped_inplace": the one quantized constant, `quant_glue_kernel_s`,
solved on the one in-sample row of rdu.anchors.QUANT_ROWS (the step time is linear in it), every other
row held out. The quantized GEMM kernel's own constants and the kernel counts are measured, not fitted
(rdu.quantized: the Stream-K kernel the engine runs, q·k·v and gate + up fused); the bf16 in-place and
"xla" constants are the ones fitted before (rdu.fit.inplace, rdu.fit.gpu)."""

from __future__ import annotations

from dataclasses import replace

from jaxdecode.config import get_preset
from rdu.anchors import QUANT_ROWS, GPURow
from rdu.fit.common import err_pct, summarize
from rdu.gpu import gpu_estimate
from rdu.hardware import H200, QUANT_FREE, GPUSpec
from rdu.quantized import QUANT_KERNELS
from rdu.trace import trace_decode_step


def quant_row_ms(row: GPURow, spec: GPUSpec) -> float:
    """The model's step time (ms) of a measured row, quantized or not."""
    cfg = get_preset(row.model)
    g = trace_decode_step(cfg, row.batch, row.context, looped=False, quantize=row.quantize, scale_dtype=row.scale_dtype)
    e = gpu_estimate(g, spec, batch=row.batch, dim=cfg.dim, kv_heads=cfg.n_kv_heads, mode=row.mode)
    return 1e3 * e.per_token_s


def solve_glue(row: GPURow, spec: GPUSpec) -> float:
    """The `quant_glue_kernel_s` at which the model meets `row` exactly."""
    lo, hi = (quant_row_ms(row, replace(spec, quant_glue_kernel_s=v)) for v in (0.0, 1e-6))
    return max(0.0, 1e-6 * (row.measured_ms - lo) / (hi - lo))


def run_quant(c_xla: dict, c_inplace: dict) -> dict:
    """The "gpu_quant" record of rdu/fitted.json: the solved constant, per-row errors, the kernel table."""
    spec = replace(H200, **c_xla, **c_inplace)
    train = [r for r in QUANT_ROWS if r.split == "train"]
    fitted = {"quant_glue_kernel_s": solve_glue(train[0], spec)}
    pub = {k: getattr(H200, k) for k in QUANT_FREE}
    rows = []
    for r in QUANT_ROWS:
        a, b = quant_row_ms(r, replace(spec, **pub)), quant_row_ms(r, replace(spec, **fitted))
        rows.append(
            {
                "group": "h200_quant",
                "what": r.what,
                "model": r.model,
                "quantize": r.quantize,
                "split": r.split,
                "mode": r.mode,
                "batch": r.batch,
                "context": r.context,
                "target": r.measured_ms,
                "unit": "ms/step",
                "source": r.source,
                "published_model": a,
                "fitted_model": b,
                "published_err_pct": err_pct(a, r.measured_ms),
                "fitted_err_pct": err_pct(b, r.measured_ms),
            }
        )
    summary = {
        f"h200_quant_{split}": {
            k: summarize([x[f"{k}_err_pct"] for x in rows if x["split"] == split]) for k in ("published", "fitted")
        }
        for split in ("train", "test")
    }
    return {
        "published": pub,
        "fitted": fitted,
        "fit_rows": [r.what for r in train],
        "held_out_rows": [r.what for r in QUANT_ROWS if r.split == "test"],
        "kernels": {f: {k: v for k, v in vars(q).items() if k != "source"} for f, q in QUANT_KERNELS.items()},
        "kernels_source": next(iter(QUANT_KERNELS.values())).source,
        "rows": rows,
        "summary": summary,
    }


def quant_table(rec: dict) -> str:
    """The quantized rows of a fitted record (rdu/fitted.json's "gpu_quant"), marked in-sample or held out."""
    q = rec["gpu_quant"]
    lines = [
        f"H200 in-place mode, quantized weights (quant_glue_kernel_s {1e6 * q['fitted']['quant_glue_kernel_s']:.2f} us)"
    ]
    for fmt, k in q["kernels"].items():
        lines.append(
            f"  {fmt}: {k['gemm_kernels']} GEMM launches a layer at {1e6 * k['gemm_fixed_s']:.2f} us + bytes at "
            f"{k['gemm_efficiency']:.3f} of the read ceiling; {k['kernels_per_layer']} kernels a layer at M = 1, "
            f"{k['kernels_per_layer_batched']} at M >= 2"
        )
    for x in (r for r in rec["rows"] if r["group"] == "h200_quant"):
        split = "in-sample" if x["split"] == "train" else "held out"
        lines.append(
            f"  {x['what'][:50]:50s} measured {x['target']:8.4f} ms  model {x['fitted_model']:8.4f} ms "
            f"{x['fitted_err_pct']:+6.1f}%  {split}"
        )
    s = rec["summary"]["h200_quant_test"]["fitted"]
    lines.append(f"  held out: MAPE {s['mape_pct']:.1f}%, max {s['max_abs_err_pct']:.1f}% (issue bar: 8%, 15%)")
    return "\n".join(lines)

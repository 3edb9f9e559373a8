"""All fits of rdu.fit in one run: the GPU constants (with and without the batch term), the SN40L
constants and the looped in-place ones; the per-row table and the record of rdu/fitted.json."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from rdu.anchors import DGX_ROW, H200_ROWS
from rdu.fit.common import PRIOR_WEIGHT, err_pct, summarize
from rdu.fit.gpu import fit_gpu, gpu_constants, gpu_row_features, gpu_time
from rdu.fit.inplace import run_inplace
from rdu.fit.quant import run_quant
from rdu.fit.sn40l import PRIOR_SIGMA, fit_sn40l, rdu_constants, sn40l_configs, sn40l_predictions
from rdu.hardware import FITTED_PATH, H100, H200, SN40L_FITTED, sn40l
from rdu.targets import IN_SAMPLE, TARGETS, runtime_step_s


def run_fit(steps: int = 600) -> dict:
    """Fit both sets of constants; returns the record written to rdu/fitted.json."""
    t0 = time.time()
    gfeats = [gpu_row_features(r) for r in H200_ROWS]
    gpu_fit, gpu_loss = fit_gpu(gfeats, steps=steps)
    flat_fit, flat_loss = fit_gpu(gfeats, steps=steps, batch_dependent=False)
    rfeats = sn40l_configs()
    rdu_fit, rdu_loss = fit_sn40l(rfeats, _in_sample_rows())
    gpub = gpu_constants(H200)
    rows = []
    for r, f in zip(H200_ROWS, gfeats):
        pub, fit = 1e3 * float(gpu_time(gpub, f)), 1e3 * float(gpu_time(gpu_fit, f))
        flat = 1e3 * float(gpu_time(flat_fit, f))
        rows.append(
            {
                "group": "h200",
                "what": r.what,
                "split": r.split,
                "mode": r.mode,
                "batch": r.batch,
                "context": r.context,
                "target": r.measured_ms,
                "unit": "ms/step",
                "source": r.source,
                "published_model": pub,
                "fitted_model": fit,
                "published_err_pct": err_pct(pub, r.measured_ms),
                "fitted_err_pct": err_pct(fit, r.measured_ms),
                "no_batch_term_model": flat,
                "no_batch_term_err_pct": err_pct(flat, r.measured_ms),
            }
        )
    # The DGX row with the serving runtime's per-token step, which each set of constants sets anew.
    pub, fit = (
        1e3 * float(gpu_time(c, gpu_row_features(DGX_ROW, runtime_step_s(replace(H100, **c))))) for c in (gpub, gpu_fit)
    )
    rows.append(
        {
            "group": "dgx_h100",
            "what": DGX_ROW.what,
            "split": "report only",
            "mode": "fixed",
            "batch": 1,
            "target": DGX_ROW.measured_ms,
            "unit": "ms/step",
            "source": DGX_ROW.source,
            "published_model": pub,
            "fitted_model": fit,
            "published_err_pct": err_pct(pub, DGX_ROW.measured_ms),
            "fitted_err_pct": err_pct(fit, DGX_ROW.measured_ms),
        }
    )
    rpub = rdu_constants(sn40l())
    p_pub, p_fit = sn40l_predictions(rpub, rfeats), sn40l_predictions(rdu_fit, rfeats)
    loo = {}
    for key, target, sigma in _in_sample_rows():
        c, _ = fit_sn40l(rfeats, [r for r in _in_sample_rows() if r[0] != key])
        v = float(sn40l_predictions(c, rfeats)[key])
        loo[key] = {"constants": c, "value": v, "target": target, "err_pct": err_pct(v, target)}
    for t in TARGETS:
        if t.key not in p_fit:
            continue
        target = (t.lo * t.hi) ** 0.5 if t.hi < 100 else t.lo
        a, b = float(p_pub[t.key]), float(p_fit[t.key])
        rows.append(
            {
                "group": "sn40l",
                "what": t.quantity,
                "key": t.key,
                "split": "train" if t.split == "in-sample" else "test",
                "target": target,
                "band": [t.lo, t.hi],
                "source": t.source,
                "published_model": a,
                "fitted_model": b,
                "published_err_pct": err_pct(a, target),
                "fitted_err_pct": err_pct(b, target),
            }
        )
    summary = {}
    for grp in ("h200", "sn40l"):
        for split in ("train", "test"):
            sub = [x for x in rows if x["group"] == grp and x["split"] == split]
            summary[f"{grp}_{split}"] = {
                "published": summarize([x["published_err_pct"] for x in sub]),
                "fitted": summarize([x["fitted_err_pct"] for x in sub]),
            }
        sub = [x for x in rows if x["group"] == grp]
        summary[f"{grp}_all"] = {
            "published": summarize([x["published_err_pct"] for x in sub]),
            "fitted": summarize([x["fitted_err_pct"] for x in sub]),
        }
    for key in [k for k in summary if k.startswith("h200")]:
        split = {"train": "train", "test": "test"}.get(key.split("_")[1])
        sub = [x for x in rows if x["group"] == "h200" and (split is None or x["split"] == split)]
        summary[key]["no_batch_term"] = summarize([x["no_batch_term_err_pct"] for x in sub])
    suite = [x for x in rows if x["group"] == "h200" and x["what"].startswith("suite unrolled")]
    for split in ("train", "test", "all"):
        sub = [x for x in suite if split in ("all", x["split"])]
        summary[f"h200_unrolled_{split}"] = {
            k: summarize([x[f"{k}_err_pct"] for x in sub]) for k in ("published", "fitted")
        }
    inplace = run_inplace(gpu_fit, steps=steps)
    rows += inplace.pop("rows")
    summary.update(inplace.pop("summary"))
    quant = run_quant(gpu_fit, inplace["fitted"])
    rows += quant.pop("rows")
    summary.update(quant.pop("summary"))
    return {
        "what": "free constants of the rdu cost model, fitted with optax Adam on log/logit parameters",
        "loss": f"mean squared log error over the train rows + {PRIOR_WEIGHT:g} x sum (free param - published)^2",
        "steps": steps,
        "fit_seconds": round(time.time() - t0, 1),
        "sn40l": {
            "published": rpub,
            "fitted": rdu_fit,
            "fitted_keys": list(SN40L_FITTED),
            "prior": f"log-normal around the published value, sigma ln 3 = {PRIOR_SIGMA:.3f}",
            "loss": "sum over in-sample rows of (log error / log half-band)^2 / 2 + the prior's",
            "train_loss": rdu_loss,
            "hbm_tb_s": 1.8,
            "fit_rows": [t.key for t in IN_SAMPLE],
            "held_out_rows": [t.key for t in TARGETS if t.split == "held out"],
            "leave_one_out": loo,
        },
        "gpu": {
            "published": gpub,
            "fitted": gpu_fit,
            "train_loss": gpu_loss,
            "gpu": "h200 (also used for h100)",
            "no_batch_term_fitted": flat_fit,
            "no_batch_term_train_loss": flat_loss,
            "fit_rows": [r.what for r in H200_ROWS if r.split == "train"],
            "held_out_rows": [r.what for r in H200_ROWS if r.split == "test"],
        },
        "gpu_inplace": inplace,
        "gpu_quant": quant,
        "rows": rows,
        "summary": summary,
    }


def _in_sample_rows() -> list[tuple[str, float, float]]:
    """(target key, value, log sigma) of the in-sample SN40L rows: the band's centre and half-width."""
    return [(t.key, (t.lo * t.hi) ** 0.5, t.sigma()) for t in IN_SAMPLE]


def format_record(rec: dict) -> str:
    lines = [f"{'group':6s} {'split':7s} {'row':62s} {'target':>9s} {'publ.':>9s} {'Δ%':>7s} {'fitted':>9s} {'Δ%':>7s}"]
    for x in rec["rows"]:
        lines.append(
            f"{x['group'][-6:]:6s} {x['split'][:7]:7s} {x['what'][:62]:62s} {x['target']:9.4g} "
            f"{x['published_model']:9.4g} {x['published_err_pct']:+7.1f} {x['fitted_model']:9.4g} "
            f"{x['fitted_err_pct']:+7.1f}"
        )
    for k, v in rec["summary"].items():
        p, f = v["published"], v["fitted"]
        flat = v.get("no_batch_term")
        lines.append(
            f"{k:15s} ({p['rows']:2d} rows): published MAPE {p['mape_pct']:5.1f}% max {p['max_abs_err_pct']:5.1f}%"
            f"  | fitted MAPE {f['mape_pct']:5.1f}% max {f['max_abs_err_pct']:5.1f}%"
            + (
                f"  | fitted without batch term {flat['mape_pct']:5.1f}% max {flat['max_abs_err_pct']:5.1f}%"
                if flat
                else ""
            )
        )
    for grp in ("sn40l", "gpu", "gpu_inplace", "gpu_quant"):
        keys = rec[grp].get("fitted_keys", rec[grp]["fitted"])
        lines.append(
            f"{grp} constants: "
            + ", ".join(f"{k} {rec[grp]['published'][k]:.4g} -> {rec[grp]['fitted'][k]:.4g}" for k in keys)
        )
    return "\n".join(lines)


def main(path: Path = FITTED_PATH) -> None:
    rec = run_fit()
    print(format_record(rec))
    path.write_text(json.dumps(rec, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path}")

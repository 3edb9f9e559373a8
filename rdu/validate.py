"""GPU numbers, published and measured, against the model's estimates, with Δ% per row and MAPE; the
conflicting anchors under each of their values. The SN40L and Table 1 targets are rdu.targets.

Nothing here is fitted per row or per model: every estimate comes from the traced graph of the
preset and the constants of `rdu.hardware` (published/assumed) or rdu/fitted.json (fitted).
Sources: papers.md §1.8 (DIAYN), h200-anchors.md and docs/log/ (our own H200 measurements).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from jaxdecode.config import get_preset
from rdu.anchors import CONFLICTS, H200_ROWS, SGLANG_ROWS
from rdu.gpu import gpu_estimate
from rdu.hardware import gpu, sn40l
from rdu.simulate import simulate_rdu
from rdu.targets import dgx_estimate, mapped, runtime_step_s, serving_estimate
from rdu.trace import trace_decode_step


@dataclass(frozen=True)
class Row:
    group: str  # "sn40l" | "gpu" | "trace"
    what: str
    published: float
    model: float
    source: str
    kind: str = "value"  # "value" | "upper bound" (up to) | "lower bound" (over)
    bound_pct: float = 25.0  # the |Δ%| this row is held to (see the module docstring of tests)

    @property
    def delta_pct(self) -> float:
        return 100.0 * (self.model - self.published) / self.published

    @property
    def within(self) -> bool:
        return abs(self.delta_pct) <= self.bound_pct


def rows(constants: str = "published") -> list[Row]:
    """Every validation row (traces are cached, so a second call is cheap); `constants` picks the
    published/assumed free constants of rdu.hardware or the fitted ones of rdu/fitted.json."""
    c = constants
    H100, H200 = gpu("h100", c), gpu("h200", c)
    out: list[Row] = []
    cfg8 = get_preset("llama-3.1-8b")
    trt = dgx_estimate(spec=H100)
    step = runtime_step_s(H100)
    out += [
        Row(
            "gpu",
            "DGX H100 TRT-LLM, Llama-3.1-8B bs1 4K: tok/s",
            300.0,
            trt.tok_s,
            "papers.md §1.8 [S:DIAYN]; 10 kernels/layer (DIAYN), runtime step from sglang's 1-GPU row",
        ),
        Row(
            "gpu",
            "DGX H100: % of 24 TB/s",
            21.0,
            100 * trt.bytes_per_token / 24e12 / trt.per_token_s,
            "papers.md §1.1 [P-abs]",
        ),
    ]
    # sglang on 8 H100s, predicted with the runtime step its 1-GPU row sets (that row is exact by construction).
    for r in SGLANG_ROWS:
        if r.split == "held out":
            e = serving_estimate(r, H100, step_s=step)
            out.append(Row("gpu", f"{r.what}, tok/s (held out)", r.tok_s, e.tok_s, r.source, bound_pct=15))
    # Our H200 measurements (h200-anchors.md), Llama-3.1-8B shape, bf16, cache 1024.
    g1k = trace_decode_step(cfg8, 1, 1024, looped=False)

    def h200(mode: str, graph=g1k, batch: int = 1):
        return gpu_estimate(graph, H200, batch=batch, dim=cfg8.dim, kv_heads=8, mode=mode)

    xla, scan, eager = h200("xla"), h200("scan_copy"), h200("eager")
    out += [
        Row("gpu", "H200 plain JAX unrolled, ms/token", 5.97, xla.ms_per_token, "h200-anchors.md", bound_pct=15),
        Row(
            "gpu",
            "H200 plain JAX lax.scan (weight copy), ms/token",
            12.53,
            scan.ms_per_token,
            "h200-anchors.md",
            bound_pct=15,
        ),
        Row(
            "gpu",
            "H200 scan / unrolled slowdown",
            12.53 / 5.97,
            scan.per_token_s / xla.per_token_s,
            "h200-anchors.md",
            bound_pct=15,
        ),
        Row(
            "gpu",
            "H200 HF static cache + torch.compile, ms/token (modeled as XLA-style fusion)",
            7.60,
            xla.ms_per_token,
            "h200-anchors.md",
            bound_pct=25,
        ),
        Row("gpu", "H200 HF eager, ms/token (one kernel per op)", 20.6, eager.ms_per_token, "h200-anchors.md"),
    ]
    for b, measured in ((8, 1042.0), (32, 1857.0)):
        e = h200("xla", trace_decode_step(cfg8, b, 1024, looped=False), b)
        out.append(
            Row("gpu", f"H200 plain JAX unrolled, batch {b}, tok/s", measured, e.tok_s, "h200-anchors.md", bound_pct=25)
        )
    # Our tensor-parallel decode on 2 NVLink H200s (jaxdecode.tp, looped in place), ctx 1024.
    for name, b, measured in TP2_MEASURED_MS:
        cfg = get_preset(name)
        e = gpu_estimate(
            trace_decode_step(cfg, b, 1024, looped=False),
            H200,
            batch=b,
            dim=cfg.dim,
            kv_heads=cfg.n_kv_heads,
            mode="xla",
            n_gpus=2,
        )
        out.append(
            Row(
                "gpu",
                f"2x H200 tensor parallel, {name} batch {b}, ms/token",
                measured,
                e.ms_per_token,
                "docs/log/2026-11-30.md (benchmarks/results/2026-11-30/tp_gpu_psum.json)",
                bound_pct=15,
            )
        )
    return out


# (model, batch, measured ms/token) of the TP scaling runs on 2 H200s (docs/log/2026-11-30.md).
TP2_MEASURED_MS = (
    ("llama-3.1-8b", 1, 4.832),
    ("llama-3.1-8b", 8, 5.229),
    ("llama-3.1-70b", 1, 23.33),
    ("llama-3.1-70b", 8, 25.238),
)


def mape(rs: list[Row]) -> float:
    return sum(abs(r.delta_pct) for r in rs) / len(rs)


def table(rs: list[Row] | None = None) -> str:
    rs = rows() if rs is None else rs
    lines = [f"{'group':6s} {'what':78s} {'published':>9s} {'model':>9s} {'Δ%':>7s} {'bound':>6s} ok  kind", "-" * 130]
    for r in rs:
        lines.append(
            f"{r.group:6s} {r.what:78s} {r.published:9.3g} {r.model:9.3g} {r.delta_pct:+7.1f} "
            f"{r.bound_pct:5.0f}% {'yes' if r.within else 'NO ':3s} {r.kind}"
        )
    for grp in ("gpu",):
        sub = [r for r in rs if r.group == grp]
        lines.append(f"MAPE {grp}: {mape(sub):.1f}% over {len(sub)} rows")
    lines.append(f"MAPE all: {mape(rs):.1f}% over {len(rs)} rows; max |Δ| {max(abs(r.delta_pct) for r in rs):.1f}%")
    return "\n".join(lines)


def h200_rows(constants: str = "published") -> list[Row]:
    """Our measured H200 step times (BENCHMARKS.md and h200-anchors.md; the rows rdu.fit uses) against
    the GPU mode of the reference simulator; `kind` says whether rdu.fit trained on the row."""

    spec = gpu("h200", constants)
    out = []
    for r in H200_ROWS:
        cfg = get_preset(r.model)
        g = trace_decode_step(cfg, r.batch, r.context, looped=False)
        e = gpu_estimate(g, spec, batch=r.batch, dim=cfg.dim, kv_heads=cfg.n_kv_heads, mode=r.mode)
        out.append(
            Row(
                "h200",
                f"{r.what} ({r.mode}), ms/step",
                r.measured_ms,
                e.ms_per_token,
                r.source,
                kind="fit row" if r.split == "train" else "held out",
                bound_pct=15.0,
            )
        )
    return out


def predict_tp(
    model: str,
    batch: int,
    ctx: int,
    n_gpus: int,
    gpu_name: str = "h200",
    *,
    constants: str = "fitted",
    mode: str = "xla",
) -> float:
    """Predicted ms per decode step of `model` on `n_gpus` GPUs of one node (Megatron tensor parallel,
    rdu.gpu.gpu_kernel_terms), batch `batch`, `ctx` cached tokens, XLA-style fusion."""
    cfg = get_preset(model)
    g = trace_decode_step(cfg, batch, ctx, looped=False)
    spec = gpu(gpu_name, constants)
    return gpu_estimate(
        g, spec, batch=batch, dim=cfg.dim, kv_heads=cfg.n_kv_heads, mode=mode, n_gpus=n_gpus
    ).ms_per_token


def spread_rows(constants: str = "published") -> list[dict]:
    """The model under each alternative of every conflicting anchor (rdu.anchors.CONFLICTS): for a
    hardware constant, the estimate it gives; for a measured row, the model's Δ% against each value."""

    cfg8 = get_preset("llama-3.1-8b")
    out = []
    for tb in (v for v, _ in CONFLICTS["sn40l_hbm_tb_s"].alternatives):
        on = simulate_rdu(mapped("llama-3.1-8b", 16, hw=sn40l(tb, constants)))
        out.append(
            {
                "conflict": "sn40l_hbm_tb_s",
                "value": tb,
                "estimate": on.tok_s,
                "what": "SN40L-16 Llama-3.1-8B bs1 4K looped, tok/s",
            }
        )
    h100 = gpu("h100", constants)
    trt = dgx_estimate(spec=h100)
    for us in (v for v, _ in CONFLICTS["dgx_h100_allreduce_us"].alternatives):
        out.append(
            {
                "conflict": "dgx_h100_allreduce_us",
                "value": us,
                "what": "DGX H100 model tok/s",
                "estimate": dgx_estimate(spec=replace(h100, allreduce_latency_s=us * 1e-6)).tok_s,
            }
        )
    for peak in (v for v, _ in CONFLICTS["dgx_h100_peak_tb_s"].alternatives):
        out.append(
            {
                "conflict": "dgx_h100_peak_tb_s",
                "value": peak,
                "what": "DGX H100 model, % of peak",
                "estimate": 100 * trt.bytes_per_token / (peak * 1e12) / trt.per_token_s,
            }
        )
    for tok_s in (v for v, _ in CONFLICTS["dgx_h100_8b_tp8_tok_s"].alternatives):
        out.append(
            {
                "conflict": "dgx_h100_8b_tp8_tok_s",
                "value": tok_s,
                "what": "DGX H100 model tok/s, Δ%",
                "estimate": 100 * (trt.tok_s - tok_s) / tok_s,
            }
        )
    spec = gpu("h200", constants)
    for name, batch, mode in (
        ("h200_hf_eager_b1_ms", 1, "eager"),
        ("h200_hf_static_b1_ms", 1, "xla"),
        ("h200_unrolled_b8_ms", 8, "xla"),
        ("h200_unrolled_b32_ms", 32, "xla"),
    ):
        e = gpu_estimate(
            trace_decode_step(cfg8, batch, 1024, looped=False), spec, batch=batch, dim=cfg8.dim, kv_heads=8, mode=mode
        )
        for v, _ in CONFLICTS[name].alternatives:
            out.append(
                {
                    "conflict": name,
                    "value": v,
                    "what": f"H200 model {e.ms_per_token:.3g} ms ({mode}), Δ%",
                    "estimate": 100 * (e.ms_per_token - v) / v,
                }
            )
    q = get_preset("qwen2.5-7b")
    e = gpu_estimate(
        trace_decode_step(q, 1, 1152, looped=False),
        spec,
        batch=1,
        dim=q.dim,
        kv_heads=q.n_kv_heads,
        mode="looped_inplace",
    )
    for v, _ in CONFLICTS["h200_ours_qwen_b1_ms"].alternatives:
        out.append(
            {
                "conflict": "h200_ours_qwen_b1_ms",
                "value": v,
                "estimate": 100 * (e.ms_per_token - v) / v,
                "what": f"H200 model {e.ms_per_token:.3g} ms (looped_inplace), Δ%",
            }
        )
    return out


def spread_table(rs: list[dict]) -> str:

    lines = ["conflicting anchors (rdu.anchors.CONFLICTS): the model under each published value (* = chosen)"]
    for r in rs:
        c = CONFLICTS[r["conflict"]]
        mark = "*" if r["value"] == c.chosen else " "
        lines.append(
            f"  {r['conflict']:24s} {mark}{r['value']:9.4g} {c.unit[:40]:40s} {r['what']:42s} {r['estimate']:+9.4g}"
        )
    return "\n".join(lines)


def max_err(rs: list[Row]) -> float:
    return max(abs(r.delta_pct) for r in rs)


def comparison_table() -> tuple[str, dict]:
    """Every row with the model under the published and under the fitted constants, then the H200
    measured rows and their MAPE / max error (all, fit rows, held-out rows). Returns (text, json)."""
    pub, fit = rows("published") + h200_rows("published"), rows("fitted") + h200_rows("fitted")
    lines = [
        f"{'group':6s} {'what':78s} {'published':>9s} {'model':>9s} {'Δ%':>7s} {'fitted':>9s} {'Δ%':>7s}  kind",
        "-" * 140,
    ]
    for a, b in zip(pub, fit):
        lines.append(
            f"{a.group:6s} {a.what[:78]:78s} {a.published:9.4g} {a.model:9.4g} {a.delta_pct:+7.1f} "
            f"{b.model:9.4g} {b.delta_pct:+7.1f}  {a.kind}"
        )
    summary = {}
    for name, sel in (
        ("gpu (published/anchor rows)", lambda r: r.group == "gpu"),
        ("H200 measured, all", lambda r: r.group == "h200"),
        ("H200 XLA modes, in-sample (batch 1 + batch 8 1k)", lambda r: r.kind == "fit row"),
        ("H200 XLA modes, held out (batch 8 8k, 32, Qwen)", lambda r: r.kind == "held out"),
    ):
        a, b = [r for r in pub if sel(r)], [r for r in fit if sel(r)]
        summary[name] = {
            "rows": len(a),
            "published": {"mape_pct": mape(a), "max_abs_err_pct": max_err(a)},
            "fitted": {"mape_pct": mape(b), "max_abs_err_pct": max_err(b)},
        }
        lines.append(
            f"{name:38s} {len(a):2d} rows: published constants MAPE {mape(a):5.1f}% max {max_err(a):5.1f}%"
            f" | fitted MAPE {mape(b):5.1f}% max {max_err(b):5.1f}%"
        )
    lines.append("issue target: the XLA modes' held-out MAPE <= 12% (in-place mode: rdu/fitted.json, <= 8%, max 15%)")
    spread = spread_rows("fitted")
    lines.append(spread_table(spread))
    data = {
        "rows": [
            dict(vars(a), delta_pct=a.delta_pct, within=a.within, fitted_model=b.model, fitted_delta_pct=b.delta_pct)
            for a, b in zip(pub, fit)
        ],
        "summary": summary,
        "spread": spread,
    }
    return "\n".join(lines), data

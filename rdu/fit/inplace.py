"""The "looped_inplace" GPU mode (rdu.gpu) as a `jnp` function, and its optax fit.

Free constants: `inplace_kernel_gap_s`, `flat_gemm_efficiency`, `flat_gemm_m_exponent`,
`split_k_efficiency`; the embedding and LM head use the "xla" constants fitted first (rdu.fit.gpu),
held fixed here. Rows: rdu.anchors.INPLACE_ROWS (train / test as marked there), plus leave-one-out
over all of them (each row predicted by a fit on the other seven), and the tensor-parallel rows
(INPLACE_TP_ROWS) reported with the fitted constants. "Before" is the previous model of these rows:
the "xla" mode with its fitted constants.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.config import get_preset
from rdu.anchors import INPLACE_ROWS, INPLACE_TP_ROWS, GPURow
from rdu.fit.common import err_pct, fit_constants, msle, summarize
from rdu.fit.gpu import GPUFeatures, gpu_features, gpu_time
from rdu.gpu import inplace_terms
from rdu.hardware import H100, H200, INPLACE_FREE, GPUSpec
from rdu.mapping import fuse
from rdu.trace import trace_decode_step


def inplace_constants(g: GPUSpec) -> dict[str, float]:
    return {k: getattr(g, k) for k in INPLACE_FREE}


@dataclass(frozen=True)
class InplaceFeatures:
    """Fixed inputs of the looped in-place step: the decoder layer's terms and the XLA rest."""

    xla: GPUFeatures  # embedding and LM head, "xla" mode
    n: float  # layer calls per token
    kernels: float
    gemm_bytes: float
    kv_bytes: float
    other_bytes: float
    compute_s: float
    comm_s: float
    log_m: float  # ln(batch)
    peak_bw: float
    read_bw: float


jax.tree_util.register_dataclass(
    InplaceFeatures,
    data_fields=[
        "xla",
        "n",
        "kernels",
        "gemm_bytes",
        "kv_bytes",
        "other_bytes",
        "compute_s",
        "comm_s",
        "log_m",
        "peak_bw",
        "read_bw",
    ],
    meta_fields=[],
)


def inplace_features(
    kernels,
    gpu: GPUSpec,
    *,
    batch: int,
    n_gpus: int = 1,
    kv_heads: int = 8,
    activation_bytes: int = 0,
    logits_bytes: int = 0,
    allreduce: str = "psum",
) -> InplaceFeatures:
    layer = next(k for k in kernels if k.is_layer)
    t = inplace_terms(
        layer, gpu, n_gpus=n_gpus, kv_heads=kv_heads, activation_bytes=activation_bytes, allreduce=allreduce
    )
    rest = gpu_features(
        [k for k in kernels if not k.is_layer],
        gpu,
        batch=batch,
        mode="xla",
        n_gpus=n_gpus,
        kv_heads=kv_heads,
        activation_bytes=activation_bytes,
        logits_bytes=logits_bytes,
    )
    return InplaceFeatures(
        rest,
        float(layer.calls * layer.iterations),
        float(t.kernels),
        t.gemm_bytes,
        t.kv_bytes,
        t.other_bytes,
        t.compute_s,
        t.comm_s,
        float(np.log(batch)),
        gpu.hbm_bw,
        gpu.read_bw,
    )


def inplace_time(c_xla: dict, c: dict, f: InplaceFeatures):
    """Per-token time (s) of `simulate_gpu(mode="looped_inplace")` as a `jnp` function."""
    eff = c["flat_gemm_efficiency"] * jnp.exp(-c["flat_gemm_m_exponent"] * f.log_m)
    mem = (
        f.gemm_bytes / (eff * f.peak_bw)
        + f.kv_bytes / (c["split_k_efficiency"] * f.peak_bw)
        + f.other_bytes / f.read_bw
    )
    layer = f.kernels * c["inplace_kernel_gap_s"] + jnp.maximum(mem, f.compute_s) + f.comm_s
    return f.n * layer + gpu_time(c_xla, f.xla)


def row_features(row: GPURow) -> tuple[InplaceFeatures, GPUFeatures]:
    """(looped_inplace features, "xla" features) of a measured row's configuration."""
    cfg = get_preset(row.model)
    all_kernels = fuse(trace_decode_step(cfg, row.batch, row.context, looped=False))
    kernels = [k for k in all_kernels if k.role != "sampling"]
    spec = H100 if row.gpu == "h100" else H200
    kw = dict(
        n_gpus=row.n_gpus,
        kv_heads=cfg.n_kv_heads,
        activation_bytes=row.batch * cfg.dim * 2,
        logits_bytes=sum(k.other_bytes for k in all_kernels if k.role == "sampling"),
    )
    return (
        inplace_features(kernels, spec, batch=row.batch, allreduce=row.allreduce, **kw),
        gpu_features(kernels, spec, batch=row.batch, mode="xla", **kw),
    )


def fit_inplace(
    feats: list[InplaceFeatures], rows, c_xla: dict, steps: int = 600, lr: float = 0.05
) -> tuple[dict, float]:
    """Fit the in-place constants on `rows` (all of them: pick the split before calling)."""
    cx = {k: float(v) for k, v in c_xla.items()}

    def loss(c):
        return msle([1e3 * inplace_time(cx, c, f) for f in feats], [r.measured_ms for r in rows])

    return fit_constants(loss, inplace_constants(H200), steps, lr, weak=frozenset({"inplace_kernel_gap_s"}))


def _ms(c_xla, c, f) -> float:
    return 1e3 * float(inplace_time(c_xla, c, f))


def run_inplace(c_xla: dict, steps: int = 600) -> dict:
    """Fit, leave-one-out, and per-row errors; the "gpu_inplace" record of rdu/fitted.json."""
    feats = [row_features(r) for r in INPLACE_ROWS]
    train = [i for i, r in enumerate(INPLACE_ROWS) if r.split == "train"]
    fitted, loss = fit_inplace([feats[i][0] for i in train], [INPLACE_ROWS[i] for i in train], c_xla, steps)
    pub = inplace_constants(H200)
    rows, loo = [], []
    for i, (r, (f, fx)) in enumerate(zip(INPLACE_ROWS, feats)):
        others = [j for j in range(len(INPLACE_ROWS)) if j != i]
        c_loo, _ = fit_inplace([feats[j][0] for j in others], [INPLACE_ROWS[j] for j in others], c_xla, steps)
        loo.append(c_loo)
        rows.append(_row(r, c_xla, pub, fitted, f, fx, loo_model=_ms(c_xla, c_loo, f)))
    tp = [_row(r, c_xla, pub, fitted, *row_features(r)) for r in INPLACE_TP_ROWS]
    summary = {}
    for name, sub in (
        ("train", [x for x in rows if x["split"] == "train"]),
        ("test", [x for x in rows if x["split"] == "test"]),
        ("all", rows),
        ("tp", tp),
    ):
        summary[f"h200_inplace_{name}"] = {
            k: summarize([x[f"{k}_err_pct"] for x in sub]) for k in ("published", "fitted", "before_xla")
        }
    summary["h200_inplace_loo"] = {
        "published": summary["h200_inplace_all"]["published"],
        "fitted": summarize([x["loo_err_pct"] for x in rows]),
    }
    return {
        "published": pub,
        "fitted": fitted,
        "train_loss": loss,
        "xla_constants": dict(c_xla),
        "fit_rows": [INPLACE_ROWS[i].what for i in train],
        "held_out_rows": [r.what for r in INPLACE_ROWS if r.split == "test"],
        "loo_fitted": loo,
        "rows": rows + tp,
        "summary": summary,
    }


def _row(r: GPURow, c_xla, pub, fitted, f, fx, loo_model: float | None = None) -> dict:
    a, b, x = _ms(c_xla, pub, f), _ms(c_xla, fitted, f), 1e3 * float(gpu_time(c_xla, fx))
    out = {
        "group": "h200_inplace" if r.split != "report only" else "h200_inplace_tp",
        "what": r.what,
        "model": r.model,
        "split": r.split,
        "mode": r.mode,
        "batch": r.batch,
        "context": r.context,
        "n_gpus": r.n_gpus,
        "allreduce": r.allreduce,
        "target": r.measured_ms,
        "unit": "ms/step",
        "source": r.source,
        "published_model": a,
        "fitted_model": b,
        "published_err_pct": err_pct(a, r.measured_ms),
        "fitted_err_pct": err_pct(b, r.measured_ms),
        "before_xla_model": x,
        "before_xla_err_pct": err_pct(x, r.measured_ms),
    }
    if loo_model is not None:
        out.update(loo_model=loo_model, loo_err_pct=err_pct(loo_model, r.measured_ms))
    return out

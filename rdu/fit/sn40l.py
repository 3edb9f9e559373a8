"""The SN40L model of `rdu.simulate.simulate_rdu` as a `jnp` function of its free constants
(`rdu_time`), its fixed inputs (`rdu_features`), the Kernel Looping rows' predictions and their fit."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.config import get_preset
from rdu.anchors import KL_MODELS, PEAK_16, SN40L_ROWS
from rdu.fit.common import fit_constants, msle
from rdu.hardware import SN40L_FREE, RDUSpec, sn40l
from rdu.mapping import ALLREDUCES_PER_LAYER, Mapping, ModelDoesNotFit, map_decode
from rdu.simulate import allreduce_s, pipeline_depth, socket_bytes
from rdu.trace import trace_decode_step

RDU_KEYS = SN40L_FREE


def rdu_constants(hw: RDUSpec) -> dict[str, float]:
    """The free constants of a spec (`SN40L_FREE`)."""
    return {k: getattr(hw, k) for k in RDU_KEYS}


@dataclass(frozen=True)
class RDUFeatures:
    """Fixed inputs of one mapping, one entry per kernel (arrays of shape [kernels])."""

    calls: np.ndarray  # calls per token as traced
    iters: np.ndarray  # iterations per call as traced
    n: np.ndarray  # calls * iterations
    is_layer: np.ndarray  # 1.0 for the decoder kernel
    hbm_bytes: np.ndarray  # bytes per socket per iteration streamed from HBM
    ddr_bytes: np.ndarray  # ... from DDR
    compute_s: np.ndarray  # PCU stage time per iteration
    comm_steps: np.ndarray  # latency steps of the all-reduces (or all-gather) per iteration
    comm_bw_s: np.ndarray  # their bandwidth time per iteration
    depth: np.ndarray  # pipeline stages of the kernel
    hbm_bw: float  # peak bytes/s per socket
    ddr_bw: float
    model_bytes: float  # bytes per token, whole model, all sockets (for the roofline)
    sockets: int


jax.tree_util.register_dataclass(
    RDUFeatures,
    data_fields=[
        "calls",
        "iters",
        "n",
        "is_layer",
        "hbm_bytes",
        "ddr_bytes",
        "compute_s",
        "comm_steps",
        "comm_bw_s",
        "depth",
        "hbm_bw",
        "ddr_bw",
        "model_bytes",
    ],
    meta_fields=["sockets"],
)


def rdu_features(m: Mapping) -> RDUFeatures:
    """Read the fixed inputs of `simulate_rdu` from a mapping (the same expressions, term by term)."""
    hw, p = m.hw, m.sockets
    f = m.placement.hbm_fraction
    rows = []
    for k in m.kernels:
        b = socket_bytes(k, m)
        alloc = m.allocations.get(k.name)
        compute = alloc.stage_time_s if alloc else k.flops / p / hw.bf16_flops
        share = ALLREDUCES_PER_LAYER if k.is_layer else 0.5 if k.role == "classifier" else 0.0
        steps = share * allreduce_s(0.0, p, 1.0, hw.p2p_bw)  # all-reduce latency = steps * p2p_latency_s
        bw_s = share * allreduce_s(m.activation_bytes if k.is_layer else k.other_bytes, p, 0.0, hw.p2p_bw)
        rows.append(
            (
                k.calls,
                k.iterations,
                k.calls * k.iterations,
                float(k.is_layer),
                f * b,
                (1 - f) * b,
                compute,
                steps,
                bw_s,
                pipeline_depth(k, m),
            )
        )
    cols = [np.asarray(c, dtype=np.float64) for c in zip(*rows)]
    return RDUFeatures(
        *cols,
        hbm_bw=hw.hbm_bw,
        ddr_bw=hw.ddr_bw,
        model_bytes=float(sum(k.calls * k.iterations * k.bytes for k in m.kernels)),
        sockets=p,
    )


def rdu_time(c: dict, f: RDUFeatures, looped: bool = True):
    """Per-token time (s) of `simulate_rdu(m, looped=looped)` as a `jnp` function of the constants `c`."""
    per_call = c["launch_s"] + c["sync_s"] + f.depth * c["stage_fill_drain_s"]
    comm = f.comm_steps * c["p2p_latency_s"] + f.comm_bw_s
    mem = jnp.maximum(f.hbm_bytes / (f.hbm_bw * c["hbm_efficiency"]), f.ddr_bytes / f.ddr_bw)
    layer = f.is_layer > 0
    if looped:
        calls, iters = jnp.where(layer, 1.0, f.calls), jnp.where(layer, f.n, f.iters)
        it = jnp.where(layer, jnp.maximum(mem, f.compute_s + comm), jnp.maximum(mem, f.compute_s) + comm)
    else:
        calls, iters = jnp.where(layer, f.n, f.calls), jnp.where(layer, 1.0, f.iters)
        tail = comm / ALLREDUCES_PER_LAYER  # the all-reduce that ends a layer's call
        it = jnp.where(layer, jnp.maximum(mem, f.compute_s + comm - tail) + tail, jnp.maximum(mem, f.compute_s) + comm)
    return jnp.sum(calls * per_call + calls * iters * it)


def sn40l_configs() -> dict[tuple[str, int, int], RDUFeatures]:
    """Features of every (model, sockets, batch) the SN40L rows use (one trace and mapping each)."""
    hw = sn40l()
    wanted = [(m, 1, 1) for m in KL_MODELS] + [(m, p, b) for m in KL_MODELS for p in (8, 16) for b in (1, 8)]
    out = {}
    for name, p, b in wanted:
        cfg = get_preset(name)
        try:
            m = map_decode(trace_decode_step(cfg, b, 4096), hw, p, batch=b, kv_heads=cfg.n_kv_heads, dim=cfg.dim)
        except ModelDoesNotFit:
            continue
        out[(name, p, b)] = rdu_features(m)
    return out


def sn40l_predictions(c: dict, feats: dict) -> dict[str, jax.Array]:
    """Model value of each SN40L row (same definitions as rdu.validate)."""
    t = {key: (rdu_time(c, f, True), rdu_time(c, f, False)) for key, f in feats.items()}
    speed = {key: off / on for key, (on, off) in t.items()}
    one = jnp.stack([s for (_, p, _), s in speed.items() if p == 1])
    multi = jnp.stack([speed[(n, p, 1)] for n in ("llama-3.1-8b", "llama-3.1-70b") for p in (8, 16)])
    geo = jnp.stack([s for (_, p, _), s in speed.items() if p in (8, 16)])

    def roof(name, p):
        return 100.0 * feats[(name, p, 1)].model_bytes / (p * PEAK_16) / t[(name, p, 1)][0]

    vals = [
        jnp.max(one),
        jnp.exp(jnp.mean(jnp.log(geo))),
        roof("llama-3.1-8b", 16),
        roof("llama-3.1-70b", 16),
        1.0 / t[("llama-3.1-8b", 16, 1)][0],
        jnp.max(multi),
        roof("llama-3.1-8b", 8),
        roof("llama-3.1-70b", 8),
        1.0 / t[("llama-3.1-8b", 8, 1)][0],
    ]
    return dict(zip([r.what for r in SN40L_ROWS], vals))


def fit_sn40l(feats: dict, steps: int = 600, lr: float = 0.05) -> tuple[dict, float]:
    train = [r for r in SN40L_ROWS if r.split == "train"]

    def loss(c):
        pred = sn40l_predictions(c, feats)
        return msle([pred[r.what] for r in train], [r.target for r in train])

    return fit_constants(loss, rdu_constants(sn40l()), steps, lr)

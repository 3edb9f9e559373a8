"""The SN40L model of `rdu.simulate.simulate_rdu` as a `jnp` function of its constants (`rdu_time`), its
fixed inputs (`rdu_features`), and the fit of `SN40L_FITTED` to the in-sample rows of rdu.targets.

The fit is a MAP estimate: each in-sample row's log error over its stated spread (the target's band read
as one standard deviation), plus a log-normal prior on each fitted constant (its source in
rdu.hardware states the prior and its spread, x/÷ 3). Two constants, two in-sample rows: the priors
carry what the rows do not pin down (the split of the carried path between stages and all-reduce hops).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxdecode.config import get_preset
from rdu.anchors import KL_MODELS, PEAK_16
from rdu.hardware import SN40L_FITTED, SN40L_FREE, RDUSpec, sn40l
from rdu.mapping import ALLREDUCES_PER_LAYER, Mapping, ModelDoesNotFit, map_decode
from rdu.simulate import pipeline_depth, socket_bytes
from rdu.trace import trace_decode_step

RDU_KEYS = SN40L_FREE
PRIOR_SIGMA = math.log(3.0)  # every fitted SN40L constant: log-normal prior, x/÷ 3 at one sigma
KL_GRID = tuple((m, p, b) for m in KL_MODELS for p in (1, 8, 16) for b in (1, 8))  # the looping-speedup grid


def rdu_constants(hw: RDUSpec) -> dict[str, float]:
    """The constants of the time model (`SN40L_FREE`)."""
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
    hops: np.ndarray  # P2P hops on the kernel's path per iteration (two per all-reduce)
    comm_bw_s: np.ndarray  # the all-reduces' bytes through the link per iteration
    depth: np.ndarray  # pipeline stages of the kernel
    hbm_bw: float  # peak bytes/s per socket
    ddr_bw: float
    prefetch_bytes: float  # free SRAM per socket for the next layer's weights
    roofline_bytes: float  # Table 1's bytes per token: resident weights (whole embedding) + KV cache
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
        "hops",
        "comm_bw_s",
        "depth",
        "hbm_bw",
        "ddr_bw",
        "prefetch_bytes",
        "roofline_bytes",
    ],
    meta_fields=["sockets"],
)


def roofline_bytes(m: Mapping) -> float:
    """Bytes per token as Table 1 counts them: every resident input (weights with the whole embedding
    table, and the KV cache), not only what the step streams."""
    return float(sum(t.nbytes for t in m.graph.inputs if t.nbytes > 2**20))


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
        msg = m.activation_bytes if k.is_layer else k.other_bytes
        hops = share * 2 if p > 1 else 0.0
        bw_s = share * 2 * (p - 1) / p * msg / hw.p2p_bw if p > 1 else 0.0
        rows.append(
            (
                k.calls,
                k.iterations,
                k.calls * k.iterations,
                float(k.is_layer),
                f * b,
                (1 - f) * b,
                compute,
                hops,
                bw_s,
                pipeline_depth(k, m),
            )
        )
    cols = [np.asarray(c, dtype=np.float64) for c in zip(*rows)]
    return RDUFeatures(
        *cols,
        hbm_bw=hw.hbm_bw,
        ddr_bw=hw.ddr_bw,
        prefetch_bytes=float(m.placement.prefetch_bytes),
        roofline_bytes=roofline_bytes(m),
        sockets=p,
    )


def rdu_time(c: dict, f: RDUFeatures, looped: bool = True):
    """Per-token time (s) of `simulate_rdu(m, looped=looped)` as a `jnp` function of the constants `c`."""
    stream_bw = f.hbm_bw * c["hbm_efficiency"]
    mem = jnp.maximum(f.hbm_bytes / stream_bw, f.ddr_bytes / f.ddr_bw)
    body = jnp.maximum(mem, f.compute_s)
    latency = f.depth * c["stage_latency_s"] + f.hops * c["p2p_hop_s"] + f.comm_bw_s
    layer = f.is_layer > 0
    if looped:
        stall = jnp.maximum(0.0, latency - f.prefetch_bytes / stream_bw)
        period = jnp.maximum(latency, body + stall)
        looped_layer = c["call_s"] + latency + body + (f.n - 1) * period
        other = f.calls * (c["call_s"] + latency + f.iters * body)
        return jnp.sum(jnp.where(layer, looped_layer, other))
    calls, iters = jnp.where(layer, f.n, f.calls), jnp.where(layer, 1.0, f.iters)
    return jnp.sum(calls * (c["call_s"] + latency + iters * body))


def sn40l_configs(hw: RDUSpec | None = None) -> dict[tuple[str, int, int], RDUFeatures]:
    """Features of every (model, sockets, batch) of the looping grid at context 4096 (one trace and
    mapping each); configurations that do not fit HBM are left out."""
    hw = hw or sn40l()
    out = {}
    for name, p, b in KL_GRID:
        cfg = get_preset(name)
        try:
            m = map_decode(trace_decode_step(cfg, b, 4096), hw, p, batch=b, kv_heads=cfg.n_kv_heads, dim=cfg.dim)
        except ModelDoesNotFit:
            continue
        out[(name, p, b)] = rdu_features(m)
    return out


def sn40l_predictions(c: dict, feats: dict) -> dict[str, jax.Array]:
    """Model value of the SN40L target rows (keys of rdu.targets.TARGETS) that the grid determines."""
    t = {key: (rdu_time(c, f, True), rdu_time(c, f, False)) for key, f in feats.items()}
    speed = jnp.stack([off / on for on, off in t.values()])

    def roof(name, p):
        f = feats[(name, p, 1)]
        return 100.0 * f.roofline_bytes / (p * PEAK_16) / t[(name, p, 1)][0]

    return {
        "sn40l16_vs_dgx": 1.0 / t[("llama-3.1-8b", 16, 1)][0] / 300.0,
        "sn40l8_vs_dgx": 1.0 / t[("llama-3.1-8b", 8, 1)][0] / 300.0,
        "roofline_70b_8": roof("llama-3.1-70b", 8),
        "roofline_70b_16": roof("llama-3.1-70b", 16),
        "roofline_8b_8": roof("llama-3.1-8b", 8),
        "roofline_8b_16": roof("llama-3.1-8b", 16),
        "kl_max": jnp.max(speed),
        "kl_geomean": jnp.exp(jnp.mean(jnp.log(speed))),
    }


def fit_sn40l(
    feats: dict, rows: list[tuple[str, float, float]], steps: int = 400, lr: float = 0.05
) -> tuple[dict, float]:
    """MAP fit of `SN40L_FITTED` to `rows` = (target key, value, sigma of its log); returns all the
    constants (the fixed ones at their prior) and the loss."""
    prior = rdu_constants(sn40l())
    z0 = {k: jnp.log(jnp.float32(prior[k])) for k in SN40L_FITTED}

    def loss(z):
        c = dict(prior, **{k: jnp.exp(v) for k, v in z.items()})
        pred = sn40l_predictions(c, feats)
        data = sum(jnp.square((jnp.log(pred[key]) - math.log(v)) / s) for key, v, s in rows) / 2
        return data + sum(jnp.square((z[k] - z0[k]) / PRIOR_SIGMA) for k in z) / 2

    opt = optax.adam(lr)

    @jax.jit
    def step(z, s):
        v, g = jax.value_and_grad(loss)(z)
        with jax.numpy_dtype_promotion("standard"):
            u, s = opt.update(g, s, z)
        return optax.apply_updates(z, u), s, v

    z, s = z0, opt.init(z0)
    for _ in range(steps):
        z, s, _ = step(z, s)
    out = dict(prior, **{k: float(jnp.exp(v)) for k, v in z.items()})
    return out, float(loss(z))

"""rdu.fit: the JAX cost model equals the numpy/Python reference, its invariants (roofline, looping,
zero overhead, d time / d bandwidth < 0 by jax.grad), the stored fit (rdu/fitted.json), the
constants choice, and bad input."""

import argparse
import math
from dataclasses import replace

import jax
import jax.numpy as jnp
import pytest

from jaxdecode.config import get_preset
from rdu.anchors import H200_ROWS
from rdu.fit.gpu import GPUFeatures, fit_gpu, gpu_constants, gpu_features, gpu_time
from rdu.fit.sn40l import rdu_constants, rdu_features, rdu_time
from rdu.gpu import gpu_estimate, simulate_gpu
from rdu.hardware import H200, gpu, load_fitted, sn40l
from rdu.mapping import ModelDoesNotFit, fuse, map_decode
from rdu.simulate import simulate_rdu
from rdu.trace import trace_decode_step

REL = 1e-5  # the JAX model runs in float32; the reference in float64
MODELS = ("qwen2.5-0.5b", "llama-3.2-1b", "llama-3.1-8b")
SOCKETS = (1, 2, 4, 8, 16)
CONSTANTS = ("published", "fitted")


def _mappings(constants):
    """(name, batch, mapping) over the grid; 70B+ are left out to keep the file fast."""
    hw = sn40l(constants=constants)
    out = []
    for name in MODELS:
        cfg = get_preset(name)
        for b in (1, 8):
            g = trace_decode_step(cfg, b, 4096)
            for p in SOCKETS:
                out.append((name, b, map_decode(g, hw, p, batch=b, kv_heads=cfg.n_kv_heads, dim=cfg.dim)))
    return out


@pytest.fixture(scope="module", params=CONSTANTS)
def grid(request):
    return request.param, _mappings(request.param)


_time = jax.jit(rdu_time, static_argnames="looped")
_dtime_dbw = jax.jit(
    jax.grad(lambda bw, c, f, looped: rdu_time(c, replace(f, hbm_bw=bw), looped)), static_argnames="looped"
)


def test_jax_rdu_model_equals_reference(grid):
    _, ms = grid
    for _, _, m in ms:
        c, f = rdu_constants(m.hw), rdu_features(m)
        for looped in (True, False):
            ref = simulate_rdu(m, looped=looped).per_token_s
            assert float(_time(c, f, looped=looped)) == pytest.approx(ref, rel=REL)


def test_invariants_roofline_looping_zero_overhead(grid):
    _, ms = grid
    for name, b, m in ms:
        on, off = simulate_rdu(m, looped=True), simulate_rdu(m, looped=False)
        floor = on.bytes_per_token / (m.sockets * m.hw.hbm_bw)
        bare_on, bare_off = (
            simulate_rdu(m, looped=True, overheads=False),
            simulate_rdu(m, looped=False, overheads=False),
        )
        assert floor <= bare_on.per_token_s <= on.per_token_s, (name, b, m.sockets)  # never beats the roofline
        assert on.per_token_s <= off.per_token_s and bare_on.per_token_s <= bare_off.per_token_s  # looping never slower
        # Zero call cost and zero latency (no stages, no all-reduce): looping gains exactly nothing.
        bare = replace(m, hw=replace(m.hw, call_s=0.0, stage_latency_s=0.0, p2p_hop_s=0.0, p2p_bw=math.inf))
        a, z = simulate_rdu(bare, looped=True), simulate_rdu(bare, looped=False)
        assert a.per_token_s == pytest.approx(z.per_token_s, rel=1e-12)
        if m.sockets == 1:
            assert bare_on.per_token_s == bare_off.per_token_s
        # The same in the JAX model.
        f = replace(rdu_features(m), comm_bw_s=jnp.zeros(len(m.kernels)))
        zero = dict(rdu_constants(m.hw), call_s=0.0, stage_latency_s=0.0, p2p_hop_s=0.0)
        assert float(_time(zero, f, looped=True)) == pytest.approx(float(_time(zero, f, looped=False)), rel=REL)


def test_time_decreases_with_bandwidth_by_grad(grid):
    _, ms = grid
    for name, b, m in ms:
        c, f = rdu_constants(m.hw), rdu_features(m)
        for looped in (True, False):
            d = float(_dtime_dbw(jnp.float32(f.hbm_bw), c, f, looped=looped))
            assert d < 0, (name, b, m.sockets, looped, d)


@pytest.fixture(scope="module")
def gpu_b1():
    cfg = get_preset("llama-3.1-8b")
    g = trace_decode_step(cfg, 1, 1024, looped=False)
    return cfg, g, [k for k in fuse(g) if k.role != "sampling"]


@pytest.mark.parametrize("constants", CONSTANTS)
def test_jax_gpu_model_equals_reference_and_grad(gpu_b1, constants):
    cfg, g, kernels = gpu_b1
    for spec in (gpu("h200", constants), gpu("h100", constants)):
        c = gpu_constants(spec)
        for mode, n in (("xla", 1), ("eager", 1), ("scan_copy", 1), ("fixed", 8), ("xla", 4)):
            kw = dict(mode=mode, n_gpus=n, kv_heads=cfg.n_kv_heads, activation_bytes=cfg.dim * 2)
            ref = simulate_gpu(kernels, spec, batch=1, **kw).per_token_s
            f = gpu_features(kernels, spec, **kw)
            assert float(gpu_time(c, f)) == pytest.approx(ref, rel=REL)
            assert ref >= f.model_bytes / n / spec.read_bw  # never beats the read roofline
            d = jax.grad(lambda bw: gpu_time(c, replace(f, read_bw=bw)))(jnp.float32(spec.read_bw))
            assert float(d) < 0


def test_fitted_json_is_complete_and_consistent(gpu_b1):
    rec = load_fitted()
    for grp, keys in (
        ("sn40l", ("call_s", "stage_latency_s", "p2p_hop_s", "hbm_efficiency")),
        ("gpu", ("kernel_overhead_s", "eager_op_s", "gemv_efficiency", "gemm_efficiency", "attention_efficiency")),
    ):
        fitted = rec[grp]["fitted"]
        assert set(fitted) == set(keys) and rec[grp]["fit_rows"] and rec[grp]["held_out_rows"]
        assert all(v > 0 for v in fitted.values()) and all(fitted[k] < 1 for k in keys if "efficiency" in k)
        assert math.isfinite(rec[grp]["train_loss"])
    rows = rec["rows"]
    assert {r["split"] for r in rows if r["group"] == "h200"} == {"train", "test"}
    assert len([r for r in rows if r["group"] == "h200"]) >= 8
    for r in rows:
        assert r["fitted_err_pct"] == pytest.approx(100 * (r["fitted_model"] - r["target"]) / r["target"])
    test = [abs(r["fitted_err_pct"]) for r in rows if r["group"] == "h200" and r["split"] == "test"]
    assert rec["summary"]["h200_test"]["fitted"]["mape_pct"] == pytest.approx(sum(test) / len(test))
    # The stored predictions are what the code gives now (batch-1 H200 rows at cache 1024, from one trace).
    cfg, _, kernels = gpu_b1
    c = rec["gpu"]["fitted"]
    for row, stored in zip(H200_ROWS, [r for r in rows if r["group"] == "h200"]):
        if row.batch == 1 and row.context == 1024:
            f = gpu_features(kernels, H200, mode=row.mode, kv_heads=8, activation_bytes=cfg.dim * 2)
            assert 1e3 * float(gpu_time(c, f)) == pytest.approx(stored["fitted_model"], rel=1e-4)


def test_constants_choice():
    rec = load_fitted()
    pub, fit = sn40l(), sn40l(constants="fitted")
    assert pub == sn40l(constants="published") and pub.stage_latency_s == 0.5e-6  # default: the priors
    assert pub.pipeline_latency_s(55) == pytest.approx(55 * 0.5e-6)  # one latency per stage
    for k in ("stage_latency_s", "p2p_hop_s"):
        assert getattr(fit, k) == rec["sn40l"]["fitted"][k] and "fitted" in fit.source(k)
    assert fit.call_s == pub.call_s and fit.hbm_efficiency == pub.hbm_efficiency  # not fitted
    assert fit.pcus == pub.pcus
    assert gpu("h200", "fitted").eager_op_s == rec["gpu"]["fitted"]["eager_op_s"]
    assert gpu("h200") is H200
    with pytest.raises(ValueError, match="constants"):
        sn40l(constants="tuned")
    with pytest.raises(ValueError, match="constants"):
        gpu("h200", "tuned")


def test_optax_fit_lowers_the_loss(gpu_b1):
    cfg, _, kernels = gpu_b1
    rows = [r for r in H200_ROWS if r.batch == 1 and r.context == 1024]
    feats = [gpu_features(kernels, H200, mode=r.mode, kv_heads=8, activation_bytes=cfg.dim * 2) for r in rows]
    assert all(isinstance(f, GPUFeatures) for f in feats)
    c0 = gpu_constants(H200)
    before = sum(
        (math.log(1e3 * float(gpu_time(c0, f))) - math.log(r.measured_ms)) ** 2 for f, r in zip(feats, rows)
    ) / len(rows)
    fitted, loss = fit_gpu(feats, rows=rows, steps=60, lr=0.05)
    assert loss < before and fitted["eager_op_s"] > c0["eager_op_s"]  # HF eager is slower than 5 us/op gives


def _cli(*argv):
    from rdu.cli import add_parser, run

    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    return run(p.parse_args(["rdu", *argv]))


def test_bad_input(capsys):
    assert _cli("--model", "no-such-model") == 2
    assert "unknown model preset 'no-such-model'" in capsys.readouterr().err
    for s in ("0", "-1", "17"):
        assert _cli("--model", "qwen2.5-0.5b", "--sockets", s) == 2
        assert "socket counts in 1..16" in capsys.readouterr().err
    assert _cli("--model", "llama-3.1-405b", "--sockets", "1,2") == 2  # fits neither
    err = capsys.readouterr().err
    assert "exceeds HBM" in err and "needs 16 sockets" in err and err.count("\n") == 1
    cfg = get_preset("qwen2.5-0.5b")
    g = trace_decode_step(cfg, 1, 4096)
    with pytest.raises(ValueError, match="sockets must be in 1..16"):
        map_decode(g, sn40l(), 0, batch=1, kv_heads=cfg.n_kv_heads, dim=cfg.dim)
    with pytest.raises(ModelDoesNotFit):
        map_decode(trace_decode_step(get_preset("llama-3.1-405b"), 1, 4096), sn40l(), 4, batch=1, kv_heads=8, dim=16384)
    with pytest.raises(ValueError, match="unknown GPU"):
        gpu("a100")
    with pytest.raises(ValueError, match="mode"):
        gpu_estimate(g, H200, batch=1, dim=cfg.dim, kv_heads=cfg.n_kv_heads, mode="tensorrt")


@pytest.mark.parametrize("constants", CONSTANTS)
def test_jax_inplace_model_equals_reference_and_grad(constants):
    from rdu.fit.inplace import inplace_constants, inplace_features, inplace_time

    spec = gpu("h200", constants)
    for name, b, s, n in (("llama-3.1-8b", 1, 1152, 1), ("llama-3.1-8b", 32, 8320, 1), ("qwen2.5-7b", 8, 1152, 2)):
        cfg = get_preset(name)
        g = trace_decode_step(cfg, b, s, looped=False)
        ks = fuse(g)
        logits = sum(k.other_bytes for k in ks if k.role == "sampling")
        ks = [k for k in ks if k.role != "sampling"]
        kw = dict(n_gpus=n, kv_heads=cfg.n_kv_heads, activation_bytes=b * cfg.dim * 2, logits_bytes=logits)
        ref = simulate_gpu(ks, spec, batch=b, mode="looped_inplace", **kw)
        assert ref.per_token_s == pytest.approx(
            gpu_estimate(
                g, spec, batch=b, dim=cfg.dim, kv_heads=cfg.n_kv_heads, mode="looped_inplace", n_gpus=n
            ).per_token_s
        )
        assert ref.calls_per_token == cfg.n_layers * 12 + 4  # 4 GEMMs + attention + 7 XLA kernels; embed + head
        f = inplace_features(ks, spec, batch=b, **kw)
        c = inplace_constants(spec)
        assert float(inplace_time(gpu_constants(spec), c, f)) == pytest.approx(ref.per_token_s, rel=REL)
        assert ref.per_token_s >= f.xla.model_bytes / n / spec.read_bw  # the layers only add time
        d = jax.grad(lambda e: inplace_time(gpu_constants(spec), dict(c, split_k_efficiency=e), f))(
            jnp.float32(c["split_k_efficiency"])
        )
        assert float(d) < 0


def test_inplace_mode_meets_the_issue_bar_on_held_out_rows():
    """Issue #6: the GPU mode against our measured H200 decode (`jaxdecode bench`, >= 8 configurations):
    MAPE <= 8%, max <= 15%. Recomputed here from the code and the stored constants; held out: the 8k
    rows and Qwen batch 1 (rdu.anchors.INPLACE_ROWS), and leave-one-out over all eight."""
    from rdu.anchors import INPLACE_ROWS
    from rdu.fit.inplace import inplace_time, row_features

    rec = load_fitted()
    c, cx = rec["gpu_inplace"]["fitted"], rec["gpu"]["fitted"]
    assert len(INPLACE_ROWS) >= 8 and {r.split for r in INPLACE_ROWS} == {"train", "test"}
    stored = {x["what"]: x for x in rec["rows"] if x["group"] == "h200_inplace"}
    err = {}
    for r in INPLACE_ROWS:
        f, _ = row_features(r)
        ms = 1e3 * float(inplace_time(cx, c, f))
        assert ms == pytest.approx(stored[r.what]["fitted_model"], rel=1e-4)
        spec = gpu("h200", "fitted")
        cfg = get_preset(r.model)
        ref = gpu_estimate(
            trace_decode_step(cfg, r.batch, r.context, looped=False),
            spec,
            batch=r.batch,
            dim=cfg.dim,
            kv_heads=cfg.n_kv_heads,
            mode="looped_inplace",
        ).ms_per_token
        assert ref == pytest.approx(ms, rel=1e-4)
        err[r.what] = (r.split, abs(100 * (ms - r.measured_ms) / r.measured_ms))
    test = [e for s, e in err.values() if s == "test"]
    every = [e for _, e in err.values()]
    assert sum(test) / len(test) <= 8.0 and max(test) <= 15.0, err  # the issue's bar, held out
    assert sum(every) / len(every) <= 8.0 and max(every) <= 15.0, err
    # A regression guard on what the fit achieves on the rows of the 10:35 suite (17 kernels per layer):
    # 5.3%, 10.7% held out; leave-one-out 4.2%, 10.2%. (The 08:57 rows of the previous build gave 4.8%,
    # 10.3%; the morning rows, q, k, v as three kernels, 4.0%, 8.4%.)
    assert sum(test) / len(test) <= 5.5 and max(test) <= 11.0, err
    loo = rec["summary"]["h200_inplace_loo"]["fitted"]
    assert loo["rows"] == len(INPLACE_ROWS) and loo["mape_pct"] <= 5.0 and loo["max_abs_err_pct"] <= 11.0

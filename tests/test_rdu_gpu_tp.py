"""rdu GPU mode: the batch-dependent matmul efficiency and the attention term by hand, tensor
parallelism by hand, the serving-stack mode ("fixed") and its runtime step by hand, predict_tp, the
conflicting-anchor spread, and `jaxdecode rdu --constants/--gpus`."""

import json
from dataclasses import replace

import pytest

from jaxdecode.cli import main
from jaxdecode.config import get_preset
from rdu.anchors import CONFLICTS, SGLANG_ROWS
from rdu.fit.gpu import gpu_constants, gpu_features, gpu_time
from rdu.gpu import gpu_estimate, simulate_gpu
from rdu.graph import Node
from rdu.hardware import H200, gpu
from rdu.mapping import Kernel, fuse
from rdu.targets import dgx_estimate, runtime_step_s, serving_estimate
from rdu.trace import trace_decode_step
from rdu.validate import predict_tp, spread_rows

REL = 1e-9  # float64 reference against a hand formula
K, N = 4096, 14336  # the cuBLAS flat-GEMM shape of h200-anchors.md


def _matmul(m: int) -> Kernel:
    """One decoder 'layer' that is a single [M, K] @ [K, N] bf16 matmul (no ops: zero kernel launches)."""
    return Kernel("decoder[mm]", "decoder", 1, 1, 2 * m * K * N, K * N * 2, 0, 0, 0)


@pytest.mark.parametrize("m", [1, 2, 8, 32, 128, 256, 1024])
def test_matmul_time_by_hand(m):
    est = simulate_gpu([_matmul(m)], H200, batch=m)
    eff = 0.80 if m == 1 else 0.87  # XLA M=1 path (kernels table); cuBLAS M=1..128 (h200-anchors)
    hand = max(K * N * 2 / (eff * 4246e9), 2 * m * K * N / 784e12)
    assert est.per_token_s == pytest.approx(hand, rel=REL)
    assert (m >= 256) == (2 * m * K * N / 784e12 > K * N * 2 / (eff * 4246e9))  # the ridge lies in (128, 256)
    if m == 256:  # measured cuBLAS 2.71 TB/s at M=256; the max() model gives 3.07 TB/s
        assert K * N * 2 / est.per_token_s == pytest.approx(2.71e12, rel=0.15)


def test_jax_model_follows_the_batch_branch():
    for m in (1, 8):
        spec = replace(H200, gemv_efficiency=0.5, gemm_efficiency=0.9)
        f = gpu_features([_matmul(m)], spec, batch=m)
        ref = simulate_gpu([_matmul(m)], spec, batch=m).per_token_s
        assert float(gpu_time(gpu_constants(spec), f)) == pytest.approx(ref, rel=1e-5)
        assert ref == pytest.approx(K * N * 2 / ((0.5 if m == 1 else 0.9) * 4246e9), rel=1e-6)


def test_attention_cost_grows_with_cache_bytes_by_hand():
    cfg = get_preset("tiny-gqa")
    spec = replace(H200, kernel_overhead_s=0.0)
    t = {}
    for b, s in ((2, 16), (2, 48), (4, 48)):
        g = trace_decode_step(cfg, b, s, looped=False)
        kv = sum(k.calls * k.iterations * k.cache_read_bytes for k in fuse(g))
        assert kv == cfg.n_layers * 2 * b * s * cfg.n_kv_heads * cfg.head_dim * 2  # K and V, bf16
        t[(b, s)] = (gpu_estimate(g, spec, batch=b, dim=cfg.dim, kv_heads=cfg.n_kv_heads).per_token_s, kv)
    (t1, kv1), (t2, kv2), (t3, kv3) = t[(2, 16)], t[(2, 48)], t[(4, 48)]
    # Same batch, longer cache: only the KV read changes (at the attention efficiency; a tiny model is
    # memory-bound, and the other per-S traffic is the [B, N, S] scores, which XLA keeps on chip).
    assert t2 - t1 == pytest.approx((kv2 - kv1) / (H200.attention_efficiency * H200.read_bw), rel=0.02)
    assert t3 > t2 and kv3 == 2 * kv2


def test_tensor_parallel_by_hand():
    """Two hand-made kernels on 2 GPUs: weights halved, KV split over kv heads, two all-reduces of
    [B, D] per layer, one all-gather of the logits."""
    spec = replace(
        H200,
        kernel_overhead_s=0.0,
        read_bw=1e12,
        gemv_efficiency=0.5,
        attention_efficiency=0.25,
        nvlink_bw=1e11,
        allreduce_latency_s=1e-5,
    )
    layer = Kernel("decoder[l]", "decoder", 4, 1, 0, 8e6, 4e6, 1e4, 2e4)
    head = Kernel("lm_head", "classifier", 1, 1, 0, 2e7, 0, 0, 1e3)
    b, d, logits = 1, 512, 4000
    est = simulate_gpu(
        [layer, head], spec, batch=b, n_gpus=2, kv_heads=8, activation_bytes=b * d * 2, logits_bytes=logits
    )
    allreduce = 1e-5 + 2 * (1 / 2) * (b * d * 2) / 1e11
    layer_s = 4e6 / 0.5 / 1e12 + 2e6 / 0.25 / 1e12 + (5e3 + 2e4) / 1e12 + 2 * allreduce
    head_s = 1e7 / 0.5 / 1e12 + 1e3 / 1e12 + 1e-5 + (1 / 2) * logits / 1e11
    assert est.per_token_s == pytest.approx(4 * layer_s + head_s, rel=REL)
    one = simulate_gpu(
        [layer, head], spec, batch=b, n_gpus=1, kv_heads=8, activation_bytes=b * d * 2, logits_bytes=logits
    )
    assert one.per_token_s == pytest.approx(
        4 * (8e6 / 0.5e12 + 4e6 / 0.25e12 + 3e4 / 1e12) + 2e7 / 0.5e12 + 1e3 / 1e12, rel=REL
    )
    # More GPUs than kv heads: the cache is replicated past 8 shards.
    e16 = simulate_gpu([layer], spec, batch=b, n_gpus=16, kv_heads=8, activation_bytes=b * d * 2)
    assert e16.kernels[0].memory_s == pytest.approx(5e5 / 0.5e12 + 5e5 / 0.25e12 + (1e4 / 8 + 2e4) / 1e12, rel=REL)


def test_fixed_mode_by_hand():
    """A serving stack's layer: its kernels (all-reduces included) at their fixed costs, the weights at
    the read ceiling, the KV at the attention efficiency; on one GPU the all-reduce kernels are absent."""
    spec = replace(H200, read_bw=1e12, attention_efficiency=0.25, nvlink_bw=1e11, allreduce_latency_s=1e-5)
    mm = Node(0, "dot_general", "matmul", "layer/mlp", [], [])
    layer = Kernel("decoder[l]", "decoder", 4, 1, 0, 8e6, 4e6, 1e4, 2e4, nodes=[mm, mm])
    b, d = 1, 512
    allreduce = 1e-5 + 2 * (1 / 2) * (b * d * 2) / 1e11
    fixed = 2 * spec.gemm_kernel_s + (10 - 2 - 2) * spec.small_kernel_s  # 10 kernels: 2 GEMMs, 2 all-reduces
    for n, comm in ((1, 0.0), (2, 2 * allreduce)):
        est = simulate_gpu(
            [layer], spec, batch=b, mode="fixed", n_gpus=n, kv_heads=8, activation_bytes=b * d * 2, step_s=1e-3
        )
        mem = 8e6 / n / 1e12 + 4e6 / n / 0.25e12 + (1e4 / n + 2e4) / 1e12
        assert est.per_token_s == pytest.approx(4 * (fixed + mem + comm) + 1e-3, rel=REL)
        assert est.calls_per_token == 4 * (8 + (2 if n > 1 else 0))
    with pytest.raises(ValueError, match="fewer than the layer's 2 weight GEMMs"):
        simulate_gpu([layer], spec, batch=1, mode="fixed", kernels_per_layer=3)


def test_runtime_step_from_one_gpu_predicts_eight():
    """The serving runtime's per-token step, set by sglang's 1-GPU row, reproduces that row and predicts
    its 8-GPU row within 10%; the DGX row is the kernels plus that step."""
    h100 = gpu("h100")
    step = runtime_step_s(h100)
    one, eight = SGLANG_ROWS
    assert 0 < step < 1 / one.tok_s
    assert serving_estimate(one, h100, step_s=step).tok_s == pytest.approx(one.tok_s, rel=1e-9)
    assert serving_estimate(eight, h100, step_s=step).tok_s == pytest.approx(eight.tok_s, rel=0.10)
    with_step, kernels = dgx_estimate(spec=h100), dgx_estimate(spec=h100, step=False)
    assert with_step.per_token_s == pytest.approx(kernels.per_token_s + step, rel=1e-9)
    assert with_step.calls_per_token == kernels.calls_per_token == 32 * 10 + 3 + 1  # DIAYN: 320 in the layers


def test_predict_tp_tiny_and_8b():
    cfg = get_preset("tiny-gqa")
    spec = gpu("h200", "fitted")
    g = trace_decode_step(cfg, 2, 32, looped=False)
    ks = fuse(g)
    logits = next(k for k in ks if k.role == "sampling").other_bytes
    assert logits == 2 * cfg.vocab_size * 4  # [B, V] f32
    ref = simulate_gpu(
        [k for k in ks if k.role != "sampling"],
        spec,
        batch=2,
        n_gpus=2,
        kv_heads=cfg.n_kv_heads,
        activation_bytes=2 * cfg.dim * 2,
        logits_bytes=logits,
    ).ms_per_token
    assert predict_tp("tiny-gqa", 2, 32, 2) == pytest.approx(ref, rel=REL)
    # A tiny model is latency-bound: 2 GPUs add 2 all-reduces per layer + 1 all-gather, and save ~nothing.
    delta = predict_tp("tiny-gqa", 2, 32, 2) - predict_tp("tiny-gqa", 2, 32, 1)
    assert delta == pytest.approx(1e3 * (2 * cfg.n_layers + 1) * spec.allreduce_latency_s, rel=0.01)
    one, two = predict_tp("llama-3.1-8b", 1, 1024, 1), predict_tp("llama-3.1-8b", 1, 1024, 2)
    assert one / 2 < two < one  # weights halve, all-reduce latency and kernel overheads do not


def test_conflicts_are_explicit_and_spread_is_reported():
    for c in CONFLICTS.values():
        assert c.chosen in [v for v, _ in c.alternatives] and all(src for _, src in c.alternatives) and c.why
    rs = spread_rows("published")
    assert {r["conflict"] for r in rs} == set(CONFLICTS) - {"h200_attention_efficiency"}
    dgx = {r["value"]: r["estimate"] for r in rs if r["conflict"] == "dgx_h100_peak_tb_s"}
    assert dgx[26.8] == pytest.approx(dgx[24.0] * 24.0 / 26.8)
    ar = {r["value"]: r["estimate"] for r in rs if r["conflict"] == "dgx_h100_allreduce_us"}
    assert ar[19.5] < ar[6.0]  # NCCL's latency is slower than TensorRT-LLM's one-shot kernel
    hbm = [r["estimate"] for r in rs if r["conflict"] == "sn40l_hbm_tb_s"]
    assert hbm == sorted(hbm) and hbm[0] < hbm[-1]  # 1.6 < 1.8 < 2.0 TB/s: faster with more bandwidth
    b32 = {r["value"]: r["estimate"] for r in rs if r["conflict"] == "h200_unrolled_b32_ms"}
    assert len(b32) == 2 and b32[6.693] > b32[32e3 / 1857.0]  # the same model, two measured values


def _rdu(argv, capsys):
    code = main(["rdu", "--model", "qwen2.5-0.5b", "--sockets", "1", "--context", "256", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_constants_and_gpus(capsys):
    runs = {}
    for c in ("published", "fitted"):
        for n in (1, 2):
            code, out, err = _rdu(["--constants", c, "--gpus", str(n), "--json"], capsys)
            assert code == 0 and err == ""
            assert f"{c} constants" in out.splitlines()[0]
            runs[(c, n)] = res = json.loads(out.strip().splitlines()[-1])
            assert res["constants"] == c and res["n_gpus"] == n and f"x{n} xla" in out
    assert runs[("published", 1)]["gpu"]["xla"]["ms_per_token"] != runs[("fitted", 1)]["gpu"]["xla"]["ms_per_token"]
    assert runs[("fitted", 2)]["gpu"]["xla"]["ms_per_token"] == pytest.approx(predict_tp("qwen2.5-0.5b", 1, 256, 2))
    assert runs[("published", 1)]["sn40l"][0]["looped"]["target"] != runs[("fitted", 1)]["sn40l"][0]["looped"]["target"]


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--constants", "tuned"], "constants"),
        (["--gpus", "0"], "--gpus"),
        (["--gpus", "9"], "--gpus"),
        (["--gpus", "two"], "--gpus"),
    ],
)
def test_cli_bad_values_exit_2_with_one_line(argv, match, capsys):
    code, out, err = _rdu(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and match in err


def test_inplace_gemm_count_groups_matmuls_by_shared_input():
    """looped_inplace: projections that read the same tensor are one kernel, whether or not they sit in
    one jitted call (q, k, v in `qkv`; gate, up in `swiglu`) and through reshapes; others one each."""
    import jax
    import jax.numpy as jnp

    from rdu.gpu import inplace_kernel_counts
    from rdu.trace import trace

    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
    three = jax.jit(lambda x, a, b, c: (x @ a, x @ b, x @ c))

    def shared(x, a, b, c, d):  # q, k, v of one x (inside a call and inline), then an o-like matmul
        q, k, v = three(x, a, b, c)
        return (q + k + v) @ d, x.reshape(1, 64) @ a

    def separate(x, a, b, c, d):
        return (x @ a) @ b, ((x * 2) @ c) @ d

    g1 = trace(shared, s(1, 64), s(64, 64), s(64, 64), s(64, 64), s(64, 64))
    g2 = trace(separate, s(1, 64), s(64, 64), s(64, 64), s(64, 64), s(64, 64))
    assert inplace_kernel_counts(g1)[0] == 2 and inplace_kernel_counts(g2)[0] == 4
    cfg = get_preset("llama-3.1-8b")
    layer = next(k for k in fuse(trace_decode_step(cfg, 1, 1152, looped=False)) if k.is_layer)
    assert inplace_kernel_counts(layer.graph) == (4, 12)  # qkv, o, gate.up, down; + attention + 7 XLA


def test_inplace_allreduce_kernel_by_hand():
    """looped_inplace on 2 GPUs: "kernel" charges the measured kernel duration per all-reduce (two per
    layer) where "psum" charges NCCL's latency plus the ring's bytes; everything else is equal. Bad
    choices are refused with the name of the problem."""
    from rdu.gpu import inplace_terms

    cfg = get_preset("llama-3.1-8b")
    layer = next(k for k in fuse(trace_decode_step(cfg, 1, 1152, looped=False)) if k.is_layer)
    spec = replace(H200, p2p_allreduce_s=5e-6, allreduce_latency_s=2e-5, nvlink_bw=1e11)
    kw = dict(n_gpus=2, kv_heads=cfg.n_kv_heads, activation_bytes=cfg.dim * 2)
    psum, kernel = (inplace_terms(layer, spec, allreduce=a, **kw) for a in ("psum", "kernel"))
    assert kernel.comm_s == pytest.approx(2 * 5e-6)
    assert psum.comm_s == pytest.approx(2 * (2e-5 + cfg.dim * 2 / 1e11))
    assert replace(kernel, comm_s=0.0) == replace(psum, comm_s=0.0)
    with pytest.raises(ValueError, match="allreduce must be one of"):
        inplace_terms(layer, spec, allreduce="nccl", **kw)
    with pytest.raises(ValueError, match="runs on 2 GPUs"):
        inplace_terms(layer, spec, allreduce="kernel", **{**kw, "n_gpus": 4})

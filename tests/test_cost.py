"""cost.py against the Kernel Looping paper's Table 1 and a hand-computed tiny case."""

import pytest

from jaxdecode.config import PRESETS, ModelConfig
from jaxdecode.cost import GIB, decode_cost, paper_table1


def test_llama31_8b_matches_kernel_looping_table1():
    row = paper_table1(PRESETS["llama-3.1-8b"], batch=1, context=4096)
    assert row["gflops"] == pytest.approx(20, rel=0.02)
    assert row["gib"] == pytest.approx(15.4, rel=0.02)
    assert row["params_gib"] == pytest.approx(14.9, rel=0.01)
    assert row["kv_gib"] == pytest.approx(0.5, rel=0.01)


def test_tiny_case_by_hand():
    # D=4, L=2, N=2, K=1, H=2, F=6, V=10, untied, no bias; batch 2, context 3, 2 bytes per element.
    cfg = ModelConfig("hand", vocab_size=10, dim=4, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=6)
    c = decode_cost(cfg, batch=2, context=3, itemsize=2)
    # per layer: q 4*4 + k 4*2 + v 4*2 + o 4*4 = 48, mlp 3*4*6 = 72, norms 2*4 = 8 -> 128 params
    assert cfg.layer_params == 128
    assert c.weight_bytes == 2 * (2 * 128 + 4 + 10 * 4 + 2 * 4)  # layers, final norm, lm head, 2 embedding rows
    assert c.kv_read_bytes == 2 * (2 * 2 * 2 * 3 * 1 * 2)  # w * 2(K,V) * L * B * S * K * H
    assert c.kv_write_bytes == 2 * (2 * 2 * 2 * 1 * 2)
    assert c.matmul_flops == 2 * 2 * (2 * 120 + 40)  # 2 * B * (L * 120 projection weights + V*D)
    assert c.attention_flops == 4 * 2 * 2 * 2 * 2 * 3  # 4 * B * L * N * H * S


def test_llama31_8b_exact_count_is_weights_dominated():
    c = decode_cost(PRESETS["llama-3.1-8b"], batch=1, context=4096)
    assert c.weight_bytes / GIB == pytest.approx(13.98, abs=0.01)  # the embedding table is not read, one row is
    assert c.flops / 1e9 == pytest.approx(17.16, abs=0.01)

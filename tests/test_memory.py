"""Memory preflight: hand-computed estimate, and a refusal with numbers before allocation."""

import pytest

from jaxdecode.cli import main
from jaxdecode.config import ModelConfig, get_preset
from jaxdecode.memory import estimate, preflight

H200_BYTES = 139 * 2**30  # what the H200's allocator reports, about 139 GiB


def test_estimate_by_hand():
    cfg = ModelConfig("hand", vocab_size=10, dim=4, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=6)
    est = estimate(cfg, itemsize=2, batch=3, context=5, looped=True)
    assert est.weights == 2 * cfg.n_params and est.packing == est.weights
    assert est.kv_cache == 2 * 2 * 3 * 5 * 1 * 2 * 2  # K,V * L * B * S * K * H * itemsize
    assert estimate(cfg, itemsize=2, looped=False).packing == 0


def test_405b_is_refused_on_one_h200_with_numbers():
    with pytest.raises(
        ValueError, match=r"llama-3\.1-405b does not fit: needs weights 811\.7 GB.*device has 149\.3 GB"
    ):
        preflight(get_preset("llama-3.1-405b"), itemsize=2, available=H200_BYTES)


def test_8b_fits_on_one_h200():
    assert preflight(get_preset("llama-3.1-8b"), itemsize=2, available=H200_BYTES).total < H200_BYTES


def test_cli_refuses_before_allocating(capsys):
    # 405B in f32 on this machine: refused by the preflight (an allocation would take minutes or crash).
    assert main(["bench", "--model", "llama-3.1-405b"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "does not fit" in err

"""Presets: exact names, published parameter counts, and validation."""

import pytest

from jaxdecode.config import PRESETS, ModelConfig, get_preset

# Published parameter counts (billions), from the model cards.
PUBLISHED_B = {
    "smollm2-135m": 0.1345,
    "llama-3.1-8b": 8.03,
    "llama-3.1-70b": 70.55,
    "llama-3.1-405b": 405.85,
    "llama-3.2-1b": 1.236,
    "llama-3.2-3b": 3.213,
    "llama-2-7b": 6.738,
    "mistral-7b": 7.242,
    "qwen2.5-0.5b": 0.494,
    "qwen2.5-7b": 7.616,
    "qwen2.5-72b": 72.71,
}


@pytest.mark.parametrize("name, billions", PUBLISHED_B.items())
def test_preset_parameter_counts(name, billions):
    assert get_preset(name).n_params / 1e9 == pytest.approx(billions, rel=0.002)


def test_unknown_preset_lists_the_names():
    with pytest.raises(ValueError, match="unknown model preset 'llama-8b'.*llama-3.1-8b"):
        get_preset("llama-8b")


def test_configs_are_hashable_and_validated():
    assert len({PRESETS["tiny-gqa"], PRESETS["tiny-gqa"].replace()}) == 1
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        ModelConfig("bad", 10, 8, 1, 4, 3, 16)
    with pytest.raises(ValueError, match="dim must be positive"):
        ModelConfig("bad", 10, 0, 1, 4, 4, 16)

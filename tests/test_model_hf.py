"""Our decoder against Hugging Face transformers' Llama and Qwen2 (PyTorch, CPU) on tiny random configs."""

import numpy as np
import pytest
from helpers import hf_logits, hf_model, state_dict_numpy

from jaxdecode.config import PRESETS, TINY_PRESETS
from jaxdecode.decode import Engine
from jaxdecode.model import init_random, load_state_dict

RTOL_F32 = 1e-5  # the bar: float32 end to end, relative to the largest logit


@pytest.mark.parametrize("name", TINY_PRESETS)
@pytest.mark.parametrize("loop_layers", [False, True], ids=["unrolled", "looped"])
def test_full_sequence_logits_match_hf(name, loop_layers):
    cfg = PRESETS[name]
    hf = hf_model(cfg)
    model = load_state_dict(init_random(cfg, seed=1), state_dict_numpy(hf))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 48))
    ours = Engine(model, loop_layers=loop_layers).forward_logits(tokens)
    ref = hf_logits(hf, tokens)
    err = np.max(np.abs(ours - ref)) / np.max(np.abs(ref))
    assert err < RTOL_F32, f"{name}: max relative error {err:.2e}"


def test_tiny_configs_cover_every_feature():
    cfgs = [PRESETS[n] for n in TINY_PRESETS]
    assert {c.attention_kind for c in cfgs} == {"MHA", "GQA", "MQA"}
    assert any(c.tie_embeddings for c in cfgs) and any(not c.tie_embeddings for c in cfgs)
    assert any(c.qkv_bias for c in cfgs) and any(c.rope_scaling for c in cfgs)


def test_load_state_dict_names_the_bad_tensor():
    cfg = PRESETS["tiny-gqa"]
    sd = state_dict_numpy(hf_model(cfg))
    del sd["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_state_dict(init_random(cfg), sd)
    sd = state_dict_numpy(hf_model(cfg))
    sd["model.norm.weight"] = sd["model.norm.weight"][:-1]
    with pytest.raises(ValueError, match="model.norm.weight.*shape"):
        load_state_dict(init_random(cfg), sd)

"""The shipped default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against HF transformers loading the same file."""

import os

import numpy as np
import pytest
import torch
from helpers import hf_greedy

from jaxdecode.decode import Engine
from jaxdecode.loading import load_model
from jaxdecode.weights.gguf import default_model_path

PROMPTS_RAW = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]
PROMPTS_CHAT = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
NEW_TOKENS = 32
RTOL_LOGITS = 1e-4  # the bar for first-step logits in float32


@pytest.fixture(scope="module")
def ours():
    loaded = load_model()
    return loaded, Engine(loaded.model)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    folder = tmp_path_factory.mktemp("gguf")
    os.symlink(path, folder / path.name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def _prompt_ids(tok, text, chat):
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]) if chat else text)


@pytest.mark.parametrize("text, chat", [(p, False) for p in PROMPTS_RAW] + [(p, True) for p in PROMPTS_CHAT])
def test_greedy_tokens_equal_transformers(ours, hf, text, chat):
    loaded, engine = ours
    ids = _prompt_ids(loaded.tokenizer, text, chat)
    got = engine.generate([ids], max_new_tokens=NEW_TOKENS).token_ids[0]
    assert got == hf_greedy(hf, ids, NEW_TOKENS)


def test_first_step_logits_equal_transformers(ours, hf):
    loaded, engine = ours
    ids = _prompt_ids(loaded.tokenizer, PROMPTS_CHAT[0], True)
    got = engine.forward_logits(np.array([ids]))[0, -1]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1].numpy()
    err = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
    assert err < RTOL_LOGITS, f"max relative error {err:.2e}"


def test_answers_paris(ours):
    loaded, engine = ours
    tok = loaded.tokenizer
    ids = _prompt_ids(tok, "What is the capital of France?", True)
    out = engine.generate([ids], max_new_tokens=24, eos_ids=tok.eos_token_ids)
    assert "Paris" in tok.decode(out.token_ids[0])

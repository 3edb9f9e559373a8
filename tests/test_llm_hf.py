"""The text-level API against HF transformers' `generate` on the shipped model, both loading the same GGUF file:
the same logits processors give the same tokens under greedy decoding, and logprobs agree within 1e-4."""

import os

import numpy as np
import pytest
import torch

from jaxdecode import LLM, SamplingParams
from jaxdecode.weights.gguf import default_model_path

NEW = 9  # one prefill token, then one chunk of 8
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]
LOGPROB_TOL = 1e-4  # the bar


@pytest.fixture(scope="module")
def llm():
    return LLM()


@pytest.fixture(scope="module")
def hf(tmp_path_factory, llm):
    """(HF model read from the GGUF file by transformers' own converter, our vocabulary in HF's tokenizer class:
    HF's stop-string criterion reads only the vocabulary)."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    path = default_model_path()
    folder = tmp_path_factory.mktemp("gguf")
    os.symlink(path, folder / path.name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=path.name, dtype=torch.float32)
    return model.eval(), PreTrainedTokenizerFast(tokenizer_object=llm.tokenizer.backend)


def _hf_generate(hf, llm, conversation, **kwargs):
    """HF's new tokens and the log_softmax of its raw logits at each, for one conversation."""
    model, tokenizer = hf
    tok = llm.tokenizer
    ids = tok.encode(tok.apply_chat_template(conversation), add_bos=False)
    eos = list(tok.eos_token_ids)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=NEW,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
            output_logits=True,
            return_dict_in_generate=True,
            tokenizer=tokenizer,
            **kwargs,
        )
    new = out.sequences[0, len(ids) :].tolist()
    logp = torch.log_softmax(torch.stack(out.logits)[:, 0].float(), dim=-1).numpy()  # [new, V]
    return new, logp[np.arange(len(new)), new]


def test_repetition_penalty_tokens_and_logprobs_equal_transformers(llm, hf):
    params = SamplingParams(max_new_tokens=NEW, repetition_penalty=1.5, logprobs=0)
    ours = llm.chat(CONVERSATIONS, params)
    for conversation, c in zip(CONVERSATIONS, ours):
        tokens, logprobs = _hf_generate(hf, llm, conversation, repetition_penalty=1.5)
        assert list(c.token_ids) == tokens
        np.testing.assert_allclose(c.logprobs, logprobs, atol=LOGPROB_TOL)
        # HF stops at an end token too: then the finish reason is "stop", else "length".
        assert c.finish_reason == ("stop" if tokens[-1] in llm.tokenizer.eos_token_ids else "length")


def test_stop_strings_end_where_transformers_stops(llm, hf):
    full = llm.chat(CONVERSATIONS[1], SamplingParams(max_new_tokens=NEW))[0].text
    stop = full[10:13]
    ours = llm.chat(CONVERSATIONS[1], SamplingParams(max_new_tokens=NEW, stop=stop))[0]
    tokens, _ = _hf_generate(hf, llm, CONVERSATIONS[1], stop_strings=[stop])
    assert list(ours.token_ids) == tokens and ours.finish_reason == "stop"
    assert ours.text == full[: full.index(stop)]  # HF keeps the stop string in its text; we cut before it

"""Tokenizer vs transformers' GGUF tokenizer on the real SmolLM2 file, plus hand-computed cases."""

from __future__ import annotations

import os

import pytest

from jaxdecode.tokenizer import Tokenizer, TokenizerError
from jaxdecode.weights import default_model_path, read_gguf

TEXTS = [
    "Hello world",
    "  leading spaces",
    "def f(x):\n    return x**2  # square\n",
    "12345 + 678 = 13023",
    "3.14159e-10",
    "café naïve 日本語 🤖🎉 👨‍👩‍👧",
    "\t\ttabs\n\n\nnewlines   trailing   ",
    "<|im_start|>user\nhi<|im_end|>\n",
    "don't you'll I'M",
    "",
    " ",
    "a" * 50,
    "<|endoftext|><repo_name>x",
    "Ḁ̸̢̛̀ zalgo",
    "https://example.com/a?b=1&c=2",
    "1,000,000 1000000",
    "\u00a0nbsp\u2003em",
    "<|im_end",
    "for (int i = 0; i < n; ++i) { s += a[i]; }",
    "Привет, мир! Ελληνικά",
    "\r\n\r\nCRLF",
    "$$\\frac{a}{b}$$",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Why? 🤔"},
    ],
    [{"role": "user", "content": "  spaced\n\nlines  "}, {"role": "assistant", "content": ""}],
]


@pytest.fixture(scope="module")
def smollm_metadata():
    return read_gguf(default_model_path()).metadata


@pytest.fixture(scope="module")
def tok(smollm_metadata):
    return Tokenizer.from_gguf(smollm_metadata)


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """transformers' own conversion of the GGUF tokenizer (an independent implementation)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("smollm")
    (d / "model.gguf").symlink_to(default_model_path())
    return transformers.AutoTokenizer.from_pretrained(d, gguf_file="model.gguf")


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok, ref, text):
    assert tok.encode(text) == ref.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers_and_round_trips(tok, ref, text):
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special=False) == text
    assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_digits_are_split_like_llamacpp(tok):
    """SmolLM2's pre-tokenizer ("smollm") splits every \\p{N} character off first, as llama.cpp and the
    original tokenizer.json (Digits(individual_digits=True)) do. transformers' GGUF conversion does not
    (it uses the plain GPT-2 pattern), so for a space before a non-ASCII digit it merges "ĠÙ"; we follow
    llama.cpp. Expected ids built by hand from the pieces."""
    for text, pieces in [(" ١٢٣", [" ", "١", "٢", "٣"]), ("x ²³ ½", ["x", " ", "²", "³", " ", "½"])]:
        assert tok.encode(text) == [i for p in pieces for i in tok.encode(p)]
    assert tok.encode("2024") == [tok.backend.token_to_id(c) for c in "2024"]


def test_special_tokens_and_eos(tok, ref):
    assert tok.eos_token_ids == (2,) and tok.token(2) == "<|im_end|>" == ref.eos_token
    assert tok.bos_id == 1 and tok.token(1) == "<|im_start|>" == ref.bos_token
    assert not tok.add_bos and tok.encode("hi") == tok.encode("hi", add_bos=False)
    assert tok.encode("hi", add_bos=True) == [1] + tok.encode("hi")
    assert tok.vocab_size == 49152 == len(ref)
    assert tok.decode([1, 19556, 2]) == "Hello"
    assert tok.decode([1, 19556, 2], skip_special=False) == "<|im_start|>Hello<|im_end|>"


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_chat_template_matches_transformers(tok, ref, conv, gen):
    msgs = CONVERSATIONS[conv]
    want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == want


def test_chat_template_by_hand(tok):
    got = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert got == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("text", ["🤖🎉 ok", "日本語のテキスト", "Ḁ̸̢̛̀ zalgo", "plain ascii text", "👨‍👩‍👧 family"])
def test_stream_decoder_yields_only_complete_text(tok, text):
    ids = tok.encode(text)
    stream = tok.stream()
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.flush() == text
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(tok.stream()(ids)) == text


def test_stream_decoder_holds_a_split_character(tok):
    ids = tok.encode("🤖")  # 4 UTF-8 bytes, more than one byte-level token
    assert len(ids) > 1
    stream = tok.stream()
    assert [stream.push(i) for i in ids] == [""] * (len(ids) - 1) + ["🤖"]
    half = tok.stream()
    half.push(ids[0])
    assert half.flush() == "\ufffd"


def test_stream_decoder_skips_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\nHi there<|im_end|>")
    assert "".join(tok.stream()(ids)) == "assistant\nHi there"


def test_from_hf_dir_matches_transformers(tmp_path, ref, tok):
    ref.save_pretrained(tmp_path)
    hf = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS:
        assert hf.encode(text) == ref.encode(text, add_special_tokens=False), text
    for msgs in CONVERSATIONS:
        assert hf.apply_chat_template(msgs) == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert hf.eos_token_ids == tok.eos_token_ids and hf.bos_id == tok.bos_id


def _tiny_metadata(**extra):
    tokens = ["<s>", "</s>", "<|end|>", "h", "i", "hi", "Ġ", "Ġhi"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3, 1, 1, 1, 1, 1],
        "tokenizer.ggml.merges": ["h i", "Ġ hi"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
    } | extra


def test_tiny_vocab_by_hand():
    t = Tokenizer.from_gguf(_tiny_metadata())
    assert t.encode("hi hi") == [5, 7]
    assert t.encode("hi</s>", add_bos=True) == [0, 5, 1]
    assert t.eos_token_ids == (1,)  # no template, so no end-of-turn token is added


def test_template_end_token_joins_eos_and_jinja_options():
    template = (
        "{% for m in messages %}\n"
        "  {% if m['role'] == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}\n"
        "  {{ m['content'] | tojson }}<|end|>\n"
        "{% endfor %}"
    )
    t = Tokenizer.from_gguf(_tiny_metadata(**{"tokenizer.chat_template": template}))
    assert t.eos_token_ids == (1, 2)
    # trim_blocks drops the newline after a block tag and lstrip_blocks the spaces before it
    assert t.apply_chat_template([{"role": "user", "content": "é"}]) == '  "é"<|end|>\n'
    with pytest.raises(TokenizerError, match="no bad roles"):
        t.apply_chat_template([{"role": "bad", "content": ""}])


def test_template_is_sandboxed():
    t = Tokenizer.from_gguf(_tiny_metadata(**{"tokenizer.chat_template": "{{ messages.__class__.__mro__ }}"}))
    with pytest.raises(TokenizerError, match="unsafe"):
        t.apply_chat_template([])


def test_errors():
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer.from_gguf(_tiny_metadata()).apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(TokenizerError, match="unsupported GGUF tokenizer model 'llama'"):
        Tokenizer.from_gguf(_tiny_metadata(**{"tokenizer.ggml.model": "llama"}))
    with pytest.raises(TokenizerError, match="unsupported pre-tokenizer 'mystery'"):
        Tokenizer.from_gguf(_tiny_metadata(**{"tokenizer.ggml.pre": "mystery"}))
    with pytest.raises(TokenizerError, match="lacks tokenizer.ggml.tokens"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "gpt2"})
    with pytest.raises(TokenizerError, match="tokenizer.json: cannot load"):
        Tokenizer.from_hf_dir("/nonexistent-dir")

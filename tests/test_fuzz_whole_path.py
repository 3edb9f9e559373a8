"""Property-based fuzzing of the whole load-and-generate path: crafted GGUF files and HF directories go through
the readers, the tokenizer's metadata, the chat template, `load_model` (the header checks, the memory
preflight, the finite check) and a one-token generation. The rule: a clear error, or a finite result.

hypothesis draws a tiny model (heads, layers, tied or not, llama or qwen2, dense or Q8_0) and then hostile
edits: any metadata key of the file set to a value of any type or range (or removed), weights holding NaN,
infinities, zeros or values up to 30, a chat template assembled from pieces that loop for hours, allocate gigabytes,
raise, escape the sandbox or do not parse, user text with special-token strings and undecodable bytes,
and raw byte flips in the header. A case passes when it either raises a ValueError (WeightsError,
TokenizerError, the preflight's) whose one-line message names the file, the key or the text at fault, or
yields a greedy token in the vocabulary from logits that are all finite, or the sampler's refusal
(`sampling.NON_FINITE`) of logits that are not. Anything else (another exception type, a hang past
`CASE_SECONDS`, a token sampled from non-finite logits) fails the test with the case hypothesis shrank.

Finite weights stay within 30, so that attention scores stay below about 1e7. Larger finite weights are
tested apart: float32 overflow, which the sampler refuses (`test_overflowing_finite_weights_are_refused`),
and, found by this fuzzer (a norm weight of 1e4, the other weights N(0, 10)), scores near 4e9 whose softmax
was 0/0 when the whole step was one XLA program on the CPU (`test_huge_attention_scores_are_finite_or_refused`;
model.py's `sdpa` says why and how it is safe now).

CI runs `CI_CASES` cases with a fixed seed and fewer shapes (compiling the forward of each drawn structure
is most of a short run). The large budget is run by hand:

    JAXDECODE_FUZZ_CASES=100000 uv run --group test pytest -q -n 0 tests/test_fuzz_whole_path.py -k whole_path -s

Run once, at commit 4786621, as two processes of 50,000 cases (--hypothesis-seed=1 and 2) side by side on
a shared two-core machine: 100,000 cases, no failure, 1814 s and 1775 s of wall time, 1151 + 1153 s of CPU
(about 23 ms a case), peak resident 1.75 GB each. 20,496 cases generated a token from finite logits,
63,662 were refused while loading, 4,777 at the prompt (template, UTF-8) and 10,514 for their prompt's
length (counts of the 80 most common outcomes each run prints; the rest, under 300 a run, are rarer ones).
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import re
import signal
import struct
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT
from gguf.quants import quantize as gguf_quantize
from helpers import SMOLLM_TOKENS, gguf_name, random_hf_state
from hypothesis import HealthCheck, Phase, given, reject, settings
from hypothesis import strategies as st
from hypothesis.errors import UnsatisfiedAssumption
from test_hostile import CHATML, tokenizer_kv, write_gguf_kv, write_hf_dir

from jaxdecode.cache import KVCache
from jaxdecode.chat_template import TemplateLimits
from jaxdecode.config import ModelConfig
from jaxdecode.loading import load_model
from jaxdecode.sampling import NON_FINITE, SamplingParams, sample
from jaxdecode.tokenizer import TokenizerError
from jaxdecode.weights import WeightsError

CI_CASES = 300
CASES = int(os.environ.get("JAXDECODE_FUZZ_CASES", CI_CASES))
CASE_SECONDS = 30.0  # a hang, not slowness: far above a case's time, first compilation included
LIMITS = TemplateLimits(seconds=0.25, output_chars=1 << 16)  # the rule is the same; the budget goes further
PROMPT_BUCKET = 16  # prompts are padded to a multiple of this, so that few shapes compile
NAN, INF = float("nan"), float("inf")
logging.getLogger("gguf").setLevel(logging.ERROR)  # the writer warns when an edit replaces a key it wrote

# --- what hypothesis draws --------------------------------------------------------------------------------

GGUF_CONFIG_KEYS = [
    "llama.block_count",
    "llama.context_length",
    "llama.embedding_length",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.rope.freq_base",
    "llama.attention.layer_norm_rms_epsilon",
    "llama.rope.dimension_count",
    "llama.attention.key_length",
    "general.architecture",
    "general.alignment",
]
TOKENIZER_KEYS = list(tokenizer_kv()) + [
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
]
HF_CONFIG_KEYS = [
    "architectures",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "head_dim",
    "tie_word_embeddings",
    "attention_bias",
]
HF_TOKENIZER_KEYS = ["bos_token", "eos_token", "pad_token", "add_bos_token", "chat_template"]

INTS = st.sampled_from(
    [0, 1, 2, 3, 4, 9, 10, 11, 16, 32, 48, 64, 256, -1, -(2**31), 2**31 - 1, 2**32, 2**40, 2**64 - 1]
)
FLOATS = st.sampled_from([0.0, -5.0, 1e-6, 1e-5, 1e-40, 1e38, 1e39, 1e300, NAN, INF, -INF, 10000.0, 0.5])
STRINGS = st.sampled_from(
    ["", "gpt2", "llama", "qwen2", "smollm", "gpt-2", "mystery", "2", "<|im_end|>", "a b", "x" * 300]
)
LISTS = st.one_of(
    st.lists(st.integers(-3, 12), max_size=12),
    st.lists(st.sampled_from(SMOLLM_TOKENS + ["", "a b", "Ġ a", "zz"]), max_size=12),
    st.just([]),
)
VALUES = st.one_of(st.none(), INTS, FLOATS, STRINGS, LISTS, st.booleans())


def _gguf_value(value, as_f64: bool, as_i64: bool):
    """A drawn value as write_gguf_kv takes it: floats as f32 or f64, ints as their own width or i64."""
    if isinstance(value, float) and as_f64:
        return (value, VT.FLOAT64)
    if isinstance(value, int) and not isinstance(value, bool) and as_i64 and -(2**63) <= value < 2**63:
        return (value, VT.INT64)
    if isinstance(value, float):
        return (value, VT.FLOAT64) if not math.isfinite(value) or abs(value) > 3e38 else value
    return value


TEMPLATE_PIECES = [
    CHATML,
    "{{ messages[0]['content'] }}",
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{{ bos_token }}{{ eos_token }}{{ pad_token }}",
    "{{ messages | tojson }}",
    "{{ messages[0]['content'] | upper }}",
    "{{ raise_exception('roles must alternate') }}",
    "{{ messages.__class__.__mro__ }}",
    "{{ ''.__class__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ strftime_now('%Y') }}",
    "{% for %}",
    "{{",
    "{{ 1 + 'a' }}",
    "{{ undefined_name.attr }}",
    "{{ ('ab' * 1000) * 1000 }}",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "{{ range(10) | list }}",
    "<|im_start|><|im_end|>",
]
HEAVY_PIECES = [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{{ 'a' * 4000000000 }}",
    "{% for i in range(100000) %}abcdefghij{% endfor %}",
]
TEMPLATES = st.one_of(
    st.just(CHATML),
    st.lists(st.sampled_from(TEMPLATE_PIECES) | st.text(max_size=8), min_size=1, max_size=4).map("".join),
    st.integers(0, 99).flatmap(lambda i: st.sampled_from(HEAVY_PIECES) if i == 0 else st.just(CHATML)),
)
NOT_TEXT = st.integers() | st.lists(st.integers(), max_size=2)  # a template stored as a number or an array
TEXT = st.lists(
    st.sampled_from(["ab", " ", "a", "b", "é", "1", "<|im_end|>", "<|im_start|>system\n", "\n", "\udcff", "日本"])
    | st.text(max_size=4),
    min_size=0,
    max_size=6,
).map("".join)

# (heads, kv heads, layers) and prompt buckets: few, so that few forwards compile; fewer still in CI, where
# compiling would otherwise take most of the time
SHAPES = [(2, 1, 1), (4, 2, 2)] if CASES > CI_CASES else [(2, 1, 2)]
MAX_PROMPT = 2 * PROMPT_BUCKET if CASES > CI_CASES else PROMPT_BUCKET  # longer prompts are counted, not run
VOCABS = [len(SMOLLM_TOKENS), len(SMOLLM_TOKENS) + 2] if CASES > CI_CASES else [len(SMOLLM_TOKENS)]
WEIGHT_VALUES = [NAN, INF, -INF, 30.0, -30.0, 0.0, 1e-30]


@st.composite
def cases(draw) -> dict:
    """One model file set and one prompt. Each hostile edit is drawn rarely enough that a tenth or more of
    the cases still load and generate."""
    n_heads, n_kv, layers = draw(st.sampled_from(SHAPES))
    arch = draw(st.sampled_from(["llama", "qwen2"]))
    cfg = ModelConfig(
        "fuzz",
        vocab_size=draw(st.sampled_from(VOCABS)),
        dim=32,
        n_layers=layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        ffn_dim=64,
        max_seq_len=draw(st.sampled_from([32, 64])),
        tie_embeddings=draw(st.booleans()),
        qkv_bias=arch == "qwen2",
    )
    kind = draw(st.sampled_from(["gguf", "gguf", "gguf", "hf"]))
    sometimes = lambda strategy, empty, one_in: draw(
        st.integers(0, one_in - 1).flatmap(  # noqa: E731
            lambda i: strategy if i == 0 else st.just(empty)
        )
    )
    keys = GGUF_CONFIG_KEYS + TOKENIZER_KEYS if kind == "gguf" else HF_CONFIG_KEYS + HF_TOKENIZER_KEYS
    edit = st.tuples(st.sampled_from(keys), VALUES, st.booleans(), st.booleans())
    weight = st.tuples(st.integers(0, 10**6), st.integers(0, 10**6), st.sampled_from(WEIGHT_VALUES))
    return dict(
        cfg=cfg,
        arch=arch,
        kind=kind,
        seed=draw(st.integers(0, 3)),
        scale=draw(st.sampled_from([1.0, 1.0, 1.0, 1e-3])),
        weights=sometimes(st.lists(weight, min_size=1, max_size=2), [], 4),
        q8=kind == "gguf" and draw(st.booleans()),
        edits=sometimes(st.lists(edit, min_size=1, max_size=3), [], 2),
        template=sometimes(st.one_of(TEMPLATES, TEMPLATES, TEMPLATES, NOT_TEXT), CHATML, 2),
        flips=sometimes(st.lists(st.tuples(st.integers(4, 4095), st.integers(1, 255)), min_size=1, max_size=2), [], 10),
        system=draw(st.none() | TEXT),
        user=draw(TEXT),
        chat=draw(st.booleans()),
    )


# --- making the files ---------------------------------------------------------------------------------


def _state(case) -> dict[str, np.ndarray]:
    state = random_hf_state(case["cfg"], seed=case["seed"])
    names = sorted(state)
    for i, j, value in case["weights"]:
        t = state[names[i % len(names)]]
        t.reshape(-1)[j % t.size] = value
    if case["scale"] != 1.0:
        state = {k: v * np.float32(case["scale"]) for k, v in state.items()}
    return state


def _write_gguf(case, path: Path) -> Path:
    cfg, state, arch, template = case["cfg"], _state(case), case["arch"], case["template"]
    kv = {"tokenizer.chat_template": template if template != [] else (0, VT.INT32)}
    for key, value, as_f64, as_i64 in case["edits"]:
        kv[key.replace("llama.", f"{arch}.", 1)] = _gguf_value(value, as_f64, as_i64)
    raw = {}
    if case["q8"]:
        for hf, t in state.items():
            if t.ndim == 2 and np.isfinite(t).all():
                raw[gguf_name(hf)] = (gguf_quantize(t, QT.Q8_0), QT.Q8_0)
    try:
        write_gguf_kv(path, cfg, state, kv=kv, raw_tensors=raw, arch=arch)
    except (ValueError, TypeError, OverflowError, struct.error):  # a value the GGUF writer cannot express
        reject()
    if case["flips"]:
        data = bytearray(path.read_bytes())
        for pos, xor in case["flips"]:
            data[pos % len(data)] ^= xor
        path.write_bytes(bytes(data))
    return path


def _write_hf(case, path: Path) -> Path:
    cfg = case["cfg"]
    config = {"architectures": ["Qwen2ForCausalLM" if case["arch"] == "qwen2" else "LlamaForCausalLM"]}
    tok_config = {"eos_token": "<|im_end|>", "chat_template": case["template"]}
    for key, value, _, _ in case["edits"]:
        (tok_config if key in HF_TOKENIZER_KEYS else config)[key] = value
    write_hf_dir(path, cfg, _state(case), config=config)
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return path


# --- one case, through the whole path --------------------------------------------------------------------


def _next_token(graphdef, state, tokens, length):
    """Prefill tokens [1, T] (the first `length` real) and sample greedily: (last logits [V], token)."""
    model = nnx.merge(graphdef, state)
    cache = KVCache.init(model.cfg, 1, tokens.shape[1], jnp.float32)
    logits, _, _ = model(tokens, jnp.arange(tokens.shape[1], dtype=jnp.int32)[None], cache.k, cache.v)
    last = logits[0, length - 1]  # [V]
    return last, sample(last[None], jax.random.key(0), SamplingParams())[0]


# One compilation per drawn model structure and prompt bucket, reused by every later case of it.
NEXT_TOKEN = jax.jit(_next_token, static_argnums=0)


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang()


def run_case(case, workdir: Path) -> str:
    """The outcome: "token" or "refused: <stage>: <error kind>"; an AssertionError when the rule is broken."""
    path = _write_gguf(case, workdir / "case.gguf") if case["kind"] == "gguf" else _write_hf(case, workdir / "case")
    stage = "load"
    try:
        loaded = load_model(str(path), dtype=jnp.float32)
        tok, cfg = loaded.tokenizer, loaded.cfg
        if tok is None:
            return "refused: no tokenizer"
        tok.template_limits = LIMITS
        stage = "prompt"
        if case["chat"]:
            messages = [{"role": "system", "content": case["system"]}] if case["system"] is not None else []
            ids = tok.encode_chat(messages + [{"role": "user", "content": case["user"]}])
        else:
            ids = tok.encode(case["user"])
        if not ids or len(ids) + 1 > cfg.max_seq_len:
            return "refused: prompt length"  # the CLI's empty prompt, the engine's context check
        if len(ids) > MAX_PROMPT:
            return "long prompt"
        stage = "generate"
        tokens = np.zeros((1, -(-len(ids) // PROMPT_BUCKET) * PROMPT_BUCKET), np.int32)
        tokens[0, : len(ids)] = ids
        graphdef, state = nnx.split(loaded.model)
        logits, token = NEXT_TOKEN(graphdef, state, jnp.asarray(tokens), len(ids))
        logits, token = np.asarray(logits), int(token)
        if token == NON_FINITE:
            assert not np.isfinite(logits).all(), "finite logits refused"
            return "refused: generate: logits not finite"
        assert np.isfinite(logits).all(), f"a token from non-finite logits ({np.isnan(logits).sum()} NaN)"
        assert 0 <= token < cfg.vocab_size, token
        assert isinstance(tok.decode([token]), str)
        return "token"
    except ValueError as e:  # WeightsError, TokenizerError and the preflight's are ValueErrors
        message = str(e)
        assert stage != "generate", f"generation raised {e!r}"
        assert message and "\n" not in message.strip(), f"not one line: {message!r}"
        named = str(path) in message or path.stem in message or "UTF-8" in message
        assert named or not isinstance(e, (WeightsError, TokenizerError)), f"names neither file nor text: {message}"
        return f"refused: {stage}: {_kind(message, path)}"


def _kind(message: str, path: Path) -> str:
    """The words of an error message without its numbers and names: an error kind, to count variety."""
    text = message.replace(str(path), "")
    return " ".join(w for w in re.split(r"[\s:]+", text) if w.isalpha())[:40]


# --- the property ----------------------------------------------------------------------------------------


@settings(
    max_examples=CASES,
    deadline=None,
    derandomize=CASES == CI_CASES,
    database=None,
    phases=[Phase.generate, Phase.shrink],
    suppress_health_check=list(HealthCheck),
)
@given(case=cases())
def _whole_path(case, workdir: Path, results: collections.Counter):
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
    try:
        outcome = run_case(case, workdir)
    except Hang:
        raise AssertionError(f"no result within {CASE_SECONDS} s") from None
    except (AssertionError, UnsatisfiedAssumption):
        raise
    except Exception:  # the point of the test: any other exception breaks the rule
        raise AssertionError(traceback.format_exc(limit=-4)) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    results[outcome] += 1


def test_whole_path(tmp_path):
    """Every drawn case gives a clear error or a finite token; and the cases reach deep: every stage, many
    error kinds, tokens. Prints the counts and the time (the large run's report)."""
    results: collections.Counter = collections.Counter()
    start, cpu = time.perf_counter(), time.process_time()
    _whole_path(workdir=tmp_path, results=results)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    total = sum(results.values())
    peak = re.search(r"VmHWM:\s*(\d+) kB", Path("/proc/self/status").read_text())
    print(f"\n{total} cases in {wall:.0f} s ({cpu:.0f} s CPU in this process; peak resident {peak and peak[1]} kB)")
    print(results.most_common(80))
    stages = {k.split(":")[1].strip() for k in results if k.startswith("refused:") and k.count(":") > 1}
    assert total >= CASES * 0.8, total
    assert {"load", "prompt"} <= stages, stages
    assert results["token"] >= total // 10, results
    assert len(results) >= 20, results


# --- finite weights whose forward is not finite ------------------------------------------------------


def test_overflowing_finite_weights_are_refused(tmp_path):
    """Finite weights of 3e38 pass the load check and overflow the forward: the sampler refuses the logits
    (`NON_FINITE`) rather than take a greedy token from NaN; the engine turns that into a WeightsError
    (test_hostile.py)."""
    cfg = ModelConfig("overflow", len(SMOLLM_TOKENS), 32, 1, 2, 1, 64, max_seq_len=32)
    state = random_hf_state(cfg)
    state["model.norm.weight"][:] = 3e38
    loaded = load_model(str(write_gguf_kv(tmp_path / "o.gguf", cfg, state)), dtype=jnp.float32)
    graphdef, params = nnx.split(loaded.model)
    logits, token = NEXT_TOKEN(graphdef, params, jnp.asarray([[3] * PROMPT_BUCKET], jnp.int32), 1)
    assert not np.isfinite(np.asarray(logits)).all()  # the case still overflows: the refusal is what is tested
    assert int(token) == NON_FINITE


def test_huge_attention_scores_are_finite_or_refused(tmp_path):
    """The case the fuzzer shrank: N(0, 10) weights, one norm weight of 1e4, a five-token prompt. Eagerly
    the logits were finite; jitted as one program (as the engine runs a step) they were NaN on the machine
    that found it, from a softmax of 0/0 (model.py's `sdpa` says how, and why it cannot happen now). Either
    outcome passes: finite logits with a token in the vocabulary, or the sampler's refusal of non-finite
    ones; never a token taken from NaN."""
    cfg = ModelConfig("scores", len(SMOLLM_TOKENS), 32, 2, 4, 2, 64, max_seq_len=32, tie_embeddings=True)
    state = {k: v * np.float32(10) for k, v in random_hf_state(cfg, seed=0).items()}
    state["model.layers.0.input_layernorm.weight"][1] = 1e4
    loaded = load_model(str(write_gguf_kv(tmp_path / "s.gguf", cfg, state)), dtype=jnp.float32)
    graphdef, params = nnx.split(loaded.model)
    tokens = np.zeros((1, PROMPT_BUCKET), np.int32)
    tokens[0, :5] = [1, 2, 1, 3, 3]
    logits, token = NEXT_TOKEN(graphdef, params, jnp.asarray(tokens), 5)
    if int(token) == NON_FINITE:
        assert not np.isfinite(np.asarray(logits)).all()
    else:
        assert np.isfinite(np.asarray(logits)).all() and 0 <= int(token) < cfg.vocab_size

"""Cached decode equals the full forward pass; batched generation equals one-by-one; EOS masking; rows that
each sample with their own settings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.config import PRESETS
from jaxdecode.decode import Engine
from jaxdecode.model import init_random
from jaxdecode.sampling import SamplingParams
from jaxdecode.weights import WeightsError


@pytest.fixture(scope="module", params=[False, True], ids=["unrolled", "looped"])
def engine(request):
    return Engine(init_random(PRESETS["tiny-gqa"], seed=3), loop_layers=request.param)


# Most tests share the shapes of test_batched_generation_equals_one_by_one (prompts padded to 16 tokens, a
# 64-row cache, chunks of 8), so that the module's engines compile them once.


def _prompts(n_tokens=(7, 12, 3), vocab=97, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in n_tokens]


def test_cached_decode_equals_full_forward(engine):
    prompt = _prompts()[0]
    gen = engine.generate([prompt], max_new_tokens=24, chunk=8)
    seq = prompt + gen.token_ids[0]
    full = engine.forward_logits(np.array([seq[:-1]]))  # [1, T, V]
    # Greedy decoding picked the argmax of the full-sequence logits at every generated position.
    assert np.argmax(full[0, len(prompt) - 1 :], axis=-1).tolist() == gen.token_ids[0]


def test_cached_step_logits_equal_full_forward_logits(engine):
    prompt = _prompts()[1]
    full = engine.forward_logits(np.array([prompt]))  # [1, T, V]
    cache = engine.new_cache(1, 64)
    step = jax.jit(engine.forward)  # one compiled step for every position, as the decode loop runs it
    stepped = []
    for pos, tok in enumerate(prompt):
        logits, cache = step(engine.params, jnp.array([[tok]], jnp.int32), jnp.array([[pos]], jnp.int32), cache)
        stepped.append(np.asarray(logits[0, 0]))
    np.testing.assert_allclose(np.stack(stepped), full[0], rtol=1e-5, atol=1e-5)


def test_batched_generation_equals_one_by_one(engine):
    prompts = _prompts()
    batched = engine.generate(prompts, max_new_tokens=20, chunk=8)
    for prompt, row in zip(prompts, batched.token_ids):
        assert engine.generate([prompt], max_new_tokens=20, chunk=8).token_ids[0] == row


def test_sampled_generation_is_seeded_and_batch_independent(engine):
    sampling = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
    prompts = _prompts()
    a = engine.generate(prompts, max_new_tokens=12, sampling=sampling, seed=7)
    b = engine.generate(prompts, max_new_tokens=12, sampling=sampling, seed=7)
    c = engine.generate(prompts, max_new_tokens=12, sampling=sampling, seed=8)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_eos_stops_a_sequence_and_masks_the_rest(engine):
    prompts = _prompts()
    free = engine.generate(prompts, max_new_tokens=20, chunk=8)
    eos = free.token_ids[0][5]  # a token the first sequence emits at step 5
    gen = engine.generate(prompts, max_new_tokens=20, chunk=8, eos_ids=[eos])
    for free_row, row in zip(free.token_ids, gen.token_ids):
        cut = free_row.index(eos) + 1 if eos in free_row else len(free_row)
        assert row == free_row[:cut]


def test_chunks_stream_in_order(engine):
    prompt = _prompts()[0]
    chunks = list(engine.generate_stream([prompt], max_new_tokens=10, chunk=4))
    assert [c.shape[1] for c in chunks] == [1, 4, 4, 1]
    streamed = np.concatenate(chunks, axis=1)[0].tolist()
    assert streamed == engine.generate([prompt], max_new_tokens=10, chunk=8).token_ids[0]


@pytest.mark.parametrize(
    "prompts, kwargs, match",
    [
        ([[]], {}, "empty prompt"),
        ([[1] * 60], {"max_new_tokens": 10}, "exceeds the model's context of 64"),
        ([[1]], {"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_bad_requests_are_refused(engine, prompts, kwargs, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, **kwargs)


@pytest.mark.parametrize("seed", [2**70, 2**32, -1, 1.5, True])
@pytest.mark.parametrize("method", ["generate", "generate_stream"])
def test_seeds_outside_32_bits_are_refused(engine, method, seed):
    """JAX's PRNG takes 32-bit seeds; a larger one raised OverflowError from deep inside jax.random."""
    with pytest.raises(ValueError, match=rf"seed must be an integer in \[0, 2\*\*32\).*got {seed!r}$"):
        next(iter(getattr(engine, method)([[1]], seed=seed)))


class NonFiniteFrom(Engine):
    """An engine whose logits are `value` at vocabulary entry 0 from position `start` on: a forward that
    overflows partway through a generation."""

    def __init__(self, start: int, value: float):
        super().__init__(init_random(PRESETS["tiny-gqa"], seed=3), loop_layers=False)
        self.start, self.value = start, value

    def forward(self, params, tokens, positions, cache):
        logits, cache = super().forward(params, tokens, positions, cache)  # [B, T, V]
        return logits.at[..., 0].set(jnp.where(positions >= self.start, self.value, logits[..., 0])), cache


@pytest.mark.parametrize(
    "start, value, where",
    [
        (0, np.nan, "new token 1 of sequence 0"),  # the prefill's token
        (5, np.inf, "new token 4 of sequence 1"),  # the second chunk's first step, a step before sequence 0's
    ],
)
def test_non_finite_logits_are_refused_not_sampled(start, value, where):
    """Prompts of 2 and 3 tokens: the logits read at position p give new token p - length + 2 (new token 1
    is the prefill's, from position length - 1), so position 5 gives new token 5 of sequence 0 and new token
    4 of sequence 1, both in the second chunk of two steps. Logits holding NaN or inf give no token: the host
    raises for the earliest, at the chunk that holds it."""
    engine = NonFiniteFrom(start, value)
    stream = engine.generate_stream([[1, 2], [1, 2, 3]], max_new_tokens=8, chunk=2)
    if start > 0:
        assert next(stream).shape == (2, 1)  # the prefill's and the first chunk's tokens are finite
        assert next(stream).shape == (2, 2)
    with pytest.raises(WeightsError, match=f"logits are not finite .* at {where}: .* overflows in float32"):
        next(stream)


def test_compiles_once_per_shape(engine):
    """Prefill and the decode chunk compile together on the first call of a shape (the chunk from the
    prefill's output shapes); a second call of the same shapes compiles nothing and gives the same
    tokens, and both compiled programs are the ones that ran (two cache entries, not four)."""
    prompts = _prompts(n_tokens=(5, 9), seed=4)
    before = len(engine._executables)
    first = engine.generate(prompts, max_new_tokens=9, chunk=4)
    assert first.compile_s > 0 and len(engine._executables) == before + 2
    again = engine.generate(prompts, max_new_tokens=9, chunk=4)
    assert again.compile_s == 0.0 and len(engine._executables) == before + 2
    assert again.token_ids == first.token_ids


def test_rows_sample_each_with_their_own_settings_wherever_they_sit(engine):
    """A greedy row with a repetition penalty carried across chunks, beside a seeded sampled row: swapping the
    rows swaps the outputs, and each penalized token is the argmax of HF's penalty on full-forward logits."""
    prompts = _prompts(n_tokens=(7, 12))
    penalized = SamplingParams(repetition_penalty=2.0, logprobs=0)
    drawn = SamplingParams(temperature=1.0, top_k=10, min_p=0.05, seed=4)
    gen = engine.generate(prompts, max_new_tokens=20, chunk=8, sampling=[penalized, drawn])
    swapped = engine.generate(prompts[::-1], max_new_tokens=20, chunk=8, sampling=[drawn, penalized])
    assert swapped.token_ids[::-1] == gen.token_ids
    prompt, new = prompts[0], gen.token_ids[0]
    full = engine.forward_logits(np.array([prompt + new[:-1]]))[0, len(prompt) - 1 :]  # [new, V]
    for k, token in enumerate(new):
        logits = full[k].copy()
        seen = list(set(prompt) | set(new[:k]))
        logits[seen] = np.where(logits[seen] < 0, logits[seen] * 2.0, logits[seen] / 2.0)
        assert logits[token] >= logits.max() - 1e-4, f"token {k}"
    assert any(np.argmax(full[k]) != t for k, t in enumerate(new))  # the penalty changed some choice
    logp = np.asarray(jax.nn.log_softmax(full, axis=-1))  # raw: before the penalty
    np.testing.assert_allclose(gen.logprobs[0], logp[np.arange(len(new)), new], atol=1e-5)

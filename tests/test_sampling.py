"""Sampling filters against hand-computed expectations; penalties against a loop written from their definitions."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.sampling import (
    NON_FINITE,
    SamplingParams,
    SamplingPlan,
    SamplingRows,
    TokenCounts,
    apply_penalties,
    min_p_filter,
    row_keys,
    sample,
    sample_rows,
    token_logprobs,
    top_k_filter,
    top_p_filter,
)

LOGITS = jnp.array([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, -1.0]])


def test_greedy_is_argmax():
    assert sample(LOGITS, jax.random.key(0), SamplingParams()).tolist() == [1, 2]


def test_top_k_keeps_the_k_largest():
    kept = np.isfinite(np.asarray(top_k_filter(LOGITS, 2)))
    assert kept.tolist() == [[False, True, True, False], [True, True, True, False]]  # ties at the k-th are kept


def test_top_p_keeps_the_smallest_set_reaching_p():
    # Row 0 probabilities, sorted: 3 -> 0.6439, 2 -> 0.2369, 1 -> 0.0871, 0 -> 0.0321.
    p = np.exp([1.0, 3.0, 2.0, 0.0]) / np.exp([1.0, 3.0, 2.0, 0.0]).sum()
    assert math.isclose(p[1], 0.6439, abs_tol=1e-4)
    kept = lambda top_p: np.isfinite(np.asarray(top_p_filter(LOGITS[:1], top_p)))[0].tolist()
    assert kept(0.5) == [False, True, False, False]  # the top token alone reaches 0.5
    assert kept(0.8) == [False, True, True, False]  # 0.644 < 0.8 <= 0.881
    assert kept(0.9) == [True, True, True, False]  # 0.881 < 0.9 <= 0.968


def test_sampling_frequencies_follow_the_filtered_distribution():
    params = SamplingParams(temperature=1.0, top_k=3)
    keys = jax.random.split(jax.random.key(0), 4000)
    draws = np.asarray(jax.vmap(lambda k: sample(LOGITS[:1], k, params))(keys))[:, 0]
    probs = np.exp([1.0, 3.0, 2.0]) / np.exp([1.0, 3.0, 2.0]).sum()
    freq = np.bincount(draws, minlength=4) / len(draws)
    assert freq[3] == 0
    np.testing.assert_allclose(freq[:3], probs[[0, 1, 2]], atol=0.03)


def test_temperature_sharpens():
    keys = jax.random.split(jax.random.key(1), 2000)
    cold = np.asarray(jax.vmap(lambda k: sample(LOGITS[:1], k, SamplingParams(temperature=0.1)))(keys))
    assert (cold == 1).mean() > 0.99


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
    ],
)
def test_bad_sampling_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


# -- per-row sampling, penalties, min-p and logprobs ----------------------------------------------------


def _rows(**values) -> SamplingRows:
    """Rows of LOGITS' two rows: defaults (every stage off) with some fields set per row."""
    return SamplingRows.of([SamplingParams(**{k: v[i] for k, v in values.items()}) for i in range(2)])


def _penalized_reference(logits, prompt, generated, rep, presence, frequency):
    """HF's RepetitionPenaltyLogitsProcessor over prompt and output tokens, then OpenAI's presence and frequency
    penalties over the output, written as loops over one row."""
    out = np.array(logits, np.float64)
    for t in set(prompt) | set(generated):
        out[t] = out[t] * rep if out[t] < 0 else out[t] / rep
    for t in set(generated):
        out[t] -= presence + frequency * generated.count(t)
    return out


def test_penalties_equal_the_hf_and_openai_definitions():
    rng = np.random.default_rng(0)
    v = 13
    logits = rng.standard_normal((2, v)).astype(np.float32) * 3
    prompts = [[1, 4, 4, 7], [0, 2]]
    generated = [[4, 5, 5, 5, 12], [2, 3, 9, 9]]
    rep, presence, frequency = [1.3, 0.8], [0.5, -0.25], [0.2, 1.5]
    tokens = jnp.asarray([p + [0] * (4 - len(p)) for p in prompts], jnp.int32)  # padded past the lengths
    counts = TokenCounts.of_prompts(tokens, jnp.asarray([4, 2], jnp.int32), v)
    for i in range(max(map(len, generated))):
        step = [g[i] if i < len(g) else 0 for g in generated]
        counts = counts.add(jnp.asarray(step, jnp.int32), jnp.asarray([i < len(g) for g in generated]))
    rows = _rows(repetition_penalty=rep, presence_penalty=presence, frequency_penalty=frequency)
    got = np.asarray(apply_penalties(jnp.asarray(logits), counts, rows))
    for r in range(2):
        want = _penalized_reference(logits[r], prompts[r], generated[r], rep[r], presence[r], frequency[r])
        np.testing.assert_allclose(got[r], want, rtol=1e-6, atol=1e-6)


def test_min_p_keeps_tokens_within_min_p_of_the_top():
    # Row 0 probabilities: 0.0871, 0.6439, 0.2369, 0.0321; row 1 (logits 0, 0, 5, -1): 0.0066, 0.0066, 0.9844, 0.0024.
    kept = np.isfinite(np.asarray(min_p_filter(LOGITS, jnp.asarray([0.2, 0.005]))))
    assert kept.tolist() == [[False, True, True, False], [True, True, True, False]]  # floors 0.1288 and 0.0049
    assert np.isfinite(np.asarray(min_p_filter(LOGITS, 0.0))).all()


def test_top_k_and_top_p_take_one_value_per_row():
    kept = np.isfinite(np.asarray(top_k_filter(LOGITS, jnp.asarray([2, 0]), width=2)))
    assert kept.tolist() == [[False, True, True, False], [True, True, True, True]]  # 0 keeps all
    kept = np.isfinite(np.asarray(top_p_filter(LOGITS, jnp.asarray([0.8, 1.0]))))
    assert kept.tolist() == [[False, True, True, False], [True, True, True, True]]  # 1 keeps all


def test_plan_turns_on_only_the_stages_a_drawn_row_uses():
    greedy_filters = SamplingParams(top_k=5, top_p=0.5, min_p=0.1)  # filters cannot change an argmax
    assert SamplingPlan.of([greedy_filters, SamplingParams()]) == SamplingPlan()
    plan = SamplingPlan.of([SamplingParams(temperature=1.0, top_k=5), SamplingParams(presence_penalty=0.5, logprobs=2)])
    assert plan == SamplingPlan(random=True, top_k=8, penalties=True, logprobs=2)  # k rounded up to 2**n


def test_sample_rows_mixes_greedy_and_drawn_rows_each_with_its_own_filters():
    rows = _rows(temperature=[0.0, 1.0], top_k=[0, 3])
    plan = SamplingPlan.of([SamplingParams(), SamplingParams(temperature=1.0, top_k=3)])
    keys = jax.random.split(jax.random.key(0), 2)
    draw = jax.jit(lambda pos: sample_rows(LOGITS, keys, jnp.stack([pos, pos]), rows, plan)[0])
    draws = np.stack([np.asarray(draw(jnp.int32(p))) for p in range(3000)])  # [3000, 2]: positions seed the draws
    assert (draws[:, 0] == 1).all()  # the greedy row
    freq = np.bincount(draws[:, 1], minlength=4) / len(draws)
    probs = np.exp([0.0, 0.0, 5.0]) / np.exp([0.0, 0.0, 5.0]).sum()  # row 1's top 3 (tokens 0, 1, 2)
    assert freq[3] == 0
    np.testing.assert_allclose(freq[:3], probs, atol=0.02)
    assert np.array_equal(draw(jnp.int32(7)), draw(jnp.int32(7)))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=1.0, top_k=3, top_p=0.9, min_p=0.05),
        SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0, logprobs=2),
    ],
    ids=["greedy", "filtered", "penalized"],
)
def test_rows_with_non_finite_logits_get_no_token(params, bad):
    """A row whose raw logits hold one NaN or infinity samples `NON_FINITE`, whatever the stages; the other
    row samples as if alone."""
    logits = LOGITS.at[0, 2].set(bad)
    keys = jax.random.split(jax.random.key(0), 2)
    counts = TokenCounts.of_prompts(jnp.asarray([[0], [3]], jnp.int32), jnp.asarray([1, 1], jnp.int32), 4)
    plan, rows, positions = SamplingPlan.of([params] * 2), SamplingRows.of([params] * 2), jnp.asarray([5, 5])
    tokens = np.asarray(sample_rows(logits, keys, positions, rows, plan, counts)[0])
    alone = np.asarray(sample_rows(LOGITS, keys, positions, rows, plan, counts)[0])
    assert tokens[0] == NON_FINITE and tokens[1] == alone[1]
    if not params.penalized:
        tokens = np.asarray(sample(logits, jax.random.key(1), params))
        assert tokens[0] == NON_FINITE and 0 <= tokens[1] < 4


def test_row_keys_use_a_rows_own_seed_wherever_it_sits():
    seeded = SamplingParams(temperature=1.0, seed=11)
    a = jax.random.key_data(row_keys([seeded, SamplingParams()], seed=0))
    b = jax.random.key_data(row_keys([SamplingParams(), SamplingParams(), seeded], seed=3))
    assert np.array_equal(a[0], b[2]) and not np.array_equal(a[1], b[1])
    assert not np.array_equal(a[1], b[0])  # rows without a seed differ by the call's seed and their index


def test_logprobs_are_the_log_softmax_of_the_raw_logits():
    lp = token_logprobs(LOGITS, jnp.asarray([2, 2]), 2)
    ref = np.asarray(jax.nn.log_softmax(LOGITS, axis=-1))
    np.testing.assert_allclose(np.asarray(lp.chosen), ref[:, 2], rtol=1e-6)
    ids = np.asarray(lp.top_ids).tolist()
    assert ids[0] == [1, 2] and ids[1][0] == 2 and ids[1][1] in (0, 1)  # row 1's second place is a tie
    np.testing.assert_allclose(np.asarray(lp.top), np.sort(ref, axis=-1)[:, ::-1][:, :2], rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("inf")}, "frequency_penalty"),
        ({"seed": -1}, "seed"),
        ({"logprobs": -1}, "logprobs"),
        ({"n": 0}, "n must be"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"top_k": True}, "top_k"),
    ],
)
def test_bad_new_sampling_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_one_stop_string_becomes_a_tuple():
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")

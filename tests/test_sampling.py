"""Sampling filters against hand-computed expectations."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.sampling import SamplingParams, sample, top_k_filter, top_p_filter

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

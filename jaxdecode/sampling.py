"""Token sampling: greedy, temperature, top-k and top-p (nucleus), seeded and jittable.

`SamplingParams` is frozen and hashable, so it is a static argument of the jitted generation loop.
Names follow Hugging Face `generate`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

Array = jax.Array


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1.0 turn those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        t, k, p = self.temperature, self.top_k, self.top_p
        if not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or math.isinf(t):
            raise ValueError(f"temperature must be a finite number >= 0, got {t}")
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {k}")
        if not isinstance(p, (int, float)) or math.isnan(p) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def top_k_filter(logits: Array, k: int) -> Array:
    """Keep the k largest logits [B, V] per row (ties with the k-th kept), set the rest to -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = jax.lax.top_k(logits, k)[0][:, -1:]  # [B, 1]
    return jnp.where(logits < kth, -jnp.inf, logits)


def top_p_filter(logits: Array, p: float) -> Array:
    """Keep the smallest set of tokens whose probability mass reaches p (at least one), per row [B, V].

    A token is kept when the mass of the tokens ranked strictly above it is below p.
    """
    if p >= 1.0:
        return logits
    order = jnp.argsort(-logits, axis=-1)  # [B, V], descending
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)  # [B, V]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_above = jnp.cumsum(probs, axis=-1) - probs  # [B, V]
    keep_sorted = mass_above < p
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
    return jnp.where(keep, logits, -jnp.inf)


def sample(logits: Array, key: Array, params: SamplingParams) -> Array:
    """Next tokens [B] int32 from logits [B, V]."""
    if params.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / params.temperature
    logits = top_k_filter(logits, params.top_k)
    logits = top_p_filter(logits, params.top_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)

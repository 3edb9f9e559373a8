"""Token sampling, seeded and jittable: penalties, temperature, top-k, top-p, min-p, and logprobs.

`SamplingParams` is one request's settings (frozen, hashable), named after HF `generate` and vLLM's
`SamplingParams`. On the device a batch samples with a `SamplingPlan` (static: which stages run, so one
compilation per plan) and `SamplingRows` (each row's values, traced), so that rows with different settings
share one batch and one compiled program.

Per token, in HF's order (logits processors, then warpers): repetition penalty, presence and frequency
penalties, temperature, top-k, top-p, min-p, then a draw (argmax for rows at temperature 0). Logprobs are
those of the model's raw logits, before any of these (vLLM's default, `raw_logprobs`).

A row whose raw logits are not all finite (NaN or ±inf: finite weights whose forward overflowed) samples no
token: it gets `NON_FINITE`, which the engine's host loop refuses, rather than an argmax or a draw over NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

# Request settings `jaxdecode.LLM` applies on the host; the Engine samples token by token and refuses them.
REQUEST_FIELDS = ("max_new_tokens", "n", "stop", "ignore_eos")

SEED_LIMIT = 2**32  # seeds are in [0, SEED_LIMIT): JAX's default PRNG keys take 32-bit seeds
NON_FINITE = -2  # the token of a row whose raw logits hold NaN or inf (-1 is the engine's padding)


def _check(name: str, value, ok: bool, want: str):
    if not ok:
        raise ValueError(f"{name} must be {want}, got {value!r}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings; the defaults turn every stage off (greedy decoding).

    Per token, on the device:
      temperature: 0 is greedy (argmax).
      top_k: keep the k most likely tokens (0: off). top_p: keep the smallest set reaching this mass (1: off).
      min_p: drop tokens whose probability is below min_p times the top token's (0: off).
      repetition_penalty: HF's; every token of the prompt or the output so far has its logit divided by it
        when positive, multiplied by it when negative (1: off).
      presence_penalty, frequency_penalty: OpenAI's and vLLM's; each token's logit is lowered by
        presence·[count > 0] + frequency·count, counting the output so far (0: off).
      seed: this row's own PRNG seed (its draws then do not depend on the batch); None: drawn from the
        call's seed and the row's index.
      logprobs: None for none; k >= 0 for the log-probability of each generated token plus the k most likely.
    Per request, applied by `jaxdecode.LLM`:
      max_new_tokens (None: the LLM's default), n samples per prompt, stop strings (the text ends before
      the first one), ignore_eos (keep going past the tokenizer's end tokens).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    max_new_tokens: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):  # one stop string, as vLLM and OpenAI accept it
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, (list, tuple)):
            object.__setattr__(self, "stop", tuple(self.stop))
        t, k, p = self.temperature, self.top_k, self.top_p
        _check("temperature", t, _is_real(t) and t >= 0, "a finite number >= 0")
        _check("top_k", k, _is_int(k) and k >= 0, "an integer >= 0")
        _check("top_p", p, _is_real(p) and 0 < p <= 1, "in (0, 1]")
        _check("min_p", self.min_p, _is_real(self.min_p) and 0 <= self.min_p <= 1, "in [0, 1]")
        r = self.repetition_penalty
        _check("repetition_penalty", r, _is_real(r) and r > 0, "a finite number > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(name, v, _is_real(v) and -2 <= v <= 2, "in [-2, 2] (OpenAI's range)")
        s = self.seed
        _check("seed", s, s is None or (_is_int(s) and 0 <= s < SEED_LIMIT), "None or an integer in [0, 2**32)")
        lp = self.logprobs
        _check("logprobs", lp, lp is None or (_is_int(lp) and lp >= 0), "None or an integer >= 0")
        m = self.max_new_tokens
        _check("max_new_tokens", m, m is None or (_is_int(m) and m >= 1), "None or an integer >= 1")
        _check("n", self.n, _is_int(self.n) and self.n >= 1, "an integer >= 1")
        _check(
            "stop",
            self.stop,
            isinstance(self.stop, tuple) and all(isinstance(x, str) and x for x in self.stop),
            "a non-empty string or a list of them",
        )
        _check("ignore_eos", self.ignore_eos, isinstance(self.ignore_eos, bool), "a bool")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty, self.presence_penalty, self.frequency_penalty) != (1, 0, 0)


@dataclass(frozen=True)
class SamplingPlan:
    """The stages the device runs for a batch. Static (one compilation per plan); each row's values are in
    `SamplingRows`, and a row whose value turns a stage off passes through it unchanged.

    top_k is the width of the `lax.top_k` that finds every row's k-th logit: the largest k of the batch,
    rounded up to a power of two so that nearby values share a compilation (0: no row filters).
    """

    random: bool = False  # some row draws (temperature > 0); otherwise every row takes the argmax
    top_k: int = 0
    top_p: bool = False
    min_p: bool = False
    penalties: bool = False  # carry the token history (`TokenCounts`) and apply the three penalties
    logprobs: int | None = None  # top logprobs per token (0: the chosen token's only); None: none

    @classmethod
    def of(cls, params: Sequence[SamplingParams]) -> SamplingPlan:
        drawn = [p for p in params if not p.greedy]  # filters cannot change an argmax
        k = max((p.top_k for p in drawn), default=0)
        lps = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            random=bool(drawn),
            top_k=1 << (k - 1).bit_length() if k else 0,
            top_p=any(p.top_p < 1 for p in drawn),
            min_p=any(p.min_p > 0 for p in drawn),
            penalties=any(p.penalized for p in params),
            logprobs=max(lps) if lps else None,
        )


@jax.tree_util.register_dataclass
@dataclass
class SamplingRows:
    """Each row's sampling values, traced: every field is [B]."""

    temperature: Array  # f32, 0: argmax
    top_k: Array  # int32, 0: off
    top_p: Array  # f32, 1: off
    min_p: Array  # f32, 0: off
    repetition_penalty: Array  # f32, 1: off
    presence_penalty: Array  # f32, 0: off
    frequency_penalty: Array  # f32, 0: off

    @classmethod
    def of(cls, params: Sequence[SamplingParams]) -> SamplingRows:
        def col(name, dtype):
            return jnp.asarray(np.array([getattr(p, name) for p in params], dtype))

        return cls(
            col("temperature", np.float32),
            col("top_k", np.int32),
            col("top_p", np.float32),
            col("min_p", np.float32),
            col("repetition_penalty", np.float32),
            col("presence_penalty", np.float32),
            col("frequency_penalty", np.float32),
        )


def row_keys(params: Sequence[SamplingParams], seed: int) -> Array:
    """PRNG keys [B]: a row's own `seed`, else fold_in(key(seed), row). A step draws with fold_in(key,
    position), so a row's draws depend only on its key and positions, never on the rest of the batch."""
    batch = jax.random.split(jax.random.key(seed), len(params))  # [B]
    own = jax.vmap(jax.random.key)(jnp.asarray(np.array([p.seed or 0 for p in params], np.uint32)))  # [B]
    has = np.array([p.seed is not None for p in params])[:, None]  # [B, 1]
    data = jnp.where(has, jax.random.key_data(own), jax.random.key_data(batch))  # [B, 2]
    return jax.random.wrap_key_data(data)


@jax.tree_util.register_dataclass
@dataclass
class TokenCounts:
    """The token history the penalties read, carried in the decode state."""

    generated: Array  # [B, V] int32, how often each token has been generated
    prompt: Array  # [B, V] bool, whether the token is in the prompt

    @classmethod
    def of_prompts(cls, tokens: Array, lengths: Array, vocab: int) -> TokenCounts:
        """From prompts tokens [B, T] padded past lengths [B]."""
        b, t = tokens.shape
        valid = jnp.arange(t)[None, :] < lengths[:, None]  # [B, T]
        ids = jnp.where(valid, tokens, vocab)  # the padding scatters out of range and is dropped
        prompt = jnp.zeros((b, vocab), bool).at[jnp.arange(b)[:, None], ids].set(True, mode="drop")
        return cls(jnp.zeros((b, vocab), jnp.int32), prompt)

    def add(self, tokens: Array, live: Array) -> TokenCounts:
        """Count tokens [B] of the rows that are live [B] (bool)."""
        rows = jnp.arange(tokens.shape[0])
        return TokenCounts(self.generated.at[rows, tokens].add(live.astype(jnp.int32)), self.prompt)


@jax.tree_util.register_dataclass
@dataclass
class TokenLogprobs:
    """Log-probabilities of the raw logits, per sampled token: [B] per step, [B, steps] over a chunk."""

    chosen: Array  # f32, the sampled token's
    top_ids: Array  # int32 [..., k], the k most likely tokens
    top: Array  # f32 [..., k], their logprobs


# -- pure functions on logits [B, V] --------------------------------------------------------------------


def apply_penalties(logits: Array, counts: TokenCounts, rows: SamplingRows) -> Array:
    """Repetition (HF: over prompt and output), then presence and frequency (OpenAI: over the output)."""
    generated = counts.generated.astype(jnp.float32)  # [B, V]
    seen = counts.prompt | (counts.generated > 0)  # [B, V]
    rep = rows.repetition_penalty[:, None]  # [B, 1]
    logits = jnp.where(seen, jnp.where(logits < 0, logits * rep, logits / rep), logits)
    presence = (counts.generated > 0).astype(jnp.float32)
    return logits - rows.presence_penalty[:, None] * presence - rows.frequency_penalty[:, None] * generated


def top_k_filter(logits: Array, k: int | Array, width: int | None = None) -> Array:
    """Keep the k largest logits [B, V] per row (ties with the k-th kept), set the rest to -inf.

    k is one int for every row, or [B] (0 or >= V: keep all), found within the top `width` (>= every k).
    """
    v = logits.shape[-1]
    if isinstance(k, int):
        if k <= 0 or k >= v:
            return logits
        kth = jax.lax.top_k(logits, k)[0][:, -1:]  # [B, 1]
    else:
        top = jax.lax.top_k(logits, min(width, v))[0]  # [B, width]
        kth = jnp.take_along_axis(top, jnp.clip(k - 1, 0, top.shape[-1] - 1)[:, None], axis=-1)  # [B, 1]
        kth = jnp.where(((k <= 0) | (k >= v))[:, None], -jnp.inf, kth)
    return jnp.where(logits < kth, -jnp.inf, logits)


def top_p_filter(logits: Array, p: float | Array) -> Array:
    """Keep the smallest set of tokens whose probability mass reaches p (at least one), per row [B, V].

    A token is kept when the mass of the tokens ranked strictly above it is below p; p is one float or [B]
    (1: keep all).
    """
    if isinstance(p, (int, float)) and p >= 1.0:
        return logits
    p = jnp.asarray(p, jnp.float32).reshape(-1, 1)  # [B or 1, 1]
    order = jnp.argsort(-logits, axis=-1)  # [B, V], descending
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)  # [B, V]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_above = jnp.cumsum(probs, axis=-1) - probs  # [B, V]
    keep_sorted = (mass_above < p) | (p >= 1)  # rounding must not drop the tail when the filter is off
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
    return jnp.where(keep, logits, -jnp.inf)


def min_p_filter(logits: Array, min_p: float | Array) -> Array:
    """Drop tokens whose probability is below min_p times the row's top probability (HF `MinPLogitsWarper`);
    logits [B, V], min_p one float or [B]."""
    probs = jax.nn.softmax(logits, axis=-1)  # [B, V]
    floor = jnp.asarray(min_p, jnp.float32).reshape(-1, 1) * jnp.max(probs, axis=-1, keepdims=True)  # [B, 1]
    return jnp.where(probs < floor, -jnp.inf, logits)


def token_logprobs(logits: Array, tokens: Array, k: int) -> TokenLogprobs:
    """The logprobs of tokens [B] under logits [B, V], and the k largest (ids and values)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, V]
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]  # [B]
    if k == 0:
        b = logits.shape[0]
        return TokenLogprobs(chosen, jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0), jnp.float32))
    top, ids = jax.lax.top_k(logp, k)  # [B, k]
    return TokenLogprobs(chosen, ids.astype(jnp.int32), top)


def sample_rows(
    logits: Array,
    keys: Array,
    positions: Array,
    rows: SamplingRows,
    plan: SamplingPlan,
    counts: TokenCounts | None = None,
) -> tuple[Array, TokenLogprobs | None]:
    """Next tokens [B] int32 from logits [B, V], each row with its own values, and their logprobs (None
    unless the plan asks). keys [B] and positions [B] (the position of the logits' token) seed the draws.
    A row whose logits are not all finite gets `NON_FINITE`."""
    raw = logits.astype(jnp.float32)
    finite = jnp.isfinite(raw).all(axis=-1)  # [B]: one reduction over V per row, beside the argmax
    x = apply_penalties(raw, counts, rows) if plan.penalties else raw
    tokens = jnp.argmax(x, axis=-1).astype(jnp.int32)  # [B]
    if plan.random:
        t = rows.temperature[:, None]  # [B, 1]
        x = x / jnp.where(t > 0, t, 1.0)
        if plan.top_k:
            x = top_k_filter(x, rows.top_k, plan.top_k)
        if plan.top_p:
            x = top_p_filter(x, rows.top_p)
        if plan.min_p:
            x = min_p_filter(x, rows.min_p)
        step_keys = jax.vmap(jax.random.fold_in)(keys, positions)  # [B]
        drawn = jax.vmap(jax.random.categorical)(step_keys, x).astype(jnp.int32)  # [B]
        tokens = jnp.where(rows.temperature > 0, drawn, tokens)
    lp = token_logprobs(raw, tokens, plan.logprobs) if plan.logprobs is not None else None
    return jnp.where(finite, tokens, NON_FINITE), lp


def sample(logits: Array, key: Array, params: SamplingParams) -> Array:
    """Next tokens [B] int32 from logits [B, V] for a batch that shares `params`, one key for the batch; a
    row whose logits are not all finite gets `NON_FINITE`. Penalties read the token history, which only the
    engine's decode state carries (`sample_rows`)."""
    if params.penalized:
        raise ValueError("penalties need the token history: sample with sample_rows and TokenCounts")
    finite = jnp.isfinite(logits).all(axis=-1)  # [B]
    if params.greedy:
        return jnp.where(finite, jnp.argmax(logits, axis=-1).astype(jnp.int32), NON_FINITE)
    logits = logits.astype(jnp.float32) / params.temperature
    logits = top_k_filter(logits, params.top_k)
    logits = top_p_filter(logits, params.top_p)
    if params.min_p > 0:
        logits = min_p_filter(logits, params.min_p)
    return jnp.where(finite, jax.random.categorical(key, logits, axis=-1).astype(jnp.int32), NON_FINITE)

"""Prefill, decode steps and the on-device generation loop.

The generation loop runs on the device in fixed-length chunks: one jitted call runs `chunk` decode
steps in a `lax.scan`, samples inside, and masks sequences that already emitted an end token. The
host syncs once per chunk (to stream the chunk's tokens and to stop when every sequence is done),
never once per token.

All steps are pure functions of (params, state): the cache is donated and returned.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdecode.cache import KVCache
from jaxdecode.looped_model import LoopedForward, default_loop_mode
from jaxdecode.model import Hook, Transformer
from jaxdecode.sampling import (
    NON_FINITE,
    REQUEST_FIELDS,
    SEED_LIMIT,
    SamplingParams,
    SamplingPlan,
    SamplingRows,
    TokenCounts,
    TokenLogprobs,
    row_keys,
    sample_rows,
)
from jaxdecode.tp import TPForward
from jaxdecode.weights.checks import WeightsError

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclass
class DecodeState:
    """Attributes:
    cache: the KV cache (a KVCache, or its packed form when layers are looped).
    tokens: [B] int32, the last sampled token of each sequence (the next step's input).
    positions: [B] int32, the position that token is written at.
    done: [B] bool, whether the sequence has emitted an end token.
    key: [B] PRNG keys, one per sequence (`sampling.row_keys`); one key for the batch is split per row.
    rows: each sequence's sampling values (`SamplingRows`); None: the chunk's static `SamplingParams` for all.
    counts: the token history penalties read (`TokenCounts`); None when no row is penalized.
    """

    cache: object
    tokens: Array
    positions: Array
    done: Array
    key: Array
    rows: SamplingRows | None = None
    counts: TokenCounts | None = None


@dataclass
class Chunk:
    """What `Engine.generate_chunks` yields: new tokens [B, n] (-1 after a sequence ended) and, when a row asked
    for them, their logprobs (`TokenLogprobs` of numpy arrays: [B, n], top ones [B, n, k])."""

    tokens: np.ndarray
    logprobs: TokenLogprobs | None = None


@dataclass
class Generation:
    """What `Engine.generate` returns: new tokens per sequence and timings. When a row asks for logprobs, each
    new token's raw logprob per sequence, and all of them as `TokenLogprobs` [B, new] (with the top ones
    [B, new, k]; columns past a sequence's end token hold nothing meaningful)."""

    token_ids: list[list[int]]
    prefill_s: float
    decode_s: float
    decode_steps: int
    compile_s: float = 0.0
    chunks: list[np.ndarray] = field(default_factory=list, repr=False)
    logprobs: list[list[float]] | None = None
    top_logprobs: TokenLogprobs | None = field(default=None, repr=False)

    @property
    def decode_tok_s(self) -> float:
        """Decode steps per second per sequence (the first token comes from prefill)."""
        return self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0


class Engine:
    """Runs a Transformer: batched prefill, then chunked on-device decoding.

    `loop_layers=True` (the default) applies the kernel-looping pass to the forward function, so the
    layers run as one `lax.scan` over stacked weights; False keeps them unrolled, for comparison.
    `loop_mode` picks how the scan reads the stacks (`looped_model.LOOP_MODES`); None: in place
    through kernels on a GPU, sliced by the scan elsewhere.
    `tp` > 1 splits the model over that many devices (tensor parallelism, `jaxdecode.tp`); a built
    `tp.TPForward` may be passed instead (then `model` may be None and its loop and kernel settings apply).
    In the in-place loop mode, `hooks` {`model.Hook`: function or None} replaces or turns off the kernel
    hooks of the model's named calls (`hooks.kernel_calls`; the defaults are
    `hooks.KERNEL_CALLS`), and `stacked_dot` replaces the dot hook (`hooks.kernel_stacked_dot`):
    a benchmark's variants are these arguments.
    """

    def __init__(
        self,
        model: Transformer | None,
        *,
        loop_layers: bool = True,
        cache_dtype=None,
        loop_mode: str | None = None,
        tp: int | TPForward = 1,
        hooks: Mapping[Hook | str, Callable | None] | None = None,
        stacked_dot: Callable | None = None,
    ):
        # the forward the engine runs: over tp devices, or looped on one, or (both None) the model as written
        self.tp_forward: TPForward | None = None
        self.looped_forward: LoopedForward | None = None
        if not (isinstance(tp, int) and tp == 1):
            self.tp_forward = (
                tp
                if isinstance(tp, TPForward)
                else TPForward.from_model(
                    model,
                    tp,
                    loop_layers=loop_layers,
                    loop_mode=loop_mode or default_loop_mode(),
                    hooks=hooks,
                    stacked_dot=stacked_dot,
                )
            )
            self.cfg, self.loop_layers, self.graphdef = (
                self.tp_forward.cfg,
                self.tp_forward.loop_layers,
                self.tp_forward.graphdef,
            )
            self.cache_dtype, self.params = cache_dtype or self.tp_forward.dtype, self.tp_forward.step_params
        else:
            self._init_one_device(model, loop_layers, cache_dtype, loop_mode, hooks, stacked_dot)
        self._prefill = jax.jit(self._prefill_fn, static_argnames=("sampling",), donate_argnums=1)
        # (params, state, done_ids, pad; steps, sampling) -> (state, tokens [B, steps]): what `generate` runs
        self.decode_chunk = jax.jit(self._chunk_fn, static_argnames=("steps", "sampling"), donate_argnums=1)
        self._executables: dict = {}  # ahead-of-time compiled steps, so that timings exclude compilation

    @property
    def loop_mode(self) -> str:
        """How the layers run: a `looped_model.LOOP_MODES` entry, or "unrolled"."""
        if not self.loop_layers:
            return "unrolled"
        return (self.tp_forward or self.looped_forward).mode

    @property
    def tp(self) -> int:
        """Devices the model is split over (1: not split)."""
        return self.tp_forward.tp if self.tp_forward is not None else 1

    def _init_one_device(self, model: Transformer, loop_layers: bool, cache_dtype, loop_mode, hooks, stacked_dot):
        self.cfg = model.cfg
        self.loop_layers = loop_layers
        self.graphdef, params = nnx.split(model)
        self.cache_dtype = cache_dtype or model.embed_tokens.dtype
        if loop_layers:
            mode = loop_mode or default_loop_mode()
            looped = LoopedForward(self.graphdef, params, self.cfg, mode=mode, hooks=hooks, stacked_dot=stacked_dot)
            if looped.finds_runs():
                self.looped_forward, self.params = looped, looped.pack_params(params)
                return
            self.loop_layers = False  # no two consecutive layers alike (one layer, or all quantized differently)
        self.params = params

    def _compiled(self, jitted, *args, timings: dict, **static):
        """The compiled executable of `jitted` for these argument shapes (compiled once, timed)."""
        leaves = tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(args))
        key = (id(jitted), jax.tree.structure(args), leaves, tuple(sorted(static.items())))
        if key not in self._executables:
            start = time.perf_counter()
            self._executables[key] = jitted.lower(*args, **static).compile()
            timings["compile_s"] = timings.get("compile_s", 0.0) + time.perf_counter() - start
        return self._executables[key]

    def _compile_steps(self, prefill_args, *, sampling: SamplingPlan, chunk: int | None, timings: dict):
        """(compiled prefill, compiled decode chunk of `chunk` steps or None), compiled at once.

        The two compile in two threads (`compile_at_once`), so the first call waits for the longer of
        the two rather than their sum. The chunk compiles from
        the prefill's output shapes (`jax.eval_shape`). With tensor parallelism the chunk's state carries
        shardings that shapes alone do not, so there it is left to the caller (None).
        """
        start = time.perf_counter()
        scratch: dict = {}
        prefill = lambda: self._compiled(self._prefill, *prefill_args, timings=scratch, sampling=sampling)  # noqa: E731
        if chunk is None or self.tp_forward is not None:
            compiled = prefill(), None
        else:
            state, _ = jax.eval_shape(functools.partial(self._prefill, sampling=sampling), *prefill_args)
            pad = jax.ShapeDtypeStruct((), jnp.int32)
            step = lambda: self._compiled(
                self.decode_chunk,
                prefill_args[0],
                state,
                prefill_args[-1],
                pad,  # noqa: E731
                timings=scratch,
                steps=chunk,
                sampling=sampling,
            )
            compiled = tuple(compile_at_once(prefill, step))
        if scratch:  # something was compiled (not all cached)
            timings["compile_s"] = timings.get("compile_s", 0.0) + time.perf_counter() - start
        return compiled

    # -- pure functions -------------------------------------------------------------------------

    def forward(self, params, tokens: Array, positions: Array, cache):
        """Logits [B, T, V] and the new cache, for tokens and positions [B, T]."""
        if self.tp_forward is not None:
            return self.tp_forward.forward(params, tokens, positions, cache)
        if self.looped_forward is not None:
            return self.looped_forward.forward(params, tokens, positions, cache)
        logits, k, v = nnx.merge(self.graphdef, params)(tokens, positions, cache.k, cache.v)
        return logits, KVCache(k, v)

    def new_cache(self, batch: int, length: int):
        if self.tp_forward is not None:
            return self.tp_forward.new_cache(batch, length, self.cache_dtype)
        cache = KVCache.init(self.cfg, batch, length, self.cache_dtype)
        return self.looped_forward.pack_cache(cache) if self.looped_forward is not None else cache

    def _prefill_fn(self, params, cache, tokens, lengths, keys, rows, done_ids, sampling: SamplingPlan):
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))  # [B, T]
        logits, cache = self.forward(params, tokens, positions, cache)  # [B, T, V]
        last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, V]
        counts = TokenCounts.of_prompts(tokens, lengths, last.shape[-1]) if sampling.penalties else None
        first, logprobs = sample_rows(last, keys, lengths - 1, rows, sampling, counts)  # [B]
        if counts is not None:
            counts = counts.add(first, jnp.ones((b,), bool))
        done = (first == NON_FINITE) | jnp.isin(first, done_ids)  # a refused row ends; the host raises
        return DecodeState(cache, first, lengths.astype(jnp.int32), done, keys, rows, counts), logprobs

    def _chunk_fn(
        self, params, state: DecodeState, done_ids, pad_id, *, steps: int, sampling: SamplingPlan | SamplingParams
    ):
        b = state.tokens.shape[0]
        plan, rows, keys = sampling, state.rows, state.key
        if isinstance(sampling, SamplingParams):  # one setting for the whole batch, no rows in the state
            plan, rows = SamplingPlan.of([sampling]), SamplingRows.of([sampling] * b)
        if plan.penalties and state.counts is None:
            raise ValueError("penalties need the token counts that Engine.generate's prefill puts in the state")
        if keys.ndim == 0:
            keys = jax.random.split(keys, b)  # [B]

        def step(state: DecodeState, _):
            logits, cache = self.forward(params, state.tokens[:, None], state.positions[:, None], state.cache)
            nxt, logprobs = sample_rows(logits[:, 0], keys, state.positions, rows, plan, state.counts)  # [B]
            counts = state.counts.add(nxt, ~state.done) if plan.penalties else state.counts
            nxt = jnp.where(state.done, pad_id, nxt)
            done = state.done | (nxt == NON_FINITE) | jnp.isin(nxt, done_ids)
            new = DecodeState(cache, nxt, state.positions + 1, done, state.key, state.rows, counts)
            return new, (nxt, logprobs)

        state, (tokens, logprobs) = jax.lax.scan(step, state, None, length=steps)
        if logprobs is None:
            return state, tokens.T  # [B, steps]
        return state, tokens.T, jax.tree.map(lambda a: jnp.moveaxis(a, 0, 1), logprobs)  # [B, steps, ...]

    # -- host loop --------------------------------------------------------------------------------

    def generate_chunks(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int = 64,
        sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        seed: int = 0,
        eos_ids: Sequence[int] = (),
        chunk: int = 16,
        timings: dict | None = None,
    ) -> Iterator[Chunk]:
        """Yield new tokens [B, n] chunk by chunk (`Chunk`, with logprobs where asked); -1 marks positions
        after a sequence ended. A chunk is `chunk` decode steps in one on-device loop and one host sync:
        16 keeps the sync's cost small against 16 steps on a GPU, while a CPU's 16 tokens still arrive
        a few times a second, so the text reads as a stream (the chat REPL asks for 4, for Ctrl-C).

        `sampling` is one `SamplingParams` for every prompt or one per prompt (their per-token fields; the
        request fields, `sampling.REQUEST_FIELDS`, are `jaxdecode.LLM`'s). Rows without a seed of their own
        draw from `seed` and their index. The first chunk holds the one token sampled from the prefill
        logits. If `timings` is a dict, it receives compile_s (ahead-of-time compilation, 0 when cached),
        prefill_s, decode_s and decode_steps; the last three exclude compilation.

        Logits that are not all finite (finite weights whose forward overflows) raise a `WeightsError` when
        their chunk reaches the host: no token is sampled from them.
        """
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or not 0 <= seed < SEED_LIMIT:
            raise ValueError(f"seed must be an integer in [0, 2**32) (JAX's PRNG takes 32-bit seeds), got {seed!r}")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt: every prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        lengths = np.array([len(p) for p in prompts], np.int32)
        longest = int(lengths.max())
        if longest + max_new_tokens > self.cfg.max_seq_len:
            raise ValueError(
                f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds the model's context of "
                f"{self.cfg.max_seq_len} tokens"
            )
        params = self._row_params(sampling, len(prompts))
        plan = SamplingPlan.of(params)
        if plan.logprobs is not None and plan.logprobs > self.cfg.vocab_size:
            raise ValueError(f"logprobs={plan.logprobs} exceeds the vocabulary of {self.cfg.vocab_size} tokens")
        steps = max_new_tokens - 1
        chunk = max(1, min(chunk, steps)) if steps else 1
        n_chunks = -(-steps // chunk)
        # Bucket the prompt and cache lengths so that nearby sizes share one compilation.
        t_pad = _round_up(longest, 16)
        cache_len = max(_round_up(longest + n_chunks * chunk + 1, 64), t_pad)
        tokens = np.zeros((len(prompts), t_pad), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        done_ids = jnp.asarray(list(eos_ids) or [-2], jnp.int32)
        timings = {} if timings is None else timings

        timings["compile_s"] = 0.0
        cache = self.new_cache(len(prompts), cache_len)
        keys, rows = row_keys(params, seed), SamplingRows.of(params)
        args = (self.params, cache, jnp.asarray(tokens), jnp.asarray(lengths), keys, rows, done_ids)
        prefill, step_chunk = self._compile_steps(
            args, sampling=plan, chunk=chunk if n_chunks else None, timings=timings
        )
        start = time.perf_counter()
        state, logprobs = prefill(*args)
        first = Chunk(np.asarray(state.tokens)[:, None], _on_host(logprobs, lambda a: a[:, None]))
        timings["prefill_s"] = time.perf_counter() - start
        self._refuse_non_finite(first.tokens, 0)
        yield first
        done = np.asarray(state.done)
        pad = jnp.int32(-1)
        if n_chunks and step_chunk is None:  # tensor parallel: compiled from the sharded state
            step_chunk = self._compiled(
                self.decode_chunk, self.params, state, done_ids, pad, timings=timings, steps=chunk, sampling=plan
            )
        start = time.perf_counter()
        decoded = 0
        for _ in range(n_chunks):
            if done.all():
                break
            state, new, *logprobs = step_chunk(self.params, state, done_ids, pad)
            keep = steps - decoded
            new = np.asarray(new)[:, :keep]
            self._refuse_non_finite(new, 1 + decoded)
            decoded += new.shape[1]
            done = np.asarray(state.done)
            timings["decode_s"] = time.perf_counter() - start
            timings["decode_steps"] = decoded
            yield Chunk(new, _on_host(logprobs[0] if logprobs else None, lambda a: a[:, :keep]))
        timings.setdefault("decode_s", 0.0)
        timings.setdefault("decode_steps", 0)

    def generate_stream(self, prompts: Sequence[Sequence[int]], **kwargs) -> Iterator[np.ndarray]:
        """Yield new tokens [B, n] chunk by chunk; -1 marks positions after a sequence ended. Takes the
        arguments of `generate_chunks` (max_new_tokens, sampling, seed, eos_ids, chunk, timings)."""
        for c in self.generate_chunks(prompts, **kwargs):
            yield c.tokens

    def generate(self, prompts: Sequence[Sequence[int]], **kwargs) -> Generation:
        """Run `generate_chunks` to the end; tokens after an end token are dropped (the end token is kept)."""
        timings: dict = {}
        chunks = list(self.generate_chunks(prompts, timings=timings, **kwargs))
        all_tokens = np.concatenate([c.tokens for c in chunks], axis=1)  # [B, new]
        ids = [[int(t) for t in row if t >= 0] for row in all_tokens]
        logprobs = top = None
        if chunks[0].logprobs is not None:
            top = jax.tree.map(lambda *a: np.concatenate(a, axis=1), *[c.logprobs for c in chunks])
            logprobs = [[float(x) for x, t in zip(lp, row) if t >= 0] for lp, row in zip(top.chosen, all_tokens)]
        return Generation(
            ids,
            timings["prefill_s"],
            timings["decode_s"],
            timings["decode_steps"],
            compile_s=timings["compile_s"],
            chunks=[c.tokens for c in chunks],
            logprobs=logprobs,
            top_logprobs=top,
        )

    def _refuse_non_finite(self, tokens: np.ndarray, first: int) -> None:
        """WeightsError if tokens [B, n] (each sequence's new tokens from index `first`, 0 being the prefill's)
        hold `NON_FINITE`; the message counts new tokens from 1."""
        bad = tokens == NON_FINITE  # [B, n]
        if bad.any():
            step = int(np.argmax(bad.any(axis=0)))
            row = int(np.argmax(bad[:, step]))
            raise WeightsError(
                f"the model's logits are not finite (NaN or inf) at new token {first + step + 1} of sequence {row}: "
                f"its weights are finite but its forward overflows in {jnp.dtype(self.cache_dtype).name} "
                "(weights too large for the arithmetic); no token was sampled from them"
            )

    @staticmethod
    def _row_params(sampling: SamplingParams | Sequence[SamplingParams], batch: int) -> list[SamplingParams]:
        """One SamplingParams per prompt, checked: per-token settings only (the request ones are LLM's)."""
        rows = [sampling] * batch if isinstance(sampling, SamplingParams) else list(sampling)
        if len(rows) != batch:
            raise ValueError(f"{len(rows)} SamplingParams for {batch} prompts: pass one, or one per prompt")
        defaults = SamplingParams()
        for i, p in enumerate(rows):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling[{i}] is a {type(p).__name__}, not a SamplingParams")
            if fields := [f for f in REQUEST_FIELDS if getattr(p, f) != getattr(defaults, f)]:
                raise ValueError(
                    f"sampling[{i}] sets {', '.join(fields)}: request settings that jaxdecode.LLM applies; "
                    "Engine.generate takes max_new_tokens= and eos_ids="
                )
        return rows

    def forward_logits(self, tokens: np.ndarray) -> np.ndarray:
        """Logits [B, T, V] of a full forward pass over tokens [B, T] (no cache reuse): for tests."""
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        logits, _ = jax.jit(self.forward)(self.params, jnp.asarray(tokens), positions, self.new_cache(b, t))
        return np.asarray(logits)


def compile_at_once(*jobs):
    """The results of the compile `jobs` (functions of no arguments), run in one thread each: XLA's
    compiler and the kernels' compilers release the GIL, so this takes about as long as the longest."""
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(job) for job in jobs]
        return [f.result() for f in futures]


def _on_host(logprobs: TokenLogprobs | None, index) -> TokenLogprobs | None:
    """Device logprobs as numpy arrays, each indexed by `index` (a step axis added, or the chunk trimmed)."""
    return None if logprobs is None else jax.tree.map(lambda a: index(np.asarray(a)), logprobs)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def default_dtype():
    """bf16 on accelerators, f32 on the CPU."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16

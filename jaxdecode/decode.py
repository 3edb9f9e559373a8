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
from jaxdecode.sampling import SamplingParams, sample
from jaxdecode.tp import TPForward

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclass
class DecodeState:
    """Attributes:
    cache: the KV cache (a KVCache, or its packed form when layers are looped).
    tokens: [B] int32, the last sampled token of each sequence (the next step's input).
    positions: [B] int32, the position that token is written at.
    done: [B] bool, whether the sequence has emitted an end token.
    key: the PRNG key for sampling.
    """

    cache: object
    tokens: Array
    positions: Array
    done: Array
    key: Array


@dataclass
class Generation:
    """What `Engine.generate` returns: new tokens per sequence and timings."""

    token_ids: list[list[int]]
    prefill_s: float
    decode_s: float
    decode_steps: int
    compile_s: float = 0.0
    chunks: list[np.ndarray] = field(default_factory=list, repr=False)

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
    hooks of the model's named calls (`looped_model.kernel_calls`; the defaults are
    `looped_model.KERNEL_CALLS`), and `stacked_dot` replaces the dot hook (`looped_model.kernel_stacked_dot`):
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

    def _compile_steps(self, prefill_args, *, sampling: SamplingParams, chunk: int | None, timings: dict):
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

    def _prefill_fn(self, params, cache, tokens, lengths, key, done_ids, sampling: SamplingParams):
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))  # [B, T]
        logits, cache = self.forward(params, tokens, positions, cache)  # [B, T, V]
        last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, V]
        key, sub = jax.random.split(key)
        first = sample(last, sub, sampling)  # [B]
        done = jnp.isin(first, done_ids)
        return DecodeState(cache, first, lengths.astype(jnp.int32), done, key), last

    def _chunk_fn(self, params, state: DecodeState, done_ids, pad_id, *, steps: int, sampling: SamplingParams):
        def step(state: DecodeState, _):
            logits, cache = self.forward(params, state.tokens[:, None], state.positions[:, None], state.cache)
            key, sub = jax.random.split(state.key)
            nxt = sample(logits[:, 0], sub, sampling)  # [B]
            nxt = jnp.where(state.done, pad_id, nxt)
            done = state.done | jnp.isin(nxt, done_ids)
            return DecodeState(cache, nxt, state.positions + 1, done, key), nxt

        state, tokens = jax.lax.scan(step, state, None, length=steps)
        return state, tokens.T  # [B, steps]

    # -- host loop --------------------------------------------------------------------------------

    def generate_stream(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int = 64,
        sampling: SamplingParams = SamplingParams(),
        seed: int = 0,
        eos_ids: Sequence[int] = (),
        chunk: int = 16,
        timings: dict | None = None,
    ) -> Iterator[np.ndarray]:
        """Yield new tokens [B, n] chunk by chunk; -1 marks positions after a sequence ended.

        The first chunk holds the one token sampled from the prefill logits. If `timings` is a dict,
        it receives compile_s (ahead-of-time compilation, 0 when cached), prefill_s, decode_s and
        decode_steps; the last three exclude compilation.
        """
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
        args = (self.params, cache, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(seed), done_ids)
        prefill, step_chunk = self._compile_steps(
            args, sampling=sampling, chunk=chunk if n_chunks else None, timings=timings
        )
        start = time.perf_counter()
        state, _ = prefill(*args)
        first = np.asarray(state.tokens)[:, None]
        timings["prefill_s"] = time.perf_counter() - start
        yield first
        done = np.asarray(state.done)
        pad = jnp.int32(-1)
        if n_chunks and step_chunk is None:  # tensor parallel: compiled from the sharded state
            step_chunk = self._compiled(
                self.decode_chunk, self.params, state, done_ids, pad, timings=timings, steps=chunk, sampling=sampling
            )
        start = time.perf_counter()
        decoded = 0
        for _ in range(n_chunks):
            if done.all():
                break
            state, new = step_chunk(self.params, state, done_ids, pad)
            new = np.asarray(new)[:, : steps - decoded]
            decoded += new.shape[1]
            done = np.asarray(state.done)
            timings["decode_s"] = time.perf_counter() - start
            timings["decode_steps"] = decoded
            yield new
        timings.setdefault("decode_s", 0.0)
        timings.setdefault("decode_steps", 0)

    def generate(self, prompts: Sequence[Sequence[int]], **kwargs) -> Generation:
        """Run `generate_stream` to the end; tokens after an end token are dropped (the end token is kept)."""
        timings: dict = {}
        chunks = list(self.generate_stream(prompts, timings=timings, **kwargs))
        all_tokens = np.concatenate(chunks, axis=1)  # [B, new]
        ids = [[int(t) for t in row if t >= 0] for row in all_tokens]
        return Generation(
            ids,
            timings["prefill_s"],
            timings["decode_s"],
            timings["decode_steps"],
            compile_s=timings["compile_s"],
            chunks=chunks,
        )

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


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def default_dtype():
    """bf16 on accelerators, f32 on the CPU."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16

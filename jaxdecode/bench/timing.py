"""One timed run of one engine, and what every timed system shares: the `Timing` record, the cache
length and chunking rules, the read ceiling and the token agreement.

The HF peers (`jaxdecode.bench.peers`) fill the same `Timing` with the same chunking and cache length,
so that their rows compare with ours.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.decode import DecodeState, Engine, compile_at_once
from jaxdecode.sampling import SamplingParams, sample

GREEDY = SamplingParams()


@dataclass
class Timing:
    """A first (compiling) run and a second, timed run of prefill + decode at one config."""

    first_call_s: float
    prefill_s: float
    decode_s: float
    steps: int  # decode steps in the timed run
    tokens: np.ndarray = field(repr=False)  # [B, 1 + steps]: the prefill's token, then the decoded ones


def cache_length(context: int, prompt_len: int, steps: int) -> int:
    """Rows of our cache (and HF's static cache): the prefix, the prompt and every step, rounded up to 64."""
    return -(-(context + prompt_len + steps) // 64) * 64


def chunking(steps: int, chunk: int = 32) -> tuple[int, int]:
    """(chunk, number of chunks) for `steps` decode steps run in on-device chunks."""
    chunk = max(1, min(chunk, steps))
    return chunk, -(-steps // chunk)


def read_ceiling_gb_s(gib: float = 4, repeats: int = 10) -> float:
    """HBM (or RAM) read bandwidth: a float32 sum over `gib` GiB of bf16, after a warm-up call."""
    x = jnp.ones((int(gib * 2**30) // 2,), jnp.bfloat16)
    total = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    total(x).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        out = total(x)
    out.block_until_ready()
    return x.nbytes * repeats / (time.perf_counter() - start) / 1e9


def tokens_agree(tokens: np.ndarray, ours: np.ndarray) -> int:
    """Leading tokens equal in every sequence of tokens [B, n] and ours [B, m]."""
    n = min(tokens.shape[1], ours.shape[1])
    same = np.all(tokens[:, :n] == ours[:, :n], axis=0)  # [n]
    return int(n if same.all() else np.argmin(same))


# Each engine keeps {(batch, prompt, cache length, chunk): [compiled prefill, compiled chunk]} across calls
# in this attribute. (A module-level WeakKeyDictionary leaked engines: its values close over their key.)
COMPILED_ATTR = "_bench_compiled"


def compiled_steps(engine: Engine) -> list:
    """Every step `time_engine` compiled for this engine: executables on one device (they answer
    `memory_analysis()`), jitted functions under tensor parallelism."""
    return [step for steps in engine.__dict__.get(COMPILED_ATTR, {}).values() for step in steps]


def time_engine(engine: Engine, prompts: np.ndarray, *, context: int, steps: int, chunk: int = 32) -> Timing:
    """Prefill prompts [B, P] at positions context.. over a zero prefix, then greedy-decode in chunks.

    The decode chunks are the engine's own jitted chunk function (`Engine.decode_chunk`, the same step
    `generate` runs); only the prefill differs from `generate`, which always starts at position 0.
    """
    b, p = prompts.shape
    chunk, n_chunks = chunking(steps, chunk)
    cache_len = cache_length(context, p, n_chunks * chunk)

    def prefill_fn(params, cache, tokens, start):
        positions = start + jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))  # [B, P]
        logits, cache = engine.forward(params, tokens, positions, cache)  # [B, P, V]
        key = jax.random.key(0)
        first = sample(logits[:, -1], key, GREEDY)  # [B]
        return DecodeState(cache, first, positions[:, -1] + 1, jnp.zeros((b,), bool), key)

    prefill = jax.jit(prefill_fn, donate_argnums=1)
    new_cache = jax.jit(engine.new_cache, static_argnums=(0, 1))  # in one jit: no per-layer copies to stack
    tokens, done_ids, pad = jnp.asarray(prompts, jnp.int32), jnp.asarray([-2], jnp.int32), jnp.int32(-1)
    compiled = engine.__dict__.setdefault(COMPILED_ATTR, {}).setdefault(
        (b, p, cache_len, chunk), []
    )  # [prefill, chunk]

    def compile_both(cache):
        """Prefill and the decode chunk compiled at once, in two threads (as `Engine.generate` does);
        with tensor parallelism the state's shardings come from running prefill, so jit compiles them."""
        if engine.tp > 1:
            compiled.extend(
                [
                    prefill,
                    lambda params, state, done_ids, pad: engine.decode_chunk(
                        params, state, done_ids, pad, steps=chunk, sampling=GREEDY
                    ),
                ]
            )
            return
        start = jnp.int32(context)
        state = jax.eval_shape(prefill_fn, engine.params, cache, tokens, start)
        spec = jax.ShapeDtypeStruct((), jnp.int32)
        compiled.extend(
            compile_at_once(
                lambda: prefill.lower(engine.params, cache, tokens, start).compile(),
                lambda: engine.decode_chunk.lower(
                    engine.params, state, done_ids, spec, steps=chunk, sampling=GREEDY
                ).compile(),
            )
        )

    def once(chunks: int):
        cache = jax.block_until_ready(new_cache(b, cache_len))
        start = time.perf_counter()
        if not compiled:
            compile_both(cache)
        state = compiled[0](engine.params, cache, tokens, jnp.int32(context))
        out = [np.asarray(state.tokens)[:, None]]
        mid = time.perf_counter()
        for _ in range(chunks):
            state, new = compiled[1](engine.params, state, done_ids, pad)
            out.append(np.asarray(new))
        return mid - start, time.perf_counter() - mid, np.concatenate(out, axis=1)

    start = time.perf_counter()
    once(1)
    first_call = time.perf_counter() - start
    prefill_s, decode_s, toks = once(n_chunks)
    return Timing(first_call, prefill_s, decode_s, n_chunks * chunk, toks[:, : 1 + steps])


def loop_mode(engine: Engine) -> str:
    """How the engine runs its layers: a `looped_model.LOOP_MODES` entry, or "unrolled"."""
    return engine.loop_mode

"""The `qkv_attend` hook of the in-place looped decode (`hooks.kernel_qkv_attend`): the q·k·v GEMM's
raw partials, their epilogue kernel (`kernels.qkv_rope`) and the attention on q rows, against the unrolled
model; the cache stacks touched only by the two kernels; the cases where the hook declines."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.decode import Engine
from jaxdecode.hooks import kernel_qkv_attend
from jaxdecode.looping import StackedRef
from kernels.decode_attention import BlockSizes as AttentionBlocks
from kernels.flat_gemm_stream import StreamBlocks, partial_rows
from tests.test_inplace_loop import (
    ATOL,
    RTOL,
    _decode_step_jaxpr,
    _inplace_engine,
    _scan_body,
    biased_model,
    reference_qkv,
)


@pytest.fixture(scope="module", params=["tiny-gqa", "tiny-qwen2"])
def qkv_model(request):
    """GQA models without and with q/k/v biases."""
    return biased_model(request.param)


TILE = 16  # divides the tiny configs' widths (48, 16) and holds half a head (4)


@functools.partial(jax.jit, static_argnames="tile_n")
def split_partials(x, stacks, layer, *, tile_n=TILE):
    """A stand-in for the Stream-K kernel's raw output (the CPU has no Mosaic GPU): slots 0 and 1 hold
    x·W over the two halves of K (f32), slot 2 holds NaN and is never written. Returns [3, M, C] (M8 rows
    where the kernel pads x: `partial_rows`)."""
    m, k = x.shape
    m_rows = partial_rows(m)
    w = jnp.concatenate([jax.lax.dynamic_index_in_dim(s, layer, keepdims=False) for s in stacks], axis=1).astype(
        jnp.float32
    )  # [K, C]
    x32 = jnp.pad(x.astype(jnp.float32), ((0, m_rows - m), (0, 0)))
    halves = [x32[:, : k // 2] @ w[: k // 2], x32[:, k // 2 :] @ w[k // 2 :]]  # [M, C] each
    return jnp.stack(halves + [jnp.full((m_rows, w.shape[1]), jnp.nan)])


def reference_partials(x, stacks, layer, tile=TILE):
    """(partials, schedule stand-in) as `flat_gemm_stream.stream_partials` returns them, tiles of `tile`."""
    columns = sum(s.shape[2] for s in stacks)
    written = np.zeros((3, columns // tile), bool)
    written[:2] = True
    return split_partials(x, stacks, layer, tile_n=tile), types.SimpleNamespace(written=lambda: written)


interpret_qkv_attend = functools.partial(
    kernel_qkv_attend,
    impl="stream",
    partials=reference_partials,
    gemm_blocks=StreamBlocks(tile_n=TILE, tile_k=16),
    attention_blocks=AttentionBlocks(16, 2),
    epilogue_backend="triton",  # the tiny configs (H 16, block_k 16) are below Mosaic GPU's tiles
    attention_backend="triton",
    interpret=True,
)


def _engine(model, qkv_attend=interpret_qkv_attend):
    return _inplace_engine(model, qkv=reference_qkv, qkv_attend=qkv_attend)


def test_engine_qkv_attend_equals_unrolled(qkv_model):
    """Greedy decode (one token per step: the hook runs; prefill's 7 tokens: it declines and the inner
    hooks run) equals the unrolled model, with and without q/k/v biases; and the prefill logits."""
    tokens = np.random.default_rng(0).integers(0, qkv_model.cfg.vocab_size, (2, 7))
    unrolled = Engine(qkv_model, loop_layers=False)
    engine = _engine(qkv_model)
    np.testing.assert_allclose(engine.forward_logits(tokens), unrolled.forward_logits(tokens), rtol=RTOL, atol=ATOL)
    prompts, kwargs = [[1, 2, 3, 4, 5], [7, 8, 9]], dict(max_new_tokens=8, chunk=4)
    assert engine.generate(prompts, **kwargs).token_ids == unrolled.generate(prompts, **kwargs).token_ids
    one = [[3, 1, 4, 1, 5, 9]]  # batch 1
    assert engine.generate(one, **kwargs).token_ids == unrolled.generate(one, **kwargs).token_ids


def test_decode_step_logits_equal_unrolled(qkv_model):
    """One decode step's logits after a prefill, through the hook, against the unrolled model."""
    cfg = qkv_model.cfg
    rng = np.random.default_rng(1)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 5)), jnp.int32)
    step = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 1)), jnp.int32)
    logits = []
    for engine in (Engine(qkv_model, loop_layers=False), _engine(qkv_model)):
        cache = engine.new_cache(2, 64)
        positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
        _, cache = engine.forward(engine.params, prompt, positions, cache)
        out, _ = engine.forward(engine.params, step, jnp.full((2, 1), 5, jnp.int32), cache)
        logits.append(np.asarray(out))
    np.testing.assert_allclose(logits[1], logits[0], rtol=RTOL, atol=ATOL)


def test_decode_step_runs_the_epilogue_kernel_and_no_cache_write_of_xla(qkv_model):
    """In the looped decode step the epilogue kernel and the rows attention run once per layer step, and
    XLA writes no cache row (no scatter or dynamic_update_slice into the 5-D stacks)."""
    body = _scan_body(_decode_step_jaxpr(_engine(qkv_model), batch=2))

    def names(jaxpr, found):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("jit", "pjit"):
                found.append(eqn.params["name"])
                names(eqn.params["jaxpr"].jaxpr, found)
            elif eqn.primitive.name in ("scatter", "dynamic_update_slice") and eqn.outvars[0].aval.ndim == 5:
                found.append("xla cache write")
        return found

    found = names(body, [])
    assert found.count("_qkv_rope_write") == 1 and found.count("decode_attention_sync_rows") == 1, found
    assert "xla cache write" not in found and "decode_attention_sync" not in found, found
    assert found.count("split_partials") == 1, found  # the three weight stacks in one GEMM call


def test_hook_declines():
    x = jnp.ones((2, 1, 48), jnp.bfloat16)
    k_stack = jnp.zeros((3, 2, 64, 2, 8), jnp.bfloat16)
    index = jnp.int32(1)
    cache = [StackedRef(k_stack, index, origin) for origin in ("k", "v")]
    ws = [StackedRef(jnp.ones((3, 48, n), jnp.bfloat16), index) for n in (48, 16, 16)]
    positions, cos = jnp.zeros((2, 1), jnp.int32), jnp.ones((2, 1, 8), jnp.float32)
    args = (x, *cache, positions, cos, cos, *ws)
    assert interpret_qkv_attend(*args) is not None
    if jax.default_backend() == "cpu":  # dispatch: XLA off the GPU
        assert kernel_qkv_attend(*args, partials=reference_partials) is None
    assert interpret_qkv_attend(jnp.ones((2, 3, 48), jnp.bfloat16), *args[1:]) is None  # T = 3 (prefill)
    assert interpret_qkv_attend(*args[:6], ws[0].stack[1], *ws[1:]) is None  # a weight that is not stacked
    assert interpret_qkv_attend(*args[:1], StackedRef(k_stack, index), *args[2:]) is None  # a cache not carried
    assert interpret_qkv_attend(x.astype(jnp.float32), *args[1:]) is None  # dtypes differ
    assert interpret_qkv_attend(*args, gemm_blocks=StreamBlocks(tile_n=32, tile_k=16)) is None  # 16 does not tile
    assert interpret_qkv_attend(*args, attention_blocks=AttentionBlocks(48, 2)) is None  # S = 64 is not whole blocks
    assert interpret_qkv_attend(*args, attention_backend="mosaic") is None  # H = 8: below Mosaic GPU's tiles
    with pytest.raises(ValueError, match="impl"):
        kernel_qkv_attend(*args, impl="triton")

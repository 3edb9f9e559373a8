"""Looped runs that read stacked inputs in place (`kernel_loop(..., stacked_dot=...)`): equal values,
no weight row copied out before a dot, fallbacks, and the engine's in-place mode."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

from jaxdecode.config import get_preset
from jaxdecode.decode import Engine
from jaxdecode.inplace import output_aliases
from jaxdecode.looped_model import LoopedForward, kernel_attention, kernel_stacked_dot, kernel_swiglu
from jaxdecode.looping import kernel_loop
from jaxdecode.model import init_random
from kernels.decode_attention import BlockSizes as AttentionBlocks
from kernels.flat_gemm import BlockSizes
from tests.test_looping import D, L, _inputs, decoder

RTOL = ATOL = 1e-5  # f32; the interpret-mode kernel sums K in tiles, so the order differs from XLA's dot
TINY_BLOCKS = BlockSizes(tile_n=16, tile_k=16)  # divides every tiny-config width (48, 80, 16)
interpret_dot = functools.partial(kernel_stacked_dot, impl="triton", block_sizes=TINY_BLOCKS, interpret=True)
# The decode attention kernel in interpret mode; block_k 16 divides the engine's 64-aligned caches.
interpret_attention = functools.partial(kernel_attention, impl="sync", block_sizes=AttentionBlocks(16, 2),
                                        interpret=True)
interpret_swiglu = functools.partial(kernel_swiglu, impl="triton", block_sizes=TINY_BLOCKS, interpret=True)


def _plain_dot(x, stack, i, out_dtype):  # reads W[i] with a dynamic slice: the same values as a dot on the row
    w = lax.dynamic_index_in_dim(stack, i, keepdims=False)  # [K, N]
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(out_dtype)


def _recording(calls):
    def dot(x, stack, i, out_dtype):
        calls.append((x.shape, stack.shape))
        return _plain_dot(x, stack, i, out_dtype)
    return dot


def _scan_body(jaxpr):
    scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scans) == 1
    return scans[0].params["jaxpr"].jaxpr


def _row_reads_feeding_dots(body) -> int:
    """dot_generals in `body` (looking through jit calls) whose rhs is a row read of a 3-D stack."""
    stacks = {v for v in body.invars if getattr(v.aval, "ndim", 0) == 3}

    def count(jaxpr, stack_vars, rows):
        found = 0
        for eqn in jaxpr.eqns:
            ins = [a for a in eqn.invars if not hasattr(a, "val")]
            if eqn.primitive.name in ("jit", "pjit") and eqn.params["name"] == "dynamic_index_in_dim" \
                    and ins and ins[0] in stack_vars:
                rows.update(eqn.outvars)
            elif eqn.primitive.name in ("dynamic_slice", "squeeze", "reshape") and ins and (
                    ins[0] in stack_vars or ins[0] in rows):
                rows.update(eqn.outvars)
            elif eqn.primitive.name == "dot_general":
                found += not hasattr(eqn.invars[1], "val") and eqn.invars[1] in rows
            elif eqn.primitive.name in ("jit", "pjit") and eqn.params["name"] != "flat_gemm":
                inner = eqn.params["jaxpr"].jaxpr if hasattr(eqn.params["jaxpr"], "jaxpr") else eqn.params["jaxpr"]
                pairs = [(iv, ov) for iv, ov in zip(inner.invars, eqn.invars) if not hasattr(ov, "val")]
                found += count(inner, {iv for iv, ov in pairs if ov in stack_vars},
                               {iv for iv, ov in pairs if ov in rows})
        return found

    return count(body, stacks, set())


def kernel_loop_inplace(args, dot):
    return kernel_loop(decoder, *args, index_mode="whole", packed_outputs={1: 1}, stacked_dot=dot)


def test_inplace_equals_plain_looped_and_unrolled():
    args = _inputs()
    expected = decoder(*args)
    calls = []
    plan = kernel_loop_inplace(args, _recording(calls))
    got = plan.unpack_outputs(jax.jit(plan.looped)(*plan.pack(*args)))
    # wq wk wv wo w_up w_down, and probs @ v_cache (the updated cache row is a stacked rhs too)
    assert [stack for _, stack in calls].count((L, D, D)) == 4 and len(calls) == 7
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def test_no_weight_row_feeds_a_dot_with_the_hook():
    args = _inputs()
    plain = kernel_loop(decoder, *args, index_mode="whole", packed_outputs={1: 1})
    assert _row_reads_feeding_dots(_scan_body(plain.jaxpr)) == 6
    kernel = functools.partial(kernel_stacked_dot, impl="triton", block_sizes=BlockSizes(2, 2), interpret=True)
    hooked = kernel_loop_inplace(args, kernel)
    assert _row_reads_feeding_dots(_scan_body(hooked.jaxpr)) == 0


def test_hook_returning_none_falls_back_to_the_row():
    args = _inputs()
    plan = kernel_loop_inplace(args, lambda *a: None)
    assert _row_reads_feeding_dots(_scan_body(plan.jaxpr)) == 6
    got = plan.unpack_outputs(jax.jit(plan.looped)(*plan.pack(*args)))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(decoder(*args))):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


@jax.jit
def odd_block(p, x):
    """Dots that are not `x @ W`: W transposed, a batched einsum, and W on the left."""
    y = x @ p["w"].T  # contracts W's axis 1
    z = jnp.einsum("bk,bkn->bn", x[None], p["wb"])[0]  # batch dimension
    return jnp.tanh(y + z + p["w"] @ x)  # W as lhs


def test_non_matching_dots_use_the_row():
    keys = jax.random.split(jax.random.key(1), 2 * 3)
    layers = [dict(w=jax.random.normal(keys[2 * i], (8, 8)), wb=jax.random.normal(keys[2 * i + 1], (1, 8, 8)))
              for i in range(3)]

    def f(params, x):
        for p in params:
            x = odd_block(p, x)
        return x

    x = jnp.linspace(-1, 1, 8)
    calls = []
    plan = kernel_loop(f, layers, x, index_mode="whole", stacked_dot=_recording(calls))
    np.testing.assert_allclose(jax.jit(plan.looped)(*plan.pack(layers, x)), f(layers, x), rtol=RTOL, atol=ATOL)
    assert calls == []  # nothing matched [..., K] x [K, N] with a stacked rhs


def test_stacked_dot_needs_whole_mode():
    with pytest.raises(ValueError, match="whole"):
        kernel_loop(decoder, *_inputs(), index_mode="slice", stacked_dot=_plain_dot)


def test_cache_rides_in_the_carry():
    args = _inputs()
    plan = kernel_loop_inplace(args, _plain_dot)
    body_call = plan._analysis.runs()[0][0]
    callee = body_call.calls[0].params["jaxpr"]
    assert output_aliases(callee, body_call.stacked, body_call.ys) == {7: 1, 8: 2}  # leaves: 6 weights, x, k_cache, v_cache
    body = _scan_body(plan.jaxpr)
    stacks = {v for v in body.invars if v.aval.shape == (L, args[1][0][0].shape[0], D)}  # [L, S, D]
    writes = [e for e in body.eqns if e.primitive.name == "dynamic_update_slice" and e.invars[0] in stacks]
    assert len(writes) == 2  # the new K and V rows go straight into the carried [L, S, D] stacks
    assert {e.outvars[0] for e in writes} <= set(body.outvars)


@pytest.fixture(scope="module")
def tiny():
    return init_random(get_preset("tiny-gqa"))


def _inplace_engine(model, dot=interpret_dot, attention=interpret_attention, swiglu=interpret_swiglu):
    engine = Engine(model, loop_mode="inplace")
    engine._plan._stacked_dot = dot  # the Pallas kernels in interpret mode (the CPU has no Mosaic GPU)
    engine._plan._calls = {"sdpa": attention, "swiglu": swiglu}
    return engine


def test_engine_inplace_logits_equal_unrolled(tiny):
    tokens = np.random.default_rng(0).integers(0, tiny.cfg.vocab_size, (2, 7))
    expected = Engine(tiny, loop_layers=False).forward_logits(tokens)
    np.testing.assert_allclose(_inplace_engine(tiny).forward_logits(tokens), expected, rtol=RTOL, atol=ATOL)


def test_engine_inplace_greedy_tokens_equal(tiny):
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    kwargs = dict(max_new_tokens=6, chunk=3)
    unrolled = Engine(tiny, loop_layers=False).generate(prompts, **kwargs).token_ids
    assert Engine(tiny, loop_mode="slice").generate(prompts, **kwargs).token_ids == unrolled
    assert _inplace_engine(tiny).generate(prompts, **kwargs).token_ids == unrolled
    # attention on materialized cache rows (the hook declines), the cache still written in place
    assert _inplace_engine(tiny, attention=lambda *args: None).generate(prompts, **kwargs).token_ids == unrolled


def _decode_step_jaxpr(engine, batch=2, cache_len=64):
    cache = engine.new_cache(batch, cache_len)
    tokens = positions = jnp.zeros((batch, 1), jnp.int32)
    return jax.make_jaxpr(engine.forward)(engine.params, tokens, positions, cache).jaxpr


def _stack_uses(jaxpr, stacks, uses):
    """Counts, by primitive, the equations of `jaxpr` that consume `stacks` or what a write or a
    free reshape of them makes, looking through jit calls."""
    frontier = set(stacks)
    while frontier:
        nxt = set()
        for eqn in jaxpr.eqns:
            hits = [p for p, a in enumerate(eqn.invars) if not hasattr(a, "val") and a in frontier]
            if not hits:
                continue
            if eqn.primitive.name in ("jit", "pjit"):
                callee = eqn.params["jaxpr"].jaxpr
                _stack_uses(callee, [callee.invars[p] for p in hits], uses)
                continue
            uses[eqn.primitive.name] = uses.get(eqn.primitive.name, 0) + 1
            if eqn.primitive.name in ("scatter", "reshape"):
                nxt.update(eqn.outvars)
        frontier = nxt - frontier
    return uses


def test_engine_inplace_cache_never_copied(tiny):
    """In the looped decode step the [L, B, S, K, H] cache stacks are touched only by the in-place
    writes (scatters into the carried stacks) and the attention kernel (pallas_call on the whole
    stacks): no row of the cache is read out (dynamic slice) or written back whole."""
    body = _scan_body(_decode_step_jaxpr(_inplace_engine(tiny)))
    stacks = [v for v in body.invars if getattr(v.aval, "ndim", 0) == 5]
    assert len(stacks) == 2
    uses = _stack_uses(body, stacks, {})
    assert uses == {"scatter": 2, "reshape": 2, "pallas_call": 1}, uses  # K, V: write, flatten, one read
    calls = [e.params["name"] for e in body.eqns if e.primitive.name in ("jit", "pjit")]
    assert calls.count("decode_attention_sync") == 1 and calls.count("flat_gemm_swiglu") == 1, calls
    assert calls.count("flat_gemm") == 5, calls  # q, k, v, o and down: every other dot reads in place
    # and with the attention hook declining, the read is one row slice per cache (no whole-row write)
    body = _scan_body(_decode_step_jaxpr(_inplace_engine(tiny, attention=lambda *args: None)))
    names = [e.primitive.name for e in body.eqns]
    assert names.count("scatter") == 2 and "dynamic_update_slice" not in names


def test_engine_default_mode_is_per_backend(tiny):
    assert Engine(tiny)._plan.mode == ("inplace" if jax.default_backend() == "gpu" else "slice")
    graphdef, params = nnx.split(tiny)
    with pytest.raises(ValueError, match="loop mode"):
        LoopedForward(graphdef, params, tiny.cfg, mode="copy")


def test_dispatch_hook_falls_back_off_hopper():
    x, stack = jnp.ones((1, 256), jnp.bfloat16), jnp.ones((2, 256, 64), jnp.bfloat16)
    if jax.default_backend() == "cpu":
        assert kernel_stacked_dot(x, stack, jnp.int32(1), jnp.bfloat16) is None  # CPU: XLA
    assert kernel_stacked_dot(x.astype(jnp.float32), stack.astype(jnp.float32), 0, jnp.float32) is None  # 16-bit only
    assert kernel_stacked_dot(x, stack, 0, jnp.float32) is None  # f32 output from bf16: keep XLA's dot

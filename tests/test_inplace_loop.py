"""Looped runs that read stacked inputs in place (`kernel_loop(..., stacked_dot=...)`): equal values,
no weight row copied out before a dot, fallbacks, and the engine's in-place mode."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

from jaxdecode.config import TensorParallel, get_preset
from jaxdecode.decode import Engine
from jaxdecode.hooks import (
    kernel_attention,
    kernel_calls,
    kernel_qkv,
    kernel_residual_norm,
    kernel_rms_norm,
    kernel_split_residual_norm,
    kernel_stacked_dot,
    kernel_swiglu,
)
from jaxdecode.looped_model import LoopedForward
from jaxdecode.looping import SplitSum, StackedRef, kernel_loop
from jaxdecode.looping.inplace import output_aliases
from jaxdecode.model import Hook, init_random
from kernels.decode_attention import BlockSizes as AttentionBlocks
from kernels.flat_gemm import BlockSizes
from kernels.flat_gemm_stream import StreamBlocks, flat_gemm_multi_reference
from kernels.rms_norm import rms_norm_reference
from tests.test_looping import D, L, _inputs, decoder

RTOL = ATOL = 1e-5  # f32; the interpret-mode kernel sums K in tiles, so the order differs from XLA's dot
TINY_BLOCKS = BlockSizes(tile_n=16, tile_k=16)  # divides every tiny-config width (48, 80, 16)
interpret_dot = functools.partial(kernel_stacked_dot, impl="triton", block_sizes=TINY_BLOCKS, interpret=True)
# The decode attention kernel in interpret mode; block_k 16 divides the engine's 64-aligned caches. The
# tiny configs' widths (D 48, H 16) are below Mosaic GPU's tiles: these run the Pallas-Triton backends.
interpret_attention = functools.partial(
    kernel_attention, impl="sync", block_sizes=AttentionBlocks(16, 2), backend="triton", interpret=True
)
interpret_swiglu = functools.partial(kernel_swiglu, impl="triton", block_sizes=TINY_BLOCKS, interpret=True)
interpret_norm = functools.partial(kernel_rms_norm, impl="triton", backend="triton", interpret=True)
interpret_residual_norm = functools.partial(kernel_split_residual_norm, impl="triton", backend="triton", interpret=True)


@functools.partial(jax.jit, static_argnames="out_dtype")
def stream_reference(x, ws, layer, *, out_dtype):
    """The stream kernel's jnp reference as one named call: it stands in for `flat_gemm_multi`."""
    return flat_gemm_multi_reference(x, ws, layer, out_dtype)


# The qkv hook with the reference injected (no Mosaic GPU on the CPU); tiles of 16 divide 48 and 16.
reference_qkv = functools.partial(
    kernel_qkv, impl="stream", gemm=stream_reference, block_sizes=StreamBlocks(tile_n=16, tile_k=16)
)


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
            if (
                eqn.primitive.name in ("jit", "pjit")
                and eqn.params["name"] == "dynamic_index_in_dim"
                and ins
                and ins[0] in stack_vars
            ):
                rows.update(eqn.outvars)
            elif (
                eqn.primitive.name in ("dynamic_slice", "squeeze", "reshape")
                and ins
                and (ins[0] in stack_vars or ins[0] in rows)
            ):
                rows.update(eqn.outvars)
            elif eqn.primitive.name == "dot_general":
                found += not hasattr(eqn.invars[1], "val") and eqn.invars[1] in rows
            elif eqn.primitive.name in ("jit", "pjit") and eqn.params["name"] not in (
                "flat_gemm",
                "flat_gemm_partials",
            ):
                inner = eqn.params["jaxpr"].jaxpr if hasattr(eqn.params["jaxpr"], "jaxpr") else eqn.params["jaxpr"]
                pairs = [(iv, ov) for iv, ov in zip(inner.invars, eqn.invars) if not hasattr(ov, "val")]
                found += count(
                    inner, {iv for iv, ov in pairs if ov in stack_vars}, {iv for iv, ov in pairs if ov in rows}
                )
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
    layers = [
        dict(w=jax.random.normal(keys[2 * i], (8, 8)), wb=jax.random.normal(keys[2 * i + 1], (1, 8, 8)))
        for i in range(3)
    ]

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
    assert output_aliases(callee, body_call.stacked, body_call.ys) == {
        7: 1,
        8: 2,
    }  # leaves: 6 weights, x, k_cache, v_cache
    body = _scan_body(plan.jaxpr)
    stacks = {v for v in body.invars if v.aval.shape == (L, args[1][0][0].shape[0], D)}  # [L, S, D]
    writes = [e for e in body.eqns if e.primitive.name == "dynamic_update_slice" and e.invars[0] in stacks]
    assert len(writes) == 2  # the new K and V rows go straight into the carried [L, S, D] stacks
    assert {e.outvars[0] for e in writes} <= set(body.outvars)


@pytest.fixture(scope="module")
def tiny():
    return init_random(get_preset("tiny-gqa"))


def _inplace_engine(
    model,
    dot=interpret_dot,
    attention=interpret_attention,
    swiglu=interpret_swiglu,
    qkv=None,
    norm=interpret_norm,
    residual_norm=None,
    qkv_attend=None,
):
    """The in-place engine with the Pallas kernels in interpret mode (the CPU has no Mosaic GPU); a hook
    given as None is off."""
    hooks = {
        Hook.SDPA: attention,
        Hook.SWIGLU: swiglu,
        Hook.RMS_NORM: norm,
        Hook.QKV: qkv,
        Hook.RESIDUAL_NORM: residual_norm,
        Hook.QKV_ATTEND: qkv_attend,
    }
    return Engine(model, loop_mode="inplace", stacked_dot=dot, hooks=hooks)


def test_engine_inplace_logits_equal_unrolled(tiny):
    tokens = np.random.default_rng(0).integers(0, tiny.cfg.vocab_size, (2, 7))
    expected = Engine(tiny, loop_layers=False).forward_logits(tokens)
    np.testing.assert_allclose(_inplace_engine(tiny).forward_logits(tokens), expected, rtol=RTOL, atol=ATOL)


def test_engine_inplace_greedy_tokens_equal(tiny):
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    kwargs = dict(max_new_tokens=6, chunk=3)
    unrolled = Engine(tiny, loop_layers=False).generate(prompts, **kwargs).token_ids
    assert Engine(tiny, loop_mode="slice").generate(prompts, **kwargs).token_ids == unrolled
    # the cache written in place by XLA, then the attention kernel
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
            if eqn.primitive.name in ("scatter", "dynamic_update_slice", "reshape"):
                nxt.update(eqn.outvars)
        frontier = nxt - frontier
    return uses


@pytest.mark.parametrize("batch, write", [(2, "scatter"), (1, "dynamic_update_slice")])
def test_engine_inplace_cache_never_copied(tiny, batch, write):
    """In the looped decode step the [L, B, S, K, H] cache stacks are touched only by the in-place
    writes (scatters into the carried stacks; one sequence writes with a dynamic_update_slice) and
    the attention kernel (pallas_call on the whole stacks): no row of the cache is read out (dynamic
    slice) or written back whole."""
    body = _scan_body(_decode_step_jaxpr(_inplace_engine(tiny), batch=batch))
    stacks = [v for v in body.invars if getattr(v.aval, "ndim", 0) == 5]
    assert len(stacks) == 2
    uses = _stack_uses(body, stacks, {})
    assert uses == {write: 2, "reshape": 2, "pallas_call": 1}, uses  # K, V: write, flatten, one kernel
    calls = [e.params["name"] for e in body.eqns if e.primitive.name in ("jit", "pjit")]
    assert calls.count("decode_attention_sync") == 1 and calls.count("flat_gemm_swiglu") == 1, calls
    # q, k, v, o and down: every other dot reads in place (the Triton kernels' partials, summed where used)
    assert calls.count("flat_gemm_partials") == 5, calls
    assert calls.count("rms_norm") == 2, calls  # both norms as one kernel each, the weight read in place
    # and with the attention hooks declining, the read is one row slice per cache (no whole-row write)
    body = _scan_body(_decode_step_jaxpr(_inplace_engine(tiny, attention=lambda *args: None)))
    names = [e.primitive.name for e in body.eqns]
    assert names.count("scatter") == 2 and "dynamic_update_slice" not in names


# What may produce an array of the stacked cache's shape in a compiled step that never copies it: the
# arguments, the while loop's tuple plumbing, and writes into a row (alone or as a fusion's root).
_IN_PLACE_PRODUCERS = {"parameter", "get-tuple-element", "tuple", "bitcast", "dynamic-update-slice", "scatter"}


def _stack_producers(engine, batch: int, cache_len: int = 64) -> list[str]:
    """The ops of the compiled, cache-donating decode step whose result has the [L, B, S, K, H] shape of a
    cache stack; a fusion is named by its root op ("fusion:copy")."""
    cache = engine.new_cache(batch, cache_len)
    tokens = positions = jnp.zeros((batch, 1), jnp.int32)
    step = jax.jit(engine.forward, donate_argnums=3).lower(engine.params, tokens, positions, cache)
    text = step.compile().as_text()
    roots = {  # computation name -> the op of its ROOT
        m.group(1): re.search(r"ROOT %\S+ = .*? ([a-z-]+)\(", m.group(2)).group(1)
        for m in re.finditer(r"^%(\S+) .*?\{\n(.*?)\n\}", text, re.S | re.M)
    }
    cfg = engine.cfg
    shape = re.escape(f"f32[{cfg.n_layers},{batch},{cache_len},{cfg.n_kv_heads},{cfg.head_dim}]")
    ops = []
    for m in re.finditer(r"^\s+(?:ROOT )?%\S+ = " + shape + r"\{[0-9,]+\} ([a-z-]+)\((.*)$", text, re.M):
        fused = re.search(r"calls=%([\w.\-]+)", m.group(2)) if m.group(1) == "fusion" else None
        ops.append(roots[fused.group(1)] if fused else m.group(1))
    return ops


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's HLO; on a GPU the kernel hooks run")
@pytest.mark.parametrize("batch", [1, 2])  # one sequence writes with a dynamic_update_slice, more with a scatter
def test_cpu_inplace_step_writes_the_stacked_cache_in_place(tiny, batch):
    """On the CPU (every kernel hook declines) the in-place mode still carries the cache stacks through
    the scan and writes the new rows into them: XLA makes no new [L, B, S, K, H] buffer per step. The
    slice mode's scan instead returns the caches as a stacked output, a fresh zero-filled buffer each
    step that is then copied; this contrast shows the check sees such copies (docs/looping.md)."""
    inplace = _stack_producers(Engine(tiny, loop_mode="inplace"), batch)
    assert set(inplace) <= _IN_PLACE_PRODUCERS, inplace
    assert {"dynamic-update-slice", "scatter"} & set(inplace)
    sliced = _stack_producers(Engine(tiny, loop_mode="slice"), batch)
    assert {"broadcast", "copy"} <= set(sliced), sliced


def test_residual_norm_hooks_per_config(tiny):
    """One device's `residual_norm` hook adds the o projection's split partials in its norm kernel; a
    tensor-parallel config gets the all-reduce hook instead, bound to its mesh axis and all-reduce, which
    leaves the call as written with psum, and with the kernel where the all-reduce kernel has no buffers."""
    assert kernel_calls()["residual_norm"] is kernel_split_residual_norm
    hook = kernel_calls(TensorParallel())["residual_norm"]
    assert (hook.func, hook.keywords["axis"], hook.keywords["allreduce_impl"]) == (kernel_residual_norm, "tp", "kernel")
    x = jnp.ones((1, 1, 256), jnp.bfloat16)
    weight = StackedRef(jnp.ones((2, 256), jnp.bfloat16), jnp.int32(0))
    assert kernel_residual_norm(x, x, weight, 1e-5, axis="tp", allreduce_impl="psum") is None
    answers = []  # inside a shard_map, where the axis is bound, but with no buffers for the kernel

    def body(v):
        answers.append(kernel_residual_norm(v, v, weight, 1e-5, axis="tp", allreduce_impl="kernel"))
        return v

    jax.eval_shape(jax.shard_map(body, mesh=jax.make_mesh((1,), ("tp",)), in_specs=jax.P(), out_specs=jax.P()), x)
    assert answers == [None]


def test_split_residual_norm_hook_declines():
    x = jnp.ones((1, 1, 256), jnp.float32)
    parts = SplitSum(jnp.ones((4, 1, 256), jnp.float32), x.shape, x.dtype)
    weight = StackedRef(jnp.ones((2, 256), jnp.float32), jnp.int32(1))
    assert kernel_split_residual_norm(x, parts, weight, 1e-5, jnp.zeros(4), impl="triton") is None  # comm buffers
    narrow = StackedRef(jnp.ones((2, 48), jnp.float32), jnp.int32(1))
    assert kernel_split_residual_norm(x[..., :48], x[..., :48], narrow, 1e-5, impl="triton") is None  # D % 64
    assert kernel_split_residual_norm(x, parts, weight.stack[1], 1e-5, impl="triton") is None  # weight not in place
    assert kernel_split_residual_norm(x, parts, weight, 1e-5) is None  # f32: no tuned kernel for it
    for backend in ("triton", "mosaic"):
        s, normed = kernel_split_residual_norm(x, parts, weight, 1e-5, impl="triton", backend=backend, interpret=True)
        np.testing.assert_allclose(s, 5.0)  # 1 + the four partials
        np.testing.assert_allclose(normed, 1.0, rtol=1e-5)  # 5 / rms(5)
        summed = 2 * x  # o's output already summed (Stream-K): one partial
        s, normed = kernel_split_residual_norm(x, summed, weight, 1e-5, impl="triton", backend=backend, interpret=True)
        np.testing.assert_allclose(s, 3.0)
        np.testing.assert_allclose(normed, 1.0, rtol=1e-5)


def test_rms_norm_hook_backends_equal_the_model():
    """The norm hook's Triton and Mosaic GPU kernels (interpreted) against `rms_norm_reference` on a
    stacked weight, the layer picked by the traced index."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(2, 1, 256)), jnp.float32)
    weight = StackedRef(jnp.asarray(rng.normal(size=(3, 256)), jnp.float32), jnp.int32(2))
    want = rms_norm_reference(x.reshape(2, 256), weight.stack, 2, eps=1e-5).reshape(x.shape)
    for backend in ("triton", "mosaic"):
        (got,) = kernel_rms_norm(x, weight, 1e-5, impl="triton", backend=backend, interpret=True)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)  # f32: one order of the 256-term sum


def test_engine_split_residual_norm_equals_unrolled(tiny):
    """The o projection's split partials added in the residual norm kernel: the unrolled model's logits
    and greedy tokens, at batch 1 (the GEMV) and 2; per layer one such kernel, and only the input norm
    left as `rms_norm`."""
    engine = _inplace_engine(tiny, residual_norm=interpret_residual_norm)
    tokens = np.random.default_rng(0).integers(0, tiny.cfg.vocab_size, (2, 7))
    np.testing.assert_allclose(
        engine.forward_logits(tokens), Engine(tiny, loop_layers=False).forward_logits(tokens), rtol=RTOL, atol=ATOL
    )
    for prompts in ([[1, 2, 3, 4, 5]], [[1, 2, 3, 4, 5], [7, 8, 9]]):
        kwargs = dict(max_new_tokens=6, chunk=3)
        assert (
            _inplace_engine(tiny, residual_norm=interpret_residual_norm).generate(prompts, **kwargs).token_ids
            == Engine(tiny, loop_layers=False).generate(prompts, **kwargs).token_ids
        )
    body = _scan_body(_decode_step_jaxpr(engine, batch=1))
    calls = [e.params["name"] for e in body.eqns if e.primitive.name in ("jit", "pjit")]
    assert calls.count("residual_rms_norm") == 1 and calls.count("rms_norm") == 1, calls


def test_engine_default_mode_is_inplace(tiny):
    assert Engine(tiny).loop_mode == "inplace"
    graphdef, params = nnx.split(tiny)
    with pytest.raises(ValueError, match="loop mode"):
        LoopedForward(graphdef, params, tiny.cfg, mode="copy")


def test_dispatch_hook_falls_back_off_hopper():
    x, stack = jnp.ones((1, 256), jnp.bfloat16), jnp.ones((2, 256, 64), jnp.bfloat16)
    if jax.default_backend() == "cpu":
        assert kernel_stacked_dot(x, stack, jnp.int32(1), jnp.bfloat16) is None  # CPU: XLA
    assert kernel_stacked_dot(x.astype(jnp.float32), stack.astype(jnp.float32), 0, jnp.float32) is None  # 16-bit only
    assert kernel_stacked_dot(x, stack, 0, jnp.float32) is None  # f32 output from bf16: keep XLA's dot


def biased_model(name: str):
    """A tiny model whose q/k/v biases (if it has them) are random (init_random makes them zero)."""
    model = init_random(get_preset(name), seed=2)
    keys = iter(jax.random.split(jax.random.key(3), 3 * model.cfg.n_layers))
    for layer in model.layers if model.cfg.qkv_bias else []:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            proj.bias.set_value(jax.random.normal(next(keys), proj.bias.shape, proj.bias.dtype))
    return model


@pytest.fixture(scope="module", params=["tiny-gqa", "tiny-qwen2"])
def qkv_model(request):
    """GQA models without and with q/k/v biases."""
    return biased_model(request.param)


def test_engine_qkv_hook_equals_unrolled(qkv_model):
    """Prefill logits (M = 14 rows) and greedy decode (M = 2) through the qkv hook equal the unrolled model."""
    tokens = np.random.default_rng(0).integers(0, qkv_model.cfg.vocab_size, (2, 7))
    unrolled = Engine(qkv_model, loop_layers=False)
    engine = _inplace_engine(qkv_model, qkv=reference_qkv)
    np.testing.assert_allclose(engine.forward_logits(tokens), unrolled.forward_logits(tokens), rtol=RTOL, atol=ATOL)
    prompts, kwargs = [[1, 2, 3, 4, 5], [7, 8, 9]], dict(max_new_tokens=6, chunk=3)
    assert engine.generate(prompts, **kwargs).token_ids == unrolled.generate(prompts, **kwargs).token_ids


def test_engine_qkv_stacks_feed_one_kernel_call(qkv_model):
    """In the looped decode step the q, k and v weight stacks [L, D, N_i] go to one call of the
    injected kernel per layer step, whole, with nothing else (no row slice) reading them."""
    cfg = qkv_model.cfg
    jaxpr = _decode_step_jaxpr(_inplace_engine(qkv_model, qkv=reference_qkv))
    assert [e.params["length"] for e in jaxpr.eqns if e.primitive.name == "scan"] == [cfg.n_layers]
    body = _scan_body(jaxpr)
    calls = [e for e in body.eqns if e.primitive.name in ("jit", "pjit") and e.params["name"] == "stream_reference"]
    assert len(calls) == 1
    stacks = [v for v in calls[0].invars if v in set(body.invars) and v.aval.ndim == 3]
    assert [v.aval.shape for v in stacks] == [(cfg.n_layers, cfg.dim, n) for n in (cfg.q_dim, cfg.kv_dim, cfg.kv_dim)]
    for stack in stacks:
        assert [e for e in body.eqns if stack in e.invars] == calls
    names = [e.params["name"] for e in body.eqns if e.primitive.name in ("jit", "pjit")]
    assert names.count("flat_gemm_partials") == 2, names  # only o and down are single dots now


def test_qkv_hook_declines():
    x = jnp.ones((2, 256), jnp.bfloat16)  # [M, D]
    wq, wkv = jnp.ones((3, 256, 128), jnp.bfloat16), jnp.ones((3, 256, 64), jnp.bfloat16)  # [L, D, N_i]
    refs = (StackedRef(wq, jnp.int32(1)), StackedRef(wkv, jnp.int32(1)), StackedRef(wkv, jnp.int32(1)))
    forced = functools.partial(kernel_qkv, impl="stream", gemm=stream_reference)
    if jax.default_backend() == "cpu":
        assert kernel_qkv(x, *refs, gemm=stream_reference) is None  # dispatch: XLA off the GPU
    assert kernel_qkv(x.astype(jnp.float32), *refs, gemm=stream_reference) is None  # 16-bit only
    assert forced(x.astype(jnp.float32), *refs) is None  # x and weights of different dtypes
    assert forced(x, *refs[:2], wkv[1]) is None  # a weight that is not stacked
    assert forced(x, *refs, block_sizes=StreamBlocks(tile_n=128)) is None  # N_kv = 64 does not tile
    q, k, v = forced(x, *refs)
    assert (q.shape, k.shape, v.shape) == ((2, 128), (2, 64), (2, 64)) and q.dtype == jnp.bfloat16


def test_qkv_hook_default_runs_the_stream_kernel():
    """The hook's default `gemm` (the stream kernel, Mosaic GPU interpreter on the CPU) with biases."""
    keys = jax.random.split(jax.random.key(4), 7)
    x = jax.random.normal(keys[0], (3, 256), jnp.bfloat16)  # [M, D]
    ws = [jax.random.normal(kk, (2, 256, n), jnp.bfloat16) for kk, n in zip(keys[1:4], (128, 64, 64))]  # [L, D, N_i]
    bs = [jax.random.normal(kk, (2, n), jnp.bfloat16) for kk, n in zip(keys[4:], (128, 64, 64))]  # [L, N_i]
    i = jnp.int32(1)
    got = kernel_qkv(
        x,
        *(StackedRef(a, i) for a in ws + bs),
        impl="stream",
        interpret=True,
        block_sizes=StreamBlocks(tile_n=64, tile_k=128, ctas=3),
    )
    want = [y + b[1] for y, b in zip(flat_gemm_multi_reference(x, ws, 1), bs)]
    for a, b in zip(got, want):  # f32 sums in another order, one bf16 rounding: 1 ulp (< 1%) of slack
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-2, atol=1e-2)


def test_dot_and_swiglu_hooks_run_the_stream_kernel():
    """impl="stream" (what a tuned table may pick) in the one-weight and SwiGLU hooks: the Stream-K
    kernel in Mosaic GPU's interpreter against the jnp references, one bf16 rounding of slack."""
    keys = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(keys[0], (3, 256), jnp.bfloat16)  # [M, D]
    wg, wu = (jax.random.normal(kk, (2, 256, 128), jnp.bfloat16) / 16 for kk in keys[1:])  # [L, D, F]
    blocks = BlockSizes(tile_n=64, tile_k=128)
    i = jnp.int32(1)
    close = functools.partial(np.testing.assert_allclose, rtol=1e-2, atol=1e-2)
    y = kernel_stacked_dot(x, wg, i, jnp.bfloat16, impl="stream", block_sizes=blocks, interpret=True)
    close(np.asarray(y, np.float32), np.asarray(flat_gemm_multi_reference(x, (wg,), 1)[0], np.float32))
    (h,) = kernel_swiglu(
        x[None], StackedRef(wg, i), StackedRef(wu, i), impl="stream", block_sizes=blocks, interpret=True
    )  # x [1, M, D]
    g, u = flat_gemm_multi_reference(x, (wg, wu), 1, jnp.float32)
    close(np.asarray(h[0], np.float32), np.asarray((jax.nn.silu(g) * u).astype(jnp.bfloat16), np.float32))

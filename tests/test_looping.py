"""Kernel-looping pass: structure, idempotence, looped == unrolled, the rules, generality."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

from jaxdecode.looping import INDEX_MODES, Packed, kernel_loop, layer
from jaxdecode.looping.find import StructuralKeys

D, F, S, L = 8, 16, 6, 4  # model width, ffn width, cache length, layers
RTOL = ATOL = 1e-6  # f32 on CPU: the scan runs the same ops as the unrolled calls


def _rms(x):  # x: [D]
    return x * lax.rsqrt(jnp.mean(x * x) + 1e-6)


@jax.jit
def block(p, x, k_cache, v_cache, pos):
    """A pre-norm decoder layer for one token. x: [D]; k_cache, v_cache: [S, D]; pos: int32[]."""
    with jax.named_scope("attn"):
        h = _rms(x)
        q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]  # [D] each
        k_cache = lax.dynamic_update_index_in_dim(k_cache, k, pos, 0)  # [S, D]
        v_cache = lax.dynamic_update_index_in_dim(v_cache, v, pos, 0)  # [S, D]
        scores = jnp.where(jnp.arange(S) <= pos, k_cache @ q / np.sqrt(D), -jnp.inf)  # [S]
        x = x + (jax.nn.softmax(scores) @ v_cache) @ p["wo"]
    with jax.named_scope("mlp"):
        x = x + jax.nn.silu(_rms(x) @ p["w_up"]) @ p["w_down"]
    return x, k_cache, v_cache


def decoder(params, cache, x, pos):
    """Unrolled reference: a Python loop over per-layer param dicts calling one jitted layer."""
    new_cache = []
    with jax.named_scope("decoder"):
        for i, (p, (k, v)) in enumerate(zip(params["layers"], cache)):
            with jax.named_scope(f"layers_{i}"):
                x, k, v = block(p, x, k, v, pos)
            new_cache.append((k, v))
    with jax.named_scope("final_norm"):
        x = _rms(x) * params["final"]
    return x, new_cache


def _params(key, n=L, ffn=(F,) * L):
    keys = iter(jax.random.split(key, 7 * n))

    def w(*shape):
        return jax.random.normal(next(keys), shape, jnp.float32) / np.sqrt(shape[0])

    layers = [
        dict(wq=w(D, D), wk=w(D, D), wv=w(D, D), wo=w(D, D), w_up=w(D, f), w_down=w(f, D))
        for _, f in zip(range(n), ffn)
    ]
    return dict(layers=layers, final=jnp.linspace(0.5, 1.5, D, dtype=jnp.float32))


def _inputs(n=L, ffn=(F,) * L):
    cache = [(jnp.zeros((S, D), jnp.float32), jnp.zeros((S, D), jnp.float32)) for _ in range(n)]
    x = jax.random.normal(jax.random.key(1), (D,))  # [D]
    return _params(jax.random.key(0), n, ffn), cache, x, jnp.int32(0)


def _walk(jaxpr):
    """Every equation of `jaxpr` and of its sub-jaxprs, with the jaxpr that holds it."""
    for eqn in jaxpr.eqns:
        yield jaxpr, eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple) else (value,):
                if isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _walk(sub)


def _prims(jaxpr, name):
    return [e for e in jaxpr.eqns if e.primitive.name == name]


def _calls(jaxpr, name):
    return [e for e in _prims(jaxpr, "jit") if e.params["name"] == name]


def _assert_close(actual, expected):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(
            np.asarray(a),
            np.asarray(e),
            rtol=RTOL,
            atol=ATOL,
            err_msg=f"max |diff| {np.abs(np.asarray(a) - np.asarray(e)).max()}",
        )


def _run_packed(plan, *args):
    out = jax.jit(plan.looped)(*plan.pack(*args))
    return plan.unpack_outputs(out)


# --- structure ------------------------------------------------------------------------------------
@pytest.mark.parametrize("index_mode", INDEX_MODES)
def test_decoder_becomes_one_scan_of_length_L(index_mode):
    args = _inputs()
    plan = kernel_loop(decoder, *args, index_mode=index_mode, packed_outputs={1: 1})
    assert len(_calls(plan.original_jaxpr, "block")) == L
    (scan,) = _prims(plan.jaxpr, "scan")
    assert scan.params["length"] == L
    assert not _calls(plan.jaxpr, "block"), "a per-layer call was left outside the scan"
    assert len(_calls(scan.params["jaxpr"], "block")) == 1
    (run,) = plan.report.runs
    assert (run.callee, run.length, run.name_scope) == ("block", L, "decoder/layers")
    assert run.carried == ["x"] and run.shared == ["pos"]
    weights = [f"p['{k}']" for k in args[0]["layers"][0]]
    assert sorted(run.stacked) == sorted(["k_cache", "v_cache", *weights])
    assert all(i.source.startswith("packed") for i in run.inputs if i.kind == "stacked")
    assert "output 1 stack 0: the scan's stacked output (no copy)" in plan.report.notes
    # The scan reads the packed stacks directly: its operands are the looped function's inputs.
    stacked_operands = [a for a in scan.invars if a in set(plan.jaxpr.invars) and a.aval.shape[:1] == (L,)]
    assert len(stacked_operands) == 6 + 2  # 6 weights, K and V caches
    body_slices = [e for _, e in _walk(scan.params["jaxpr"]) if e.primitive.name == "dynamic_slice"]
    assert len(body_slices) == (0 if index_mode == "slice" else 6 + 2)


@pytest.mark.parametrize("index_mode", INDEX_MODES)
def test_idempotent(index_mode):
    plan = kernel_loop(decoder, *_inputs(), index_mode=index_mode)
    again = kernel_loop(plan.looped, *plan.packed_shapes(), index_mode=index_mode)
    assert not again.report.runs
    assert StructuralKeys().jaxpr(again.jaxpr) == StructuralKeys().jaxpr(plan.jaxpr)


def test_name_scopes_are_kept():
    plan = kernel_loop(decoder, *_inputs())
    (scan,) = _prims(plan.jaxpr, "scan")
    (call,) = _calls(scan.params["jaxpr"], "block")
    assert str(scan.source_info.name_stack) == "decoder"
    assert str(call.source_info.name_stack) == "layers"  # layers_0, layers_1, ... collapse
    assert call.params["jaxpr"] is plan.original_jaxpr.eqns[0].params["jaxpr"]  # callee untouched

    def scopes(jaxpr):
        return [str(e.source_info.name_stack) for e in jaxpr.eqns]

    n_norm = scopes(plan.original_jaxpr).count("final_norm")
    assert set(scopes(plan.jaxpr)) == {"decoder", "final_norm"}  # the unstacked cache: "decoder"
    assert scopes(plan.jaxpr).count("final_norm") == n_norm


# --- values ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("index_mode", INDEX_MODES)
def test_looped_equals_unrolled(index_mode):
    args = _inputs()
    plan = kernel_loop(decoder, *args, index_mode=index_mode, packed_outputs={1: 1})
    _assert_close(_run_packed(plan, *args), jax.jit(decoder)(*args))


def test_packed_cache_round_trip_over_steps():
    params, cache, x, pos = _inputs()
    plan = kernel_loop(decoder, params, cache, x, pos, packed_outputs={1: 1})
    packed_params, packed_cache, _, _ = plan.pack(params, cache, x, pos)
    step, ref_step = jax.jit(plan.looped), jax.jit(decoder)
    for t in range(3):
        y, packed_cache = step(packed_params, packed_cache, x, jnp.int32(t))
        ref_y, cache = ref_step(params, cache, x, jnp.int32(t))
        assert isinstance(packed_cache, Packed) and packed_cache.stacks[0].shape == (L, S, D)
        _assert_close((y, packed_cache.unpack()), (ref_y, cache))
        x = y


# --- the rules: what is not looped ---------------------------------------------------------------
def test_op_on_carried_path_splits_the_run():
    def fn(params, cache, x, pos):
        for i, (p, (k, v)) in enumerate(zip(params["layers"], cache)):
            x, _, _ = block(p, x, k, v, pos)
            if i == 1:
                x = 2.0 * x  # between calls 2 and 3, on the carried path
        return x

    args = _inputs()
    plan = kernel_loop(fn, *args)
    assert [r.length for r in plan.report.runs] == [2, 2]
    assert [s.params["length"] for s in _prims(plan.jaxpr, "scan")] == [2, 2]
    (skip,) = plan.report.skips
    assert "op `mul` between calls sits on the carried path" in skip.reason
    assert "not merged" in str(plan.report)
    _assert_close(_run_packed(plan, *args), fn(*args))


def test_independent_ops_between_calls_are_hoisted_or_sunk():
    def fn(params, cache, x, pos):
        total = jnp.zeros((), jnp.float32)
        for i, (p, (k, v)) in enumerate(zip(params["layers"], cache)):
            x, k, v = block(p, x, k, v, pos + 0 * i)
            total = total + jnp.sum(k)  # reads the run, read by no later call: sunk
            pos = pos * 1  # reads nothing the run computes: hoisted
        return x, total

    args = _inputs()
    plan = kernel_loop(fn, *args)
    (run,) = plan.report.runs
    assert run.length == L and run.sunk > 0 and run.hoisted > 0
    _assert_close(_run_packed(plan, *args), fn(*args))


def test_calls_that_do_not_chain_are_not_looped():
    def fn(params, cache, x, pos):  # every layer reads the same x: nothing is carried
        return sum(block(p, x, k, v, pos)[0] for p, (k, v) in zip(params["layers"], cache))

    plan = kernel_loop(fn, *_inputs())
    assert not plan.report.runs and not _prims(plan.jaxpr, "scan")
    assert len(plan.report.skips) == L - 1
    assert all("does not chain" in s.reason for s in plan.report.skips)


def test_differing_shapes_split_into_runs():
    ffn = (F, F, 2 * F, 2 * F)  # layers 3 and 4 have a wider MLP
    args = _inputs(ffn=ffn)
    plan = kernel_loop(decoder, *args, packed_outputs={1: 1})
    w_up = [[i.aval for i in r.inputs if i.label == "p['w_up']"] for r in plan.report.runs]
    assert [r.length for r in plan.report.runs] == [2, 2]
    assert w_up == [["float32[8,16]"], ["float32[8,32]"]]
    (skip,) = plan.report.skips
    assert "structurally different" in skip.reason
    assert len(_prims(plan.jaxpr, "scan")) == 2
    _assert_close(_run_packed(plan, *args), decoder(*args))


def test_single_calls_between_runs_take_their_callees_wiring():
    """A mixed file's layers (llama.cpp's Q4_K_M gives v and down more bits in some layers), lone_calls on (the
    default in place): a single call of a callee that has a run elsewhere becomes a scan of length 1 wired as that
    run; one of a callee without a run stays as written and is reported."""
    ffn = (F, 2 * F, 2 * F, F, 2 * F, 2 * F, F, F)  # F: calls 0, 3 alone, 6-7 a run; 2F: runs 1-2, 4-5
    args = _inputs(len(ffn), ffn)
    plan = kernel_loop(decoder, *args, packed_outputs={1: 1}, lone_calls=True)
    assert [r.length for r in plan.report.runs] == [1, 2, 1, 2, 2]
    assert [s.name_scope[-1] for s in plan.report.skips] == ["1", "3", "4", "6"]  # why each run ended
    assert [s.params["length"] for s in _prims(plan.jaxpr, "scan")] == [1, 2, 1, 2, 2]
    assert not _calls(plan.jaxpr, "block")  # every layer inside a scan
    assert {r.name_scope for r in plan.report.runs} == {"decoder/layers"}
    _assert_close(_run_packed(plan, *args), decoder(*args))
    plan = kernel_loop(decoder, *args, packed_outputs={1: 1})  # lone calls stay as written by default (not in place)
    assert [r.length for r in plan.report.runs] == [2, 2, 2] and len(_calls(plan.jaxpr, "block")) == 2

    ffn = (2 * F, F, F, 2 * F, F, F)  # 2F: calls 0 and 3 alone, no run to take the wiring from
    args = _inputs(len(ffn), ffn)
    plan = kernel_loop(decoder, *args, packed_outputs={1: 1}, lone_calls=True)
    assert [r.length for r in plan.report.runs] == [2, 2]
    assert len(_calls(plan.jaxpr, "block")) == 2
    assert all("structurally different" in s.reason for s in plan.report.skips)
    _assert_close(_run_packed(plan, *args), decoder(*args))


def test_side_effects_are_not_looped():
    seen = []

    @jax.jit
    def noisy(w, x):
        jax.debug.callback(lambda v: seen.append(v), x)
        return jnp.tanh(x @ w)

    def fn(ws, x):
        for w in ws:
            x = noisy(w, x)
        return x

    ws = [jnp.eye(D) * (i + 1) for i in range(3)]
    plan = kernel_loop(fn, ws, jnp.ones(D))
    assert not plan.report.runs and len(_calls(plan.jaxpr, "noisy")) == 3
    assert all("side effects" in s.reason for s in plan.report.skips) and len(plan.report.skips) == 3

    def fn_print_between(ws, x):  # an effectful op between calls ends the run
        for i, w in enumerate(ws):
            x = jax.jit(lambda w, x: jnp.tanh(x @ w))(w, x)
            if i == 1:
                jax.debug.callback(lambda v: seen.append(v), x)
        return x

    plan = kernel_loop(fn_print_between, ws, jnp.ones(D))
    assert [r.length for r in plan.report.runs] == [2]
    assert "side effects" in plan.report.skips[0].reason


# --- generality -----------------------------------------------------------------------------------
class ParallelBlock(nnx.Module):
    """GPT-J-style parallel attention and MLP with a post-norm: unlike our pre-norm Llama layer."""

    def __init__(self, d, f, rngs):
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.up, self.down = nnx.Linear(d, f, rngs=rngs), nnx.Linear(f, d, rngs=rngs)
        self.norm = nnx.LayerNorm(d, rngs=rngs)

    @nnx.jit
    def __call__(self, x):  # x: [T, D]
        with jax.named_scope("attn"):
            q, k, v = jnp.split(self.qkv(x), 3, axis=-1)  # [T, D] each
            mask = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
            a = jax.nn.softmax(jnp.where(mask, q @ k.T / np.sqrt(x.shape[1]), -jnp.inf)) @ v  # [T, D]
        with jax.named_scope("mlp"):
            m = self.down(jax.nn.gelu(self.up(x)))  # [T, D]
        return self.norm(x + a + m)


class TinyDecoder(nnx.Module):
    def __init__(self, rngs, n=3):
        self.blocks = nnx.List([ParallelBlock(D, F, rngs) for _ in range(n)])
        self.head = nnx.Linear(D, 11, rngs=rngs)

    def __call__(self, x):
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def test_flax_nnx_decoder():
    model = TinyDecoder(nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    fn = lambda state, x: nnx.merge(graphdef, state)(x)
    x = jax.random.normal(jax.random.key(2), (5, D))
    plan = kernel_loop(fn, state, x)
    (run,) = plan.report.runs
    assert run.length == 3 and len(run.stacked) == 8 and len(run.carried) == 1
    assert _prims(plan.jaxpr, "scan")[0].params["length"] == 3
    _assert_close(_run_packed(plan, state, x), fn(state, x))


@functools.partial(jax.jit, static_argnums=0)
def layer_step(graphdef, state, x):
    """The main model's pattern: one module-level jit, graphdef static, nnx.merge inside."""
    return nnx.merge(graphdef, state)(x)


def test_nnx_layer_step_pattern_with_jitted_whole_function():
    blocks = [ParallelBlock(D, F, nnx.Rngs(i)) for i in range(4)]
    graphdef = nnx.split(blocks[0])[0]
    states = [nnx.split(b)[1] for b in blocks]

    @jax.jit  # a jit around the whole function is looked through, so packing still applies
    def fn(states, x):
        for st in states:
            x = layer_step(graphdef, st, x)
        return x

    x = jax.random.normal(jax.random.key(3), (5, D))
    plan = kernel_loop(fn, states, x)
    (run,) = plan.report.runs
    assert run.length == 4 and all(i.source.startswith("packed") for i in run.inputs if i.kind == "stacked")
    _assert_close(_run_packed(plan, states, x), fn(states, x))


def test_structurally_equal_callees_from_separate_jits():
    def make():
        @layer
        def mix(w, b, x):
            return jax.nn.relu(x @ w) + b

        return mix

    mixes = [make() for _ in range(3)]

    def fn(ws, x):
        for mix, w in zip(mixes, ws):
            x = mix(w, 0.5, x)
        return x

    ws = [jax.random.normal(jax.random.key(i), (D, D)) for i in range(3)]
    x = jnp.ones(D)
    jaxpr = jax.make_jaxpr(fn)(ws, x)
    assert len({id(e.params["jaxpr"]) for e in jaxpr.eqns}) == 3  # three separate traces
    plan = kernel_loop(fn, ws, x)
    (run,) = plan.report.runs
    assert run.length == 3 and run.shared == ["b"]
    _assert_close(_run_packed(plan, ws, x), fn(ws, x))


def test_runs_inside_jit_cond_scan_and_while_bodies():
    args = _inputs()

    def fn(params, cache, x, pos):
        @jax.jit
        def inner(params, cache, x):  # not the whole function: the run is nested in a jit
            return decoder(params, cache, x, pos)[0]

        y = inner(params, cache, x) + 1.0
        z = lax.cond(pos >= 0, lambda x: decoder(params, cache, x, pos)[0], lambda x: x, y)

        def step(x, _):
            return decoder(params, cache, x, pos)[0], None

        z = lax.scan(step, z, None, length=2)[0]

        def body(carry):
            i, x = carry
            return i + 1, decoder(params, cache, x, pos)[0]

        return lax.while_loop(lambda carry: carry[0] < pos + 2, body, (pos, z))[1]

    plan = kernel_loop(fn, *args)
    assert len(plan.report.runs) == 4
    assert [r.where for r in plan.report.runs] == [
        "fn/jit(inner)",
        "fn/cond.branches[1]",
        "fn/scan",
        "fn/while.body_jaxpr",
    ]
    stacked = [i for r in plan.report.runs for i in r.inputs if i.kind == "stacked"]
    assert all("run is nested" in i.source for i in stacked)
    looped_scans = [e for _, e in _walk(plan.jaxpr) if e.primitive.name == "scan" and e.params["length"] == L]
    assert len(looped_scans) == 4
    assert not [
        e
        for _, e in _walk(plan.jaxpr)
        if e.primitive.name == "jit"
        and e.params["name"] == "block"
        and not any(e is c for s in looped_scans for c in s.params["jaxpr"].eqns)
    ]
    (inner,) = _calls(plan.jaxpr, "inner")  # re-traced: its other equations keep their scopes
    inner_scopes = [str(e.source_info.name_stack) for e in inner.params["jaxpr"].eqns]
    assert inner_scopes[-1] == "final_norm" and set(inner_scopes) == {"decoder", "final_norm"}
    _assert_close(_run_packed(plan, *args), fn(*args))


# --- bad input ------------------------------------------------------------------------------------
def test_bad_input():
    args = _inputs()
    with pytest.raises(ValueError, match="index_mode"):
        kernel_loop(decoder, *args, index_mode="gather")
    with pytest.raises(ValueError, match="cannot be packed like argument 0"):
        kernel_loop(decoder, *args, packed_outputs={1: 0})
    plan = kernel_loop(decoder, *args)
    with pytest.raises(TypeError, match="must be packed"):
        plan.looped(*args)

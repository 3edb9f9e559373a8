"""rdu.trace / rdu.graph: structure of traced decode steps, hand-computed FLOPs, agreement with
jaxdecode.cost and with XLA's cost analysis."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.extend import core as jcore

from jaxdecode.config import get_preset
from jaxdecode.cost import decode_cost
from jaxdecode.looped_model import LoopedForward
from jaxdecode.model import Hook, Transformer, init_random, quantize_weights
from rdu.trace import trace, trace_decode_step

F32 = jnp.float32


def spec(shape, dtype=F32):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_matmul_flops_and_bytes_by_hand():
    # x[3,16] @ w1[16,40] -> silu -> @ w2[40,8], f32
    f = lambda x, w1, w2: jax.nn.silu(x @ w1) @ w2  # noqa: E731
    g = trace(f, spec((3, 16)), spec((16, 40)), spec((40, 8)))
    dots = g.find("dot_general")
    assert [d.flops for d in dots] == [2 * 3 * 40 * 16, 2 * 3 * 8 * 40]
    assert dots[0].bytes_read == 4 * (3 * 16 + 16 * 40) and dots[0].bytes_written == 4 * 3 * 40
    assert (
        g.total_flops() == 2 * 3 * 40 * 16 + 2 * 3 * 8 * 40 + 3 * 40
    )  # + the mul of silu (logistic is transcendental)
    assert g.total_transcendentals() == 3 * 40
    assert g.find("jit")[0].name == "silu"  # the jit of jax.nn.silu is kept as hierarchy
    # Fused: read x, w1, w2 once, write the result once.
    assert g.fused_bytes == 4 * (3 * 16 + 16 * 40 + 40 * 8 + 3 * 8)


def test_batched_dot_and_reduction_flops():
    f = lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b).sum(-1)  # noqa: E731
    g = trace(f, spec((5, 2, 7)), spec((5, 7, 3)))
    assert g.find("dot_general")[0].flops == 2 * 5 * 2 * 3 * 7  # batch dims included
    assert g.find("reduce_sum")[0].flops == 5 * 2 * (3 - 1)


def test_scan_trip_count_and_inplace_update():
    def f(c, xs, buf):
        c, _ = jax.lax.scan(lambda c, x: (c @ x, None), c, xs)  # [4,4] @ [4,4], 6 times
        return c, jax.lax.dynamic_update_slice(buf, c[:1], (2, 0))

    g = trace(f, spec((4, 4)), spec((6, 4, 4)), spec((100, 4)))
    scan = g.find("scan")[0]
    assert scan.trip_count == 6 and scan.kind == "loop"
    assert g.total_flops() == 6 * 2 * 4 * 4 * 4
    # buf is updated in place: the output aliases input 2 and writes one row only.
    assert g.output_alias == [None, 2]
    assert g.output_writes[1] == 4 * 4 and g.input_reads[2] == 0


@pytest.mark.parametrize("name", ["tiny-gqa", "llama-3.1-8b"])
def test_looped_decode_step_structure(name):
    cfg = get_preset(name)
    g = trace_decode_step(cfg, 1, 32)
    scans = [n for n in g.nodes if n.op == "scan"]
    assert len(scans) == 1 and scans[0].trip_count == cfg.n_layers
    body = scans[0].children[0]
    assert [n.name for n in body.nodes if n.kind == "call"] == ["decoder_layer_call"]
    scopes = g.scopes()
    for s in ("embed", "lm_head", "layers/attention/sdpa", "layers/attention/kv_cache_update", "layers/mlp"):
        assert any(x == s or x.startswith(s + "/") for x in scopes), s
    unrolled = trace_decode_step(cfg, 1, 32, looped=False)
    assert sum(n.name == "decoder_layer_call" for n in unrolled.nodes) == cfg.n_layers
    assert any(s.startswith(f"layers_{cfg.n_layers - 1}/") for s in unrolled.scopes())
    assert unrolled.total_flops() == g.total_flops() and unrolled.fused_bytes == g.fused_bytes


def _call_names(jaxpr) -> set[str]:
    """The name of every jit call in a jaxpr (eqn `params["name"]`), recursing into sub-jaxprs."""
    names = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("pjit", "jit"):
            names.add(str(eqn.params["name"]))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                    names |= _call_names(getattr(sub, "jaxpr", sub))
    return names


@pytest.mark.parametrize("looped", [True, False])
def test_every_hook_is_a_named_call_of_the_traced_decode_step(looped):
    """rdu (and the engine's kernel hooks) key on `model.Hook` members: each must be a call name in the
    decode step's jaxpr (T = 1) and a call node of the graph rdu builds from it."""
    cfg = get_preset("tiny-gqa")
    abstract = nnx.eval_shape(lambda: Transformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract)
    plan = LoopedForward(graphdef, params, cfg).plan(1, 1, 64, jnp.bfloat16)
    jaxpr = plan.jaxpr if looped else plan.original_jaxpr
    names = _call_names(getattr(jaxpr, "jaxpr", jaxpr))
    dense_hooks = {h for h in Hook if h != Hook.QUANT_DOT}  # quant_dot: only where weights are quantized
    assert {h for h in dense_hooks if h not in names} == set(), sorted(names)
    g = trace_decode_step(cfg, 1, 64, looped=looped)
    calls = {n.name for n, _ in g.walk() if n.kind == "call"}
    assert {h for h in dense_hooks if h not in calls} == set(), sorted(calls)
    quantized = quantize_weights(init_random(cfg, dtype=jnp.bfloat16), "int8", group=16)
    graphdef, params = nnx.split(quantized)
    plan = LoopedForward(graphdef, params, cfg).plan(1, 1, 64, jnp.bfloat16)
    assert Hook.QUANT_DOT in _call_names((plan.jaxpr if looped else plan.original_jaxpr).jaxpr)


@pytest.mark.parametrize(
    "name,batch,context,flop_tol",
    [
        # cost.py leaves out elementwise work (norms, RoPE, softmax, SwiGLU): 0.16% of an 8B step, but
        # up to ~8% of a tiny config whose width is 48.
        ("llama-3.1-8b", 1, 4096, 0.005),
        ("llama-3.1-70b", 4, 2048, 0.005),
        ("tiny-gqa", 2, 32, 0.08),
        ("tiny-qwen2", 1, 16, 0.08),
    ],
)
def test_totals_agree_with_cost_py(name, batch, context, flop_tol):
    cfg = get_preset(name)
    g = trace_decode_step(cfg, batch, context)
    c = decode_cost(cfg, batch=batch, context=context, itemsize=2)
    assert g.total_flops() == pytest.approx(c.flops, rel=flop_tol)
    assert g.total_flops() >= c.flops  # the gap is only the elementwise work cost.py leaves out
    matmul = g.flops_by_kind()["matmul"]
    assert matmul == c.flops  # dots alone: exactly cost.py's matmul + attention FLOPs
    # Fused traffic adds only small activations (tokens, positions, cos/sin, x, logits) to cost.py.
    assert g.fused_bytes == pytest.approx(c.bytes, rel=0.01)
    assert g.fused_bytes >= c.bytes


def _unrolled_forward(cfg, dtype):
    abstract = nnx.eval_shape(lambda: Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract)
    params = jax.tree.map(lambda x: spec(x.shape, x.dtype), params)

    def fwd(params, tokens, positions, k, v):
        return nnx.merge(graphdef, params)(tokens, positions, k, v)

    tok = spec((2, 1), jnp.int32)
    kv = [spec((2, 32, cfg.n_kv_heads, cfg.head_dim), dtype)] * cfg.n_layers
    return fwd, (params, tok, tok, kv, kv)


# Tolerances vs XLA (f32 on CPU, so no bf16 upcasting): XLA's compiled module splits a few ops
# (logistic -> neg/exp/add/div, the f32 softmax) into more elementwise FLOPs than the jaxpr shows;
# matmul FLOPs agree exactly, so the gap is a share of the elementwise work: ~2% of a tiny config,
# ~0.1% of SmolLM2. Transcendentals agree exactly with the lowered (pre-fusion) module. Per-op bytes
# differ more (XLA folds the lm_head transpose into the dot; counts scatter operands whole), so only
# a loose band is checked for them.
@pytest.mark.parametrize("name,flop_tol", [("tiny-gqa", 0.025), ("tiny-qwen2", 0.025), ("smollm2-135m", 0.002)])
def test_flops_agree_with_xla_cost_analysis(name, flop_tol):
    cfg = get_preset(name)
    fwd, args = _unrolled_forward(cfg, F32)
    g = trace(fwd, *args)
    lowered = jax.jit(fwd).lower(*args)
    compiled = lowered.compile().cost_analysis()
    pre = lowered.cost_analysis()
    assert g.total_flops() == pytest.approx(compiled["flops"], rel=flop_tol)
    assert g.total_transcendentals() == pre["transcendentals"]
    assert g.total_op_bytes() == pytest.approx(pre["bytes accessed"], rel=0.5)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_bytes_agree_with_cost_py(quantize):
    """The traced step of a quantized 8B reads its codes (int4: half a byte each) and float32 scales: the
    bytes cost.py counts for `quantize`, plus the same small activations as the dense step."""
    cfg = get_preset("llama-3.1-8b")
    g = trace_decode_step(cfg, 1, 1024, quantize=quantize)
    c = decode_cost(cfg, batch=1, context=1024, itemsize=2, quantize=quantize)
    assert g.fused_bytes == pytest.approx(c.bytes, rel=0.01)
    assert g.fused_bytes >= c.bytes
    dense = decode_cost(cfg, batch=1, context=1024, itemsize=2)
    assert g.fused_bytes < dense.bytes * (0.6 if quantize == "int8" else 0.3)

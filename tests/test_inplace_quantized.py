"""The quantized layer of the in-place looped decode: q·k·v, gate/up and every other projection through
`kernels.quant_gemm_stream`, the q·k·v partials through the same epilogue and attention kernels as bf16
weights. On the CPU each hook against the model's own function (Mosaic GPU's interpreter); on Hopper a
compiled decode step against the unrolled model, whose dots XLA runs on the dequantized weights."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT
from helpers import random_blocks
from interpreted import run_json

from jaxdecode.config import ModelConfig
from jaxdecode.decode import Engine
from jaxdecode.hooks import kernel_mlp, kernel_qkv_attend, kernel_quant_dot, kernel_swiglu
from jaxdecode.looping import StackedRef, outside_runs
from jaxdecode.model import Hook, init_random, quantize_weights
from jaxdecode.model import qkv_attend as model_qkv_attend
from jaxdecode.model import swiglu as model_swiglu
from jaxdecode.quantized import matmul, quantize
from jaxdecode.weights.repack import repack
from kernels.decode_attention import BlockSizes as AttentionBlocks
from kernels.quant_gemm import QuantBlocks
from kernels.quant_gemm_stream import QuantStreamBlocks

BLOCKS = QuantStreamBlocks(tile_n=64, tile_k=64, stages=2, compute_wgs=1, ctas=8)  # 64-row tiles, 2 units a tile
# bf16 activations: each dot's f32 sum is rounded to bf16 by both (2^-8 relative) in different orders, and
# the kernel rounds each scaled weight to bf16 (2^-9) as well; over two layers, a few bf16 ulps of the logits.
RTOL = 2.0**-6


def _stacks(seed: int, widths, k: int = 128, layers: int = 3):
    """Quantized int4 weights (G = 32, offsets) [K, N_i] for each width, stacked over `layers`: the
    QuantizedWeight of layer `LAYER` per width, and the hooks' view of all of them (StackedRef leaves)."""
    keys = jax.random.split(jax.random.key(seed), len(widths))
    stacked = [
        quantize(jax.random.normal(kk, (layers, k, n), jnp.float32) * k**-0.5, "int4", 32)
        for kk, n in zip(keys, widths)
    ]
    index = jnp.int32(LAYER)
    one = [jax.tree.map(lambda a: a[LAYER], w) for w in stacked]
    leaves = [StackedRef(a, index) for w in stacked for a in (w.codes, w.scales, w.offsets)]
    return one, leaves


LAYER = 1


def _close(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=4 * 2.0**-8 * np.abs(want).max())


# The hooks are called directly (as the in-place loop calls them, with StackedRef leaves) rather than from
# a traced engine: inside one XLA:CPU program, interpreted kernels of several warpgroups can starve each
# other of the CPU's threads (each blocks one in a barrier), which deadlocks a two-core machine.


def test_qkv_attend_hook_with_quantized_weights_equals_the_model():
    """q·k·v in one interpreted launch, its partials through the bf16 epilogue (RoPE, the cache rows written
    into layer LAYER of the stacks) and the attention kernel, against `model.qkv_attend` on that layer."""
    b, d, h, heads, kv_heads, s = 2, 128, 64, 2, 1, 64
    one, leaves = _stacks(1, (heads * h, kv_heads * h, kv_heads * h))
    ks = jax.random.split(jax.random.key(2), 4)
    x = jax.random.normal(ks[0], (b, 1, d), jnp.float32).astype(jnp.bfloat16)
    k_stack = (jax.random.normal(ks[1], (3, b, s, kv_heads, h), jnp.float32) * 0.5).astype(jnp.bfloat16)
    v_stack = jax.random.normal(ks[2], (3, b, s, kv_heads, h), jnp.float32).astype(jnp.bfloat16)
    positions = jnp.array([[5], [11]], jnp.int32)
    angles = positions[..., None].astype(jnp.float32) * jnp.linspace(0.1, 1.0, h)  # [B, 1, H]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    index = jnp.int32(LAYER)
    got = kernel_qkv_attend(
        x,
        StackedRef(k_stack, index, "k"),
        StackedRef(v_stack, index, "v"),
        positions,
        cos,
        sin,
        *leaves,
        impl="stream",
        quant_blocks=BLOCKS,
        attention_blocks=AttentionBlocks(16, 2),
        epilogue_backend="triton",  # the small heads here are below Mosaic GPU's tiles
        attention_backend="triton",
        interpret=True,
    )
    assert got is not None
    out, k_new, v_new = model_qkv_attend(x, k_stack[LAYER], v_stack[LAYER], positions, cos, sin, *one)
    _close(got[0], out)
    _close(got[1].stack[LAYER], k_new)
    _close(got[2].stack[LAYER], v_new)
    np.testing.assert_array_equal(np.asarray(got[1].stack[0]), np.asarray(k_stack[0]))  # other layers untouched


def test_swiglu_and_quant_dot_hooks_with_quantized_weights_equal_the_model():
    """gate/up in one interpreted launch (silu·mul in f32, one rounding) and a single quantized dot, against
    `model.swiglu` and `quant_dot` on layer LAYER of the stacks."""
    x = jax.random.normal(jax.random.key(3), (2, 1, 128), jnp.float32).astype(jnp.bfloat16)
    (gate, up, down), leaves = _stacks(4, (256, 256, 128))
    (got,) = kernel_swiglu(x, *leaves[:6], impl="stream", quant_blocks=BLOCKS, interpret=True)
    _close(got, model_swiglu(x, gate, up))
    (got,) = kernel_quant_dot(x, *leaves[6:], impl="stream", stream_blocks=BLOCKS, interpret=True)
    _close(got, matmul(x, down))


def _two_level_stacks():
    """gate and up as Q4_K (int4 codes, two levels with offsets) and down as Q6_K (int8 codes in groups of 16, two
    levels), each repacked from random GGUF blocks for 3 layers and stacked: (layer LAYER's weights, the leaves)."""
    rng = np.random.default_rng(7)
    d = f = 256  # K-quant rows hold whole super-blocks of 256

    def stack(qtype, rows, k):  # the weight [k, rows] of GGUF rows [rows, k]
        layers = [repack(random_blocks(qtype, rows, k, rng), qtype, (rows, k), "test") for _ in range(3)]
        return jax.tree.map(lambda *a: jnp.stack(a), *layers)

    stacked = [stack(QT.Q4_K, f, d), stack(QT.Q4_K, f, d), stack(QT.Q6_K, d, f)]
    index = jnp.int32(LAYER)
    one = [jax.tree.map(lambda a: a[LAYER], w) for w in stacked]
    return one, [[StackedRef(a, index) for a in jax.tree.leaves(w)] for w in stacked]


def two_level_hooks_equal_the_model() -> dict:
    """The interpreted hooks on two-level stacks against the model's functions (run in a process of its own)."""
    x = jax.random.normal(jax.random.key(5), (2, 1, 256), jnp.float32).astype(jnp.bfloat16)
    (gate, up, down), (g_leaves, u_leaves, d_leaves) = _two_level_stacks()
    assert (len(g_leaves), len(d_leaves)) == (5, 3)  # codes, sc, m, d, -dmin; codes, sc, d
    (got,) = kernel_swiglu(x, *g_leaves, *u_leaves, impl="stream", quant_blocks=BLOCKS, interpret=True)
    _close(got, model_swiglu(x, gate, up))
    (got,) = kernel_quant_dot(x, *d_leaves, impl="stream", stream_blocks=BLOCKS, interpret=True)
    _close(got, matmul(x, down))
    tiles = QuantBlocks(tile_n=64, tile_k=128)  # the tile-per-CTA kernel, which takes M > 64
    (got,) = kernel_quant_dot(x, *d_leaves, impl="mosaic", block_sizes=tiles, interpret=True)
    _close(got, matmul(x, down))
    return {"ok": True}


def test_two_level_k_quant_hooks_equal_the_model():
    """Q4_K gate/up in one launch and a Q6_K down (through both quantized GEMM kernels), their scales in two levels,
    against `model.swiglu` and `quant_dot` (XLA on the expanded scales); the MLP kernels, which take one level,
    decline them."""
    assert run_json(
        "import sys; sys.path.insert(0, 'tests'); import test_inplace_quantized as t, json; "
        "print(json.dumps(t.two_level_hooks_equal_the_model()))"
    ) == {"ok": True}
    x = jnp.zeros((2, 1, 256), jnp.bfloat16)
    _, (g_leaves, u_leaves, d_leaves) = _two_level_stacks()
    assert kernel_mlp(x, *g_leaves, *u_leaves, *g_leaves, impl="fused", interpret=True) is None  # 3 Q4_K


ON_HOPPER = jax.default_backend() == "gpu" and any(s in jax.devices()[0].device_kind for s in ("H100", "H200"))
# Widths the engine's default blocks tile (K = 256 and 512, N = 128..512: one unit is 256 deep).
CFG_DEFAULT_TILES = ModelConfig("tiny-quant-gpu", 97, 256, 2, 4, 2, 512, max_seq_len=64)
# D = 128 is not a multiple of the 256-deep units: q·k·v and gate/up decline (the looped path's XLA
# dequantizes them); only down (K = 256) takes the stream kernel.
CFG_NARROW = ModelConfig("tiny-quant-narrow", 97, 128, 2, 2, 1, 256, max_seq_len=64)
TAKEN = {"tiny-quant-gpu": {"quant_dot", "swiglu", "qkv_attend"}, "tiny-quant-narrow": {"quant_dot"}}


def test_q4_k_m_layers_alone_between_runs_are_looped_in_place():
    """A Q4_K_M model of 8 layers gives v and down Q6_K in layers 0, 3, 6 and 7: layers 0 and 3 sit alone between
    runs of the other kind. Each becomes a scan of one, so the in-place hooks are offered every layer's q·k·v and
    MLP (they decline on the CPU, and XLA runs the same layer): the looped step equals the unrolled one up to the
    order of float32 sums."""
    cfg = dataclasses.replace(CFG_DEFAULT_TILES, n_layers=8)
    model = quantize_weights(init_random(cfg, seed=5, dtype=jnp.float32), "q4_k_m")
    offered: list = []

    def counted(name, hook):
        return lambda *args, **kwargs: offered.append(name) or hook(*args, **kwargs)

    hooks = {Hook.SWIGLU: counted("swiglu", kernel_swiglu), Hook.QKV_ATTEND: counted("qkv_attend", kernel_qkv_attend)}
    looped = Engine(model, loop_mode="inplace", hooks=hooks)
    assert [run.length for run in looped.looped_forward.report(batch=1, cache_len=64).runs] == [1, 2, 1, 2, 2]
    step = jnp.asarray([[3]], jnp.int32)
    outs = []
    for engine in (Engine(model, loop_layers=False), looped):
        out, _ = engine.forward(engine.params, step, jnp.zeros((1, 1), jnp.int32), engine.new_cache(1, 64))
        outs.append(np.asarray(out))
    assert offered.count("qkv_attend") == offered.count("swiglu") == 5  # one trace of each run's body
    # the same float32 ops, fused or contracted differently in a scan body: per layer at most the longest sum's
    # rounding (F = 512 terms of 2^-24), over 8 layers
    np.testing.assert_allclose(outs[1], outs[0], rtol=0, atol=8 * 512 * 2.0**-24 * np.abs(outs[0]).max())


@pytest.mark.skipif(not ON_HOPPER, reason="compiled Mosaic GPU kernels need a Hopper GPU")
@pytest.mark.parametrize("cfg", [CFG_DEFAULT_TILES, CFG_NARROW], ids=lambda c: c.name)
@pytest.mark.parametrize("quant_hooks", ["kernels", "xla"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("fmt", ["int4", "q4_k_m"])
def test_compiled_default_hooks_equal_unrolled(fmt, batch, quant_hooks, cfg):
    """On Hopper, the engine's own hooks (no overrides but counting): one decode step through the fused
    quantized kernels, compiled, against the unrolled model; the hooks the shapes allow each took a call.
    quant_hooks="xla" turns the three quantized hooks off (the in-place loop slices the int4 stacks and XLA
    dequantizes): it separates a fault of the kernels from one of the looped path around them. fmt "q4_k_m":
    two-level Q4_K and Q6_K (v and down in layers 0, 3, 6 and 7 of 8, the head), which a layer's q·k·v launch
    declines there; layers 0 and 3 alone between runs of the other kind."""
    if fmt == "q4_k_m":
        cfg = dataclasses.replace(cfg, n_layers=8)
    model = quantize_weights(init_random(cfg, seed=5, dtype=jnp.bfloat16), fmt, group=32)
    calls: list = []

    def counted(name, hook):
        def run(*args, **kwargs):
            out = hook(*args, **kwargs)
            calls.append((name, out is not None))
            return out

        return outside_runs(run) if name == "quant_dot" else run

    hooks = {
        Hook.QUANT_DOT: counted("quant_dot", kernel_quant_dot),
        Hook.SWIGLU: counted("swiglu", kernel_swiglu),
        Hook.QKV_ATTEND: counted("qkv_attend", kernel_qkv_attend),
    }
    if quant_hooks == "xla":
        hooks = dict.fromkeys(hooks)
    rng = np.random.default_rng(6)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, 5)), jnp.int32)
    step = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, 1)), jnp.int32)
    results = []
    for engine in (Engine(model, loop_layers=False), Engine(model, loop_mode="inplace", hooks=hooks)):
        cache = engine.new_cache(batch, 64)
        positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (batch, 5))
        _, cache = engine.forward(engine.params, prompt, positions, cache)
        out, _ = engine.forward(engine.params, step, jnp.full((batch, 1), 5, jnp.int32), cache)
        results.append(np.asarray(out, np.float32))
    # RTOL's few bf16 steps a logit for two layers; the errors of more layers add up along the residual stream
    atol = 4 * 2.0**-8 * np.abs(results[0]).max() * cfg.n_layers / 2
    np.testing.assert_allclose(results[1], results[0], rtol=RTOL * cfg.n_layers / 2, atol=atol)
    if quant_hooks == "kernels":
        assert {name for name, ok in calls if ok} == TAKEN[cfg.name], calls


@pytest.mark.skipif(not ON_HOPPER, reason="compiled Mosaic GPU kernels need a Hopper GPU")
@pytest.mark.parametrize("design", ["phases", "owned"])
@pytest.mark.parametrize("batch", [1, 8])
def test_compiled_fused_mlp_equals_the_unfused_path(batch, design):
    """The optional fused MLP hook (`kernel_mlp`: gate/up, SwiGLU and down in one launch, of either design) on a
    4-layer int4 model, compiled: the first decode step's logits match the default looped engine's (the same
    kernels' arithmetic but h's rounding, the sums' order and, for "owned", gate's and up's x rounded to int8
    as down's is) and the unrolled model's, and greedy decoding picks the same tokens; the hook took the MLP
    wherever M <= 8 (the decode step, and the prompt at batch 1)."""
    cfg = ModelConfig("tiny-quant-fused-mlp", 97, 512, 4, 4, 2, 1024, max_seq_len=64)
    model = quantize_weights(init_random(cfg, seed=7, dtype=jnp.bfloat16), "int4", group=128)
    taken: list = []

    def counted(x, *args, **kwargs):
        out = kernel_mlp(x, *args, design=design, **kwargs)
        taken.append((int(np.prod(x.shape[:-1])), out is not None))  # (M, taken): the kernel takes M <= 8
        return out

    rng = np.random.default_rng(8)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, 5)), jnp.int32)
    logits, tokens = [], []
    engines = (Engine(model, loop_layers=False), Engine(model), Engine(model, hooks={Hook.MLP: counted}))
    for engine in engines:
        cache = engine.new_cache(batch, 64)
        positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (batch, 5))
        out, cache = engine.forward(engine.params, prompt, positions, cache)
        step = jnp.argmax(out[:, -1:], axis=-1).astype(jnp.int32)  # [B, 1]
        out, _ = engine.forward(engine.params, step, jnp.full((batch, 1), 5, jnp.int32), cache)
        logits.append(np.asarray(out, np.float32))
        tokens.append(np.asarray(jnp.argmax(out[:, -1], axis=-1)))
    assert taken and all(ok for m, ok in taken if m <= 8) and (1 if batch == 1 else batch, True) in taken, taken
    scale = np.abs(logits[0]).max()
    for got in logits[1:]:
        np.testing.assert_allclose(got, logits[0], rtol=RTOL, atol=4 * 2.0**-8 * scale)
    top2 = np.sort(logits[1][:, -1], axis=-1)[:, -2:]  # [B, 2]: runner-up and best of the unfused path
    clear = top2[:, 1] - top2[:, 0] > 2 * 4 * 2.0**-8 * scale  # rows whose best token no rounding can flip
    np.testing.assert_array_equal(tokens[2][clear], tokens[1][clear])

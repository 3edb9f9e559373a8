"""Quantized weights kept on the device (`jaxdecode.quantized`, `jaxdecode.weights.repack`).

References: numpy hand computations of the round-to-nearest quantizer, the `gguf` package's own
`gguf.quants.dequantize` for every repacked GGML type, the dense dot of the dequantized weight, and the
unrolled model against its looped form. The shipped SmolLM2 file kept quantized is checked against
HF transformers in tests/test_default_model.py (the engine's default load) and against our own
dequantized path here.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gguf import quants
from gguf.constants import GGMLQuantizationType as QT
from helpers import random_blocks
from test_default_model import PROMPTS_CHAT, PROMPTS_RAW

from jaxdecode import quantized
from jaxdecode.bench import compiled_steps, time_engine
from jaxdecode.config import ModelConfig, get_preset
from jaxdecode.cost import decode_cost, matmul_params_per_layer, quantized_bytes
from jaxdecode.decode import Engine
from jaxdecode.hooks import kernel_quant_dot
from jaxdecode.loading import load_model
from jaxdecode.looping import outside_runs
from jaxdecode.memory import estimate
from jaxdecode.model import Hook, init_random, quantize_weights
from jaxdecode.quantized import QuantizedWeight, check_quantized, matmul, quant_dot, quantize
from jaxdecode.weights.repack import REPACKED, repack, repacked_bytes
from kernels.quant_gemm import QuantBlocks

F32_EPS = 2.0**-24  # float32 unit roundoff


def _dense(qw: QuantizedWeight) -> np.ndarray:
    """The format's formula in float64 numpy: w[k, n] = s[k // G, n] · codes[n, k] + o[k // G, n], codes
    in the weight's own K order."""
    codes = np.asarray(qw.natural_codes()).astype(np.float64)  # [N, K]
    g = codes.shape[1] // qw.scales.shape[0]
    s = np.repeat(np.asarray(qw.scales, np.float64), g, axis=0)  # [K, N]
    o = 0.0 if qw.offsets is None else np.repeat(np.asarray(qw.offsets, np.float64), g, axis=0)
    return codes.T * s + o


def _rounded(a: np.ndarray, dtype) -> np.ndarray:
    """`a` rounded to `dtype` (ml_dtypes' rounding, independent of JAX's), back in float32."""
    return a.astype(jnp.dtype(dtype)).astype(np.float32)


def _assert_stored(got, want: np.ndarray, dtype) -> np.ndarray:
    """A stored scale (offset) equals the by-hand value rounded to `dtype`: exactly for 16 bits, whose
    rounding absorbs the f32 division's (XLA may divide by a reciprocal multiply), else within 4 f32
    roundings. Returns the stored values, which the codes are chosen against."""
    got = np.asarray(got, np.float32)
    if jnp.dtype(dtype).itemsize == 2:
        np.testing.assert_array_equal(got, _rounded(want, dtype))
    else:
        np.testing.assert_allclose(got, want, rtol=F32_EPS * 4, atol=F32_EPS * 8)
    return got


@pytest.mark.parametrize("scale_dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_int8_quantizes_symmetrically_to_nearest_per_group(scale_dtype):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(64, 24)).astype(np.float32)  # [K, N], groups of 16 along K
    qw = quantize(w, "int8", group=16, scale_dtype=scale_dtype)
    assert qw.codes.shape == (24, 64) and qw.scales.shape == (4, 24) and qw.offsets is None
    assert qw.codes.dtype == jnp.int8 and qw.scales.dtype == scale_dtype
    groups = w.reshape(4, 16, 24)
    scale = _assert_stored(qw.scales, np.abs(groups).max(axis=1) / np.float32(127), scale_dtype)  # [K/G, N]
    want = np.clip(np.round(groups / scale[:, None, :]), -127, 127).reshape(64, 24)
    np.testing.assert_array_equal(np.asarray(qw.codes).astype(np.int32).T, want.astype(np.int32))
    # round to nearest: every value within half a step of its group's stored scale, plus what rounding the
    # scale moves the grid's end (max|w| = 127·scale up to the scale's relative rounding, u)
    u = jnp.finfo(scale_dtype).eps / 2
    bound = np.repeat(scale, 16, axis=0) * (0.5 + 127 * u + 1e-6)
    assert np.all(np.abs(_dense(qw) - w) <= bound)
    assert qw.nbytes == 24 * 64 + 4 * 24 * jnp.dtype(scale_dtype).itemsize


@pytest.mark.parametrize("scale_dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_int4_quantizes_min_to_max_over_16_levels_per_group(scale_dtype):
    rng = np.random.default_rng(1)
    w = (rng.normal(size=(64, 24)) + rng.normal(size=(1, 24))).astype(np.float32)  # skewed columns
    qw = quantize(w, "int4", group=32, scale_dtype=scale_dtype)
    assert qw.codes.dtype == jnp.int4 and qw.scales.shape == qw.offsets.shape == (2, 24)
    assert qw.scales.dtype == qw.offsets.dtype == scale_dtype
    groups = w.reshape(2, 32, 24)
    lo, hi = groups.min(axis=1), groups.max(axis=1)  # [K/G, N], by hand
    scale = _assert_stored(qw.scales, (hi - lo) / np.float32(15), scale_dtype)
    offset = _assert_stored(qw.offsets, lo + 8 * scale, scale_dtype)
    codes = np.asarray(qw.natural_codes()).astype(np.int32).T.reshape(2, 32, 24)
    want = np.clip(np.round((groups - offset[:, None]) / scale[:, None]), -8, 7)
    np.testing.assert_array_equal(codes, want)
    if scale_dtype == jnp.float32:
        assert codes.min() == -8 and codes.max() == 7  # both extremes of every group are on the grid
    # stored in the kernels' order: column 32b + 8t + 2c + e holds the weight's column 32b + 8c + 2t + e
    b, r = np.divmod(np.arange(64), 32)
    t, c, e = r // 8, r % 8 // 2, r % 2
    stored = np.asarray(qw.codes).astype(np.int32)  # [N, K]
    np.testing.assert_array_equal(stored, want.reshape(64, 24).T[:, 32 * b + 8 * c + 2 * t + e])
    # within half a step of the stored grid, which rounding the scale and offset moves by at most
    # u·(|offset| + 8·scale) at its ends, u the scale dtype's relative rounding
    u = jnp.finfo(scale_dtype).eps / 2
    shift = u * (np.abs(lo + 8 * scale) + 8 * scale) + 8 * u * scale
    bound = np.repeat(scale * (0.5 + 1e-5) + shift, 32, axis=0)
    assert np.all(np.abs(_dense(qw) - w) <= bound)
    assert qw.nbytes == 24 * 64 // 2 + 2 * 24 * 2 * jnp.dtype(scale_dtype).itemsize


def test_quantize_refuses_an_unknown_scale_dtype():
    with pytest.raises(ValueError, match="scale dtype int8 is not one of float16, bfloat16, float32"):
        quantize(np.ones((64, 8), np.float32), "int4", 32, scale_dtype=jnp.int8)


def test_quantize_refuses_groups_that_do_not_divide_k():
    with pytest.raises(ValueError, match="group size 128 does not divide K=576"):
        quantize(np.ones((576, 8), np.float32), "int4", 128)
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        quantize(np.ones((64, 8), np.float32), "int3", 32)


def test_quant_dot_equals_the_dense_dot_of_the_dequantized_weight():
    rng = np.random.default_rng(1)
    codes = rng.integers(-8, 8, size=(40, 96)).astype(jnp.int4)  # [N, K]
    scales = rng.random((3, 40)).astype(np.float32)  # [K/G, N], G = 32
    offsets = rng.normal(size=(3, 40)).astype(np.float32)
    qw = QuantizedWeight(jnp.asarray(codes), jnp.asarray(scales), jnp.asarray(offsets), "test")
    check_quantized(qw, "test")
    x = rng.normal(size=(2, 5, 96)).astype(np.float32)
    want = x.astype(np.float64) @ _dense(qw)
    got = np.asarray(matmul(jnp.asarray(x), qw))
    assert got.shape == (2, 5, 40) and got.dtype == np.float32
    # f32 products and a sum over K = 96 terms: |error| <= K·eps·Σ|x·w| (a loose, standard bound)
    bound = 96 * F32_EPS * (np.abs(x) @ np.abs(_dense(qw))) * 2
    assert np.all(np.abs(got - want) <= bound)
    # s·c is exact in f32 (a float times a 4-bit integer); adding o rounds once (twice without an FMA)
    deq = np.asarray(qw.dequantize(), np.float64)
    assert np.all(np.abs(deq - _dense(qw)) <= 2 * F32_EPS * (np.abs(_dense(qw)) + np.abs(offsets).max()))
    np.testing.assert_array_equal(got, np.asarray(quant_dot(jnp.asarray(x), qw.codes, qw.scales, qw.offsets)))


@pytest.mark.parametrize("qtype", REPACKED, ids=[q.name for q in REPACKED])
def test_repack_equals_gguf_dequantize(qtype):
    """The repacked codes, scales and offsets give gguf.quants.dequantize's values: exactly, except where a
    recentred offset (8·d·sc − dmin·m, computed in float64) is rounded once to float32; then within that
    rounding, half an ulp of the offset plus half an ulp of the value."""
    rng = np.random.default_rng(int(qtype))
    rows, k = 6, 512
    blocks = random_blocks(qtype, rows, k, rng)
    qw = repack(blocks, qtype, (rows, k), "test")
    check_quantized(qw, "test")
    ref = quants.dequantize(blocks, qtype)  # [rows, K] float32
    got = np.asarray(qw.dequantize()).T  # [rows, K]
    expanded = qw.group_scales()[1]
    offsets = 0.0 if expanded is None else np.repeat(np.abs(np.asarray(expanded)), qw.group, axis=0).T
    assert np.all(np.abs(got - ref) <= F32_EPS * (offsets + np.abs(ref)))
    if qw.offsets is None or qtype in (QT.Q4_1, QT.Q5_1):  # f16 d, m: the recentred offset is exact
        np.testing.assert_array_equal(got, ref)
    assert qw.nbytes == repacked_bytes(qtype, rows, k)


def test_cost_and_preflight_count_quantized_bytes():
    cfg = get_preset("llama-3.1-8b")
    dense = decode_cost(cfg, batch=1, context=1024, itemsize=2)
    int4 = decode_cost(cfg, batch=1, context=1024, itemsize=2, quantize="int4")
    projections = cfg.n_layers * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336) + 128256 * 4096
    assert dense.weight_bytes - int4.weight_bytes == 2 * projections - quantized_bytes(projections, "int4")
    assert quantized_bytes(projections, "int4") == projections // 2 + projections // 128 * 4  # f16 scale, offset
    assert int4.kv_read_bytes == dense.kv_read_bytes
    est = estimate(get_preset("llama-3.1-70b"), itemsize=2, quantize="int4", looped=False, context=1024)
    assert 36e9 < est.weights < 44e9  # 70.6B parameters at 4.5 bits, the embedding table in bf16


def test_quantized_model_looped_equals_unrolled_with_mixed_layer_formats():
    """Layers quantized differently (int8 and int4, groups 32 and 16) cannot share one scan body: the
    looping pass makes runs of equal layers. Greedy tokens and logits equal the unrolled model's."""
    cfg = get_preset("tiny-gqa")
    model = init_random(cfg, seed=3)
    quantize_weights(model, "int8", group=32)
    assert cfg.n_layers == 3
    for layer in model.layers[2:]:  # the last layer's MLP int4 at group 16: another pytree structure
        for p in ("gate_proj", "up_proj", "down_proj"):
            param = getattr(layer.mlp, p).weight
            param.set_value(quantize(param.get_value().dequantize(), "int4", 16))
    prompt = [[5, 9, 2, 7, 1]]
    unrolled = Engine(model, loop_layers=False)
    looped = Engine(model, loop_layers=True)
    assert looped.generate(prompt, max_new_tokens=6).token_ids == unrolled.generate(prompt, max_new_tokens=6).token_ids
    a = looped.forward_logits(np.array(prompt))
    b = unrolled.forward_logits(np.array(prompt))
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)  # the same f32 operations in another order


def test_quantized_model_computes_the_dense_model_of_its_dequantized_weights():
    """A quantized model is the dense model whose weights are the dequantized ones: same logits up to f32
    summation order (the quantized dot dequantizes in f32 and sums in another order)."""
    cfg = get_preset("tiny-mqa")  # tied embeddings: the table is quantized too, lookups dequantize rows
    quant = quantize_weights(init_random(cfg, seed=4), "int8", group=16)
    dense = init_random(cfg, seed=5)
    for (path, q), (_, d) in zip(nnx.iter_graph(quant), nnx.iter_graph(dense), strict=True):
        if isinstance(q, nnx.Param):
            value = q.get_value()
            if isinstance(value, QuantizedWeight):
                value = value.dequantize().T if path[-2:] == ("embed_tokens", "embedding") else value.dequantize()
            d.set_value(value)
    tokens = np.array([[3, 1, 4, 1, 5]])
    got = Engine(quant, loop_layers=False).forward_logits(tokens)
    want = Engine(dense, loop_layers=False).forward_logits(tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_layers_that_never_repeat_run_unrolled():
    """Alternating formats (and a one-layer model) leave the pass no run of equal layers: the engine runs
    the layers as written instead of failing to pack the cache."""
    cfg = get_preset("tiny-gqa")
    model = init_random(cfg, seed=6)
    for i, layer in enumerate(model.layers):
        for p in ("gate_proj", "up_proj", "down_proj"):
            param = getattr(layer.mlp, p).weight
            param.set_value(quantize(param.get_value(), "int4" if i % 2 else "int8", 16))
    one_layer = init_random(dataclasses.replace(cfg, n_layers=1), seed=7)
    for m in (model, one_layer):
        looped = Engine(m, loop_layers=True)
        assert not looped.loop_layers and looped.looped_forward is None
        want = Engine(m, loop_layers=False).generate([[1, 2, 3]], max_new_tokens=4).token_ids
        assert looped.generate([[1, 2, 3]], max_new_tokens=4).token_ids == want


# A config whose widths the quantized kernel tiles (N and K multiples of 64), small enough for the interpreter.
TILED = ModelConfig("tiny-tiled", 97, 128, 2, 2, 1, 256, max_seq_len=64)
INTERPRET_BLOCKS = QuantBlocks(tile_n=64, tile_k=64, max_concurrent_steps=2)


def test_inplace_engine_reads_quantized_stacks_with_the_kernel():
    """The in-place looped decode hands every quantized dot to `kernel_quant_dot` (Mosaic GPU's interpreter
    on the CPU: the kernel reads codes[i] and scales[i] of the stacks in place) and matches the unrolled
    model, whose dots XLA runs on the dequantized weights. bf16 activations: both round each dot's f32 sum
    to bf16 (2^-8 relative), and the sums differ in order, so the logits agree to a few bf16 ulps."""
    model = quantize_weights(init_random(TILED, seed=8, dtype=jnp.bfloat16), "int4", group=32)
    calls = []

    def counted(*args, **kwargs):
        out = kernel_quant_dot(*args, impl="mosaic", block_sizes=INTERPRET_BLOCKS, interpret=True, **kwargs)
        calls.append(out is not None)
        return out

    hooks = {h: None for h in Hook if h != Hook.QUANT_DOT} | {Hook.QUANT_DOT: counted}
    engine = Engine(model, loop_mode="inplace", hooks=hooks, stacked_dot=lambda *a: None)
    tokens = np.array([[3, 14, 15, 92, 65]])
    got = engine.forward_logits(tokens)
    want = Engine(model, loop_layers=False).forward_logits(tokens)
    assert calls and all(calls)  # 7 projections of the layer body, traced once for the scan
    np.testing.assert_allclose(got, want, rtol=2**-6, atol=4 * 2**-8 * np.abs(want).max())


def test_random_quantized_init_makes_no_dense_projection():
    """`init_random(quantize=)` draws each projection and quantizes it at once: every projection (and a tied
    table) is a QuantizedWeight of the config's shape, norms are ones, and the model decodes."""
    cfg = get_preset("tiny-mqa")
    model = init_random(cfg, seed=2, quantize="int4")
    projections = [
        getattr(layer.self_attn, p).weight.get_value() for layer in model.layers for p in ("q_proj", "o_proj")
    ] + [model.embed_tokens.embedding.get_value()]
    assert all(isinstance(w, QuantizedWeight) for w in projections)
    assert projections[-1].shape == (cfg.dim, cfg.vocab_size) and projections[0].shape == (cfg.dim, cfg.q_dim)
    w = np.asarray(projections[0].dequantize())
    assert abs(w.std() * np.sqrt(cfg.dim) - 1) < 0.2  # normal / sqrt(fan_in), through 4-bit rounding
    np.testing.assert_array_equal(np.asarray(model.layers[0].input_layernorm.weight.get_value()), 1.0)
    assert len(Engine(model).generate([[1, 2, 3]], max_new_tokens=3).token_ids[0]) == 3


def test_inplace_engine_hands_the_output_projection_to_the_kernel():
    """Outside the looped layers, the quantized output projection (a tied table here, V = 128 tiles) is
    offered to `kernel_quant_dot` too, with plain arrays (codes [V, D]); the logits match the unrolled
    model's to a few bf16 ulps (each dot's f32 sum rounded to bf16 once, in a different order)."""
    cfg = ModelConfig("tiny-tiled-head", 128, 128, 2, 2, 1, 256, max_seq_len=64, tie_embeddings=True)
    model = quantize_weights(init_random(cfg, seed=9, dtype=jnp.bfloat16), "int4", group=32)
    shapes = []

    @outside_runs
    def counted(x, codes, *rest):
        out = kernel_quant_dot(x, codes, *rest, impl="mosaic", block_sizes=INTERPRET_BLOCKS, interpret=True)
        shapes.append((getattr(codes, "ndim", None), out is not None))
        return out

    hooks = {h: None for h in Hook if h != Hook.QUANT_DOT} | {Hook.QUANT_DOT: counted}
    engine = Engine(model, loop_mode="inplace", hooks=hooks, stacked_dot=lambda *a: None)
    tokens = np.array([[3, 14, 15, 92, 65]])
    got = engine.forward_logits(tokens)
    want = Engine(model, loop_layers=False).forward_logits(tokens)
    assert (2, True) in shapes  # the output projection, codes [V, D], went to the kernel
    np.testing.assert_allclose(got, want, rtol=2**-6, atol=4 * 2**-8 * np.abs(want).max())


# The CPU path of quant_dot (`quantized._quant_dot_cpu`): float32 activations, the dequantized rows in tiles.


@pytest.mark.parametrize("codes_dtype", [jnp.int8, jnp.int4])
@pytest.mark.parametrize("with_offsets", [True, False])
@pytest.mark.parametrize("tile_rows", [40, 8])  # one tile, and five tiles of a lax.map
def test_cpu_quant_dot_equals_the_float64_dot(monkeypatch, codes_dtype, with_offsets, tile_rows):
    """x [2, 5, K] times a [K, N] = [96, 40] weight against numpy's float64 dot of the format's formula.
    Bound: each dequantized weight rounds twice (s·c, then + o: 2 eps of |s·c| + |o|), each product once,
    and a sum of K terms in any order adds at most (K - 1) eps of the sum of |terms|: in all, at most
    (K + 2) eps · Σ_k |x_k| (|s·c| + |o|), to first order in eps."""
    monkeypatch.setattr(quantized, "CPU_TILE_BYTES", 4 * 96 * tile_rows)  # rows per tile = tile_rows
    quant_dot.clear_cache()
    rng = np.random.default_rng(7)
    lo, hi = (-8, 8) if codes_dtype == jnp.int4 else (-127, 128)
    codes = jnp.asarray(rng.integers(lo, hi, size=(40, 96)).astype(codes_dtype))  # [N, K]
    scales = rng.random((3, 40)).astype(np.float32)  # [K/G, N], G = 32
    offsets = rng.normal(size=(3, 40)).astype(np.float32) if with_offsets else None
    qw = QuantizedWeight(codes, jnp.asarray(scales), None if offsets is None else jnp.asarray(offsets), "t")
    x = rng.normal(size=(2, 5, 96)).astype(np.float32)
    got = np.asarray(matmul(jnp.asarray(x), qw))
    quant_dot.clear_cache()  # later tests trace with the default tile size
    sc = np.abs(np.asarray(qw.natural_codes()).astype(np.float64).T * np.repeat(scales, 32, axis=0))  # |s·c| [K, N]
    o = 0.0 if offsets is None else np.abs(np.repeat(offsets, 32, axis=0))
    bound = (96 + 2) * F32_EPS * (np.abs(x) @ (sc + o))
    assert got.shape == (2, 5, 40)
    assert np.all(np.abs(got - x.astype(np.float64) @ _dense(qw)) <= bound)


@pytest.mark.parametrize("x0", [0.0, -0.0, 1.5, -1.5, np.inf, -np.inf, np.nan, -np.nan, 1e-45, -3.4e38])
def test_cpu_quant_dot_dependency_on_x_leaves_the_codes_unchanged(x0):
    """`_after` makes the codes a function of x without changing them, whatever x's first element is
    (signed zeros, infinities, NaNs of either sign, a subnormal): its condition never holds."""
    codes = jnp.asarray(np.arange(-8, 8, dtype=np.int8).reshape(4, 4))
    x = jnp.asarray(np.array([[x0, 2.0, 3.0, 4.0]], np.float32))
    np.testing.assert_array_equal(np.asarray(jax.jit(quantized._after)(x, codes)), np.asarray(codes))


@pytest.mark.parametrize("loop_layers", [True, False])
def test_cpu_decode_step_dequantizes_one_weight_at_a_time(loop_layers):
    """XLA:CPU hoists a dequantization that depends on parameters only out of the decode loop (or to the
    start of a step), and the step then holds every projection in float32. The decode chunk's temporary
    memory stays under four times the largest projection's float32 size (1 MB here, of 16 MB in all),
    looped (codes read in place from the stacks) and unrolled."""
    cfg = ModelConfig("cpu-dequant", 1024, 256, 4, 4, 2, 1024, max_seq_len=64, tie_embeddings=True)
    model = quantize_weights(init_random(cfg, seed=10), "int8", group=64)
    engine = Engine(model, loop_layers=loop_layers)
    time_engine(engine, np.array([[1, 2, 3]]), context=0, steps=4)
    chunk = compiled_steps(engine)[1]
    largest = 4 * cfg.dim * cfg.vocab_size  # the tied output projection, [V, D] in float32
    all_f32 = 4 * (cfg.n_layers * matmul_params_per_layer(cfg) + cfg.vocab_size * cfg.dim)
    assert all_f32 == 16 * largest  # 4 layers of 983,040 projection weights, and the table's 262,144
    assert chunk.memory_analysis().temp_size_in_bytes < 4 * largest


def test_device_put_widens_int4_codes_on_the_cpu():
    """On the CPU the int4 codes become int8 with the same values (XLA:CPU converts int8 to float faster)."""
    codes = np.arange(-8, 8, dtype=np.int8).reshape(2, 8).astype(jnp.int4)  # [N, K]
    qw = QuantizedWeight(codes, np.ones((1, 2), np.float32), np.zeros((1, 2), np.float32), "Q4_1").device_put()
    assert qw.codes.dtype == jnp.int8 and qw.nbytes == 16 + 2 * 2 * 4
    np.testing.assert_array_equal(np.asarray(qw.codes), np.arange(-8, 8).reshape(2, 8))


def test_device_put_on_the_cpu_puts_permuted_int4_codes_back_in_k_order():
    """Int4 codes in groups of 32 are stored in the kernels' K order; widened to int8 on the CPU, they
    are put back in the weight's own order (int8 codes are never permuted), and the weight is unchanged."""
    rng = np.random.default_rng(3)
    w = rng.normal(size=(64, 8)).astype(np.float32)  # [K, N]
    qw = quantize(w, "int4", group=32)
    placed = qw.device_put()
    assert placed.codes.dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(placed.codes), np.asarray(qw.natural_codes()).astype(np.int8))
    np.testing.assert_array_equal(np.asarray(placed.dequantize()), np.asarray(qw.dequantize()))


def test_a_model_quantized_on_load_is_placed_and_quantize_weights_keeps_the_stored_format():
    """`load_model(quantize="int4")` widens the codes on the CPU as a GGUF file's are; `quantize_weights`
    alone keeps int4 (what rdu traces and cost.py counts): the same values either way."""
    from jaxdecode.config import get_preset
    from jaxdecode.model import init_random, quantize_weights

    loaded = load_model("tiny-gqa", quantize="int4", seed=2)
    stored = init_random(get_preset("tiny-gqa"), seed=2, quantize="int4")
    quantized = quantize_weights(init_random(get_preset("tiny-gqa"), seed=2), "int4")
    placed, kept = (m.layers[0].mlp.down_proj.weight.get_value() for m in (loaded.model, stored))
    assert placed.codes.dtype == jnp.int8 and kept.codes.dtype == jnp.int4
    assert quantized.layers[0].mlp.down_proj.weight.get_value().codes.dtype == jnp.int4
    np.testing.assert_array_equal(np.asarray(placed.codes), np.asarray(kept.natural_codes().astype(jnp.int8)))


@pytest.fixture(scope="module")
def default_kept_and_dequantized():
    return load_model(), load_model(dequantize=True)


def test_default_model_kept_quantized_equals_its_dequantized_weights(default_kept_and_dequantized):
    """The issue's bar for the shipped file kept quantized, float32 activations: first-step logits within
    1e-3 of the dequantized model's (relative to the largest logit), and the same 32 greedy tokens on the
    chat and raw prompts of tests/test_default_model.py. The weights are equal (the repack is exact); the
    sums run in another order."""
    kept, dense = default_kept_and_dequantized
    tok = kept.tokenizer
    prompts = [tok.encode(t) for t in PROMPTS_RAW]
    prompts += [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in PROMPTS_CHAT]
    ours, ref = Engine(kept.model), Engine(dense.model)
    got, want = ours.forward_logits(np.array([prompts[-3]]))[0, -1], ref.forward_logits(np.array([prompts[-3]]))[0, -1]
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-3
    for ids in prompts:
        assert ours.generate([ids], max_new_tokens=32).token_ids == ref.generate([ids], max_new_tokens=32).token_ids


@pytest.mark.parametrize("dtype", [jnp.int4, np.int8])
def test_host_permutation_of_codes_equals_the_kernels_permute_k(dtype):
    """The load-time permutation of numpy codes (moved as 2-byte pairs) equals `permute_k` done by jnp,
    for stacked and unstacked codes; a non-contiguous array takes `permute_k` itself."""
    from kernels.quant_gemm import permute_k

    rng = np.random.default_rng(4)
    for shape in ((3, 5, 96), (7, 64)):
        codes = rng.integers(-8, 8, size=shape).astype(dtype)
        want = np.asarray(permute_k(jnp.asarray(codes)))
        got = quantized._permute_k(codes)
        assert got.dtype == codes.dtype and got.shape == codes.shape
        np.testing.assert_array_equal(got.astype(np.int8), want.astype(np.int8))
        np.testing.assert_array_equal(quantized._permute_k(got).astype(np.int8), codes.astype(np.int8))
    strided = rng.integers(-8, 8, size=(64, 10)).astype(dtype).T  # [10, 64], not C-contiguous
    np.testing.assert_array_equal(
        np.asarray(quantized._permute_k(strided)).astype(np.int8), np.asarray(permute_k(strided)).astype(np.int8)
    )

"""`--quantize q4_k_m` (`jaxdecode.kquants`): Q4_K and Q6_K made by round to nearest are GGUF's own formats (packed
into GGUF blocks, `gguf.quants.dequantize` gives our values), every value within half a step of its grid, the mix
picks the tensors llama.cpp's llama-quantize picked in the committed Q4_K_M file, and the bytes counted ahead
(`cost.projection_bytes`) are the built model's."""

from __future__ import annotations

from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as ref_dequantize

from jaxdecode.config import ModelConfig
from jaxdecode.cost import decode_cost, step_weight_bytes
from jaxdecode.decode import Engine
from jaxdecode.kquants import _fit_groups, mix_format, quantize_k, use_more_bits
from jaxdecode.model import init_random, quantize_weights

F32_EPS = float(np.finfo(np.float32).eps)
Q4_K_M_FILE = Path(__file__).parent / "data" / "tiny-llama-q4_k_m.gguf"


def _weight(seed: int, k: int = 512, n: int = 24) -> np.ndarray:
    """[K, N] with groups of very different spreads and signs: skewed, all positive, tiny, zero."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(k, n)) * np.exp(rng.normal(size=(k // 32, 1, n))).repeat(32, axis=0).reshape(k, n)
    w[:32, 0] = np.abs(w[:32, 0]) + 1.0  # a group with no negative value: its min is clamped to 0
    w[32:64, 1] = 0.0
    w[64:80, 2] *= 1e-4
    return (w * 0.02).astype(np.float32)


def _pack(values: np.ndarray, width: int, bits: int) -> np.ndarray:
    """The inverse of `jaxdecode.weights.quant.unpack`: uint8 [n, m·(8/bits)·width] → [n, m·width]."""
    n = values.shape[0]
    fields = values.astype(np.uint8).reshape(n, -1, 8 // bits, width)  # [n, m, 8/bits, width]
    shifts = np.arange(0, 8, bits, dtype=np.uint8)[:, None]
    return np.bitwise_or.reduce(fields << shifts, axis=2).reshape(n, -1)


def _f16_bytes(a) -> np.ndarray:  # float16 [n] → uint8 [n, 2]
    return np.asarray(a, np.float16).reshape(-1, 1).view(np.uint8)


def _as_gguf_blocks(qw, fmt: str) -> np.ndarray:
    """The weight's arrays written as GGUF blocks, uint8 [N · K/256, block bytes], llama.cpp's field order."""
    codes = np.asarray(qw.natural_codes()).astype(np.int16)  # [N, K]
    n, k = codes.shape
    blocks = n * k // 256
    per_block = lambda a: np.asarray(a).T.reshape(blocks, -1)  # noqa: E731  [K/., N] → [blocks, values a block]
    d = per_block(qw.super_scales)
    if fmt == "q4_k":
        sc, m, dmin = (
            per_block(qw.scales).astype(np.uint8),
            per_block(qw.offsets).astype(np.uint8),
            -per_block(qw.super_offsets),
        )
        scales = np.concatenate(  # get_scale_min_k4's packing: 6-bit values, the top two bits of 4..7 in bytes 0..7
            [
                sc[:, :4] | (sc[:, 4:] >> 4) << 6,
                m[:, :4] | (m[:, 4:] >> 4) << 6,
                (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4,
            ],
            axis=1,
        )
        qs = _pack((codes + 8).reshape(blocks, 256), 32, 4)
        return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qs], axis=1)
    q = (codes + 32).reshape(blocks, 256)
    ql, qh = _pack(q & 15, 64, 4), _pack(q >> 4, 32, 2)
    return np.concatenate([ql, qh, per_block(qw.scales).astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=1)


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_k_quants_are_the_gguf_formats(fmt):
    """Packed into GGUF blocks, the arrays dequantize by gguf.quants to our values: exactly for Q6_K (d·sc·c, all
    exact), and within the recentred offset's one rounding for Q4_K (as `repack`'s)."""
    qw = quantize_k(_weight(1), fmt)
    ref = ref_dequantize(_as_gguf_blocks(qw, fmt), QT.Q4_K if fmt == "q4_k" else QT.Q6_K).reshape(24, 512)
    got = np.asarray(qw.dequantize()).T  # [N, K]
    if fmt == "q6_k":
        np.testing.assert_array_equal(got, ref)
    else:
        offsets = np.repeat(np.abs(np.asarray(qw.group_scales()[1])), 32, axis=0).T
        assert np.all(np.abs(got - ref) <= F32_EPS * (offsets + np.abs(ref)))


def test_the_q4_k_search_never_loses_to_the_plain_grid():
    """Each group's fit (llama.cpp's make_qkx2_quants) has at most the weighted squared error of the plain
    [min(x, 0), max(x)] grid, which is one of its candidates; on heavy-tailed weights it is lower in total."""
    g = jnp.asarray(np.random.default_rng(4).standard_t(5, size=(64, 32)), jnp.float32)  # 64 groups
    w = jnp.sqrt(jnp.mean(g * g, -1, keepdims=True)) + jnp.abs(g)

    def error(scale, lo):  # weighted squared error of the group on its 16 levels
        levels = jnp.clip(jnp.round((g - lo[:, None]) / scale[:, None]), 0, 15)
        return np.asarray(jnp.sum(w * (scale[:, None] * levels + lo[:, None] - g) ** 2, -1))

    lo = jnp.minimum(g.min(-1), 0.0)
    plain = error((g.max(-1) - lo) / 15, lo)
    fitted = error(*_fit_groups(g))
    assert np.all(fitted <= plain * (1 + 1e-6)) and fitted.sum() < 0.97 * plain.sum()


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_every_value_is_within_half_a_step_of_its_grid(fmt):
    """Hand-computed from the stored arrays: each value is at most half its group's step from the dequantized one,
    except past the grid's ends where the 6-bit (8-bit) rounding of the group's scale shrank it (then clipped to the
    end) and where the group's scale rounds to 0; the super-block scales are the largest group scale over 63 (127),
    rounded to float16, so that group's sub-scale is the top one."""
    w = _weight(2)
    qw = quantize_k(w, fmt)
    g = 32 if fmt == "q4_k" else 16
    scale = np.repeat(np.asarray(qw.group_scales()[0]), g, axis=0)  # [K, N]
    err = np.abs(np.asarray(qw.dequantize()) - w)
    codes = np.swapaxes(np.asarray(qw.natural_codes()).astype(np.int32), 0, 1)  # [K, N]
    lo, hi = (-8, 7) if fmt == "q4_k" else (-32, 31)
    inside = (codes > lo) & (codes < hi) & (scale > 0)
    assert np.all(err[inside] <= scale[inside] / 2 * (1 + 1e-5) + 1e-12)
    if fmt == "q6_k":  # a group whose scale is under half of d rounds its sub-scale to 0: |w| < 31·d/2 there
        d_k = np.repeat(np.asarray(qw.super_scales, np.float32), 256, axis=0)  # [K, N]
        assert np.all(err[scale == 0] <= 31 * d_k[scale == 0] / 2)
    d = np.asarray(qw.super_scales, np.float32)  # [K/256, N]
    sc = np.asarray(qw.scales, np.int32).reshape(2, 256 // g, 24)  # [super-block, group, N]
    if fmt == "q6_k":  # round to nearest: d is the largest group's amax / 31, over 127
        wanted = np.abs(w.reshape(2, 256 // g, g, 24)).max(2) / 31
        np.testing.assert_array_equal(d, (wanted.max(1) / 127).astype(np.float16))
    else:  # the fitted scales: the largest group of each super-block takes the top sub-scale, 63
        assert np.all((sc.max(1) == 63) | (d == 0)) and sc.min() >= 0
    assert np.all(err[32:64, 1] == 0) and np.all(err <= np.abs(w).max() / 8)  # a zero group stays zero


def test_q4_k_m_picks_the_tensors_llama_quantize_picked():
    """The committed file was made by llama.cpp's llama-quantize at Q4_K_M from a 4-layer model: its attn_v and
    ffn_down are Q6_K (or Q8_0, Q6_K's fallback where rows are not whole super-blocks) exactly in the layers our mix
    gives Q6_K, and the output projection is Q6_K."""
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(Q4_K_M_FILE).tensors}
    layers = 4
    more = {QT.Q6_K, QT.Q8_0}
    for i in range(layers):
        for ours, theirs in (("v_proj", "attn_v"), ("down_proj", "ffn_down"), ("q_proj", "attn_q")):
            assert (mix_format("q4_k_m", ours, i, layers) == "q6_k") == (types[f"blk.{i}.{theirs}.weight"] in more)
    assert types["output.weight"] == QT.Q6_K and mix_format("q4_k_m", "lm_head", None, layers) == "q6_k"
    # Llama-3.1-8B's 32 layers: the first and last four and every third between
    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]


CFG = ModelConfig("tiny-kquant", 97, 256, 4, 4, 2, 512, max_seq_len=64)


def test_q4_k_m_model_bytes_and_runs():
    """A model quantized to Q4_K_M holds what `cost.decode_cost` counts ahead, byte for byte; its layers mix two
    formats (v and down in Q6_K in layers 2 and 3), so the looping pass makes runs of equal layers: looped equals
    unrolled, and both equal the dense model of the dequantized weights."""
    model = quantize_weights(init_random(CFG, seed=3), "q4_k_m")
    fmts = [layer.mlp.down_proj.weight.get_value().fmt for layer in model.layers]
    assert fmts == ["Q4_K", "Q4_K", "Q6_K", "Q6_K"]
    assert step_weight_bytes(model) == decode_cost(CFG, quantize="q4_k_m", itemsize=4, context=0).weight_bytes
    drawn = init_random(CFG, seed=3, quantize="q4_k_m")  # drawn quantized: the same formats and bytes
    assert step_weight_bytes(drawn) == step_weight_bytes(model)
    prompt = [[5, 9, 2, 7, 1]]
    looped, unrolled = Engine(model, loop_layers=True), Engine(model, loop_layers=False)
    assert looped.generate(prompt, max_new_tokens=6).token_ids == unrolled.generate(prompt, max_new_tokens=6).token_ids
    np.testing.assert_allclose(
        looped.forward_logits(np.array(prompt)), unrolled.forward_logits(np.array(prompt)), rtol=1e-5, atol=1e-5
    )


def test_a_width_without_super_blocks_falls_back():
    """K = 576 (SmolLM2's width) holds no whole super-block: Q4_K takes int4 and Q6_K int8, in groups of 32."""
    w = jax.random.normal(jax.random.key(0), (576, 64), jnp.float32)
    assert (quantize_k(w, "q4_k").fmt, quantize_k(w, "q4_k").group) == ("int4", 32)
    assert (quantize_k(w, "q6_k").fmt, quantize_k(w, "q6_k").super_scales) == ("int8", None)
    with pytest.raises(ValueError, match="unknown K-quant 'q5_k'"):
        quantize_k(w, "q5_k")

"""kernels/quant_gemm.py against its jnp reference: compiled on Hopper, interpreted on the CPU.

The interpret-mode subclass runs the Mosaic GPU kernel through Mosaic GPU's own interpreter (SMEM,
TMA, barriers, wgmma), which takes wgmma operands from SMEM only: there the codes, converted and
scaled in registers exactly as compiled, go through an SMEM buffer before the wgmma. On a GPU
machine run with JAX_PLATFORMS=cuda,cpu (the interpreter's callbacks need the CPU device).
Because the interpreter skips Mosaic GPU's layout and swizzle rules, a few Llama-sized calls are also
lowered for CUDA on whatever host runs the tests, which applies those rules without a GPU.

Grid: int4 and int8 codes; G = 32, 128 and per-channel (G = K); with and without offsets; M = 1, 5,
8, 19; stacked (traced layer index, the last layer) and unstacked; k_splits 1, 2 and 4; f16, bf16
and f32 scales; both scale placements (`QuantBlocks.scale_in`); two levels of scales (the K-quants', at M
past the stream kernel's 64, where this kernel takes their calls).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import two_level_scales

from kernels import quant_gemm as qg
from kernels import superblocks

ON_HOPPER = jax.default_backend() == "gpu" and any(s in jax.devices()[0].device_kind for s in ("H100", "H200"))
# Outputs are ~N(0, 1). Kernel and reference each round an f32 sum to the output dtype once (bf16: a
# half-ulp, 2^-8 relative, so they differ by up to one ulp, 2^-7) and add over K in different orders
# (f32: ~2^-24·√K, far below that).
RTOL = {jnp.bfloat16: 2.0**-7, jnp.float16: 2.0**-10}
ATOL = {jnp.bfloat16: 2.0**-7, jnp.float16: 2.0**-10}
# scale_in="w" rounds every scaled weight to x's dtype (bf16: 2^-9 relative, twice; with offsets,
# in the kernel under "w", three times over terms whose sum has σ √2·σ(y)), an error of at most
# ~2^-8·σ(y) per output that averages over K; 6σ of it.
ATOL_W = {jnp.bfloat16: 6 * 2.0**-8, jnp.float16: 6 * 2.0**-11}


@dataclasses.dataclass(frozen=True)
class Case:
    m: int
    codes: str  # "int4" | "int8"
    group: int  # 0: per-channel (G = K)
    scales: str = "float32"
    offsets: bool = False
    stacked: bool = True
    k_splits: int | None = 1
    scale_in: str = "acc"
    x: str = "bfloat16"
    n: int = 128
    k: int = 512

    @property
    def g(self) -> int:
        return self.group or self.k


CASES = {
    "int4_g128_m1": Case(1, "int4", 128),
    "int4_g32_m5_f16scales_offsets": Case(5, "int4", 32, scales="float16", offsets=True),
    "int4_g32_m19_w_split2": Case(19, "int4", 32, scale_in="w", k_splits=2),
    "int4_perchannel_m8_split4_unstacked": Case(8, "int4", 0, k_splits=4, stacked=False),
    "int4_g128_m8_bf16scales_w_offsets": Case(8, "int4", 128, scales="bfloat16", scale_in="w", offsets=True),
    "int8_g128_m8_f16scales_offsets_split2": Case(8, "int8", 128, scales="float16", offsets=True, k_splits=2),
    "int8_g32_m19_unstacked": Case(19, "int8", 32, stacked=False, n=256, k=256),
    "int8_perchannel_m1_w_offsets": Case(1, "int8", 0, scale_in="w", offsets=True),
    "int8_g32_m5_w_f16scales": Case(5, "int8", 32, scales="float16", scale_in="w"),
    "int8_g128_m5_f16x_auto_splits": Case(5, "int8", 128, x="float16", k_splits=None),
    "int4_g128_m1_auto_offsets_split2": Case(1, "int4", 128, offsets=True, scale_in="auto", k_splits=2),
}
# name: (M, codes, G, offsets, scale_in, k_splits, stacked) of two-level weights, K = 512 (two super-blocks)
TWO_LEVEL = {
    "q4_k_like_m72_w_offsets": (72, jnp.int4, 32, True, "w", 1, True),
    "q4_k_like_m8_acc_offsets_split2": (8, jnp.int4, 32, True, "acc", 2, True),
    "q6_k_like_int8_g16_m5_unstacked": (5, jnp.int8, 16, False, "acc", 1, False),
}


BLOCKS = qg.QuantBlocks(tile_n=64, tile_k=128, max_concurrent_steps=2)  # 4 k-steps at K = 512
LAYERS = 3


def _inputs(case: Case, seed: int = 0):
    """x ~ N(0, 1); codes uniform over their range; scales (and offsets) sized so that y ~ N(0, 1)."""
    ks = jax.random.split(jax.random.key(seed), 4)
    cdt, hi = (jnp.int4, 8) if case.codes == "int4" else (jnp.int8, 128)
    x = jax.random.normal(ks[0], (case.m, case.k), jnp.float32).astype(case.x)
    codes = jax.random.randint(ks[1], (LAYERS, case.n, case.k), -hi, hi, jnp.int32).astype(cdt)  # [L, N, K]
    groups = case.k // case.g
    unit = 1.0 / (hi / np.sqrt(3) * np.sqrt(case.k))  # 1 / (code rms · √K)
    scales = jax.random.uniform(ks[2], (LAYERS, groups, case.n), jnp.float32, 0.5, 1.5) * unit  # [L, K/G, N]
    offsets = None
    if case.offsets:  # Σ_g offsets · xsum: xsum ~ N(0, G)
        offsets = jax.random.normal(ks[3], (LAYERS, groups, case.n), jnp.float32) / np.sqrt(case.k)
    scales = scales.astype(case.scales)
    if not case.stacked:
        return x, codes[0], scales[0], None if offsets is None else offsets[0], None
    return x, codes, scales, offsets, jnp.int32(LAYERS - 1)


def _close(out, ref, dtype, scale_in="acc"):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all()
    diff = np.abs(out - ref)
    atol = (ATOL_W if scale_in == "w" else ATOL)[dtype]
    ok = diff <= atol + RTOL[dtype] * np.abs(ref)
    assert ok.all(), f"max diff {diff.max():.3g}, mean {diff.mean():.3g}, |ref| max {np.abs(ref).max():.3g}"


class TestQuantGemm:
    INTERPRET = False

    def setup_method(self):
        if not self.INTERPRET and not ON_HOPPER:
            pytest.skip("compiled Mosaic GPU kernels need a Hopper GPU")

    @pytest.mark.parametrize("name", list(CASES))
    def test_matches_reference(self, name):
        case = CASES[name]
        x, codes, scales, offsets, layer = _inputs(case)
        cfg = dataclasses.replace(BLOCKS, k_splits=case.k_splits, scale_in=case.scale_in)
        out = qg.quant_gemm(x, codes, scales, offsets, layer, group=case.g, block_sizes=cfg, interpret=self.INTERPRET)
        ref = qg.quant_gemm_reference(x, codes, scales, offsets, layer, group=case.g)
        _close(out, ref, jnp.dtype(case.x).type, cfg.resolved(offsets is not None).scale_in)

    def test_loop_over_layers_reads_each_layer(self):
        """A fori_loop with a traced layer index, each layer's output feeding the next ([L, K, K] codes)."""
        case = Case(8, "int4", 128, n=256, k=256)
        x, codes, scales, _, _ = _inputs(case, seed=1)

        def run(gemm):
            return jax.lax.fori_loop(0, LAYERS, lambda l, c: gemm(c, l), x)

        cfg = dataclasses.replace(BLOCKS, k_splits=2)
        out = run(
            lambda c, l: qg.quant_gemm(c, codes, scales, None, l, group=128, block_sizes=cfg, interpret=self.INTERPRET)
        )
        _close(out, run(lambda c, l: qg.quant_gemm_reference(c, codes, scales, None, l, group=128)), jnp.bfloat16)

    @pytest.mark.parametrize("name", list(TWO_LEVEL))
    def test_two_level_matches_reference(self, name):
        """Int8 sub-scales (and mins) and f16 super-blocks, multiplied in the kernel, against the reference on the
        expanded scales; under "acc" the offsets are added outside the kernel from the layer's expanded ones."""
        m, cdt, group, offsets, scale_in, k_splits, stacked = TWO_LEVEL[name]
        case = Case(m, "int4" if cdt == jnp.int4 else "int8", group, offsets=offsets, k_splits=k_splits)
        x, codes, *_ = _inputs(case, seed=2)
        hi = 8 if cdt == jnp.int4 else 128
        levels = two_level_scales(jax.random.key(3), LAYERS, case.k, case.n, group, np.sqrt(3 / case.k) / hi, offsets)
        layer = jnp.int32(LAYERS - 1) if stacked else None
        if not stacked:
            codes, levels = codes[LAYERS - 1], tuple(None if a is None else a[LAYERS - 1] for a in levels)
        sub, mins, d, dmin = levels
        cfg = dataclasses.replace(BLOCKS, k_splits=k_splits, scale_in=scale_in)
        out = qg.quant_gemm(
            x,
            codes,
            sub,
            mins,
            layer,
            group=group,
            block_sizes=cfg,
            interpret=self.INTERPRET,
            super_scales=d,
            super_offsets=dmin,
        )
        ref = qg.quant_gemm_reference(x, codes, *superblocks.expand(*levels), layer, group=group)
        _close(out, ref, jnp.bfloat16, cfg.resolved(offsets).scale_in)


class TestQuantGemmInterpret(TestQuantGemm):
    INTERPRET = True


LOWERED = {  # name: (M, codes dtype, G, scales dtype, QuantBlocks): Llama-sized K, N
    "int4_g32_acc_m1": (1, jnp.int4, 32, jnp.float16, qg.QuantBlocks()),
    "int4_g128_w_m8": (8, jnp.int4, 128, jnp.float32, qg.QuantBlocks(scale_in="w")),
    "int8_g128_acc_m19_n64_k512": (19, jnp.int8, 128, jnp.bfloat16, qg.QuantBlocks(tile_n=64, tile_k=512)),
    "int8_perchannel_w_m256": (256, jnp.int8, 4096, jnp.float32, qg.QuantBlocks(scale_in="w")),
}


@pytest.mark.parametrize("name", list(LOWERED))
def test_lowers_for_hopper_on_any_host(name):
    """Lowering for CUDA runs Mosaic GPU's layout, tiling and swizzle checks (which the interpreter
    skips) down to its LLVM-level module, on a machine without a GPU."""
    m, cdt, group, sdt, cfg = LOWERED[name]
    n, k, layers = 1024, 4096, 4
    args = (
        jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((layers, n, k), cdt),
        jax.ShapeDtypeStruct((layers, k // group, n), sdt),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    op = lambda x, c, s, l: qg.quant_gemm(x, c, s, None, l, group=group, block_sizes=cfg)
    text = jax.jit(op).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("scale_in", ["w", "acc"])
@pytest.mark.parametrize("cdt, group", [(jnp.int4, 32), (jnp.int8, 16)], ids=["q4_k", "q6_k"])
def test_two_level_lowers_for_hopper_on_any_host(cdt, group, scale_in):
    """Two levels at Llama's K (16 super-blocks) and M = 128, with Q4_K's offsets (in the kernel under "w")."""
    m, n, k, layers = 128, 1024, 4096, 4
    offsets = cdt == jnp.int4
    sub = jax.ShapeDtypeStruct((layers, k // group, n), jnp.int8)
    sup = jax.ShapeDtypeStruct((layers, k // 256, n), jnp.float16)
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((layers, n, k), cdt), sub)
    args += (sub if offsets else None, jax.ShapeDtypeStruct((), jnp.int32), sup, sup if offsets else None)
    cfg = qg.QuantBlocks(scale_in=scale_in)
    op = lambda x, c, s, o, l, ss, so: qg.quant_gemm(  # noqa: E731
        x, c, s, o, l, group=group, block_sizes=cfg, super_scales=ss, super_offsets=so
    )
    text = jax.jit(op).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_dequantize_reference_by_hand():
    """N = 2, K = 4, G = 2: w[k, n] = scales[k // 2, n] · codes[n, k] + offsets[k // 2, n]."""
    codes = jnp.array([[1, -2, 3, -8], [7, 0, -1, 2]], jnp.int4)  # [N, K]
    scales = jnp.array([[0.5, 2.0], [0.25, -1.0]], jnp.float16)  # [K/G, N]
    offsets = jnp.array([[1.0, 0.0], [0.0, 10.0]], jnp.float32)  # [K/G, N]
    w = qg.dequantize_reference(codes, scales, offsets, group=2)
    expected = [  # [K, N]
        [0.5 * 1 + 1, 2.0 * 7 + 0],
        [0.5 * -2 + 1, 2.0 * 0 + 0],
        [0.25 * 3 + 0, -1.0 * -1 + 10],
        [0.25 * -8 + 0, -1.0 * 2 + 10],
    ]
    assert w.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(w), np.array(expected, np.float32))
    stacked = qg.dequantize_reference(jnp.stack([codes, codes]), jnp.stack([scales, scales]), None, group=2)
    assert stacked.shape == (2, 4, 2)
    np.testing.assert_array_equal(
        np.asarray(stacked[1]), np.array(expected, np.float32) - np.asarray(jnp.repeat(offsets, 2, 0))
    )


def test_xla_impl_is_the_reference_and_takes_f32_x():
    case = CASES["int4_g32_m5_f16scales_offsets"]
    x, codes, scales, offsets, layer = _inputs(case)
    x32 = x.astype(jnp.float32)
    out = qg.quant_gemm(x32, codes, scales, offsets, layer, group=32, impl="xla")
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, qg.quant_gemm_reference(x32, codes, scales, offsets, layer, group=32))
    w = qg.dequantize_reference(codes[layer], scales[layer], offsets[layer], group=32)  # [K, N]
    np.testing.assert_allclose(np.asarray(out), np.asarray(x32) @ np.asarray(w), rtol=1e-5, atol=1e-5)


BAD = {  # name: (change to a valid call, message naming the numbers)
    "n_not_tiled": (dict(n=96), r"N=96 must be a multiple of tile_n=64"),
    "k_not_tiled": (dict(k=320, group=32), r"K=320 must be a multiple of tile_k=128"),
    "group_not_dividing_tile_k": (dict(k=384, group=96), r"tile_k=128 must be a multiple or divisor of G=96"),
    "int4_group_16": (dict(group=16), r"G=16"),
    "m_too_big": (dict(m=300), r"M=300"),
    "group_not_dividing_k": (dict(group=100), r"G=100 must divide K=512"),
    "codes_uint8": (dict(codes=jnp.uint8), r"int4 or int8, got uint8"),
    "scales_int": (dict(scales=jnp.int32), r"f16, bf16 or f32, got int32"),
    "x_f32_mosaic": (dict(x=jnp.float32), r"bf16 or f16 x, got float32.*impl='xla'"),
    "scales_wrong_shape": (dict(scale_groups=2), r"scales \[L, K/G, N\]=\(1, 2, 128\)"),
    "unknown_scale_in": (dict(scale_in="x"), r"scale_in must be 'acc', 'w' or 'auto', got 'x'"),
}


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_input_raises_naming_the_numbers(bad):
    change, message = BAD[bad]
    p = dict(m=5, n=128, k=512, group=128, codes=jnp.int4, scales=jnp.float32, x=jnp.bfloat16) | change
    x = jnp.zeros((p["m"], p["k"]), p["x"])
    codes = jnp.zeros((1, p["n"], p["k"]), p["codes"])
    scales = jnp.ones((1, p.get("scale_groups", p["k"] // p["group"]), p["n"]), p["scales"])
    with pytest.raises(ValueError, match=message):
        cfg = dataclasses.replace(BLOCKS, scale_in=p.get("scale_in", "acc"))
        qg.quant_gemm(x, codes, scales, None, 0, group=p["group"], block_sizes=cfg, interpret=True)


def test_stacked_without_layer_raises():
    x, codes, scales, _, _ = _inputs(CASES["int4_g128_m1"])
    with pytest.raises(ValueError, match="layer index"):
        qg.quant_gemm(x, codes, scales, group=128, interpret=True)

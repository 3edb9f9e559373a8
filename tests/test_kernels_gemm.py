"""kernels/flat_gemm.py against its jnp reference: compiled on a GPU, interpreted on the CPU.

The Mosaic GPU kernel runs on the CPU through Mosaic GPU's own interpreter
(`plgpu.InterpretGPUParams`: shared memory, TMA, barriers, wgmma); the Triton-flavoured kernel
through Pallas' HLO interpreter. tests/conftest.py pins JAX to the CPU; on a GPU machine run with
JAX_PLATFORMS=cuda,cpu (the interpret-mode subclass needs the CPU device for its callbacks).

Grid (kernels.shapes.TEST_GEMM): M = 1, 2, 5, 8, 19, 64, 128, stacked and unstacked weights, split K.
Kernels run with poisoned (NaN-filled) output buffers, so an element they skip fails the comparison:
aliased into the Triton kernel, the interpreter's NaN-initialized GMEM for the Mosaic one (compiled
Mosaic cannot alias an output in jax 0.11, so the compiled class checks it unpoisoned).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import dispatch
from kernels import flat_gemm as fg
from kernels.shapes import TEST_GEMM

ON_HOPPER = jax.default_backend() == "gpu" and any(s in jax.devices()[0].device_kind for s in ("H100", "H200"))
# bf16 output rounding (2^-8 relative) of values ~1, and a different f32 summation order over K.
ATOL = {jnp.bfloat16: 2e-2}
RTOL = {jnp.bfloat16: 1e-2}
BLOCKS = fg.BlockSizes(tile_n=64, tile_k=128, max_concurrent_steps=2)  # 2 k-steps at K=256


def _inputs(shape, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(ks[0], (shape.m, shape.k), jnp.bfloat16)
    scale = 1.0 / np.sqrt(shape.k)
    w = (jax.random.normal(ks[1], (shape.layers, shape.k, shape.n)) * scale).astype(jnp.bfloat16)
    w2 = (jax.random.normal(ks[2], (shape.layers, shape.k, shape.n)) * scale).astype(jnp.bfloat16)
    r = jax.random.normal(ks[3], (shape.m, shape.n), jnp.bfloat16)
    return x, w, w2, r


def _close(out, ref, dtype=jnp.bfloat16):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    diff = np.abs(out - ref)
    ok = diff <= ATOL[dtype] + RTOL[dtype] * np.abs(ref)
    assert ok.all(), f"max diff {diff.max():.3g}, mean {diff.mean():.3g}"


def _impls(m):
    return ["mosaic", "triton"] + (["gemv"] if m == 1 else [])


CASES = [(name, impl) for name, s in TEST_GEMM.items() for impl in _impls(s.m)]


class TestFlatGemm:
    INTERPRET = False

    def setup_method(self):
        if not self.INTERPRET and not ON_HOPPER:
            pytest.skip("compiled Mosaic GPU kernels need a Hopper GPU")

    def _poison(self, impl):
        return self.INTERPRET or impl != "mosaic"

    @pytest.mark.parametrize("name,impl", CASES, ids=[f"{n}-{i}" for n, i in CASES])
    def test_stacked_layer_matches_reference(self, name, impl):
        shape = TEST_GEMM[name]
        x, w, _, r = _inputs(shape)
        layer = jnp.int32(shape.layers - 1)  # traced: the op is jitted with layer as an argument
        out = fg.flat_gemm(
            x, w, layer, r, impl=impl, block_sizes=BLOCKS, interpret=self.INTERPRET, poison=self._poison(impl)
        )
        _close(out, fg.flat_gemm_reference(x, w, layer, r))

    @pytest.mark.parametrize("impl", ["mosaic", "triton"])
    def test_swiglu_matches_reference(self, impl):
        shape = TEST_GEMM["tiny_m5_k256_n192"]
        x, wg, wu, _ = _inputs(shape, seed=1)
        out = fg.flat_gemm_swiglu(
            x, wg, wu, 1, impl=impl, block_sizes=BLOCKS, interpret=self.INTERPRET, poison=self._poison(impl)
        )
        _close(out, fg.flat_gemm_swiglu_reference(x, wg, wu, 1))

    def test_swiglu_m128_halves_tile_k_to_fit_two_stages(self):
        """Two weights at M = 128 and tile_k 256 need 128 KiB a stage: the kernel must halve tile_k so that
        its two pipeline stages fit (it raised "max_concurrent_steps must be greater than ..." before)."""
        shape = TEST_GEMM["tiny_m128_k256_n64"]
        x, wg, wu, _ = _inputs(shape, seed=5)
        cfg = fg.BlockSizes(tile_n=64, tile_k=256, max_concurrent_steps=4)
        out = fg.flat_gemm_swiglu(
            x, wg, wu, 0, impl="mosaic", block_sizes=cfg, interpret=self.INTERPRET, poison=self.INTERPRET
        )
        _close(out, fg.flat_gemm_swiglu_reference(x, wg, wu, 0))

    def test_unstacked_weight_and_k_splits(self):
        shape = TEST_GEMM["tiny_m8_k512_n128"]
        x, w, _, _ = _inputs(shape, seed=2)
        cfg = fg.BlockSizes(tile_n=64, tile_k=128, max_concurrent_steps=2, k_splits=2)
        out = fg.flat_gemm(x, w[0], impl="mosaic", block_sizes=cfg, interpret=self.INTERPRET, poison=self.INTERPRET)
        _close(out, fg.flat_gemm_reference(x, w[0]))

    @pytest.mark.parametrize("name", ["tiny_m1_k256_n128", "tiny_m8_k512_n128", "tiny_m128_k256_n64"])
    def test_dispatched_impl_matches_reference(self, name):
        """M = 1 → gemv, 8 → mosaic, 128 → XLA under a table with M1 = 2, M2 = 64 (tests/ synthetic)."""
        shape = TEST_GEMM[name]
        x, w, _, r = _inputs(shape, seed=4)
        table = dispatch.parse_table(
            dict(
                device_kind="test",
                source="test",
                gemm=[dict(op="t", form="plain", n=shape.n, k=shape.k, m1=2, m2=64, flat_impl="mosaic")],
            )
        )
        choice = dispatch.choose_gemm(shape.m, shape.n, shape.k, table=table, block_sizes=BLOCKS)
        assert choice.impl == {1: "gemv", 8: "mosaic", 128: "xla"}[shape.m], choice
        out = fg.flat_gemm(
            x, w, 1, r, impl=choice.impl, block_sizes=BLOCKS, interpret=self.INTERPRET, poison=self._poison(choice.impl)
        )
        _close(out, fg.flat_gemm_reference(x, w, 1, r))

    @pytest.mark.parametrize("name,impl", [("tiny_m1_k256_n128", "gemv"), ("tiny_m5_k256_n192", "triton")])
    def test_partials_sum_to_the_gemm(self, name, impl):
        """flat_gemm_partials [splits, M, N]: summed over the splits and rounded, flat_gemm's result bit for
        bit (the same kernel and sum); each split alone is not."""
        shape = TEST_GEMM[name]
        x, w, _, _ = _inputs(shape, seed=6)
        cfg = fg.BlockSizes(tile_n=64, tile_k=64, k_splits=2)
        parts = fg.flat_gemm_partials(x, w, 1, impl=impl, block_sizes=cfg, interpret=self.INTERPRET)
        assert parts.shape == (2, shape.m, shape.n) and parts.dtype == jnp.float32
        out = fg.flat_gemm(x, w, 1, impl=impl, block_sizes=cfg, interpret=self.INTERPRET)
        np.testing.assert_array_equal(
            np.asarray(parts.sum(axis=0).astype(x.dtype), np.float32), np.asarray(out, np.float32)
        )
        _close(out, fg.flat_gemm_reference(x, w, 1))
        assert not np.allclose(np.asarray(parts[0]), np.asarray(out, np.float32), atol=1e-2)

    def test_loop_over_layers_reads_each_layer(self):
        shape = TEST_GEMM["tiny_m8_k512_n128"]
        x, w, _, _ = _inputs(shape, seed=3)
        w = jnp.tile(w, (1, 1, shape.k // shape.n))  # [L, K, K]: each output feeds the next layer

        def run(gemm):
            return jax.lax.fori_loop(0, shape.layers, lambda l, c: gemm(c, l), x)

        out = run(lambda c, l: fg.flat_gemm(c, w, l, impl="mosaic", block_sizes=BLOCKS, interpret=self.INTERPRET))
        _close(out, run(lambda c, l: fg.flat_gemm_reference(c, w, l)))


class TestFlatGemmInterpret(TestFlatGemm):
    INTERPRET = True


def test_xla_impl_is_the_reference():
    shape = TEST_GEMM["tiny_m5_k256_n192"]
    x, w, w2, r = _inputs(shape)
    np.testing.assert_array_equal(fg.flat_gemm(x, w, 1, r, impl="xla"), fg.flat_gemm_reference(x, w, 1, r))
    np.testing.assert_array_equal(
        fg.flat_gemm_swiglu(x, w, w2, 0, impl="xla"), fg.flat_gemm_swiglu_reference(x, w, w2, 0)
    )


def test_poison_needs_interpret_for_mosaic():
    shape = TEST_GEMM["tiny_m5_k256_n192"]
    x, w, _, _ = _inputs(shape)
    with pytest.raises(ValueError, match="poison"):
        fg.flat_gemm(x, w, 0, impl="mosaic", block_sizes=BLOCKS, poison=True)


def test_partials_take_the_triton_kernels_only():
    x, w, _, _ = _inputs(TEST_GEMM["tiny_m1_k256_n128"])
    with pytest.raises(ValueError, match="impl 'gemv' or 'triton'"):
        fg.flat_gemm_partials(x, w, 0, impl="mosaic", interpret=True)


@pytest.mark.parametrize("bad", ["stacked_without_layer", "n_not_tiled", "gemv_m2", "m_too_big"])
def test_bad_input_raises(bad):
    shape = TEST_GEMM["tiny_m5_k256_n192"]
    x, w, _, _ = _inputs(shape)
    with pytest.raises(ValueError):
        if bad == "stacked_without_layer":
            fg.flat_gemm(x, w, interpret=True)
        elif bad == "n_not_tiled":
            fg.flat_gemm(x, w[:, :, :100], 0, interpret=True)
        elif bad == "gemv_m2":
            fg.flat_gemm(x[:2], w, 0, impl="gemv", interpret=True)
        else:
            fg.flat_gemm(jnp.zeros((300, shape.k), jnp.bfloat16), w, 0, interpret=True)

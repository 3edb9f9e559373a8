"""kernels/rms_norm against its jnp reference (which is what the model's RMSNorm computes), both
implementations (Triton, Mosaic GPU), in interpret mode on the CPU and compiled on an H100/H200; outputs
poisoned beforehand (Mosaic GPU: its interpreter's outputs start as NaN; compiled, no poison). The
Mosaic kernels are also lowered for CUDA on any host, at Llama sizes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.model import rms_norm as model_rms_norm
from kernels import rms_norm as rn
from kernels.rms_norm import chunk_size, residual_rms_norm, residual_rms_norm_reference, rms_norm, rms_norm_reference

ON_GPU = jax.default_backend() == "gpu" and any(k in jax.devices()[0].device_kind for k in ("H100", "H200"))
# (rows, D): Llama (4096), Qwen2.5-7B (3584 = 7 x 512), SmolLM2 (576 = 9 x 64), prefill-sized rows
SHAPES = [(1, 4096), (8, 3584), (3, 576), (32, 64)]
# Mosaic GPU interpreted, few and small: an odd M at D = 256 (rows loaded from GMEM into registers) and
# SmolLM2's 576 (not a multiple of 128: rows staged through SMEM)
NORM_CASES = [("triton", r, d, dt) for r, d in SHAPES for dt in (jnp.bfloat16, jnp.float32)] + [
    ("mosaic", 3, 256, jnp.bfloat16),
    ("mosaic", 3, 256, jnp.float16),
    ("mosaic", 1, 256, jnp.float32),
    ("mosaic", 2, 576, jnp.bfloat16),
]
# (impl, splits, rows, D)
RESIDUAL_CASES = [("triton", 4, 1, 4096), ("triton", 2, 3, 3584), ("triton", 1, 2, 576), ("triton", 3, 1, 64)] + [
    ("mosaic", 3, 3, 256),
    ("mosaic", 2, 1, 576),
]


def _inputs(rows, dim, dtype, seed=0, layers=5):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = (3.0 * jax.random.normal(kx, (rows, dim))).astype(dtype)
    weights = (1.0 + 0.2 * jax.random.normal(kw, (layers, dim))).astype(dtype)  # a stack of layers
    return x, weights


def _rtol(dtype) -> float:
    """The sum of squares runs in another order than the reference's: one rounding step of the output
    dtype at most (bf16: 2^-8 relative, f16: 2^-11; f32: a few ulps)."""
    return {jnp.bfloat16: 2.0**-7, jnp.float16: 2.0**-10}.get(dtype, 1e-6)


def _check_norm(out, x, weights, layer, dtype):
    ref = rms_norm_reference(x, weights, layer, eps=1e-5)
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all(), "an element was not written"
    np.testing.assert_allclose(out, ref, rtol=_rtol(dtype), atol=0)


def _check_residual(s, out, partials, residual, weights, layer, dtype):
    assert s.dtype == out.dtype == dtype and s.shape == out.shape == residual.shape
    assert np.isfinite(np.asarray(s, np.float32)).all() and np.isfinite(np.asarray(out, np.float32)).all()
    # the sum against numpy, which rounds where the model does (XLA on the GPU may keep the projection's
    # output in f32 before the add: its excess precision), the splits in order: equal
    host = np.asarray(partials)
    total = functools.reduce(np.add, list(host))  # [M, D] f32
    block_out = total.astype(np.dtype(dtype))
    s_host = (np.asarray(residual).astype(np.float32) + block_out.astype(np.float32)).astype(np.dtype(dtype))
    np.testing.assert_array_equal(np.asarray(s, np.float32), s_host.astype(np.float32))
    # the norm, in numpy too (the model's two roundings), the sum of squares in another order
    s32 = s_host.astype(np.float32)
    normed = (s32 / np.sqrt((s32 * s32).mean(axis=-1, keepdims=True) + 1e-5)).astype(np.dtype(dtype))
    w = np.asarray(weights[layer]).astype(np.float32)
    out_ref = (normed.astype(np.float32) * w).astype(np.dtype(dtype))
    np.testing.assert_allclose(np.asarray(out, np.float32), out_ref.astype(np.float32), rtol=_rtol(dtype), atol=0)


def test_reference_is_the_models_norm():
    x, weights = _inputs(4, 576, jnp.bfloat16)
    np.testing.assert_array_equal(
        np.asarray(rms_norm_reference(x, weights, 3, eps=1e-5), np.float32),
        np.asarray(model_rms_norm(x, weights[3], 1e-5), np.float32),
    )


def test_chunk_size_divides():
    assert [chunk_size(d) for d in (4096, 3584, 576, 8192, 12288)] == [4096, 512, 64, 4096, 4096]


class TestRMSNorm:
    INTERPRET = True

    def setup_method(self):
        if not self.INTERPRET and not ON_GPU:
            pytest.skip("the compiled kernel is checked on an H100/H200")

    @pytest.fixture(autouse=True)
    def _interpret_on_the_cpu(self):
        """Interpreted kernels run on the CPU: on a GPU, XLA would keep float32 where the kernel rounds
        (its excess precision), and the exact-rounding checks below would test XLA, not the kernel."""
        if not self.INTERPRET:
            yield
            return
        with jax.default_device(jax.devices("cpu")[0]):
            yield

    def _poison(self, impl: str) -> bool:
        """Compiled Mosaic GPU kernels take no aliased (poisoned) output; interpreted, their outputs start as NaN."""
        return self.INTERPRET or impl == "triton"

    @pytest.mark.parametrize("impl, rows, dim, dtype", NORM_CASES)
    def test_matches_reference(self, impl, rows, dim, dtype):
        x, weights = _inputs(rows, dim, dtype, seed=rows + dim)
        out = rms_norm(
            x, weights, jnp.int32(3), eps=1e-5, interpret=self.INTERPRET, poison=self._poison(impl), impl=impl
        )
        assert out.dtype == dtype and out.shape == x.shape
        _check_norm(out, x, weights, 3, dtype)

    @pytest.mark.parametrize("impl, rows, dim, layers", [("triton", 2, 4096, 5), ("mosaic", 3, 256, 3)])
    def test_layer_index_selects_the_weight_row(self, impl, rows, dim, layers):
        x, weights = _inputs(rows, dim, jnp.bfloat16, layers=layers)
        outs = [
            np.asarray(
                rms_norm(
                    x, weights, jnp.int32(i), eps=1e-5, interpret=self.INTERPRET, poison=self._poison(impl), impl=impl
                ),
                np.float32,
            )
            for i in range(layers)
        ]
        for i, out in enumerate(outs):
            _check_norm(out, x, weights, i, jnp.bfloat16)
        assert not np.array_equal(outs[0], outs[1])

    @pytest.mark.parametrize("impl, splits, rows, dim", RESIDUAL_CASES)
    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
    def test_residual_norm_matches_reference(self, impl, splits, rows, dim, dtype):
        residual, weights = _inputs(rows, dim, dtype, seed=splits + rows + dim)
        partials = jax.random.normal(jax.random.key(dim), (splits, rows, dim), jnp.float32)
        s, out = residual_rms_norm(
            partials,
            residual,
            weights,
            jnp.int32(2),
            eps=1e-5,
            interpret=self.INTERPRET,
            poison=self._poison(impl),
            impl=impl,
        )
        _check_residual(s, out, partials, residual, weights, 2, dtype)

    @pytest.mark.parametrize("impl", ["triton", "mosaic"])
    def test_residual_norm_rounds_as_the_model(self, impl):
        """By hand, in numpy: the projection's output rounds to bf16 before the residual add. With u = 2^-9
        (a quarter of bf16's step at 1), partials summing to 1 + 1.5u round to 1; adding the residual u gives
        1 + u, which rounds to 1. One rounding of the exact 1 + 2.5u would give 1 + 4u."""
        import ml_dtypes

        dim, u = 256, 2.0**-9
        partials = jnp.full((2, 1, dim), 0.5 + 0.75 * u, jnp.float32)
        residual = jnp.full((1, dim), u, jnp.bfloat16)
        weights = jnp.ones((1, dim), jnp.bfloat16)
        s, out = residual_rms_norm(partials, residual, weights, 0, eps=0.0, interpret=self.INTERPRET, impl=impl)
        block_out = np.float32(1.0 + 1.5 * u).astype(ml_dtypes.bfloat16)
        expected = (np.float32(block_out) + np.float32(u)).astype(ml_dtypes.bfloat16)
        assert float(expected) == 1.0 and float(np.float32(1.0 + 2.5 * u).astype(ml_dtypes.bfloat16)) == 1.0 + 4 * u
        np.testing.assert_array_equal(np.asarray(s, np.float32), np.float32(expected))
        np.testing.assert_array_equal(np.asarray(out, np.float32), 1.0)  # a constant row normalizes to 1

    def test_mosaic_stream_reuses_smem_slots(self):
        """Five splits through two SMEM stages (the budget holds two rows of partials): each stage's slot
        is refilled, and the sum still takes every split once, in order."""
        residual, weights = _inputs(2, 256, jnp.bfloat16, layers=2)
        partials = jax.random.normal(jax.random.key(5), (5, 2, 256), jnp.float32)
        s, out = rn._mosaic_residual_call(
            partials,
            residual,
            weights,
            jnp.int32(1),
            eps=1e-5,
            interpret=self.INTERPRET,
            poison=self.INTERPRET,
            smem_bytes=2 * 256 * 4,
        )
        _check_residual(s, out, partials, residual, weights, 1, jnp.bfloat16)


class TestRMSNormCompiled(TestRMSNorm):
    INTERPRET = False

    @pytest.mark.parametrize("rows, dim, splits", [(1, 4096, 4), (8, 8192, 16), (64, 4096, 2), (1, 3584, 1)])
    def test_mosaic_at_model_widths(self, rows, dim, splits):
        """Llama-3.1-8B / 70B and Qwen2.5-7B widths, decode batch sizes, the GEMV's split counts."""
        x, weights = _inputs(rows, dim, jnp.bfloat16, seed=dim + rows, layers=4)
        _check_norm(rms_norm(x, weights, jnp.int32(3), eps=1e-5, impl="mosaic"), x, weights, 3, jnp.bfloat16)
        partials = jax.random.normal(jax.random.key(dim), (splits, rows, dim), jnp.float32)
        s, out = residual_rms_norm(partials, x, weights, jnp.int32(2), eps=1e-5, impl="mosaic")
        _check_residual(s, out, partials, x, weights, 2, jnp.bfloat16)


@pytest.mark.parametrize("op", ["rms_norm", "residual_rms_norm"])
@pytest.mark.parametrize("rows, dim, splits", [(1, 4096, 4), (64, 8192, 16), (1, 576, 2)])
def test_mosaic_lowers_for_hopper_on_any_host(op, rows, dim, splits):
    """Lowering for CUDA runs Mosaic GPU's layout and TMA checks (which the interpreter skips) down to its
    LLVM-level module, on a machine without a GPU: Llama-3.1-8B (4096) and 70B (8192) widths, and 576
    (SmolLM2: rows staged through SMEM)."""
    x = jax.ShapeDtypeStruct((rows, dim), jnp.bfloat16)
    weights = jax.ShapeDtypeStruct((32, dim), jnp.bfloat16)
    layer = jax.ShapeDtypeStruct((), jnp.int32)
    if op == "rms_norm":
        traced = jax.jit(lambda x, w, l: rms_norm(x, w, l, eps=1e-5, impl="mosaic")).trace(x, weights, layer)
    else:
        partials = jax.ShapeDtypeStruct((splits, rows, dim), jnp.float32)
        fn = lambda p, x, w, l: residual_rms_norm(p, x, w, l, eps=1e-5, impl="mosaic")  # noqa: E731
        traced = jax.jit(fn).trace(partials, x, weights, layer)
    assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()


def test_residual_reference_is_the_models_ops():
    """The jnp reference equals the model's o-projection rounding, residual add and RMSNorm."""
    residual, weights = _inputs(2, 576, jnp.bfloat16)
    partials = jax.random.normal(jax.random.key(1), (3, 2, 576), jnp.float32)
    s, out = residual_rms_norm_reference(partials, residual, weights, 1, eps=1e-5)
    block_out = (partials[0] + partials[1] + partials[2]).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(residual + block_out, np.float32))
    np.testing.assert_array_equal(
        np.asarray(out, np.float32), np.asarray(model_rms_norm(residual + block_out, weights[1], 1e-5), np.float32)
    )


def test_residual_norm_bad_input_is_named():
    residual, weights = _inputs(2, 64, jnp.bfloat16)
    partials = jnp.zeros((2, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="partials \\[splits, M, D\\]"):
        residual_rms_norm(partials[0], residual, weights, 0, eps=1e-5, interpret=True)
    with pytest.raises(ValueError, match="partials \\[splits, M, D\\]"):
        residual_rms_norm(partials[:, :1], residual, weights, 0, eps=1e-5, interpret=True)
    with pytest.raises(ValueError, match="partials must be float32"):
        residual_rms_norm(partials.astype(jnp.bfloat16), residual, weights, 0, eps=1e-5, interpret=True)


def test_bad_input_is_named():
    x, weights = _inputs(2, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match="x \\[M, D\\] and weights \\[L, D\\]"):
        rms_norm(x[None], weights, 0, eps=1e-5, interpret=True)
    with pytest.raises(ValueError, match="x \\[M, D\\] and weights \\[L, D\\]"):
        rms_norm(x, weights[:, :32], 0, eps=1e-5, interpret=True)
    with pytest.raises(ValueError, match="share a dtype"):
        rms_norm(x, weights.astype(jnp.float32), 0, eps=1e-5, interpret=True)
    with pytest.raises(ValueError, match="unknown impl"):
        rms_norm(x, weights, 0, eps=1e-5, interpret=True, impl="xla")


def test_mosaic_refusals_are_named():
    x, weights = _inputs(2, 96, jnp.bfloat16)
    with pytest.raises(ValueError, match="D a multiple of 64"):
        rms_norm(x, weights, 0, eps=1e-5, interpret=True, impl="mosaic")
    with pytest.raises(ValueError, match="D a multiple of 64"):
        residual_rms_norm(jnp.zeros((2, *x.shape), jnp.float32), x, weights, 0, eps=1e-5, interpret=True, impl="mosaic")
    x, weights = _inputs(2, 256, jnp.bfloat16)
    with pytest.raises(ValueError, match="poison needs interpret mode"):
        rms_norm(x, weights, 0, eps=1e-5, poison=True, impl="mosaic")
    with pytest.raises(ValueError, match="exceed smem_bytes"):
        rn._mosaic_residual_call(
            jnp.zeros((2, *x.shape), jnp.float32), x, weights, 0, eps=1e-5, interpret=True, poison=False, smem_bytes=512
        )

"""kernels/rms_norm against its jnp reference (which is what the model's RMSNorm computes), in
interpret mode on the CPU and compiled on an H100/H200; outputs poisoned beforehand."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.model import rms_norm as model_rms_norm
from kernels.rms_norm import chunk_size, residual_rms_norm, residual_rms_norm_reference, rms_norm, rms_norm_reference

ON_GPU = jax.default_backend() == "gpu" and any(k in jax.devices()[0].device_kind for k in ("H100", "H200"))
# (rows, D): Llama (4096), Qwen2.5-7B (3584 = 7 x 512), SmolLM2 (576 = 9 x 64), prefill-sized rows
SHAPES = [(1, 4096), (8, 3584), (3, 576), (32, 64)]


def _inputs(rows, dim, dtype, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = (3.0 * jax.random.normal(kx, (rows, dim))).astype(dtype)
    weights = (1.0 + 0.2 * jax.random.normal(kw, (5, dim))).astype(dtype)  # a stack of 5 layers
    return x, weights


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

    @pytest.mark.parametrize("rows, dim", SHAPES)
    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
    def test_matches_reference(self, rows, dim, dtype):
        x, weights = _inputs(rows, dim, dtype, seed=rows + dim)
        out = rms_norm(x, weights, jnp.int32(3), eps=1e-5, interpret=self.INTERPRET, poison=True)
        ref = rms_norm_reference(x, weights, 3, eps=1e-5)
        out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
        assert np.isfinite(out).all(), "an element was not written"
        # the sum of squares runs in another order: one rounding step of the output dtype at most
        # (bf16: 2^-8 relative; f32: a few ulps)
        rtol = 2.0**-7 if dtype == jnp.bfloat16 else 1e-6
        np.testing.assert_allclose(out, ref, rtol=rtol, atol=0)

    def test_layer_index_selects_the_weight_row(self):
        x, weights = _inputs(2, 4096, jnp.bfloat16)
        rows = [
            np.asarray(rms_norm(x, weights, jnp.int32(i), eps=1e-5, interpret=self.INTERPRET), np.float32)
            for i in range(weights.shape[0])
        ]
        for i, row in enumerate(rows):
            np.testing.assert_allclose(
                row, np.asarray(rms_norm_reference(x, weights, i, eps=1e-5), np.float32), rtol=2.0**-7
            )
        assert not np.array_equal(rows[0], rows[1])

    @pytest.mark.parametrize("splits, rows, dim", [(4, 1, 4096), (2, 3, 3584), (1, 2, 576), (3, 1, 64)])
    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
    def test_residual_norm_matches_reference(self, splits, rows, dim, dtype):
        residual, weights = _inputs(rows, dim, dtype, seed=splits + rows + dim)
        partials = jax.random.normal(jax.random.key(dim), (splits, rows, dim), jnp.float32)
        s, out = residual_rms_norm(
            partials, residual, weights, jnp.int32(2), eps=1e-5, interpret=self.INTERPRET, poison=True
        )
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
        out_ref = (normed.astype(np.float32) * np.asarray(weights[2]).astype(np.float32)).astype(np.dtype(dtype))
        np.testing.assert_allclose(
            np.asarray(out, np.float32),
            out_ref.astype(np.float32),
            rtol=2.0**-7 if dtype == jnp.bfloat16 else 1e-6,
            atol=0,
        )

    def test_residual_norm_rounds_as_the_model(self):
        """By hand, in numpy: the projection's output rounds to bf16 before the residual add. With u = 2^-9
        (a quarter of bf16's step at 1), partials summing to 1 + 1.5u round to 1; adding the residual u gives
        1 + u, which rounds to 1. One rounding of the exact 1 + 2.5u would give 1 + 4u."""
        import ml_dtypes

        dim, u = 256, 2.0**-9
        partials = jnp.full((2, 1, dim), 0.5 + 0.75 * u, jnp.float32)
        residual = jnp.full((1, dim), u, jnp.bfloat16)
        weights = jnp.ones((1, dim), jnp.bfloat16)
        s, out = residual_rms_norm(partials, residual, weights, 0, eps=0.0, interpret=self.INTERPRET)
        block_out = np.float32(1.0 + 1.5 * u).astype(ml_dtypes.bfloat16)
        expected = (np.float32(block_out) + np.float32(u)).astype(ml_dtypes.bfloat16)
        assert float(expected) == 1.0 and float(np.float32(1.0 + 2.5 * u).astype(ml_dtypes.bfloat16)) == 1.0 + 4 * u
        np.testing.assert_array_equal(np.asarray(s, np.float32), np.float32(expected))
        np.testing.assert_array_equal(np.asarray(out, np.float32), 1.0)  # a constant row normalizes to 1


class TestRMSNormCompiled(TestRMSNorm):
    INTERPRET = False


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

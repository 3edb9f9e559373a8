"""kernels/rms_norm against its jnp reference (which is what the model's RMSNorm computes), in
interpret mode on the CPU and compiled on an H100/H200; outputs poisoned beforehand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.model import rms_norm as model_rms_norm
from kernels.rms_norm import chunk_size, rms_norm, rms_norm_reference

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
  np.testing.assert_array_equal(np.asarray(rms_norm_reference(x, weights, 3, eps=1e-5), np.float32),
                                np.asarray(model_rms_norm(x, weights[3], 1e-5), np.float32))


def test_chunk_size_divides():
  assert [chunk_size(d) for d in (4096, 3584, 576, 8192, 12288)] == [4096, 512, 64, 4096, 4096]


class TestRMSNorm:
  INTERPRET = True

  def setup_method(self):
    if not self.INTERPRET and not ON_GPU:
      pytest.skip("the compiled kernel is checked on an H100/H200")

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
    rows = [np.asarray(rms_norm(x, weights, jnp.int32(i), eps=1e-5, interpret=self.INTERPRET), np.float32)
            for i in range(weights.shape[0])]
    for i, row in enumerate(rows):
      np.testing.assert_allclose(row, np.asarray(rms_norm_reference(x, weights, i, eps=1e-5), np.float32),
                                 rtol=2.0**-7)
    assert not np.array_equal(rows[0], rows[1])


class TestRMSNormCompiled(TestRMSNorm):
  INTERPRET = False


def test_bad_input_is_named():
  x, weights = _inputs(2, 64, jnp.bfloat16)
  with pytest.raises(ValueError, match="x \\[M, D\\] and weights \\[L, D\\]"):
    rms_norm(x[None], weights, 0, eps=1e-5, interpret=True)
  with pytest.raises(ValueError, match="x \\[M, D\\] and weights \\[L, D\\]"):
    rms_norm(x, weights[:, :32], 0, eps=1e-5, interpret=True)
  with pytest.raises(ValueError, match="share a dtype"):
    rms_norm(x, weights.astype(jnp.float32), 0, eps=1e-5, interpret=True)

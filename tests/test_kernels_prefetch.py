"""kernels/l2_prefetch and the engine's prefetch markers: the kernel passes x through unchanged (Mosaic
GPU's interpreter, where the prefetch itself is a no-op), its box plan covers what it is asked for,
and in the looped decode the hooks put one prefetch kernel per marker on the right stacks and rows
without changing a token. Whether the prefetches make decode faster is a GPU measurement
(BENCHMARKS.md), not a test."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode import looped_model
from jaxdecode.config import get_preset
from jaxdecode.decode import Engine
from jaxdecode.inplace import StackedRef
from jaxdecode.model import init_random
from kernels.l2_prefetch import box_plan, prefetch_l2, prefetched_bytes
from tests.test_inplace_loop import _decode_step_jaxpr, _inplace_engine, _scan_body

SITES = ("o", "mlp", "down", "next_qkv")


def test_passes_x_through_bit_for_bit():
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (2, 384), jnp.bfloat16)
  w1 = jax.random.normal(keys[1], (3, 512, 768), jnp.bfloat16)  # [L, K, N]
  w2 = jax.random.normal(keys[2], (3, 512, 256), jnp.bfloat16)
  y = jax.jit(lambda x, l: prefetch_l2(x, [w1, w2], l, ctas=4, interpret=True))(x, jnp.int32(2))
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(x, np.float32))


def test_box_plan_covers_the_budget_in_whole_row_blocks():
  # [4096, 14336] bf16: boxes 256 x 256, 56 per row block of 7 MiB; 16 MiB holds 2 row blocks
  assert box_plan((4096, 14336), 16 << 20, 2) == (256, 256, 2, 56)
  assert box_plan((4096, 14336), 1 << 40, 2) == (256, 256, 16, 56)  # the whole weight at most
  assert box_plan((128, 6144), 1 << 30, 2) == (128, 256, 1, 24)  # K below one box: one box of K rows
  assert box_plan((512, 96), 1 << 30, 4) == (256, 32, 2, 3)  # N = 96: boxes 32 wide
  ws = [jnp.zeros((2, 4096, 4096), jnp.bfloat16), jnp.zeros((2, 4096, 1024), jnp.bfloat16)]
  assert prefetched_bytes(ws) == 4096 * 5120 * 2  # everything
  assert prefetched_bytes(ws, 64 << 20) == 4096 * 5120 * 2  # 32 MiB each covers both
  assert prefetched_bytes(ws, 40 << 20) == (10 * 256 * 4096 + 4096 * 1024) * 2  # 20 MiB each
  # 15 MiB each: 7 of the first stack's 16 row blocks of 2 MiB, all of the second (8 MiB)
  assert prefetched_bytes(ws, 30 << 20) == (7 * 256 * 4096 + 4096 * 1024) * 2
  # 1 MiB each: no row block of the first stack (2 MiB), two of the second's (512 KiB)
  assert prefetched_bytes(ws, 2 << 20) == 2 * 256 * 1024 * 2


def test_bad_input_is_refused():
  w = jnp.zeros((2, 256, 256), jnp.bfloat16)
  with pytest.raises(ValueError, match="passes through x"):
    prefetch_l2(jnp.zeros((1, 100), jnp.bfloat16), [w], 0, interpret=True)  # not a multiple of 128
  with pytest.raises(ValueError, match="stacked weights"):
    prefetch_l2(jnp.zeros((1, 128), jnp.bfloat16), [w[0]], 0, interpret=True)
  with pytest.raises(ValueError, match="multiple of 8"):
    box_plan((256, 100), 1 << 20, 2)


@pytest.fixture
def prefetch_everywhere(monkeypatch):
  monkeypatch.setattr(looped_model, "PREFETCH_BYTES", {"o": None, "mlp": 1 << 20, "down": None, "next_qkv": None})


def _engine_with_prefetch(model):
  engine = _inplace_engine(model)
  engine._plan._calls |= {f"prefetch_{s}": functools.partial(looped_model.kernel_prefetch, site=s, interpret=True,
                                                               next_layer=s == "next_qkv") for s in SITES}
  return engine


@pytest.fixture(scope="module")
def model():
  """A small Llama whose widths are multiples of 128 (the prefetch kernel's pass-through)."""
  return init_random(dataclasses.replace(get_preset("tiny-gqa"), dim=128, ffn_dim=256, n_heads=4, n_kv_heads=2, head_dim=32),
                     seed=1)


def test_engine_tokens_unchanged(model, prefetch_everywhere):
  prompts, kwargs = [[1, 2, 3, 4, 5]], dict(max_new_tokens=6, chunk=3)
  unrolled = Engine(model, loop_layers=False).generate(prompts, **kwargs).token_ids
  assert _engine_with_prefetch(model).generate(prompts, **kwargs).token_ids == unrolled


def test_engine_step_prefetches_each_projection(model, prefetch_everywhere):
  """One prefetch kernel per marker in the looped step's body, each on the whole stacks of the
  projection that follows it (o; gate and up; down; the next layer's q, k, v), read at layer i (i + 1
  for q, k, v, clamped to the last layer)."""
  body = _scan_body(_decode_step_jaxpr(_engine_with_prefetch(model), batch=1))
  calls = [e for e in body.eqns if e.primitive.name in ("jit", "pjit") and e.params["name"] == "prefetch_l2"]
  cfg = model.cfg
  widths = [[v.aval.shape for v in e.invars if getattr(v.aval, "ndim", 0) == 3] for e in calls]
  assert widths == [[(cfg.n_layers, cfg.q_dim, cfg.dim)],
                    [(cfg.n_layers, cfg.dim, cfg.ffn_dim)] * 2,
                    [(cfg.n_layers, cfg.ffn_dim, cfg.dim)],
                    [(cfg.n_layers, cfg.dim, cfg.q_dim), (cfg.n_layers, cfg.dim, cfg.kv_dim),
                     (cfg.n_layers, cfg.dim, cfg.kv_dim)]], widths


def test_hook_declines_where_it_should(monkeypatch):
  x = jnp.ones((1, 256), jnp.bfloat16)
  ref = StackedRef(jnp.zeros((2, 256, 256), jnp.bfloat16), jnp.int32(1))
  hook = functools.partial(looped_model.kernel_prefetch, site="o", interpret=True)
  monkeypatch.setattr(looped_model, "PREFETCH_BYTES", {})
  assert hook(x, ref) is None  # the site is off
  monkeypatch.setattr(looped_model, "PREFETCH_BYTES", {"o": None})
  assert hook(x, ref.stack[1]) is None  # not a stacked weight
  assert hook(jnp.ones((1, 100), jnp.bfloat16), ref) is None  # x not a multiple of 128
  assert hook(jnp.ones((16, 8192), jnp.bfloat16), ref) is None  # prefill-sized x
  if jax.default_backend() == "cpu":
    assert looped_model.kernel_prefetch(x, ref, site="o") is None  # no TMA off Hopper
  (y,) = hook(x, ref)
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(x, np.float32))

"""kernels/dispatch.py (the lookup rule) and kernels/shapes.py (the shape catalog)."""

import dataclasses

import pytest

from kernels import dispatch
from kernels.shapes import CATALOG, MODELS, TEST_ATTENTION, TEST_GEMM


@dataclasses.dataclass
class FakeDevice:
  platform: str
  device_kind: str


H200 = FakeDevice("gpu", "NVIDIA H200")
POINTS = dispatch.GEMM_TABLE["H200"]


def test_cpu_falls_back_to_xla():
  cpu = FakeDevice("cpu", "cpu")
  assert dispatch.choose_gemm(1, 4096, 4096, device=cpu).impl == "xla"
  assert dispatch.choose_attention(device=cpu).impl == "xla"


def test_non_hopper_gpu_falls_back_to_xla():
  a100 = FakeDevice("gpu", "NVIDIA A100-SXM4-80GB")
  choice = dispatch.choose_gemm(8, 4096, 4096, device=a100)
  assert choice.impl == "xla" and "A100" in choice.reason


@pytest.mark.parametrize("looped", [False, True])
def test_inflection_points_split_m_into_three_ranges(looped):
  m2 = POINTS.looped_m2 if looped else POINTS.m2
  for m in range(1, 300):
    impl = dispatch.choose_gemm(m, 14336, 4096, looped=looped, device=H200).impl
    if m < min(POINTS.m1, m2):
      assert impl == POINTS.gemv_impl, m
    elif m < m2 and m <= 256:
      assert impl == POINTS.flat_impl, m
    else:
      assert impl == "xla", m


def test_rule_with_three_nonempty_ranges(monkeypatch):
  table = dict(dispatch.GEMM_TABLE)
  table["H200"] = dispatch.GemmPoints(m1=2, m2=16, gemv_impl="gemv", flat_impl="mosaic",
                                      looped_m2=257, source="test")
  monkeypatch.setattr(dispatch, "GEMM_TABLE", table)
  impls = [dispatch.choose_gemm(m, 4096, 4096, device=H200).impl for m in (1, 2, 15, 16)]
  assert impls == ["gemv", "mosaic", "mosaic", "xla"]


def test_looped_keeps_the_kernel_longer():
  m = POINTS.m2
  assert dispatch.choose_gemm(m, 4096, 4096, device=H200).impl == "xla"
  looped = dispatch.choose_gemm(m, 4096, 4096, looped=True, device=H200)
  assert looped.impl == POINTS.flat_impl and "copy" in looped.reason
  assert dispatch.choose_gemm(257, 4096, 4096, looped=True, device=H200).impl == "xla"


def test_untiled_shape_goes_to_xla_with_reason():
  choice = dispatch.choose_gemm(8, 4100, 4096, device=H200)
  assert choice.impl == "xla" and "tile_n" in choice.reason


def test_every_choice_has_a_reason():
  assert dispatch.choose_gemm(POINTS.m1, 4096, 4096, device=H200).reason
  assert dispatch.choose_attention(device=H200).impl == "async"


@pytest.mark.parametrize("name,n_qkv,ffn", [("llama3_8b", 6144, 14336), ("qwen25_7b", 4608, 18944),
                                            ("smollm2_135m", 960, 1536)])
def test_catalog_shapes(name, n_qkv, ffn):
  shapes = CATALOG[f"{name}_b8_s8192_decode"]
  ops = {g.op: g for g in shapes.gemms}
  assert ops["qkv"].n == n_qkv and ops["qkv"].m == 8
  assert ops["gate"].n == ffn and ops["down"].k == ffn
  assert ops["o"].k == MODELS[name].num_heads * MODELS[name].head_dim
  a = shapes.attention
  assert (a.batch, a.cache_len, a.num_heads % a.num_kv_heads) == (8, 8192, 0)


def test_catalog_names_and_bytes():
  assert len(CATALOG) == 3 * 3 * 2 + 1
  a = CATALOG["llama3_8b_b1_s4096_decode".replace("4096", "8192")].attention
  assert a.kv_bytes == 2 * 2 * 8192 * 8 * 128  # K and V, bf16
  assert all(s.cache_len % 32 == 0 for s in TEST_ATTENTION.values())
  assert any(s.m % 8 for s in TEST_GEMM.values())

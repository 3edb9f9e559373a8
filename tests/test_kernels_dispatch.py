"""kernels/dispatch.py (table lookup, shipped H200 table) and kernels/shapes.py (the catalog)."""

import dataclasses
import json

import pytest

from kernels import dispatch, tune
from kernels.shapes import CATALOG, MODELS, TEST_ATTENTION, TEST_GEMM


@dataclasses.dataclass
class FakeDevice:
    platform: str
    device_kind: str


H200 = FakeDevice("gpu", "NVIDIA H200")
LLAMA = [(6144, 4096), (4096, 4096), (28672, 4096), (14336, 4096), (4096, 14336)]  # [N, K]


def test_normalized_names():
    assert dispatch.normalize_gpu_name("NVIDIA H200") == "h200"
    assert dispatch.normalize_gpu_name("NVIDIA H100 80GB HBM3") == "h100_80gb_hbm3"
    assert dispatch.normalize_gpu_name("NVIDIA A100-SXM4-80GB") == "a100_sxm4_80gb"


def test_cpu_falls_back_to_xla():
    cpu = FakeDevice("cpu", "cpu")
    assert dispatch.choose_gemm(1, 4096, 4096, device=cpu).impl == "xla"
    assert dispatch.choose_attention(device=cpu).impl == "xla"


def test_gpu_without_table_falls_back_to_xla_and_says_why():
    a100 = FakeDevice("gpu", "NVIDIA A100-SXM4-80GB")
    choice = dispatch.choose_gemm(8, 4096, 4096, looped=True, device=a100)
    assert choice.impl == "xla" and "a100_sxm4_80gb.json" in choice.reason
    assert "tune" in choice.reason
    assert dispatch.choose_attention(device=a100).impl == "xla"


def test_shipped_h200_table_is_consistent_with_its_timings():
    """The shipped table's points are what tune's rule gives for the timings stored next to them."""
    table, where = dispatch.table_for(H200)
    assert where == "kernels/tables/h200.json" and table.device_kind == "NVIDIA H200"
    raw = json.loads((dispatch.TABLES_DIR / "h200.json").read_text())
    assert "docs/log/2026-11-30.md" in raw["source"] and "kernels_bench.py" in raw["source"]
    for e in raw["gemm"]:
        timings = {i: {int(m): us for m, us in t.items()} for i, t in e["timings_us"].items()}
        points = tune.inflection_points(timings, raw["ms"], raw["margin"])
        if e.get("flat_impl_from") == "end_to_end":  # picked by whole-decode runs, cited in "source"
            assert e["flat_impl"] in tune.FLAT_IMPLS and "end-to-end" in raw["source"], e["op"]
            points["flat_impl"] = e["flat_impl"]
        assert points == dict(m1=e["m1"], m2=e["m2"], flat_impl=e["flat_impl"]), e["op"]
    assert tune.pick_attention(raw["attention"]["timings_us"]) == table.attention_impl


def test_h200_choices_follow_the_measurements():
    # Called once per step, XLA's dot beat every kernel at M = 1 on all four shapes: M2 = 1.
    for n, k in LLAMA:
        for m in (1, 2, 8, 64, 128):
            assert dispatch.choose_gemm(m, n, k, device=H200).impl == "xla", (m, n, k)
    # Looped over 32 stacked layers the table's rows put gemv first at M = 1 on [4096, 4096] and the
    # flat kernels first on [14336, 4096], and every kernel ahead of the scan at M = 8. The flat kernel
    # in loops is the Stream-K one: whole decode steps ran faster with it, where the per-shape timings
    # had the two within the 5% margin (docs/log/2026-11-30.md). The GEMV is Pallas-Triton, which the
    # loop no longer takes: Stream-K below M1 too.
    looped = lambda m, n, k: dispatch.choose_gemm(m, n, k, looped=True, device=H200)
    assert looped(1, 4096, 4096).impl == "stream" and "no Pallas-Triton" in looped(1, 4096, 4096).reason  # M1 = 2
    assert looped(2, 4096, 4096).impl == "stream"
    assert looped(1, 14336, 4096).impl == "stream"
    assert looped(1, 3584, 18944).impl == "stream"
    assert looped(128, 14336, 4096).impl == "stream"
    assert looped(300, 14336, 4096).impl == "xla"  # past the kernels' M limit (the wgmma N side)
    nearest = looped(1, 28672, 4096)  # gate+up was not measured looped: nearest is [14336, 4096]
    assert nearest.impl == "stream" and "nearest profiled [N, K]=[14336, 4096]" in nearest.reason
    assert dispatch.choose_attention(device=H200).impl == "sync"


def test_untiled_shape_goes_to_xla_with_reason():
    choice = dispatch.choose_gemm(8, 4100, 4096, looped=True, device=H200)
    assert choice.impl == "xla" and "tile_n" in choice.reason


def test_env_table_overrides_the_shipped_one(tmp_path, monkeypatch):
    path = tmp_path / "mine.json"
    path.write_text(
        json.dumps(
            dict(
                device_kind="NVIDIA H200",
                source="test",
                gemm=[dict(op="o", form="plain", n=4096, k=4096, m1=1, m2=16, flat_impl="triton")],
                attention=dict(impl="async"),
            )
        )
    )
    monkeypatch.setenv(dispatch.TABLE_ENV, str(path))
    choice = dispatch.choose_gemm(8, 4096, 4096, device=H200)
    assert choice.impl == "triton" and str(path) in choice.reason
    assert dispatch.choose_gemm(16, 4096, 4096, device=H200).impl == "xla"
    assert dispatch.choose_gemm(8, 4096, 4096, looped=True, device=H200).impl == "xla"  # no entry
    assert dispatch.choose_attention(device=H200).impl == "async"


def test_loop_takes_no_pallas_triton_kernel():
    """A table's GEMV (below M1) and Triton flat kernel stay on the plain form; the loop, the decode
    path, takes the Mosaic GPU Stream-K kernel in their place (Pallas-Triton is deprecated)."""
    entries = [
        dict(op="o", form=form, n=4096, k=4096, m1=2, m2=None, flat_impl="triton") for form in ("plain", "looped")
    ]
    table = dispatch.parse_table(dict(device_kind="NVIDIA H200", source="test", gemm=entries))
    plain = lambda m: dispatch.choose_gemm(m, 4096, 4096, table=table).impl  # noqa: E731
    looped = lambda m: dispatch.choose_gemm(m, 4096, 4096, looped=True, table=table)  # noqa: E731
    assert (plain(1), plain(2)) == ("gemv", "triton")
    assert looped(1).impl == looped(2).impl == "stream" and "no Pallas-Triton" in looped(1).reason


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(gemm=[]), "device_kind"),
        (
            dict(
                device_kind="x",
                source="s",
                gemm=[dict(op="o", form="unrolled", n=1, k=1, m1=1, m2=None, flat_impl="mosaic")],
            ),
            "form",
        ),
        (
            dict(
                device_kind="x", source="s", gemm=[dict(op="o", form="plain", n=1, k=1, m1=4, m2=2, flat_impl="mosaic")]
            ),
            "m1 <= m2",
        ),
        (
            dict(
                device_kind="x", source="s", gemm=[dict(op="o", form="plain", n=1, k=1, m1=1, m2=2, flat_impl="cublas")]
            ),
            "impl",
        ),
        (dict(device_kind="x", source="s", gemm=[], attention=dict(impl="flash")), "attention"),
    ],
)
def test_malformed_table_raises(bad, match):
    with pytest.raises(ValueError, match=match):
        dispatch.parse_table(bad)


@pytest.mark.parametrize(
    "name,n_qkv,ffn", [("llama3_8b", 6144, 14336), ("qwen25_7b", 4608, 18944), ("smollm2_135m", 960, 1536)]
)
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
    a = CATALOG["llama3_8b_b1_s8192_decode"].attention
    assert a.kv_bytes == 2 * 2 * 8192 * 8 * 128  # K and V, bf16
    grid = TEST_ATTENTION.values()
    assert {s.num_heads // s.num_kv_heads for s in grid} >= {1, 4, 8}
    assert {s.head_dim for s in grid} == {64, 128} and max(s.batch for s in grid) == 64
    assert {1, 63, 65, 200} <= {s.cache_len for s in grid}  # not multiples of any block
    assert {1, 128} <= {s.m for s in TEST_GEMM.values()} and any(s.m % 8 for s in TEST_GEMM.values())

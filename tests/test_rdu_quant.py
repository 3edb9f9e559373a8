"""The quantized in-place GPU mode (rdu.quantized, rdu.fit.quant): its kernel table equals what the
measured result files give; the held-out quantized rows meet the issue's in-place bar; a quantized
step is charged its real bytes. Fewer quantized bytes never slower: tests/test_rdu_invariants.py."""

from pathlib import Path

import pytest

from jaxdecode.config import get_preset
from rdu.anchors import QUANT_ROWS
from rdu.fit.quant import quant_row_ms, solve_glue
from rdu.gpu import inplace_terms
from rdu.hardware import gpu, load_fitted
from rdu.mapping import fuse
from rdu.quantized import BENCH_FILE, QUANT_KERNELS, STEP_FILE, measured_kernels, quant_format
from rdu.trace import trace_decode_step

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not (ROOT / BENCH_FILE).exists() or not (ROOT / STEP_FILE).exists(), reason="no result files")
def test_kernel_table_is_what_the_measurements_give():
    got = measured_kernels(ROOT)
    for fmt, q in QUANT_KERNELS.items():
        m = got[fmt]
        assert m.gemm_fixed_s == pytest.approx(q.gemm_fixed_s, rel=1e-3)
        assert m.gemm_efficiency == pytest.approx(q.gemm_efficiency, rel=1e-3)
        assert (m.gemm_kernels, m.kernels_per_layer, m.kernels_per_layer_batched) == (
            q.gemm_kernels,
            q.kernels_per_layer,
            q.kernels_per_layer_batched,
        )


def test_quant_format_from_dtypes():
    assert quant_format(iter(["bfloat16", "int32", "int4", "float32"])) == "int4"
    assert quant_format(iter(["bfloat16", "int8"])) == "int8"
    assert quant_format(["bfloat16", "int32"]) is None


def test_held_out_quantized_rows_meet_the_in_place_bar():
    """Issue #27: quantized decode predicted by the in-place mode; one row in-sample, the rest held out
    (MAPE <= 8%, max <= 15%). Recomputed from the code and the stored constant."""
    rec = load_fitted()
    spec = gpu("h200", "fitted")
    assert spec.quant_glue_kernel_s == rec["gpu_quant"]["fitted"]["quant_glue_kernel_s"]
    train = [r for r in QUANT_ROWS if r.split == "train"]
    assert len(train) == 1 and solve_glue(train[0], spec) == pytest.approx(spec.quant_glue_kernel_s, rel=1e-6)
    test = [r for r in QUANT_ROWS if r.split == "test"]
    assert {r.quantize for r in test} >= {"int4", "int8"}
    err = [abs(quant_row_ms(r, spec) / r.measured_ms - 1) * 100 for r in test]
    assert sum(err) / len(err) <= 8.0 and max(err) <= 15.0, err


def test_quantized_layer_is_charged_its_codes_and_scales():
    cfg = get_preset("llama-3.1-8b")
    spec = gpu("h200", "fitted")
    for fmt, ratio in (("int4", 0.28), ("int8", 0.52)):
        layer = next(k for k in fuse(trace_decode_step(cfg, 1, 1152, looped=False, quantize=fmt)) if k.is_layer)
        dense = next(k for k in fuse(trace_decode_step(cfg, 1, 1152, looped=False)) if k.is_layer)
        assert layer.weight_bytes == pytest.approx(ratio * dense.weight_bytes, rel=0.03)
        t = inplace_terms(layer, spec, quant=fmt)
        q = QUANT_KERNELS[fmt]
        assert t.quant_kernels == q.kernels_per_layer and t.kernels == 0
        assert t.quant_mem_s == pytest.approx(layer.weight_bytes / (q.gemm_efficiency * spec.read_bw))

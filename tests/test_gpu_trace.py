"""benchmarks/gpu_trace.step_profile on synthetic traces: a step is read from one LM head launch to the next."""

from __future__ import annotations

from benchmarks import gpu_trace


def _trace(step_kernels, steps: int):
    """A trace of `steps` decode steps on one GPU stream: step_kernels [(name, µs)] each step, back to back
    with a 0.5 µs gap, after the metadata events that name the GPU track."""
    events = [{"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}}]
    ts = 0.0
    for _ in range(steps):
        for name, dur in step_kernels:
            events.append({"ph": "X", "pid": 7, "tid": 1, "name": name, "ts": ts, "dur": dur})
            ts += dur + 0.5
    return events


def test_quantized_head_shares_the_projections_kernel_name():
    """The head is the quantized GEMM kernel too: its launches are told apart by their length, so a step
    holds all 4 layers' kernels (2 GEMMs and a norm each) plus the head and the sampler, 14 kernels."""
    layer = [("quant_gemm_stream", 13.0), ("rms_norm", 2.0), ("quant_gemm_stream", 4.0)]
    step = layer * 4 + [("quant_gemm_stream", 100.0), ("argmax", 1.5)]
    prof = gpu_trace.step_profile(_trace(step, steps=6), steps=6)
    assert prof["kernels_per_step"] == len(step) == 14
    assert prof["step_kernel_us"] == sum(d for _, d in step)
    assert prof["lm_head_kernel"] == "quant_gemm_stream"


def test_bf16_head_by_its_own_name():
    """A bf16 head has a name of its own; the step is the same whichever rule finds it."""
    step = [("gemv", 30.0), ("rms_norm", 2.0)] * 3 + [("gemm_fusion_dot", 235.0)]
    prof = gpu_trace.step_profile(_trace(step, steps=4), steps=4)
    assert prof["kernels_per_step"] == 7
    assert prof["lm_head_kernel"] == "gemm_fusion_dot"
    # the span: 7 kernels and 7 gaps of 0.5 µs from the end of one head to the end of the next
    assert prof["step_span_us"] == sum(d for _, d in step) + 7 * 0.5


def test_a_per_layer_kernel_longer_than_the_head_is_not_the_head():
    """A fused per-layer kernel (the MLP as one launch) can outlast the quantized head; it runs once a
    layer, so the head is still the long launch of the projections' kernel that runs once a step."""
    layer = [("quant_gemm_stream", 8.0), ("rms_norm", 2.0), ("quant_mlp", 150.0)]
    step = layer * 3 + [("quant_gemm_stream", 100.0), ("argmax", 1.5)]
    prof = gpu_trace.step_profile(_trace(step, steps=5), steps=5)
    assert prof["lm_head_kernel"] == "quant_gemm_stream"
    assert prof["kernels_per_step"] == len(step) == 11

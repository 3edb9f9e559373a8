"""rdu.hardware / mapping / simulate / validate: capacities, looping, sockets, a hand-computed case,
and the validation table held to its stated bounds."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import pytest

from jaxdecode.config import get_preset
from rdu.hardware import GIB, H200, sn40l
from rdu.mapping import ModelDoesNotFit, allocate, map_decode
from rdu.simulate import simulate_rdu
from rdu.trace import trace, trace_decode_step

HW = sn40l()


def mapped(name, sockets, batch=1, context=4096, hw=HW):
    cfg = get_preset(name)
    g = trace_decode_step(cfg, batch, context)
    return map_decode(g, hw, sockets, batch=batch, kv_heads=cfg.n_kv_heads, dim=cfg.dim)


def test_hardware_parameters_have_sources():
    for field, value, source in HW.table():
        assert source, f"SN40L {field} has no source"
    for field, value, source in H200.table():
        assert source or field == "sources", f"H200 {field} has no source"
    assert HW.pcus == HW.pmus == 1040 and HW.sram_bytes == 520 * 2**20 and HW.hbm_bytes == 64 * GIB
    assert H200.read_bw == 4246e9 and H200.achieved_flops == 784e12 and H200.bf16_flops == 989e12
    with pytest.raises(ValueError, match="1.6"):
        sn40l(1.7)


def test_allocate_binary_search_by_hand():
    t, units = allocate([4.0, 2.0, 1.0], 7, rate=1.0)  # T = 1 gives 4 + 2 + 1 = 7 units
    assert t == pytest.approx(1.0, rel=2e-3) and units == [4, 2, 1]
    with pytest.raises(ModelDoesNotFit, match="stages"):
        allocate([1.0] * 5, 4, rate=1.0)


def test_405b_does_not_fit_one_socket_and_says_why():
    with pytest.raises(ModelDoesNotFit) as e:
        mapped("llama-3.1-405b", 1)
    msg = str(e.value)
    assert "exceeds HBM" in msg and "64 GiB" in msg and "needs 16 sockets" in msg
    m = mapped("llama-3.1-405b", 16)
    assert m.placement.hbm_bytes <= HW.hbm_bytes and m.placement.ddr_bytes == 0
    # With DDR spill allowed it fits one socket, streaming the overflow from DDR (200 GB/s).
    cfg = get_preset("llama-3.1-405b")
    spill = map_decode(trace_decode_step(cfg, 1, 4096), HW, 1, batch=1, kv_heads=8, dim=cfg.dim, allow_ddr=True)
    assert spill.placement.ddr_bytes > 600 * GIB
    assert simulate_rdu(spill).per_token_s > 3.0  # ~690 GiB at 200 GB/s


def test_decoder_layer_is_one_kernel_using_the_chip():
    m = mapped("llama-3.1-8b", 1)
    assert [k.role for k in m.kernels] == ["embedding", "decoder", "classifier", "sampling"]
    assert m.calls_per_token == 4 and m.layers == 32  # KL: embedding, looped decoders, classifier, sampling
    alloc = m.allocations[m.kernels[1].name]
    assert len(alloc.stages) >= 20  # SN40L: fused pipelines of 20+ operators
    assert alloc.pcus <= HW.pcus and alloc.pmus <= HW.pmus and alloc.pcus > 0.9 * HW.pcus


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "llama-3.1-8b", "llama-3.1-70b"])
@pytest.mark.parametrize("batch", [1, 8])
def test_looping_never_slower_and_roofline_holds(name, batch):
    for p in (1, 2, 4, 8, 16):
        try:
            m = mapped(name, p, batch=batch)
        except ModelDoesNotFit:
            continue
        on, off = simulate_rdu(m, looped=True), simulate_rdu(m, looped=False)
        assert on.per_token_s <= off.per_token_s
        floor = simulate_rdu(m, looped=True, overheads=False)
        assert floor.per_token_s >= on.bytes_per_token / (p * HW.hbm_bw)
        if p == 1:  # no all-reduce: without call overheads looping changes nothing
            assert floor.per_token_s == pytest.approx(simulate_rdu(m, looped=False, overheads=False).per_token_s)


@pytest.mark.parametrize("batch", [1, 8])
def test_tied_embedding_lookup_reads_rows_not_the_table(batch):
    """Qwen2.5-0.5B ties its embedding table to the LM head: the lookup kernel gathers B rows, the LM
    head reads the whole table (the table used to be charged to both kernels)."""
    cfg = get_preset("qwen2.5-0.5b")
    assert cfg.tie_embeddings
    m = mapped("qwen2.5-0.5b", 1, batch=batch)
    emb, head = (next(k for k in m.kernels if k.role == r) for r in ("embedding", "classifier"))
    rows = batch * cfg.dim * 2
    table = cfg.vocab_size * cfg.dim * 2
    assert emb.weight_bytes == rows
    # The LM head reads the table (the trace's whole-step read of it also counts the gathered rows).
    assert table <= head.weight_bytes <= table + rows
    # The whole step then streams what the trace says it reads, plus the sampling kernel's logits (to
    # 0.1%: kernel boundaries add activation traffic); charging the table twice was 19% over.
    sampling = next(k for k in m.kernels if k.role == "sampling")
    assert simulate_rdu(m).bytes_per_token == pytest.approx(m.graph.fused_bytes + sampling.bytes, rel=1e-3)


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "llama-3.1-8b", "llama-3.1-70b"])
def test_one_pipeline_latency_at_boundaries_and_in_the_loop(name):
    """The layer's latency, computed here from the constants (stages x stage latency + two all-reduces of
    two hops and the message through the link), is what every unlooped call exposes and what a looped
    iteration races against its stream; the loop saves (L - 1) x (call + latency + body - period)."""
    for p in (1, 2, 4, 8, 16):
        try:
            m = mapped(name, p)
        except ModelDoesNotFit:
            continue
        layer = next(k for k in m.kernels if k.is_layer)
        depth = len(m.allocations[layer.name].stages)
        hops = 0.0 if p == 1 else 2 * (2 * HW.p2p_hop_s + 2 * (p - 1) / p * m.activation_bytes / HW.p2p_bw)
        latency = depth * HW.stage_latency_s + hops
        on, off = simulate_rdu(m, looped=True), simulate_rdu(m, looped=False)
        a, b = (next(k for k in e.kernels if k.name.startswith("decoder")) for e in (on, off))
        assert a.boundary_s == pytest.approx(latency) and b.boundary_s == pytest.approx(latency)
        body = max(b.memory_s, b.compute_s)
        assert b.total_s == pytest.approx(m.layers * (HW.call_s + latency + body))
        assert a.iteration_s == pytest.approx(max(latency, body))  # free SRAM covers the latency here
        assert m.placement.prefetch_bytes >= latency * HW.stream_bw
        saved = (m.layers - 1) * (HW.call_s + latency + body - a.iteration_s)
        assert off.per_token_s - on.per_token_s == pytest.approx(saved)


def test_prefetch_too_small_for_the_latency_stalls_the_loop():
    """With no free SRAM the next layer cannot stream ahead: a looped iteration costs latency + body, so
    looping saves only the call cost."""
    m = mapped("llama-3.1-8b", 16)
    starved = replace(m, placement=replace(m.placement, prefetch_bytes=0))
    on, off = simulate_rdu(starved), simulate_rdu(starved, looped=False)
    a = next(k for k in on.kernels if k.name.startswith("decoder"))
    assert a.iteration_s == pytest.approx(a.boundary_s + max(a.memory_s, a.compute_s))
    assert off.per_token_s - on.per_token_s == pytest.approx((m.layers - 1) * HW.call_s)
    assert on.per_token_s > simulate_rdu(m).per_token_s


def test_stage_buffers_are_tiled_to_fit_or_refused_with_the_numbers():
    """Attention scores of a long context at batch 32 exceed the SRAM whole: the stage is tiled along
    the sequence until every stage's double-buffered output fits, and the free SRAM shrinks. A chip
    with almost no SRAM refuses the mapping and says how much the buffers need."""
    m = mapped("llama-3.2-1b", 1, batch=32, context=32768)
    alloc = m.allocations[next(k for k in m.kernels if k.is_layer).name]
    tiled = [s for s in alloc.stages if s.tiles > 1]
    assert tiled and all(s.held_bytes <= s.buffer_bytes / 2 for s in tiled)
    assert alloc.buffer_bytes + m.placement.prefetch_bytes == pytest.approx(HW.sram_bytes, abs=1)
    assert sum(s.pmus for s in alloc.stages) <= HW.pmus
    small = mapped("llama-3.1-8b", 1)
    assert small.placement.prefetch_bytes > 0.98 * HW.sram_bytes  # batch 1: buffers are a few MiB
    with pytest.raises(ModelDoesNotFit, match=r"stage buffers need \d+ PMUs"):
        mapped("llama-3.1-8b", 1, hw=replace(HW, pmus=60, pmu_bytes=1024))


@pytest.mark.parametrize("name", ["llama-3.1-8b", "llama-3.1-70b", "qwen2.5-0.5b"])
def test_monotonic_in_sockets_until_latency_bound(name):
    prev = None
    for p in (1, 2, 4, 8, 16):
        try:
            m = mapped(name, p)
        except ModelDoesNotFit:
            continue
        est = simulate_rdu(m, looped=True)
        layer = next(k for k in est.kernels if k.name.startswith("decoders"))
        if prev is not None and est.per_token_s > prev:
            # Only allowed once the carried activation's latency is what bounds an iteration.
            assert layer.boundary_s >= layer.memory_s
        elif prev is not None and name != "qwen2.5-0.5b":
            assert est.per_token_s < prev
        prev = est.per_token_s


def test_streamed_allreduce_by_hand():
    assert HW.allreduce_s(1e6, 1) == 0.0
    # Two hops (reduce-scatter into the owner's PMUs, all-gather back) whatever p, plus the bytes.
    for p in (2, 4, 16):
        assert HW.allreduce_s(1e6, p) == pytest.approx(2 * HW.p2p_hop_s + 2 * (p - 1) / p * 1e6 / HW.p2p_bw)


@jax.jit
def _toy_layer(x, w):
    return x @ w


def test_simulate_trivial_graph_by_hand():
    # Two calls of one layer kernel: x[1,1024] @ w[1024,1024], bf16.
    f = lambda x, w1, w2: _toy_layer(_toy_layer(x, w1), w2)  # noqa: E731
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
    g = trace(f, s(1, 1024), s(1024, 1024), s(1024, 1024))
    hw = replace(HW, call_s=10e-6, stage_latency_s=1e-6, hbm_efficiency=1.0, hbm_bw=1e12)
    m = map_decode(g, hw, 1, batch=1, kv_heads=1, dim=1024)
    assert [(k.role, k.calls) for k in m.kernels] == [("decoder", 2), ("sampling", 1)]
    layer = m.kernels[0]
    assert layer.weight_bytes == 1024 * 1024 * 2 and layer.other_bytes == 2 * 1024 * 2
    mem = (1024 * 1024 * 2 + 2 * 1024 * 2) / 1e12  # weights + x in + x out, one layer
    # Each call: call 10 + one pipeline stage (the matmul; sampling counts as one) * 1 us = 11 us; looped, the
    # second layer streams while the first's activation passes the one stage (1 us < its 2.1 us stream).
    sampling = 11e-6 + 1024 * 2 / 1e12
    on, off = simulate_rdu(m, looped=True), simulate_rdu(m, looped=False)
    assert off.per_token_s == pytest.approx(2 * (11e-6 + mem) + sampling)
    assert on.per_token_s == pytest.approx(11e-6 + 2 * mem + sampling)
    assert on.calls_per_token == 2 and off.calls_per_token == 3


# GPU rows the model is known to miss with the published (prior) constants, kept honest rather than
# widening their bounds:
# - H200 batch 32 (h200-anchors' plain-JAX peer, 17.2 ms) conflicts with our own engine's 6.7 ms for the
#   same configuration (rdu.anchors.CONFLICTS).
# - The published constants put the batch-1 tensor-parallel rows 19% and 26% slow (the fit fixes them).
KNOWN_MISSES = {
    "H200 plain JAX unrolled, batch 32, tok/s",
    "2x H200 tensor parallel, llama-3.1-8b batch 1, ms/token",
    "2x H200 tensor parallel, llama-3.1-70b batch 1, ms/token",
}
# Targets of issue #27 that one consistent model does not meet (docs/rdu.md gives the numbers): SN40L-8
# is stream-bound at 98% of the roofline (2.53x; the band ends at 2.5x = 96.9%).
KNOWN_TARGET_FAILS = {"sn40l8_vs_dgx"}


def test_fitted_model_predicts_the_two_gpu_measurements():
    """Issue #9's bar: the GPU mode (fitted constants, measured all-reduce latency) predicts our 2-GPU
    tensor-parallel decode within 15% for Llama-3.1-8B and within 20% for 70B."""
    from rdu.validate import rows

    tp = {r.what: r for r in rows("fitted") if r.what.startswith("2x H200")}
    assert len(tp) == 4
    assert all(r.within for w, r in tp.items() if "8b" in w), {w: r.delta_pct for w, r in tp.items()}
    assert all(abs(r.delta_pct) < 20 for r in tp.values()), {w: r.delta_pct for w, r in tp.items()}


def test_validation_rows_within_stated_bounds():
    from rdu.validate import rows, table

    rs = rows()
    print(table(rs))
    assert {r.what for r in rs if not r.within} == KNOWN_MISSES
    assert len(rs) >= 10


def test_targets_from_one_set_of_constants():
    """Every target row of issue #27 from the fitted constants: value inside its band except the known
    fails; every row says whether the fit saw it; in-sample rows are fewer than the held-out ones."""
    from rdu.targets import TARGETS, evaluate, table

    rs = evaluate("fitted")
    print(table(rs))
    assert [r["key"] for r in rs] == [t.key for t in TARGETS]
    assert {r["key"] for r in rs if not r["pass"] and not r["soft"]} == KNOWN_TARGET_FAILS
    assert all(r["split"] in ("in-sample", "held out", "report only", "no constants") for r in rs)
    splits = [r["split"] for r in rs]
    assert splits.count("in-sample") < splits.count("held out")
    by = {r["key"]: r for r in rs}
    assert 2.5 < by["sn40l8_vs_dgx"]["value"] < 2.55  # the miss is at the band's edge, not a new regression

"""rdu.hardware / mapping / simulate / validate: capacities, looping, sockets, a hand-computed case,
and the validation table held to its stated bounds."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import pytest

from jaxdecode.config import get_preset
from rdu.hardware import GIB, H200, sn40l
from rdu.mapping import ModelDoesNotFit, allocate, map_decode
from rdu.simulate import allreduce_s, simulate_rdu
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
def test_unlooped_layer_overlaps_all_but_the_last_allreduce(name):
    """Without looping the all-reduce after o_proj overlaps the MLP's weight stream inside the call and
    the one after down_proj ends the call; with looping both overlap the next layer's stream. So with
    call overheads off, looping gains at most one all-reduce per layer, and nothing on one socket."""
    for p in (1, 2, 4, 8, 16):
        try:
            m = mapped(name, p)
        except ModelDoesNotFit:
            continue
        on, off = simulate_rdu(m, looped=True, overheads=False), simulate_rdu(m, looped=False, overheads=False)
        a, b = (next(k for k in e.kernels if k.name.startswith("decoder")) for e in (on, off))
        half = a.comm_s / 2
        assert a.iteration_s == pytest.approx(max(a.memory_s, a.compute_s + a.comm_s))
        assert b.iteration_s == pytest.approx(max(b.memory_s, b.compute_s + half) + half)
        assert 0.0 <= b.iteration_s - a.iteration_s <= half * (1 + 1e-12)
        assert 0.0 <= off.per_token_s - on.per_token_s <= m.layers * half * (1 + 1e-9)
        # With call overheads the gain grows by exactly (L - 1) calls' launch + boundary (sync + the
        # fill/drain of the layer's pipeline, one stage latency per stage).
        on1, off1 = simulate_rdu(m, looped=True), simulate_rdu(m, looped=False)
        depth = len(m.allocations[m.kernels[1].name].stages)
        extra = (m.layers - 1) * (HW.launch_s + HW.sync_s + depth * HW.stage_fill_drain_s)
        assert off1.per_token_s - on1.per_token_s == pytest.approx(off.per_token_s - on.per_token_s + extra)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "llama-3.1-70b", "qwen2.5-0.5b"])
def test_monotonic_in_sockets_until_allreduce_bound(name):
    prev = None
    for p in (1, 2, 4, 8, 16):
        try:
            m = mapped(name, p)
        except ModelDoesNotFit:
            continue
        est = simulate_rdu(m, looped=True)
        layer = next(k for k in est.kernels if k.name.startswith("decoders"))
        if prev is not None and est.per_token_s > prev:
            # Only allowed once the per-layer all-reduce latency is what bounds an iteration.
            assert layer.compute_s + layer.comm_s >= layer.memory_s
        elif prev is not None and name != "qwen2.5-0.5b":
            assert est.per_token_s < prev
        prev = est.per_token_s


def test_allreduce_alpha_beta_by_hand():
    assert allreduce_s(1e6, 1, 1e-6, 1e9) == 0.0
    assert allreduce_s(1e6, 4, 1e-6, 1e9) == pytest.approx(2 * 1e-6 * 2 + 2 * 0.75 * 1e6 / 1e9)


@jax.jit
def _toy_layer(x, w):
    return x @ w


def test_simulate_trivial_graph_by_hand():
    # Two calls of one layer kernel: x[1,1024] @ w[1024,1024], bf16.
    f = lambda x, w1, w2: _toy_layer(_toy_layer(x, w1), w2)  # noqa: E731
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
    g = trace(f, s(1, 1024), s(1024, 1024), s(1024, 1024))
    hw = replace(HW, launch_s=1e-6, sync_s=9e-6, stage_fill_drain_s=1e-6, hbm_efficiency=1.0, hbm_bw=1e12)
    m = map_decode(g, hw, 1, batch=1, kv_heads=1, dim=1024)
    assert [(k.role, k.calls) for k in m.kernels] == [("decoder", 2), ("sampling", 1)]
    layer = m.kernels[0]
    assert layer.weight_bytes == 1024 * 1024 * 2 and layer.other_bytes == 2 * 1024 * 2
    mem = (1024 * 1024 * 2 + 2 * 1024 * 2) / 1e12  # weights + x in + x out, one layer
    # Each call: launch 1 + sync 9 + one pipeline stage (the matmul; sampling counts as one) * 1 = 11 us.
    sampling = 11e-6 + 1024 * 2 / 1e12
    on, off = simulate_rdu(m, looped=True), simulate_rdu(m, looped=False)
    assert off.per_token_s == pytest.approx(2 * (11e-6 + mem) + sampling)
    assert on.per_token_s == pytest.approx(11e-6 + 2 * mem + sampling)
    assert on.calls_per_token == 2 and off.calls_per_token == 3


# Rows the model is known to miss (kept honest rather than widening their bounds):
# - SN40L-8 / DGX H100 "about 2x" (+26%): with the DGX side at the published 300 tok/s, any SN40L-8 at
#   >= 90% of roofline (the KL claim, met here for 8B and 70B) is >= 2.47x (741 tok/s); the claims agree
#   only if that DGX ran ~25% faster (~350-380 tok/s). Likewise >= 90% for 8B at 16 sockets would mean
#   >= 4.94x against "up to 3.7x", so the model keeps 8B at 16 sockets all-reduce-bound (69%, 3.79x).
# - KL one-socket maximum (1.98x, -10%) and the 8/16-socket geomean (1.78x, +11%) sit at the two edges:
#   the all-reduces on the carried activation (1.5 us per step, assumed) dilute the multi-socket gains,
#   which lets the two claims part (ratio 1.11, was 1.00), not as far as the published 1.375.
# - H200 batch 32 (h200-anchors' plain-JAX peer, 17.2 ms): the model gives 7.7 ms; our own engine measures
#   6.65 ms for the same configuration (BENCHMARKS.md suite), so the two sources conflict
#   (rdu.anchors.CONFLICTS, reported by `jaxdecode rdu --validate`).
# With the published (unfitted) constants the batch-1 tensor-parallel rows come out 19% and 26% slow.
KNOWN_MISSES = {
    "SN40L-8 / DGX H100, Llama-3.1-8B bs1 4K (up to 2.0x)",
    "H200 plain JAX unrolled, batch 32, tok/s",
    "2x H200 tensor parallel, llama-3.1-8b batch 1, ms/token",
    "2x H200 tensor parallel, llama-3.1-70b batch 1, ms/token",
}


def test_fitted_model_predicts_the_two_gpu_measurements():
    """Issue #9's bar: the GPU mode (fitted constants, measured all-reduce latency) predicts our 2-GPU
    tensor-parallel decode within 15% for Llama-3.1-8B; the 70B batch-1 row is the known miss (+19%)."""
    from rdu.validate import rows

    tp = {r.what: r for r in rows("fitted") if r.what.startswith("2x H200")}
    assert len(tp) == 4
    assert all(r.within for w, r in tp.items() if "8b" in w), {w: r.delta_pct for w, r in tp.items()}
    assert all(abs(r.delta_pct) < 20 for r in tp.values()), {w: r.delta_pct for w, r in tp.items()}


def test_validation_rows_within_stated_bounds():
    from rdu.validate import mape, rows, table

    rs = rows()
    print(table(rs))
    misses = {r.what for r in rs if not r.within}
    assert misses == KNOWN_MISSES
    assert mape([r for r in rs if r.group == "sn40l"]) < 20
    assert len(rs) >= 20

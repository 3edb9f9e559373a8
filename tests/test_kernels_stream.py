"""kernels/flat_gemm_stream.py against its jnp reference and a hand-checked schedule.

The kernel runs compiled on a Hopper GPU and, on the CPU, in Mosaic GPU's own interpreter (shared
memory, TMA, barriers, wgmma). The interpreter fills GMEM with NaN first, so the poison test proves
that every (slot, tile) the schedule calls written was written, and the combine never reads another.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import flat_gemm_stream as fs

ON_HOPPER = jax.default_backend() == "gpu" and any(s in jax.devices()[0].device_kind for s in ("H100", "H200"))
# bf16 output rounding (2^-8 relative) of values ~1, and a different f32 summation order over K.
ATOL, RTOL = 2e-2, 1e-2
SMALL = fs.StreamBlocks(tile_n=64, tile_k=128, stages=2, ctas=5)

# (M, K, widths of the weights, blocks): tiles shared by 2+ CTAs, CTAs spanning 3 tiles, 1-3 weights
CASES = {
    "qkv_m5": (5, 512, (192, 64, 128), SMALL),  # 6 tiles x 4 k-steps over 5 CTAs
    "swiglu_m8": (8, 256, (128, 128), fs.StreamBlocks(tile_n=64, tile_k=128, stages=3, ctas=3)),
    "one_m1_many_ctas": (1, 1024, (64,), fs.StreamBlocks(tile_n=64, tile_k=128, stages=2, ctas=8)),
    "m19_cta_per_unit": (19, 256, (128,), fs.StreamBlocks(tile_n=64, tile_k=128, stages=2, ctas=7)),
    "m64_two_ctas": (64, 384, (64, 64), fs.StreamBlocks(tile_n=64, tile_k=128, stages=2, ctas=2)),
    # weights loaded before griddepcontrol.wait, x after (compiled; the interpreter ignores pdl)
    "qkv_m5_pdl": (5, 512, (192, 64, 128), fs.StreamBlocks(tile_n=64, tile_k=128, stages=2, ctas=5, pdl=True)),
}


def _inputs(m, k, ns, layers=3, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(ns) + 1)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    ws = tuple((jax.random.normal(kk, (layers, k, n)) / np.sqrt(k)).astype(jnp.bfloat16) for kk, n in zip(keys[1:], ns))
    return x, ws


def _close(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    diff = np.abs(out - ref)
    assert (diff <= ATOL + RTOL * np.abs(ref)).all(), f"max diff {diff.max():.3g}"


def test_schedule_by_hand():
    # 6 tiles x 4 k-steps = 24 units over 5 CTAs: R = 5 units each, all 5 CTAs used.
    s = fs.schedule(512, (192, 64, 128), SMALL, 5)
    assert (s.ks, s.tiles, s.units_per_cta, s.ctas) == (4, (3, 1, 2), 5, 5)
    # CTA c covers units [5c, 5c+5): tile 0 = units 0-3 (CTA 0 only); tile 1 = 4-7 (CTAs 0, 1);
    # tile 2 = 8-11 (1, 2); tile 3 = 12-15 (2, 3); tile 4 = 16-19 (3); tile 5 = 20-23 (4).
    assert s.slots == 2
    np.testing.assert_array_equal(s.written(), [[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]])
    # 2 tiles x 8 k-steps over 100 CTAs: one unit each, 16 CTAs used, 8 share each tile.
    s = fs.schedule(1024, (128,), fs.StreamBlocks(tile_n=64, tile_k=128), 100)
    assert (s.units_per_cta, s.ctas, s.slots) == (1, 16, 8)
    assert s.written().all()


def test_sum_written_adds_the_written_slots_in_slot_order_by_hand():
    """[P, M, T·tile_n] partials: unwritten slots (NaN) never enter, rows past M are dropped, and the slots
    are added 0, 1, 2 in order: 2^24 + 1 + 1 rounds to 2^24 in f32 one step at a time (the kernels' order),
    to 2^24 + 2 if the last two were added first."""
    big = np.float32(2.0**24)
    parts = np.full((3, 2, 4), np.nan, np.float32)  # 3 slots, M8 = 2 rows (M = 1), 2 tiles of 2 columns
    parts[0] = [[big, big, 5.0, 6.0], [7.0, 7.0, 7.0, 7.0]]
    parts[1, :, :2] = 1.0  # tile 0 only
    parts[2, :, :2] = 1.0
    written = np.array([[True, True], [True, False], [True, False]])  # [P, T]
    got = np.asarray(fs.sum_written(jnp.asarray(parts), written, 2, 1))
    np.testing.assert_array_equal(got, [[big, big, 5.0, 6.0]])


def test_which_m_read_x_unpadded():
    # H200: M = 19, 39 and 63 failed to lower unpadded ("dimension 0 must have size smaller or a multiple
    # of its tiling 8"); M = 1..8, 16, 24, 32, 64 ran and matched (benchmarks/stream_gemm_gpu.py every_m)
    assert [m for m in range(1, 42) if fs.tma_reads_unpadded(m)] == [1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40]


class TestStream:
    INTERPRET = False

    def setup_method(self):
        if not self.INTERPRET and not ON_HOPPER:
            pytest.skip("compiled Mosaic GPU kernels need a Hopper GPU")

    @pytest.mark.parametrize("name", list(CASES))
    def test_matches_reference(self, name):
        m, k, ns, cfg = CASES[name]
        x, ws = _inputs(m, k, ns)
        layer = jnp.int32(2)  # traced: the op is jitted with layer as an argument
        outs = fs.flat_gemm_multi(x, ws, layer, block_sizes=cfg, interpret=self.INTERPRET)
        refs = fs.flat_gemm_multi_reference(x, ws, layer)
        assert len(outs) == len(ns)
        for out, ref in zip(outs, refs):
            _close(out, ref)

    def test_f32_out_and_unstacked(self):
        m, k, ns, cfg = CASES["qkv_m5"]
        x, ws = _inputs(m, k, ns, seed=1)
        outs = fs.flat_gemm_multi(
            x, tuple(w[1] for w in ws), out_dtype=jnp.float32, block_sizes=cfg, interpret=self.INTERPRET
        )
        refs = fs.flat_gemm_multi_reference(x, ws, 1, out_dtype=jnp.float32)
        for out, ref in zip(outs, refs):
            assert out.dtype == jnp.float32
            np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)  # same f32 sums, other order

    def test_loop_over_layers_reads_each_layer(self):
        m, k, layers = 8, 256, 4
        x, (w,) = _inputs(m, k, (k,), layers=layers, seed=2)  # [L, K, K]: each output feeds the next

        def run(gemm):
            return jax.lax.fori_loop(0, layers, lambda l, c: gemm(c, l), x)

        out = run(lambda c, l: fs.flat_gemm_multi(c, (w,), l, block_sizes=SMALL, interpret=self.INTERPRET)[0])
        _close(out, run(lambda c, l: fs.flat_gemm_multi_reference(c, (w,), l)[0]))

    def test_pdl_reads_x_after_the_previous_kernel(self):
        """With pdl each call may start before the previous kernel ends: each x is the previous call's output
        (through XLA's combine), so an x read before griddepcontrol.wait would show. Llama-3.1-8B's o shape."""
        if self.INTERPRET:
            pytest.skip("the interpreter ignores pdl (test_loop_over_layers_reads_each_layer covers the rest)")
        m, k, layers = 1, 4096, 6
        x, (w,) = _inputs(m, k, (k,), layers=layers, seed=3)
        pdl = fs.StreamBlocks(pdl=True)

        def run(gemm):
            return jax.jit(lambda x: jax.lax.fori_loop(0, layers, lambda l, c: gemm(c, l), x))(x)

        out = run(lambda c, l: fs.flat_gemm_multi(c, (w,), l, block_sizes=pdl, interpret=self.INTERPRET)[0])
        _close(out, run(lambda c, l: fs.flat_gemm_multi_reference(c, (w,), l)[0]))


def test_pdl_lowers_for_hopper_with_one_wait():
    """Lowered for CUDA on any host: with pdl the kernel holds griddepcontrol.wait, without it none."""
    x = jax.ShapeDtypeStruct((1, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4, 4096, 4096), jnp.bfloat16)
    for pdl in (False, True):
        op = lambda x, w, l: fs.flat_gemm_multi(x, (w,), l, block_sizes=fs.StreamBlocks(ctas=132, pdl=pdl))  # noqa: B023
        text = jax.jit(op).trace(x, w, jax.ShapeDtypeStruct((), jnp.int32)).lower(lowering_platforms=("cuda",))
        assert ("griddepcontrol" in text.as_text()) == pdl


class TestStreamInterpret(TestStream):
    INTERPRET = True

    @pytest.mark.parametrize("name", list(CASES))
    def test_every_written_slot_is_written(self, name):
        m, k, ns, cfg = CASES[name]
        x, ws = _inputs(m, k, ns)
        partials, sched = fs.stream_partials(x, ws, 0, cfg, interpret=True)  # GMEM starts as NaN
        assert partials.shape == (sched.slots, fs.partial_rows(m), sched.tile_count * cfg.tile_n)  # batch-major
        parts = np.asarray(partials).reshape(sched.slots, -1, sched.tile_count, cfg.tile_n).transpose(0, 2, 1, 3)
        written = sched.written()
        assert not np.isnan(parts[written]).any()
        if not written.all():  # the unwritten slots really are left alone (still NaN)
            assert np.isnan(parts[~written]).all()


@pytest.mark.parametrize("bad", ["no_layer", "k_not_tiled", "n_not_tiled", "m_too_big", "dtype", "one_stage"])
def test_bad_input_raises(bad):
    x, ws = _inputs(5, 256, (128,))
    with pytest.raises(ValueError):
        if bad == "no_layer":
            fs.flat_gemm_multi(x, ws, interpret=True)
        elif bad == "k_not_tiled":
            fs.flat_gemm_multi(x[:, :200], (ws[0][:, :200],), 0, block_sizes=SMALL, interpret=True)
        elif bad == "n_not_tiled":
            fs.flat_gemm_multi(x, (ws[0][:, :, :100],), 0, block_sizes=SMALL, interpret=True)
        elif bad == "m_too_big":
            fs.flat_gemm_multi(jnp.zeros((300, 256), jnp.bfloat16), ws, 0, block_sizes=SMALL, interpret=True)
        elif bad == "dtype":
            fs.flat_gemm_multi(x.astype(jnp.float32), ws, 0, block_sizes=SMALL, interpret=True)
        else:
            fs.flat_gemm_multi(x, ws, 0, block_sizes=fs.StreamBlocks(tile_n=64, tile_k=128, stages=1), interpret=True)

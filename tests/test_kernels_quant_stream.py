"""kernels/quant_gemm_stream.py against quant_gemm's reference: compiled on Hopper, interpreted on the CPU.

Grid: int4 and int8 codes; G = 32, 128 and per-channel (G = K); with and without offsets; one level of scales
and two (the K-quants' int8 per group and f16 per super-block of 256, in units of half, one and two
super-blocks); M = 1, 5, 8;
one weight and three (q·k·v widths); one and two compute warpgroups; stacked (traced layer index) and
unstacked; schedules whose tiles span several CTAs (several partial-sum slots). The interpreter runs
the three warpgroups, their barriers, the TMA copies and the wgmmas (operands through SMEM there);
a few Llama-sized calls are also lowered for CUDA on any host, which applies Mosaic GPU's layout and
swizzle rules that the interpreter skips.
"""

import dataclasses
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import two_level_scales

from kernels import flat_gemm_stream, superblocks
from kernels import quant_feeds as qf
from kernels import quant_gemm as qg
from kernels import quant_gemm_stream as qs

ON_HOPPER = jax.default_backend() == "gpu" and any(s in jax.devices()[0].device_kind for s in ("H100", "H200"))
pytestmark = pytest.mark.usefixtures("interpret_on_the_cpu")  # conftest: interpreted tests on the CPU device
# Outputs are ~N(0, 1). Both round an f32 sum to bf16 once (one ulp apart at most: 2^-7 relative) and add
# in different orders (f32: far below that). scale_in="w" also rounds every scaled (and offset) weight to
# bf16 (2^-9 relative, up to three roundings) before the f32 sum: at most ~2^-8·σ(y) per output, which
# averages over K; 6σ of it. Biased int4 codes (int4_feed="biased") add (bias + code) · x over a group in f32
# and take bias · Σx off: the sum's terms reach ~150·|x|, so its f32 error is at most G · 2^-24 · 150 · Σ|x|
# (~0.12 code·x units at G = 128), times a scale of ~1/(4.6·√K): under 2^-10 per group, 2^-8 over K = 512 at
# that worst case (within the "acc" bound).
ATOL = {"acc": 2.0**-7, "w": 6 * 2.0**-8}
RTOL = 2.0**-7
LAYERS = 3


@dataclasses.dataclass(frozen=True)
class Case:
    m: int
    codes: str  # "int4" | "int8"
    group: int  # 0: per-channel (G = K)
    ns: tuple[int, ...] = (256,)
    offsets: bool = False
    scales: str = "float32"
    stacked: bool = True
    wgs: int = 2
    scale_in: str = "acc"
    k: int = 512
    feed: str = "biased"  # int4_feed
    x: str = "bfloat16"
    permuted: bool = False  # codes stored in permute_k order (permuted_codes=True), as the engine keeps int4
    two_level: bool = False  # int8 sub-scales (sub-offsets) and f16 super-block ones, as the repacked K-quants
    tile_k: int = 128

    @property
    def g(self) -> int:
        return self.group or self.k


CASES = {
    "int4_g128_m1_one": Case(1, "int4", 128),
    "int4_g32_m5_qkv_offsets": Case(5, "int4", 32, ns=(256, 128, 128), offsets=True),
    "int4_g128_m8_qkv_offsets_f16": Case(8, "int4", 128, ns=(256, 128, 128), offsets=True, scales="float16"),
    "int8_g128_m1_qkv": Case(1, "int8", 128, ns=(256, 128, 128)),
    "int8_perchannel_m8_one_wg": Case(8, "int8", 0, wgs=1),
    "int4_g32_m1_unstacked_one_wg_offsets": Case(1, "int4", 32, offsets=True, stacked=False, wgs=1),
    "int8_g32_m5_bf16scales_two": Case(5, "int8", 32, ns=(128, 384), scales="bfloat16"),
    "int4_g32_m5_qkv_offsets_w": Case(5, "int4", 32, ns=(256, 128, 128), offsets=True, scale_in="w", feed="relabel"),
    "int4_g128_m1_relabel_offsets": Case(1, "int4", 128, offsets=True, feed="relabel"),
    "int4_g128_m1_relabel_w": Case(1, "int4", 128, offsets=True, feed="relabel", scale_in="w"),
    "int8_g32_m8_w_4wg": Case(8, "int8", 32, ns=(256, 512), scale_in="w", wgs=4),
    "int4_g128_m5_shuffle": Case(5, "int4", 128, feed="shuffle"),
    "int4_g128_m5_f16x_offsets": Case(5, "int4", 128, offsets=True, scales="float16", x="float16"),
    "int8_perchannel_m8_w_f16": Case(8, "int8", 0, scales="float16", scale_in="w"),
    "int4_g128_m8_four_wgs_offsets": Case(8, "int4", 128, ns=(256, 512), offsets=True, wgs=4),
    # x padded to 16 rows
    "int4_g32_m10_padded_w_offsets": Case(10, "int4", 32, offsets=True, scale_in="w", feed="relabel"),
    "int8_g128_m19_qkv": Case(19, "int8", 128, ns=(256, 128, 128)),
    # codes stored permuted: the relabel feed takes x as it is, the others permute it first
    "int4_g128_m1_relabel_permuted_offsets": Case(1, "int4", 128, offsets=True, feed="relabel", permuted=True),
    "int4_g32_m5_qkv_relabel_permuted_w": Case(
        5, "int4", 32, ns=(256, 128, 128), feed="relabel", scale_in="w", permuted=True
    ),
    "int4_g128_m5_shuffle_permuted": Case(5, "int4", 128, feed="shuffle", permuted=True),
    "int4_g32_m1_biased_permuted_offsets": Case(1, "int4", 32, offsets=True, permuted=True),
    # int8 activations: against `quant_gemm_s8_reference` (x rounded per group as the feed rounds it)
    "int4_g128_m1_s8_offsets": Case(1, "int4", 128, offsets=True, feed="s8"),
    "int4_g128_m8_qkv_s8_permuted": Case(8, "int4", 128, ns=(256, 128, 128), feed="s8", permuted=True),
    "int4_g128_m5_s8_four_wgs_offsets": Case(5, "int4", 128, ns=(256, 512), offsets=True, wgs=4, feed="s8"),
    # 20 units over 8 CTAs, 3 each: CTA 1 holds k-steps 3, 0, 1 (its x wraps around K)
    "int4_g128_m1_s8_wrapping_permuted": Case(1, "int4", 128, ns=(640,), offsets=True, feed="s8", permuted=True),
    "int4_g128_m12_s8_padded": Case(12, "int4", 128, ns=(128, 256), feed="s8"),  # M8 = 16, x padded
    # int8 codes with int8 activations: codes from SMEM straight into the s8 wgmma
    "int8_g128_m1_qkv_s8": Case(1, "int8", 128, ns=(256, 128, 128), feed="s8"),
    "int8_g128_m8_s8_bf16scales": Case(8, "int8", 128, ns=(640,), scales="bfloat16", feed="s8"),
    # `--quantize int4`'s own format (f16 scales and offsets, codes stored permuted) on both int4 feeds the
    # decode runs: s8 (o, q·k·v, down) and relabel with the scales in registers (gate and up)
    "int4_g128_m1_s8_f16scales_offsets": Case(1, "int4", 128, offsets=True, feed="s8", scales="float16", permuted=True),
    "int4_g128_m8_relabel_w_f16scales_offsets": Case(
        8, "int4", 128, ns=(256, 256), offsets=True, feed="relabel", scale_in="w", scales="float16", permuted=True
    ),
    # two levels, as the repacked K-quants: Q4_K (int4, G = 32, offsets) on the engine's two int4 feeds, Q6_K
    # (int8, G = 16), Q5_K (int8, G = 32, offsets); units of half a super-block, one, and two
    "int4_g32_m5_qkv_two_level_offsets": Case(5, "int4", 32, ns=(256, 128, 128), offsets=True, two_level=True),
    "int4_g32_m1_two_level_relabel_w_permuted": Case(
        1, "int4", 32, offsets=True, two_level=True, feed="relabel", scale_in="w", permuted=True, tile_k=256
    ),
    "int8_g16_m8_two_level": Case(8, "int8", 16, two_level=True, tile_k=256),
    "int8_g32_m8_two_level_w_offsets_wide_unit": Case(
        8, "int8", 32, ns=(256, 128), offsets=True, two_level=True, scale_in="w", tile_k=512
    ),
}
# interpreted in a process of their own (`interpreted.py`): the s8 feed, and the two-level stages of four or five
# arrays, whose interpreted barriers deadlocked on two cores beside XLA:CPU's concurrency-optimized scheduler
OWN_PROCESS = [name for name, case in CASES.items() if case.feed == "s8" or case.two_level]
# 8 CTAs off the GPU; K = 512 is 4 units per tile, so tiles span two or three CTAs
BLOCKS = qs.QuantStreamBlocks(tile_n=128, tile_k=128, stages=2, ctas=8)


def _weight(key, case: Case, n: int):
    """codes uniform over their range; scales (and offsets) sized so that y ~ N(0, 1)."""
    ks = jax.random.split(key, 3)
    cdt, hi = (jnp.int4, 8) if case.codes == "int4" else (jnp.int8, 128)
    codes = jax.random.randint(ks[0], (LAYERS, n, case.k), -hi, hi, jnp.int32).astype(cdt)  # [L, N, K]
    groups = case.k // case.g
    unit = 1.0 / (hi / np.sqrt(3) * np.sqrt(case.k))  # 1 / (code rms · √K)
    if case.two_level:  # 6-bit sub-scales and mins as the K-quants', f16 super-block d and -dmin
        weight = (codes, *two_level_scales(ks[1], LAYERS, case.k, n, case.g, unit, case.offsets))
        return weight if case.stacked else tuple(None if a is None else a[0] for a in weight)
    scales = (jax.random.uniform(ks[1], (LAYERS, groups, n), jnp.float32, 0.5, 1.5) * unit).astype(case.scales)
    offsets = None
    if case.offsets:  # Σ_g offsets · xsum: xsum ~ N(0, G)
        offsets = (jax.random.normal(ks[2], (LAYERS, groups, n), jnp.float32) / np.sqrt(case.k)).astype(case.scales)
    if not case.stacked:
        return codes[0], scales[0], None if offsets is None else offsets[0]
    return codes, scales, offsets


def _inputs(case: Case, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 1 + len(case.ns))
    x = jax.random.normal(keys[0], (case.m, case.k), jnp.float32).astype(case.x)
    weights = tuple(_weight(kk, case, n) for kk, n in zip(keys[1:], case.ns))
    return x, weights, (jnp.int32(LAYERS - 1) if case.stacked else None)


def _check_case(name: str, blocks: qs.QuantStreamBlocks, interpret: bool) -> None:
    """CASES[name] through quant_gemm_multi against the reference of its feed."""
    case = CASES[name]
    x, weights, layer = _inputs(case)
    stored = tuple((qg.permute_k(w[0]), *w[1:]) for w in weights) if case.permuted else weights
    outs = qs.quant_gemm_multi(
        x, stored, layer, group=case.g, block_sizes=blocks, permuted_codes=case.permuted, interpret=interpret
    )
    assert len(outs) == len(weights)
    for out, (c, *groupwise) in zip(outs, weights):
        s, o = superblocks.expand(*groupwise) if case.two_level else groupwise
        assert out.dtype == jnp.dtype(case.x)
        if case.feed == "s8":
            ref = qs.quant_gemm_s8_reference(x, c, s, o, layer, group=case.g)
        else:
            ref = qg.quant_gemm_reference(x, c, s, o, layer, group=case.g)
        _close(out, ref, case.scale_in)


def _close(out, ref, scale_in="acc"):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == ref.shape and np.isfinite(out).all()
    diff = np.abs(out - ref)
    ok = diff <= ATOL[scale_in] + RTOL * np.abs(ref)
    assert ok.all(), f"max diff {diff.max():.3g}, mean {diff.mean():.3g}, |ref| max {np.abs(ref).max():.3g}"


class TestQuantStream:
    INTERPRET = False

    def setup_method(self):
        if not self.INTERPRET and not ON_HOPPER:
            pytest.skip("compiled Mosaic GPU kernels need a Hopper GPU")

    def _blocks(self, case: Case) -> qs.QuantStreamBlocks:
        cfg = dataclasses.replace(
            BLOCKS,
            compute_wgs=case.wgs,
            tile_n=max(128, 64 * case.wgs),
            scale_in=case.scale_in,
            tile_k=case.tile_k,
            int4_feed=case.feed,
            int8_feed="s8" if case.feed == "s8" else "convert",
        )
        return cfg if self.INTERPRET else dataclasses.replace(cfg, ctas=None)

    @pytest.mark.parametrize("name", list(CASES))
    def test_matches_reference(self, name):
        if self.INTERPRET and name in OWN_PROCESS:
            pytest.skip("interpreted in a process of its own: test_own_process_cases_interpreted_match_reference")
        _check_case(name, self._blocks(CASES[name]), self.INTERPRET)

    @pytest.mark.parametrize("in_flight", [1, 2])
    @pytest.mark.parametrize("name", ["int4_g128_m1_relabel_w", "int8_g128_m19_qkv", "int4_g32_m5_qkv_offsets"])
    def test_bounded_in_flight_matches_reference(self, name, in_flight):
        """Copies held to `in_flight` units past the last landed one (the memory warpgroup also waits on the
        stages' arrivals), on 3 CTAs so each runs several units through a ring of 3 stages."""
        cfg = dataclasses.replace(self._blocks(CASES[name]), stages=3, in_flight=in_flight)
        _check_case(name, dataclasses.replace(cfg, ctas=3) if self.INTERPRET else cfg, self.INTERPRET)

    def test_loop_over_layers_reads_each_layer(self):
        """A fori_loop with a traced layer index, each layer's output feeding the next ([L, K, K] codes)."""
        case = Case(8, "int4", 128, ns=(256,), k=256)
        x, ((codes, scales, _),), _ = _inputs(case, seed=1)
        cfg = self._blocks(case)

        def run(gemm):
            return jax.lax.fori_loop(0, LAYERS, lambda l, h: gemm(h, l), x)

        out = run(
            lambda h, l: qs.quant_gemm_multi(
                h, ((codes, scales, None),), l, group=128, block_sizes=cfg, interpret=self.INTERPRET
            )[0]
        )
        _close(out, run(lambda h, l: qg.quant_gemm_reference(h, codes, scales, None, l, group=128)))


class TestQuantStreamInterpret(TestQuantStream):
    INTERPRET = True

    def test_own_process_cases_interpreted_match_reference(self):
        """The s8 feed's and the two-level cases, interpreted in a process of its own: with two or more units per
        CTA and a compute warpgroup reading a stage's constants, Mosaic GPU's interpreter deadlocks on two cores
        unless XLA:CPU's concurrency-optimized scheduler is off (as in test_kernels_quant_mlp)."""
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env["XLA_FLAGS"] = (
            env.get("XLA_FLAGS", "") + " --xla_cpu_enable_concurrency_optimized_scheduler=false"
        ).strip()
        root = pathlib.Path(__file__).resolve().parent.parent
        code = (
            "import sys; sys.path.insert(0, 'tests'); import test_kernels_quant_stream as t\n"
            "for name in t.OWN_PROCESS:\n"
            "    t._check_case(name, t.TestQuantStreamInterpret()._blocks(t.CASES[name]), True)\n"
            "    print('ok', name, flush=True)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=900
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        assert done.stdout.count("ok ") == len(OWN_PROCESS)

    def test_every_written_slot_is_written(self):
        """The interpreter's GMEM starts as NaN: a slot the schedule calls written but no CTA wrote shows up."""
        case = CASES["int4_g32_m5_qkv_offsets"]
        x, weights, layer = _inputs(case)
        parts, sched = qs.quant_stream_partials(x, weights, layer, group=case.g, cfg=BLOCKS, interpret=True)
        assert parts.shape == (sched.slots, x.shape[0], sched.tile_count * BLOCKS.tile_n)  # batch-major, M rows
        written = np.repeat(sched.written(), BLOCKS.tile_n, axis=1)  # [P, T·tile_n]
        assert np.isfinite(np.asarray(parts).transpose(0, 2, 1)[written]).all()
        assert sched.slots > 1  # the grid has tiles shared by CTAs


LLAMA = {  # name: (M, N_i, K) of Llama-3.1-8B's projections, as the engine hands them to one launch
    "o_m1": (1, (4096,), 4096),
    "o_m8": (8, (4096,), 4096),
    "qkv_m1": (1, (4096, 1024, 1024), 4096),
    "gate_up_m8": (8, (14336, 14336), 4096),
    "down_m1": (1, (4096,), 14336),
}


@pytest.mark.skipif(not ON_HOPPER, reason="compiled Mosaic GPU kernels need a Hopper GPU")
class TestCompiledAtLlamaShapes:
    INTERPRET = False  # conftest's fixture runs module-level tests on the CPU device: a class keeps the GPU

    @pytest.mark.parametrize("schedule", ["default", "pdl", "in_flight_2"])
    @pytest.mark.parametrize("fmt", ["int4", "int8", "int4_s8", "int8_s8"])
    @pytest.mark.parametrize("name", list(LLAMA))
    def test_every_call_matches_reference(self, fmt, name, schedule):
        """The engine's blocks (`QuantStreamBlocks()`, every SM) at full size, three calls of one compiled
        function: a register-operand hazard once corrupted some calls and not others at these shapes, never
        at the small ones above (docs/kernels.md). pdl: weights loaded before griddepcontrol.wait; in_flight_2: at
        most two units' copies outstanding. *_s8:
        the int8-activation feed against its own reference."""
        m, ns, k = LLAMA[name]
        s8 = fmt.endswith("_s8")
        fmt = fmt.removesuffix("_s8")
        case = Case(m, fmt, 128, ns=ns, offsets=fmt == "int4", k=k)
        x, weights, layer = _inputs(case)
        reference = qs.quant_gemm_s8_reference if s8 else qg.quant_gemm_reference
        refs = [reference(x, c, s, o, layer, group=128) for c, s, o in weights]
        feed = dict(int4_feed="s8", int8_feed="s8") if s8 else dict(int4_feed="relabel", int8_feed="convert")
        extra = {"default": {}, "pdl": dict(pdl=True), "in_flight_2": dict(in_flight=2)}[schedule]
        cfg = qs.QuantStreamBlocks(**extra, **feed)
        gemm = jax.jit(lambda x, weights: qs.quant_gemm_multi(x, weights, layer, group=128, block_sizes=cfg))
        scale_in = cfg.resolved(ns, fmt == "int4", 4 if fmt == "int4" else 8).scale_in
        for _ in range(3):
            for out, ref in zip(gemm(x, weights), refs):
                _close(out, ref, scale_in)


LOWERED = {  # name: (M, codes dtype, G, offsets, N_i...): Llama-3.1-8B's K; int4 at G = 128 takes the s8 feed
    "int4_g128_offsets_m1_qkv": (1, jnp.int4, 128, True, (4096, 1024, 1024)),
    "int4_g128_offsets_m8_gate_up": (8, jnp.int4, 128, True, (14336, 14336)),
    "int4_g128_offsets_m1_gate": (1, jnp.int4, 128, True, (14336,)),
    "int4_g32_m8_gate_up": (8, jnp.int4, 32, False, (14336, 14336)),
    "int8_g128_m1_one": (1, jnp.int8, 128, False, (4096,)),
    # two levels (`kernels.superblocks`): Q4_K's q·k·v and gate/up, Q6_K's down (int8 codes in groups of 16)
    "q4_k_two_level_m1_qkv": (1, jnp.int4, 32, True, (4096, 1024, 1024)),
    "q4_k_two_level_m8_gate_up": (8, jnp.int4, 32, True, (14336, 14336)),
    "q6_k_two_level_m1_one": (1, jnp.int8, 16, False, (4096,)),
}


@pytest.mark.parametrize("name", list(LOWERED))
def test_lowers_for_hopper_on_any_host(name):
    """Lowering for CUDA runs Mosaic GPU's layout, tiling and swizzle checks (which the interpreter
    skips) down to its LLVM-level module, on a machine without a GPU."""
    m, cdt, group, offsets, ns = LOWERED[name]
    k, layers = 4096, 4
    two = "two_level" in name
    sub = jnp.int8 if two else jnp.float16
    per_super = lambda n: jax.ShapeDtypeStruct((layers, k // superblocks.SUPER_GROUP, n), jnp.float16)  # noqa: E731
    weights = tuple(
        (
            jax.ShapeDtypeStruct((layers, n, k), cdt),
            jax.ShapeDtypeStruct((layers, k // group, n), sub),
            jax.ShapeDtypeStruct((layers, k // group, n), sub) if offsets else None,
        )
        + ((per_super(n), per_super(n) if offsets else None) if two else ())
        for n in ns
    )
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    cfg = qs.QuantStreamBlocks(ctas=132, pdl=name == "int4_g128_offsets_m1_qkv")  # one with pdl
    op = lambda x, w, l: qs.quant_gemm_multi(x, w, l, group=group, block_sizes=cfg)
    text = jax.jit(op).trace(x, weights, jax.ShapeDtypeStruct((), jnp.int32)).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in text.as_text()
    assert ("griddepcontrol" in text.as_text()) == cfg.pdl  # weights before the wait, x after


@pytest.mark.parametrize(
    "bad",
    [
        dict(m=65),  # past MAX_M
        dict(n2=96),  # a width not in whole tiles
        dict(mixed=True),  # one weight with offsets, one without
        dict(scale_in="x"),
        dict(wgs=5),
        dict(scale_in="w", feed="biased"),  # the bias comes off the accumulators only
        dict(m=20, feed="s8"),  # M8 = 24 does not divide the 64-row chunks x is rounded in
        dict(group=64, feed="s8"),  # int8 activations in groups of 128 columns or more
    ],
)
def test_untiled_shapes_are_refused_with_the_numbers(bad):
    case = Case(bad.get("m", 1), "int4", bad.get("group", 128), ns=(128, bad.get("n2", 128)), offsets=True)
    x, weights, layer = _inputs(case)
    if bad.get("mixed"):
        weights = (weights[0], (weights[1][0], weights[1][1], None))
    cfg = dataclasses.replace(
        BLOCKS,
        scale_in=bad.get("scale_in", "acc"),
        compute_wgs=bad.get("wgs", 2),
        int4_feed=bad.get("feed", "relabel"),
    )
    with pytest.raises(qs.UntiledShape, match=r"\d|scale_in"):
        qs.quant_gemm_multi(x, weights, layer, group=case.g, block_sizes=cfg, interpret=True)


def test_schedule_is_the_bf16_stream_kernels():
    """The partials layout is flat_gemm_stream's, so its combine and the q·k·v epilogue apply."""
    cfg = qs.QuantStreamBlocks(tile_n=128, tile_k=256, ctas=132)
    ours = flat_gemm_stream.schedule(4096, (4096, 1024, 1024), cfg.gemm_blocks(), 132)
    theirs = flat_gemm_stream.schedule(4096, (4096, 1024, 1024), flat_gemm_stream.StreamBlocks(128, 256), 132)
    assert ours == theirs and ours.units == 48 * 16


def test_permute_k_moves_each_column_as_the_register_relabel_does():
    """permute_k puts column 32b + 8c + 2t + e at 32b + 8t + 2c + e (by hand) and is its own inverse."""
    from kernels.quant_gemm_stream import permute_k

    k = 64
    cols = np.asarray(permute_k(jnp.arange(k)[None]))[0]
    for b, c, t, e in np.ndindex(k // 32, 4, 4, 2):
        assert cols[32 * b + 8 * t + 2 * c + e] == 32 * b + 8 * c + 2 * t + e
    np.testing.assert_array_equal(np.asarray(permute_k(permute_k(jnp.arange(k)[None])))[0], np.arange(k))


def test_permute_pairs_moves_each_column_as_the_biased_conversion_pairs_them():
    """permute_pairs puts column 32b + 8c + t + 4e (code t + 4e of lane c's register) at 32b + 8t + 2c + e."""
    k = 64
    cols = np.asarray(qf.permute_pairs(jnp.arange(k)[None]))[0]
    for b, c, t, e in np.ndindex(k // 32, 4, 4, 2):
        assert cols[32 * b + 8 * t + 2 * c + e] == 32 * b + 8 * c + t + 4 * e
    assert sorted(cols) == list(range(k))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_bias_bits_are_the_bias_plus_each_code(dtype):
    """The lop3's output, (nibble & 0xF) ^ the bias's half-word, read as `dtype`, is bias + code for every int4
    code: the sign flip of the nibble adds 8 to the code and the exponent bits make the mantissa count units."""
    bias, half = qf.BIAS_BITS[jnp.dtype(dtype)]
    codes = np.arange(-8, 8)
    bits = ((codes & 0xF) ^ half).astype(np.uint16)
    values = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(bits), dtype), np.float64)
    np.testing.assert_array_equal(values, bias + codes)


def test_register_operand_wgmmas_go_through_the_waiting_helpers():
    """wgmma reads a register operand asynchronously while the compiler reuses its registers, which
    corrupted results compiled and only at full size (docs/kernels.md); the interpreter cannot see it.
    So in the kernels that feed wgmma from registers, every wgmma is issued by the one helper, which waits
    for it before returning."""
    import ast
    import pathlib

    helpers = {"mma_from_registers", "mma_from_smem"}
    root = pathlib.Path(qs.__file__).parent
    for name in ("quant_gemm.py", "quant_gemm_stream.py", "quant_mlp.py"):
        tree = ast.parse((root / name).read_text())
        for fn in (f for f in tree.body if isinstance(f, ast.FunctionDef)):  # module level, nested defs inside
            for node in ast.walk(fn):
                call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                if call and node.func.attr == "wgmma":
                    assert fn.name in helpers, f"{name}: {fn.name} issues a wgmma outside the waiting helpers"
        for fn in (f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name in helpers):
            assert "wgmma_wait(0)" in ast.unparse(fn), f"{name}: {fn.name} does not wait for its wgmma"


def test_permute_s8_moves_each_column_as_the_s8_conversion_does():
    """permute_s8 puts column 32b + 8c + 2i + e (byte i of lane c's low (e = 0) or high (e = 1) register)
    at 32b + 16e + 4c + i, where WGMMA_LAYOUT_8BIT hands wgmma that byte (by hand)."""
    k = 64
    cols = np.asarray(qf.permute_s8(jnp.arange(k)[None]))[0]
    for b, c, i, e in np.ndindex(k // 32, 4, 4, 2):
        assert cols[32 * b + 16 * e + 4 * c + i] == 32 * b + 8 * c + 2 * i + e
    assert sorted(cols) == list(range(k))


def test_s8_x_order_for_permuted_codes_is_what_each_thread_holds():
    """The kernel rounds x in the WGMMA layout and hands wgmma the bytes as WGMMA_LAYOUT_8BIT without moving
    them between threads (`x_as_s8_operand`): operand column 32b + 16e + 4c + i is x's column 32b + 8i + 2c + e
    (by hand), which lane column c holds in the WGMMA layout (columns 2c, 2c + 1 of each 8-column tile), and
    that is permute_s8(permute_k(x)), the order s8 codes stored in permute_k order are read in."""
    k = 64
    cols = np.asarray(qf.permute_s8(qg.permute_k(jnp.arange(k)[None])))[0]
    for b, e, c, i in np.ndindex(k // 32, 2, 4, 4):
        src = cols[32 * b + 16 * e + 4 * c + i]
        assert src == 32 * b + 8 * i + 2 * c + e and (src % 8) // 2 == c  # held by lane column c
    assert sorted(cols) == list(range(k))


@pytest.mark.parametrize(
    "m, group, ns, want",
    [
        (1, 128, (4096, 1024, 1024), "s8"),
        (8, 128, (4096,), "s8"),
        (1, 128, (14336, 14336), "relabel"),  # x of 14 k-steps held: 3 stages fit, not the 4 asked for
        (20, 128, (4096,), "relabel"),  # M8 = 24 does not divide 64
        (1, 64, (4096,), "relabel"),  # groups under 128 columns
        (1, 128, (4096,), "s8_int8"),  # int8 codes: s8 from SMEM
        (20, 128, (4096,), "convert_int8"),
    ],
)
def test_auto_feed_is_s8_where_it_applies(m, group, ns, want):
    """int4_feed="auto" (the default): int8 activations at G = 128 and M8 dividing 64 where the CTA's x fits
    in shared memory beside the stages asked for (Llama-3.1-8B's gate+up: each CTA holds x of 14 k-steps),
    else the relabelled 16-bit feed."""
    k = 4096
    want, _, int8 = want.partition("_")
    weights = tuple(
        (
            jax.ShapeDtypeStruct((2, n, k), jnp.int8 if int8 else jnp.int4),
            jax.ShapeDtypeStruct((2, k // group, n), jnp.float32),
            None if int8 else jax.ShapeDtypeStruct((2, k // group, n), jnp.float32),
        )
        for n in ns
    )
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    cfg = qs.resolve_blocks(qs.QuantStreamBlocks(), x, weights, group, ctas=132)
    assert (cfg.int8_feed if int8 else cfg.int4_feed) == want


def test_s8_lop3_gives_each_code_plus_8():
    """(nibble ^ 8) & 0xF, the lop3 of the s8 conversion (LUT 0x28: (a ^ b) & c), is code + 8 for every int4."""
    codes = np.arange(-8, 8)
    a, b, c = codes & 0xF, 0x8, 0xF
    lut = 0x28
    bits = [(lut >> ((((a >> j) & 1) << 2) | (((b >> j) & 1) << 1) | ((c >> j) & 1))) & 1 for j in range(4)]
    out = sum(bit << j for j, bit in enumerate(bits))
    np.testing.assert_array_equal(out, codes + qf.S8_BIAS)


def test_quantize_activations_by_hand():
    """Per row and group: xq · s within s / 2 of x, |xq| <= 127 with the group's largest at ±127; the constants
    s, -8 s Σ xq and Σ x; an all-zero group gets s = 1 and xq = 0."""
    x = jax.random.normal(jax.random.key(3), (8, 512), jnp.float32).astype(jnp.bfloat16)
    x = x.at[2, 128:256].set(0)
    xq, consts = qf.quantize_activations(x, 128, offsets=True)
    xf = np.asarray(x, np.float32).reshape(8, 4, 128)
    q = np.asarray(xq, np.int32).reshape(8, 4, 128)
    s, bias, xsum = (np.asarray(consts[:, i]).T for i in range(3))  # [M8, K/G] each
    amax = np.abs(xf).max(-1)
    np.testing.assert_allclose(s, np.where(amax > 0, amax / 127, 1), rtol=1e-6)
    assert np.abs(q).max() <= 127 and (np.abs(q).max(-1)[amax > 0] == 127).all()
    assert (np.abs(q * s[..., None] - xf) <= s[..., None] / 2 * (1 + 1e-6)).all()
    np.testing.assert_array_equal(q[2, 1], 0)
    np.testing.assert_allclose(bias, -8 * s * q.sum(-1), rtol=1e-6)
    np.testing.assert_allclose(xsum, xf.sum(-1), rtol=1e-5, atol=1e-5)


def test_s8_reference_is_within_the_rounding_of_x_of_the_exact_product():
    """quant_gemm_s8_reference differs from x · W only by x's rounding: |Σ w (x - xq s)| <= Σ |w| s / 2."""
    case = Case(4, "int4", 128, offsets=True)
    x, ((c, s, o),), layer = _inputs(case)
    ref = np.asarray(qs.quant_gemm_s8_reference(x, c, s, o, layer, group=128))
    exact = np.asarray(qg.quant_gemm_reference(x, c, s, o, layer, group=128, out_dtype=jnp.float32))
    w = np.abs(np.asarray(qg.dequantize_reference(c[layer], s[layer], None, group=128)))  # [K, N]
    _, consts = qf.quantize_activations(x, 128, offsets=True)
    step = np.repeat(np.asarray(consts[:, 0]).T, 128, axis=1)  # [M, K]: each column's s
    bound = (step / 2) @ w + 1e-4
    assert (np.abs(ref - exact) <= bound).all() and (np.abs(ref - exact) > 0).any()

"""kernels/decode_attention against its jnp reference: compiled on a GPU, interpreted on the CPU.

Grid (kernels.shapes.TEST_ATTENTION): GQA groups 1, 3, 4, 8; head dims 64 and 128; batch up to 64;
S = 1, 40, 63, 65, 200 (not multiples of the block: padded and masked) and 128, 256; T = 1 and 3.
Every kernel runs with poisoned (NaN-filled, aliased) output buffers, so an element it does not
write fails the comparison. The synchronized kernel and the combine run on both backends ("triton",
"mosaic"); the Mosaic GPU ones interpreted on a few small cases (a length not a multiple of the block,
an empty split, T = 1 and 3, a stack of layers at a traced index, batch > 1, refilled TMA stages), at
model shapes compiled on a Hopper GPU, and lowered for CUDA on any host.

tests/conftest.py pins JAX to the CPU; on a GPU machine run with JAX_PLATFORMS=cuda,cpu. Interpreted
tests run on the CPU device there too (conftest's `interpret_on_the_cpu`).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import decode_attention as da
from kernels.decode_attention.attention import attention_call
from kernels.decode_attention.combine import combine_partials, combine_splits
from kernels.decode_attention.layout import from_rows, split_layout, to_rows
from kernels.shapes import CATALOG, TEST_ATTENTION, AttentionShape

ON_GPU = jax.default_backend() == "gpu"
ON_HOPPER = ON_GPU and any(s in jax.devices()[0].device_kind for s in ("H100", "H200"))
# bf16 output rounding (2^-8 relative) plus P cast to bf16 before the P·V dot, on outputs of size ~1.
ATOL = {jnp.bfloat16: 2e-2}
# Small blocks so that the CPU interpreter runs several splits and loop steps per split.
BLOCKS = da.BlockSizes(block_k=32, num_splits=2)
# The Mosaic kernel's blocks are whole wgmma M sides: 64 cache positions.
MOSAIC_BLOCKS = da.BlockSizes(block_k=64, num_splits=2)
BACKENDS = ["triton", "mosaic"]


# Compiled-only shapes (Hopper): Llama-3.1-8B and SmolLM2-135M decode steps, Llama-3.1-70B's heads.
MOSAIC_MODEL_SHAPES = {
    s.name: s
    for s in (
        CATALOG["llama3_8b_b1_s1024_decode"].attention,
        CATALOG["llama3_8b_b8_s8192_decode"].attention,
        CATALOG["llama3_8b_b32_s1024_decode"].attention,
        CATALOG["smollm2_135m_b1_s1024_decode"].attention,
        CATALOG["smollm2_135m_b32_s8192_decode"].attention,
        AttentionShape("llama3_70b_b1_s8192", 1, 1, 64, 8, 128, 8192),
        AttentionShape("llama3_70b_b64_s1024", 64, 1, 64, 8, 128, 1024),
        AttentionShape("smollm2_b4_s64", 4, 1, 9, 3, 64, 64),
        AttentionShape("llama3_8b_t3_b4_s1000", 4, 3, 32, 8, 128, 1000),
    )
}


def _blocks(backend, **kw):
    """BLOCKS, or MOSAIC_BLOCKS for "mosaic", with the fields in kw replaced."""
    return dataclasses.replace(MOSAIC_BLOCKS if backend == "mosaic" else BLOCKS, **kw)


def _inputs(shape, seed=0, lengths=None):
    b, t, n, kh, h, s = (
        shape.batch,
        shape.tokens,
        shape.num_heads,
        shape.num_kv_heads,
        shape.head_dim,
        shape.cache_len,
    )
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (b, t, n, h), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, s, kh, h), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, s, kh, h), jnp.bfloat16)
    if lengths is None:  # ragged: one short sequence, one full, the rest in between
        lengths = np.linspace(min(t + 4, s), s, b).astype(np.int32)[::-1].copy()
    return q, k, v, jnp.asarray(lengths, jnp.int32)


def _close(out, ref, dtype=jnp.bfloat16, what=""):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    diff = np.abs(out - ref)
    assert np.isfinite(out).all(), f"{what} non-finite output"
    assert diff.max() <= ATOL[dtype], f"{what} max diff {diff.max():.3g}, mean {diff.mean():.3g}"


pytestmark = pytest.mark.usefixtures("interpret_on_the_cpu")


class TestDecodeAttention:
    INTERPRET = False

    def setup_method(self):
        if not self.INTERPRET and not ON_GPU:
            pytest.skip("compiled Pallas kernels need a GPU")

    def _backend(self, backend):
        if backend == "mosaic" and not self.INTERPRET and not ON_HOPPER:
            pytest.skip("compiled Mosaic GPU kernels need a Hopper GPU")
        return backend

    def _async(self, q, k, v, lengths, phi, **kw):
        return da.decode_attention_async(
            q, k, v, lengths, phi, block_sizes=BLOCKS, interpret=self.INTERPRET, poison=True, **kw
        )

    # tiny_gqa4_b2_s256 and tiny_mha_b1_s128 are checked against the reference by the tests below.
    @pytest.mark.parametrize("name", [n for n in TEST_ATTENTION if n not in ("tiny_gqa4_b2_s256", "tiny_mha_b1_s128")])
    def test_async_matches_reference(self, name):
        q, k, v, lengths = _inputs(TEST_ATTENTION[name])
        ref, ref_lse = da.decode_attention_reference(q, k, v, lengths)
        out, info = self._async(q, k, v, lengths, 0.0, recompute=False)  # fallback: tests below
        _close(out, ref)
        assert not info.recomputed.any(), "φ=0 suits N(0,1) logits: nothing should be flagged"
        np.testing.assert_allclose(info.lse, ref_lse, atol=1e-3)

    @pytest.mark.parametrize("backend", BACKENDS)
    @pytest.mark.parametrize("name", ["tiny_gqa4_t3_b2_s128", "tiny_gqa4_b3_s63_h128"])
    def test_sync_matches_reference(self, name, backend):
        """T = 3 (causal rows, the jnp combine); S = 63 (padded to a block, ragged lengths: the second
        split is empty) with H = 128."""
        q, k, v, lengths = _inputs(TEST_ATTENTION[name], seed=1)
        ref, _ = da.decode_attention_reference(q, k, v, lengths)
        out = da.decode_attention_sync(
            q,
            k,
            v,
            lengths,
            block_sizes=_blocks(backend),
            interpret=self.INTERPRET,
            poison=True,
            backend=self._backend(backend),
        )
        _close(out, ref)

    @pytest.mark.parametrize("backend", BACKENDS)
    def test_sync_long_split(self, backend):
        """One split of 6 blocks through 2 stages (the Mosaic kernel refills its TMA buffers), lengths
        200 (ends inside a block: 4 blocks run) and 384."""
        q, k, v, lengths = _inputs(AttentionShape("long", 2, 1, 8, 2, 64, 384), seed=6, lengths=[200, 384])
        ref, _ = da.decode_attention_reference(q, k, v, lengths)
        blocks = da.BlockSizes(block_k=64, num_splits=1, num_stages=2)
        out = da.decode_attention_sync(
            q, k, v, lengths, block_sizes=blocks, interpret=self.INTERPRET, poison=True, backend=self._backend(backend)
        )
        _close(out, ref)

    def test_default_blocks_unaligned_length(self):
        """Default BlockSizes (block_k 64, splits chosen from S): S = 65 pads to 128, 2 splits."""
        q, k, v, lengths = _inputs(TEST_ATTENTION["tiny_mha_b2_s65"], seed=5, lengths=[65, 64])
        ref, _ = da.decode_attention_reference(q, k, v, lengths)
        out, info = da.decode_attention_async(q, k, v, lengths, 0.0, interpret=self.INTERPRET, poison=True)
        _close(out, ref)
        assert not info.recomputed.any()

    @pytest.mark.parametrize("phi", [300.0, -300.0])  # overflow / denominator underflow
    def test_bad_phi_recomputes_every_row(self, phi):
        q, k, v, lengths = _inputs(TEST_ATTENTION["tiny_gqa4_b2_s256"], seed=2)
        ref, _ = da.decode_attention_reference(q, k, v, lengths)
        out, info = self._async(q, k, v, lengths, phi)
        _close(out, ref)
        assert info.recomputed.all()
        unsafe, _ = self._async(q, k, v, lengths, phi, recompute=False)
        assert not np.allclose(
            np.asarray(unsafe, np.float32), np.asarray(ref, np.float32), atol=ATOL[jnp.bfloat16], equal_nan=False
        ), "the fallback was not needed"

    def test_flags_name_exactly_the_overflowing_rows(self):
        shape = TEST_ATTENTION["tiny_gqa4_b2_s256"]
        q, k, v, lengths = _inputs(shape, seed=3)
        q = q.at[1, 0, 5].multiply(200.0)  # one row (b=1, n=5) with logits ~ +1e3: e^{x-φ} overflows
        ref, _ = da.decode_attention_reference(q, k, v, lengths)
        out, info = self._async(q, k, v, lengths, 0.0)
        _close(out, ref)
        expected = np.zeros((shape.batch, shape.tokens, shape.num_heads), bool)
        expected[1, 0, 5] = True
        np.testing.assert_array_equal(info.recomputed, expected)

    def test_traced_phi_per_layer_in_scan(self):
        q, k, v, lengths = _inputs(TEST_ATTENTION["tiny_mha_b1_s128"], seed=4)
        ref, _ = da.decode_attention_reference(q, k, v, lengths)
        phis = jnp.array([0.0, 500.0], jnp.float32)  # layer 1 has a hopeless φ

        def body(_, phi):
            out, info = self._async(q, k, v, lengths, phi)
            return None, (out, info.recomputed.mean())

        _, (outs, rates) = jax.lax.scan(body, None, phis)
        _close(outs[0], ref)
        _close(outs[1], ref)
        np.testing.assert_array_equal(rates, [0.0, 1.0])

    @pytest.mark.parametrize(
        "name, backend",
        [("tiny_gqa4_t3_b2_s128", "triton"), ("tiny_gqa4_b2_s256", "triton"), ("tiny_gqa4_b2_s256", "mosaic")],
    )
    def test_stacked_cache_reads_the_given_layer(self, name, backend):
        """k, v as stacks [L, B, S, K, H] plus a traced layer index (the looped decode's form) give
        exactly the result of that layer's cache alone, for the synchronized kernel and (Triton only)
        the async one, called per layer and in a scan over the layers (the messages name which failed)."""
        shape = TEST_ATTENTION[name]
        layers = [_inputs(shape, seed=10 + i) for i in range(3)]
        q, lengths = layers[0][0], layers[0][3]
        k_stack = jnp.stack([k for _, k, _, _ in layers])  # [L, B, S, K, H]
        v_stack = jnp.stack([v for _, _, v, _ in layers])
        kw = dict(interpret=self.INTERPRET, poison=True, backend=self._backend(backend))
        refs = [da.decode_attention_reference(q, k, v, lengths)[0] for _, k, v, _ in layers]
        for i, ref in enumerate(refs):
            sync = da.decode_attention_sync(
                q, k_stack, v_stack, lengths, layer=jnp.int32(i), block_sizes=_blocks(backend), **kw
            )
            _close(sync, ref, what=f"layer {i} alone:")

        # In the scan the outputs are the kernel's own: jax.new_ref's poisoned buffers inside a scan body
        # read back wrong on the GPU for the Mosaic kernel (max diff ~1.5 in every layer, while the same
        # calls unrolled or jitted one at a time agree), so the poison checks stay with the calls above.
        kw_scan = dict(kw, poison=False)

        def body(_, i):
            sync = da.decode_attention_sync(
                q, k_stack, v_stack, lengths, layer=i, block_sizes=_blocks(backend), **kw_scan
            )
            if backend == "mosaic":  # the async kernel is Pallas-Triton only
                return None, (sync, sync, False)
            out, info = self._async(q, k_stack, v_stack, lengths, 0.0, layer=i)
            return None, (sync, out, info.recomputed.any())

        _, (sync, out, recomputed) = jax.lax.scan(body, None, jnp.arange(3, dtype=jnp.int32))
        for i, ref in enumerate(refs):
            _close(sync[i], ref, what=f"layer {i} in the scan:")
            _close(out[i], ref, what=f"layer {i} in the scan (async):")
        assert not recomputed.any()

    @pytest.mark.parametrize(
        "shape, backend",
        [
            (AttentionShape("g4", 2, 1, 32, 8, 128, 128), "triton"),
            (AttentionShape("g7", 3, 1, 28, 4, 64, 192), "triton"),
            (AttentionShape("g1", 1, 1, 4, 4, 64, 64), "triton"),
            (AttentionShape("g4", 2, 1, 32, 8, 128, 128), "mosaic"),
            (AttentionShape("g7", 3, 1, 28, 4, 64, 192), "mosaic"),  # 3 splits; the combine's rows padded to 8
        ],
    )
    def test_sync_rows_equals_sync(self, shape, backend):
        """q given as the kernel's rows (what kernels.qkv_rope writes: zeros past the group) gives the
        output of `decode_attention_sync` on q itself, on a stacked cache at a traced layer."""
        layers = [_inputs(shape, seed=40 + i) for i in range(2)]
        q, lengths = layers[0][0], layers[0][3]
        k_stack = jnp.stack([k for _, k, _, _ in layers])  # [L, B, S, K, H]
        v_stack = jnp.stack([v for _, _, v, _ in layers])
        # the stack is read in place, so the splits must divide its blocks: Mosaic's S / 64 (auto)
        blocks = da.BlockSizes(32, num_splits=2) if backend == "triton" else da.BlockSizes(64)
        rows = to_rows(q, shape.num_kv_heads)  # [B, K, R, H]
        group = shape.num_heads // shape.num_kv_heads
        got = da.decode_attention_sync_rows(
            rows,
            k_stack,
            v_stack,
            lengths - 1,
            group=group,
            layer=jnp.int32(1),
            block_sizes=blocks,
            length_offset=1,
            interpret=self.INTERPRET,
            poison=True,
            backend=self._backend(backend),
        )
        kw = dict(block_sizes=blocks, interpret=self.INTERPRET, backend=backend)
        want = da.decode_attention_sync(q, k_stack, v_stack, lengths, layer=jnp.int32(1), **kw)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
        _close(got, da.decode_attention_reference(q, layers[1][1], layers[1][2], lengths)[0])

    @pytest.mark.parametrize(
        "shape, backend",
        [
            (AttentionShape("g4", 2, 1, 32, 8, 128, 256), "triton"),
            (AttentionShape("g1", 1, 1, 4, 4, 64, 128), "triton"),
            (AttentionShape("g8", 3, 1, 16, 2, 128, 192), "triton"),
            (AttentionShape("g4", 2, 1, 32, 8, 128, 256), "mosaic"),
        ],
    )
    def test_combine_kernel_equals_the_jnp_combine(self, shape, backend):
        """combine="kernel" (one Pallas kernel for the split combine) against combine="xla" and the
        reference, on ragged lengths (some splits past a sequence's end hold no rows: m = -1e30, l = 0),
        with poisoned outputs, also over a stacked cache at a traced layer."""
        q, k, v, lengths = _inputs(shape, seed=40)
        lengths = lengths.at[0].set(3)  # most of sequence 0's splits are empty
        kw = dict(interpret=self.INTERPRET, poison=True, backend=self._backend(backend))
        block_k = 64 if backend == "mosaic" else 32
        blocks = da.BlockSizes(block_k=block_k, num_splits=shape.cache_len // 64, combine="kernel")
        fused = da.decode_attention_sync(q, k, v, lengths, block_sizes=blocks, **kw)
        plain = da.decode_attention_sync(q, k, v, lengths, block_sizes=dataclasses.replace(blocks, combine="xla"), **kw)
        ref, _ = da.decode_attention_reference(q, k, v, lengths)
        _close(fused, ref)
        # the same f32 sums in split order (XLA may reduce in another order): at most one bf16 rounding apart
        np.testing.assert_allclose(np.asarray(fused, np.float32), np.asarray(plain, np.float32), rtol=2**-7, atol=1e-6)
        stacked = da.decode_attention_sync(
            q,
            jnp.stack([k, k]),
            jnp.stack([v, v]),
            lengths,
            layer=jnp.int32(1),
            block_sizes=da.BlockSizes(block_k=block_k, combine="kernel"),
            **kw,
        )
        _close(stacked, ref)

    @pytest.mark.parametrize(
        "shape, lengths",
        [
            (AttentionShape("g4", 2, 1, 32, 8, 128, 256), [3, 256]),  # sequence 0: three of four splits empty
            (AttentionShape("g7", 3, 1, 28, 4, 64, 192), [192, 100, 65]),  # 3 splits; the combine's rows padded
            (AttentionShape("g8_b8", 8, 1, 32, 4, 128, 512), None),  # the 8B group, splits of two blocks
            (AttentionShape("llama3_8b_b1_s1024", 1, 1, 32, 8, 128, 1024), [1000]),  # compiled only: 16 splits
            (AttentionShape("llama3_8b_b8_s1024", 8, 1, 32, 8, 128, 1024), None),
            (AttentionShape("llama3_70b_b1_s8192", 1, 1, 64, 8, 128, 8192), [8191]),  # 32 splits
        ],
    )
    def test_fused_combine_equals_the_combine_kernel(self, shape, lengths):
        """combine="fused" (the attention kernel's last split of each kv head combines: one launch) against
        combine="kernel" (the same partials, the combine its own kernel): the same arithmetic on the same
        partials, so equal bit for bit; on a stacked cache at a traced layer, ragged lengths, poisoned
        outputs, and against the reference."""
        if not self.INTERPRET and not ON_HOPPER:
            pytest.skip("the Mosaic GPU kernels need Hopper")
        if self.INTERPRET and shape.cache_len > 512:
            pytest.skip("model shapes are too large for the interpreter")
        q, k, v, lens = _inputs(shape, seed=42, lengths=lengths)
        rows = to_rows(q, shape.num_kv_heads)  # [B, K, R, H]
        group = shape.num_heads // shape.num_kv_heads
        k_stack, v_stack = jnp.stack([v, k]), jnp.stack([k, v])  # [2, B, S, K, H]: layer 1 holds (k, v)
        kw = dict(group=group, layer=jnp.int32(1), length_offset=1, interpret=self.INTERPRET, poison=True)
        outs = {
            combine: da.decode_attention_sync_rows(
                rows,
                k_stack,
                v_stack,
                lens - 1,
                block_sizes=da.BlockSizes(block_k=64, combine=combine),
                backend="mosaic",
                **kw,
            )
            for combine in ("fused", "kernel")
        }
        np.testing.assert_array_equal(np.asarray(outs["fused"], np.float32), np.asarray(outs["kernel"], np.float32))
        _close(outs["fused"], da.decode_attention_reference(q, k, v, lens)[0])

    def test_combine_kernel_declines_what_it_does_not_tile(self):
        """T = 3 and a group of 3 are not the kernel's shapes: combine="kernel" then combines in jnp,
        with the same values as combine="xla"."""
        for shape in (AttentionShape("t3", 2, 3, 8, 2, 64, 128), AttentionShape("g3", 2, 1, 6, 2, 64, 128)):
            q, k, v, lengths = _inputs(shape, seed=41)
            outs = [
                da.decode_attention_sync(
                    q,
                    k,
                    v,
                    lengths,
                    block_sizes=da.BlockSizes(block_k=32, num_splits=2, combine=c),
                    interpret=self.INTERPRET,
                    poison=True,
                )
                for c in ("kernel", "xla")
            ]
            np.testing.assert_array_equal(np.asarray(outs[0], np.float32), np.asarray(outs[1], np.float32))

    @pytest.mark.parametrize("name", list(MOSAIC_MODEL_SHAPES))
    def test_mosaic_at_model_shapes(self, name):
        """Compiled only: the Mosaic kernels at Llama-3.1-8B, 70B and SmolLM2-135M shapes with the default
        blocks (the splits a real decode takes), against the reference; a stack of two layers read at
        layer 1 where S is whole blocks, else the padded single cache (T = 3, S = 1000)."""
        if self.INTERPRET:
            pytest.skip("model shapes are too large for the interpreter")
        shape = MOSAIC_MODEL_SHAPES[name]
        # ragged: the first sequence ends one short of the cache (inside a block), the rest shorter
        s = shape.cache_len
        lengths = np.linspace(s - 1, max(shape.tokens, s // 5), shape.batch).astype(np.int32)
        q, k, v, lengths = _inputs(shape, seed=7, lengths=lengths)
        ref, _ = da.decode_attention_reference(q, k, v, lengths)
        kw = dict(poison=True, backend=self._backend("mosaic"))
        if shape.cache_len % 64:
            out = da.decode_attention_sync(q, k, v, lengths, **kw)
        else:
            other = _inputs(shape, seed=8, lengths=lengths)
            k, v = jnp.stack([other[1], k]), jnp.stack([other[2], v])  # [2, B, S, K, H]
            out = da.decode_attention_sync(q, k, v, lengths, layer=jnp.int32(1), **kw)
        _close(out, ref)


class TestDecodeAttentionInterpret(TestDecodeAttention):
    INTERPRET = True


LOWERED = {  # name: (B, T, N, K, H, S): Llama-3.1-8B with a 1k cache, 70B, SmolLM2-135M
    "llama3_8b_b1_s1024": (1, 1, 32, 8, 128, 1024),
    "llama3_70b_b64_s8192": (64, 1, 64, 8, 128, 8192),
    "smollm2_b4_s1024": (4, 1, 9, 3, 64, 1024),
}


@pytest.mark.parametrize("rows", [False, True])
@pytest.mark.parametrize("name", list(LOWERED))
def test_mosaic_lowers_for_hopper_on_any_host(name, rows):
    """Lowering for CUDA runs Mosaic GPU's layout, tiling and swizzle checks (which the interpreter
    skips) on a machine without a GPU: both kernels, on a stacked cache at a traced layer, from q
    (`decode_attention_sync`) or from its rows (`decode_attention_sync_rows`)."""
    b, t, n, kh, h, s = LOWERED[name]
    cache = jax.ShapeDtypeStruct((4, b, s, kh, h), jnp.bfloat16)  # [L, B, S, K, H]
    args = (cache, cache, jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
    if rows:
        q = jax.ShapeDtypeStruct((b, kh, da.query_rows(t, n // kh), h), jnp.bfloat16)  # [B, K, R, H]
        op = lambda q, k, v, lengths, i: da.decode_attention_sync_rows(  # noqa: E731
            q, k, v, lengths, group=n // kh, layer=i, length_offset=1, backend="mosaic"
        )
    else:
        q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
        op = lambda q, k, v, lengths, i: da.decode_attention_sync(q, k, v, lengths, layer=i, backend="mosaic")  # noqa: E731
    text = jax.jit(op).trace(q, *args).lower(lowering_platforms=("cuda",)).as_text()
    assert "decode_attention_sync_mosaic" in text and "combine_splits_mosaic" in text


@pytest.mark.parametrize("name", ["llama3_8b_b1_s1024", "llama3_70b_b64_s8192", "smollm2_b4_s1024"])
def test_fused_combine_lowers_for_hopper_on_any_host(name):
    """combine="fused" lowers for CUDA (its global semaphore, fences and the combine's layouts) as one
    kernel: no separate combine launch in the module."""
    b, t, n, kh, h, s = LOWERED[name]
    cache = jax.ShapeDtypeStruct((4, b, s, kh, h), jnp.bfloat16)  # [L, B, S, K, H]
    q = jax.ShapeDtypeStruct((b, kh, da.query_rows(t, n // kh), h), jnp.bfloat16)  # [B, K, R, H]
    blocks = da.BlockSizes(combine="fused")
    op = lambda q, k, v, lengths, i: da.decode_attention_sync_rows(  # noqa: E731
        q, k, v, lengths, group=n // kh, layer=i, length_offset=1, block_sizes=blocks, backend="mosaic"
    )
    args = (cache, cache, jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
    text = jax.jit(op).trace(q, *args).lower(lowering_platforms=("cuda",)).as_text()
    assert "decode_attention_fused_mosaic" in text and "combine_splits_mosaic" not in text


def test_mosaic_refuses_what_it_does_not_tile():
    q, k, v, lengths = _inputs(TEST_ATTENTION["tiny_gqa4_b2_s256"])
    with pytest.raises(ValueError, match="multiples of 64"):  # wgmma's M side
        da.decode_attention_sync(q, k, v, lengths, block_sizes=BLOCKS, backend="mosaic", interpret=True)
    with pytest.raises(ValueError, match="backend must be"):
        da.decode_attention_sync(q, k, v, lengths, backend="cuda", interpret=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_combine_splits_against_the_jnp_combine(backend):
    """The kernel on its own, in f32, on random partials with one empty split per row group (neither
    attention kernel's: either backend's combine reads any partials): equal to `combine_partials` +
    `from_rows` to f32 rounding of a 5-term sum."""
    keys = jax.random.split(jax.random.key(42), 3)
    b, kh, splits, rows, g, h = 2, 3, 5, 16, 4, 64
    acc = jax.random.normal(keys[0], (b, kh, splits, rows, h), jnp.float32)
    l = 1.0 + jax.random.uniform(keys[1], (b, kh, splits, rows), jnp.float32)
    m = 3.0 * jax.random.normal(keys[2], (b, kh, splits, rows), jnp.float32)
    acc, l, m = acc.at[:, :, 2].set(0.0), l.at[:, :, 2].set(0.0), m.at[:, :, 2].set(-1e30)  # an empty split
    got = combine_splits(
        acc, l, m, group=g, out_dtype=jnp.float32, cfg=da.BlockSizes(), interpret=True, poison=True, backend=backend
    )
    o, _ = combine_partials(acc, l, m)
    want = from_rows(o, 1, g)
    assert got.shape == want.shape == (b, 1, kh * g, h)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_splits_are_the_fewest_that_reach_192_programs_within_one_wave_and_32_splits():
    splits = lambda b, k, s, **kw: split_layout(b, k, s, da.BlockSizes(**kw))[0]  # noqa: E731
    # 1k context (1152 rows = 18 blocks of 64), 8 kv heads: batch 1 (8 pairs) would need 24 splits, which no
    # divisor of 18 gives, so it takes the most, a split a block; batch 8 (64 pairs) needs 3, 16 needs 2, 32 needs 1
    assert [splits(b, 8, 1152) for b in (1, 8, 16, 32)] == [18, 3, 2, 1]
    # 4k (66 blocks = 2 x 3 x 11): 24 splits wanted at batch 1, 33 the next divisor, past the 32-split cap: the
    # largest within it; 8k (130 = 2 x 5 x 13): 26 reaches 24; batch 8 at 4k: 3
    assert [splits(1, 8, 4224), splits(1, 8, 8320), splits(8, 8, 4224)] == [22, 26, 3]
    assert splits(1, 8, 4224, max_splits=None) == 33
    # one wave: 4 kv heads at batch 64 (256 pairs) reach 192 with one split; 660 // 256 = 2 caps a larger target
    assert splits(64, 4, 1152) == 1 and splits(64, 4, 1152, target_programs=768) == 2
    # without the one-wave and 32-split caps, at a larger target
    uncapped = dict(target_programs=264, max_programs=None, max_splits=None)
    assert [splits(1, 8, 4224, **uncapped), splits(8, 8, 1152, **uncapped)] == [33, 6]
    assert splits(1, 8, 1152, num_splits=4) == 4


def test_block_sizes_names_a_bad_combine():
    with pytest.raises(ValueError, match="combine must be"):
        da.BlockSizes(combine="fuse")


def test_calibrate_phi_centers_the_window():
    rng = np.random.default_rng(0)
    maxima = rng.normal(12.0, 2.0, size=10_000)
    phi, covered = da.calibrate_phi(maxima)
    assert abs(phi - 12.0) < 0.5
    assert covered == 1.0
    phi, covered = da.calibrate_phi(np.r_[maxima, 400.0], coverage=0.999, window=da.SoftmaxWindow(-5.0, 5.0))
    assert 0.9 < covered < 1.0  # the 400 outlier and the tails beyond ±5 fall outside


def test_calibrate_phi_rejects_empty():
    with pytest.raises(ValueError):
        da.calibrate_phi([np.nan])


def test_bad_shapes_raise():
    q, k, v, lengths = _inputs(TEST_ATTENTION["tiny_mha_b1_s128"])
    with pytest.raises(ValueError):
        da.decode_attention_async(q, k, v[:, :64], lengths, 0.0, interpret=True)
    with pytest.raises(ValueError):
        da.decode_attention_sync(q, k, v, lengths[None], interpret=True)
    with pytest.raises(ValueError, match="layer index"):  # a stack needs its layer, a layer a stack
        da.decode_attention_sync(q, k[None], v[None], lengths, interpret=True)
    with pytest.raises(ValueError, match="layer index"):
        da.decode_attention_sync(q, k, v, lengths, layer=0, interpret=True)
    short = _inputs(TEST_ATTENTION["tiny_mha_b2_s65"])  # S = 65: a stack is never padded (copied)
    with pytest.raises(ValueError, match="multiple of block_k"):
        da.decode_attention_sync(short[0], short[1][None], short[2][None], short[3], layer=0, interpret=True)
    rows = to_rows(q, k.shape[2])  # [B, K, R, H]
    with pytest.raises(ValueError, match="stacked caches"):  # the rows form reads stacks only
        da.decode_attention_sync_rows(rows, k, v, lengths, group=1, layer=0, interpret=True)
    with pytest.raises(ValueError, match="group"):
        da.decode_attention_sync_rows(rows, k[None], v[None], lengths, group=rows.shape[2] + 1, layer=0, interpret=True)


def test_poison_shows_unwritten_outputs():
    """The poison mechanism itself: a kernel that writes nothing leaves every partial NaN."""
    shape = TEST_ATTENTION["tiny_mha_b1_s128"]
    q, k, v, lengths = _inputs(shape)
    q_rows = to_rows(q, shape.num_kv_heads)  # [B, K, R, H]
    acc, l = attention_call(
        lambda *refs, **kw: None,
        (lengths, lengths),
        q_rows,
        k,
        v,
        None,
        num_out=2,
        sm_scale=1.0,
        group=1,
        tokens=1,
        length_offset=0,
        cfg=BLOCKS,
        interpret=True,
        poison=True,
    )
    assert np.isnan(acc).all() and np.isnan(l).all()


def test_length_offset_is_added_inside_the_kernel():
    """`length_offset=1` with lengths - 1 (what the looped decode passes: last positions) gives the
    reference at lengths, for both kernels; without the offset the result changes."""
    q, k, v, lengths = _inputs(TEST_ATTENTION["tiny_gqa4_b2_s256"], seed=3)
    ref, _ = da.decode_attention_reference(q, k, v, lengths)
    kw = dict(block_sizes=BLOCKS, interpret=True, poison=True)
    _close(da.decode_attention_sync(q, k, v, lengths - 1, length_offset=1, **kw), ref)
    _close(da.decode_attention_async(q, k, v, lengths - 1, 0.0, length_offset=1, **kw)[0], ref)
    shorter = da.decode_attention_sync(q, k, v, lengths - 1, **kw)  # one position fewer per sequence
    assert np.abs(np.asarray(shorter, np.float32) - np.asarray(ref, np.float32)).max() > 10 * ATOL[jnp.bfloat16]

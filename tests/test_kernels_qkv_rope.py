"""kernels/qkv_rope (the q·k·v epilogue: split sum, bias, RoPE, q rows, cache writes), Pallas-Triton and
Mosaic GPU, against its jnp reference, which is checked against the model's own ops; in interpret mode on
the CPU, lowered for CUDA on any host (Mosaic GPU) and compiled on an H100/H200. q starts poisoned (NaN)
and unwritten partial slots hold NaN, so an element the kernel skips, or a slot it adds that the GEMM never
wrote, shows up."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.model import apply_rope, rope_cos_sin
from kernels.decode_attention.layout import to_rows
from kernels.flat_gemm_stream import StreamBlocks, combine, partial_rows, schedule
from kernels.qkv_rope import fits, qkv_rope_write, qkv_rope_write_reference

ON_GPU = jax.default_backend() == "gpu" and any(k in jax.devices()[0].device_kind for k in ("H100", "H200"))
pytestmark = pytest.mark.usefixtures("interpret_on_the_cpu")  # conftest: interpreted tests on the CPU device
# (B, N, K, H, tile_n, layers, S): Llama-3.1-8B TP1 and TP2 at batch 1, Qwen2.5-7B's 7:1 group at batch 8, SmolLM2's
# head 64 with 3 kv heads, MHA
SHAPES = [
    (1, 32, 8, 128, 64, 3, 64),
    (1, 16, 4, 128, 64, 2, 64),
    (8, 28, 4, 128, 64, 2, 32),
    (3, 9, 3, 64, 64, 2, 48),
    (2, 4, 4, 32, 16, 2, 16),
]
# (impl, shape, biased, every_slot, layer): every Triton case; few Mosaic GPU ones in interpret mode (its
# interpreter is slow on a CPU): MHA with a bias, 12 sequences over two chunks of 8 in the middle of 3 layers,
# SmolLM2's heads with every slot written (no table) and 13 zero rows of q. Compiled, Mosaic GPU takes every
# shape and Llama-3.1-8B at batch 64 too.
BIAS_SLOTS = [(False, False), (True, False), (False, True)]
CASES = [
    ("triton", shape, biased, every, shape[5] - 1) for shape, (biased, every) in itertools.product(SHAPES, BIAS_SLOTS)
]
MOSAIC_INTERPRETED = [
    ("mosaic", (2, 4, 4, 32, 16, 2, 16), True, False, 1),
    ("mosaic", (12, 4, 2, 32, 16, 3, 16), False, False, 1),
    ("mosaic", (3, 9, 3, 64, 64, 2, 48), False, True, 0),
]
MOSAIC_COMPILED = [("mosaic", *case[1:]) for case in CASES] + [
    MOSAIC_INTERPRETED[1],
    ("mosaic", (64, 32, 8, 128, 64, 2, 16), True, False, 0),
]


def _params(cases):
    return [
        pytest.param(
            *case,
            id=f"{case[0]}-{'x'.join(map(str, case[1]))}-{'bias' if case[2] else 'nobias'}-"
            f"{'all' if case[3] else 'table'}-layer{case[4]}",
        )
        for case in cases
    ]


def _inputs(batch, heads, kv_heads, head_dim, tile_n, layers, cache_len, seed=0, slots=3):
    """Partials with a Stream-K-like written pattern (slot 0 always, later slots for some tiles) and NaN in
    every unwritten slot; RoPE angles of real positions; random caches; positions including one past the
    end (the write clamps to S - 1)."""
    rng = np.random.default_rng(seed)
    columns = (heads + 2 * kv_heads) * head_dim
    m_rows = partial_rows(batch)  # batch-major, as the Stream-K kernels write them
    written = rng.random((slots, columns // tile_n)) < 0.5
    written[0] = True
    parts = rng.normal(0.0, 2.0, (slots, m_rows, columns)).astype(np.float32)
    parts = np.where(np.repeat(written, tile_n, axis=1)[:, None, :], parts, np.nan)
    positions = rng.integers(0, cache_len, batch).astype(np.int32)
    positions[-1] = cache_len + 5
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    cos, sin = rope_cos_sin(jnp.asarray(inv_freq), jnp.asarray(positions)[:, None])  # [B, 1, H]
    stacks = [
        jnp.asarray(rng.normal(size=(layers, batch, cache_len, kv_heads, head_dim)), jnp.bfloat16) for _ in range(2)
    ]
    biases = tuple(
        jnp.asarray(rng.normal(size=(layers, n * head_dim)), jnp.bfloat16) for n in (heads, kv_heads, kv_heads)
    )
    return jnp.asarray(parts), written, cos[:, 0], sin[:, 0], jnp.asarray(positions), *stacks, biases


def test_reference_is_the_models_math():
    """The reference against the ops the model runs: `flat_gemm_stream.combine` of the partials, the
    bias add, `model.apply_rope`, `to_rows` and one `dynamic_update_slice` per sequence."""
    batch, heads, kv_heads, head_dim, tile_n, layers, cache_len = 2, 4, 2, 16, 8, 2, 16
    parts, _, cos, sin, positions, k_stack, v_stack, biases = _inputs(
        batch, heads, kv_heads, head_dim, tile_n, layers, cache_len
    )
    cfg = StreamBlocks(tile_n=tile_n, tile_k=16)
    sched = schedule(64, (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), cfg, ctas=5)
    parts = parts[: sched.slots]
    parts = jnp.where(jnp.repeat(jnp.asarray(sched.written()), tile_n, axis=1)[:, None, :], parts, jnp.nan)
    y = combine(parts, sched, tile_n, batch).astype(jnp.bfloat16)  # [B, C]
    y = y + jnp.concatenate([b[1] for b in biases])
    q, k, v = jnp.split(y, [heads * head_dim, (heads + kv_heads) * head_dim], axis=1)
    q = apply_rope(q.reshape(batch, 1, heads, head_dim), cos[:, None], sin[:, None])
    k = apply_rope(k.reshape(batch, 1, kv_heads, head_dim), cos[:, None], sin[:, None])
    want_k, want_v = k_stack, v_stack
    for b in range(batch):
        at = (1, b, positions[b], 0, 0)
        want_k = jax.lax.dynamic_update_slice(want_k, k[b][None, None], at)
        want_v = jax.lax.dynamic_update_slice(want_v, v.reshape(batch, 1, kv_heads, head_dim)[b][None, None], at)
    got = qkv_rope_write_reference(
        parts, sched.written(), cos, sin, positions, k_stack, v_stack, 1, biases, heads=heads, tile_n=tile_n
    )
    for a, b in zip(got, (to_rows(q, kv_heads), want_k, want_v)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_fits():
    assert fits(32, 8, 128, 64, 16) and fits(9, 3, 64, 64, 16)
    assert not fits(32, 8, 128, 32, 16)  # half a head spans two tiles
    assert not fits(6, 2, 24, 64, 16)  # a half head of 12 is no power of two
    assert not fits(64, 2, 128, 64, 16)  # G = 32 query heads do not fit 16 rows
    assert fits(32, 8, 128, 64, 16, impl="mosaic") and fits(9, 3, 64, 64, 16, impl="mosaic")
    assert fits(4, 2, 16, 8, 16) and not fits(4, 2, 16, 8, 16, impl="mosaic")  # [8, 8] is half a warpgroup


# (B, N, K, H, D, biased): the q·k·v GEMM's real Stream-K schedule on 132 SMs, cache [4, B, 256, K, H] bf16
LOWERED = {
    "llama8b_b1": (1, 32, 8, 128, 4096, False),
    "llama8b_b64_bias": (64, 32, 8, 128, 4096, True),
    "llama70b_b8": (8, 64, 8, 128, 8192, False),
    "smollm2_b12": (12, 9, 3, 64, 576, False),
    "mha_h32_bias": (2, 4, 4, 32, 256, True),  # a bias row of 64 bytes: TMA loads move 128·n bytes
}


@pytest.mark.parametrize("name", list(LOWERED))
def test_mosaic_lowers_for_hopper_on_any_host(name):
    """Lowering for CUDA runs Mosaic GPU's layout and TMA checks (which the interpreter skips), on a machine
    without a GPU; the stacks (jit arguments, donated) are the custom call's outputs 1 and 2, aliased."""
    batch, heads, kv_heads, head_dim, d, biased = LOWERED[name]
    cfg = StreamBlocks(tile_k=64 if d % 256 else 256)
    sched = schedule(d, (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), cfg, ctas=132)
    sds = jax.ShapeDtypeStruct
    parts = sds((sched.slots, partial_rows(batch), (heads + 2 * kv_heads) * head_dim), jnp.float32)
    angles = sds((batch, head_dim), jnp.float32)
    stack = sds((4, batch, 256, kv_heads, head_dim), jnp.bfloat16)
    biases = tuple(sds((4, n * head_dim), jnp.bfloat16) for n in (heads, kv_heads, kv_heads)) if biased else ()

    def op(parts, cos, sin, positions, k_stack, v_stack, layer, biases):
        return qkv_rope_write(
            parts, sched.written(), cos, sin, positions, k_stack, v_stack, layer, biases,
            heads=heads, tile_n=cfg.tile_n, impl="mosaic",
        )  # fmt: skip

    args = (parts, angles, angles, sds((batch,), jnp.int32), stack, stack, sds((), jnp.int32), biases)
    text = jax.jit(op, donate_argnums=(4, 5)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    assert "output_tuple_indices = [1], operand_index" in text and "output_tuple_indices = [2], operand_index" in text


class TestQkvRopeWrite:
    INTERPRET = True

    def setup_method(self):
        if not self.INTERPRET and not ON_GPU:
            pytest.skip("the compiled kernel is checked on an H100/H200")

    @pytest.mark.parametrize("impl, shape, biased, every_slot, layer", _params(CASES + MOSAIC_INTERPRETED))
    def test_matches_reference(self, impl, shape, biased, every_slot, layer):
        """every_slot: all slots written (as in Llama-3.1-8B's q·k·v on one H200), so the kernel takes no table.
        The last sequence's position is past the cache (the write clamps it to S - 1)."""
        batch, heads, kv_heads, head_dim, tile_n, layers, cache_len = shape
        parts, written, cos, sin, positions, k_stack, v_stack, biases = _inputs(
            *shape, seed=sum(shape), slots=2 if every_slot else 3
        )
        if every_slot:
            written, parts = np.ones_like(written), jnp.nan_to_num(parts, nan=1.0)
        biases = biases if biased else ()
        got = qkv_rope_write(
            parts,
            written,
            cos,
            sin,
            positions,
            k_stack,
            v_stack,
            jnp.int32(layer),
            biases,
            heads=heads,
            tile_n=tile_n,
            impl=impl,
            interpret=self.INTERPRET,
            poison=True,
        )
        want = qkv_rope_write_reference(
            parts, written, cos, sin, positions, k_stack, v_stack, layer, biases, heads=heads, tile_n=tile_n
        )
        for name, a, b in zip(("q rows", "k stack", "v stack"), got, want):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            assert np.isfinite(a).all(), f"{name}: an element was not written, or an unwritten slot was added"
            # Interpreted: the same f32 operations in the same order, one rounding each, so equal. Compiled,
            # XLA's reference may skip a bf16 rounding (excess precision: the bias add, kept in f32 inside
            # its fusion) and the GPU may fuse the rotation's multiply-add: an input of the rotation moves by
            # one bf16 step (2^-8 of its size, up to the largest |value|), and the rotation carries that
            # into outputs that may be smaller (cancellation); plus the output's own rounding.
            # (Interpreted on a GPU, the reference's XLA ops keep that excess precision too.)
            # The Pallas-Triton interpreter runs the body as XLA:CPU code, which may contract the rotation's
            # multiply-add into one FMA (one rounding, not two): the f32 result moves by an ulp and its bf16
            # rounding by at most one step, 2^-7 of the value (the reference runs op by op, unfused).
            if self.INTERPRET and jax.default_backend() == "cpu":
                rtol, atol = (0, 0) if impl == "mosaic" else (2.0**-7, 0)
            else:
                rtol, atol = 2.0**-8, 2.0**-7 * np.abs(b).max()
            np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=name)
        # the rows of other layers and positions are untouched
        untouched = np.ones(k_stack.shape, bool)
        clamped = np.minimum(np.asarray(positions), cache_len - 1)
        untouched[layer, np.arange(batch), clamped] = False
        for new, old in zip(got[1:], (k_stack, v_stack)):
            np.testing.assert_array_equal(
                np.asarray(new, np.float32)[untouched], np.asarray(old, np.float32)[untouched]
            )

    def test_bad_inputs(self):
        parts, written, cos, sin, positions, k_stack, v_stack, biases = _inputs(1, 4, 2, 16, 8, 2, 16)
        call = lambda **kw: qkv_rope_write(
            **(
                {
                    "partials": parts,
                    "written": written,
                    "cos": cos,
                    "sin": sin,  # noqa: E731
                    "positions": positions,
                    "k_stack": k_stack,
                    "v_stack": v_stack,
                    "layer": 0,
                    "heads": 4,
                    "tile_n": 8,
                    "interpret": True,
                }
                | kw
            )
        )
        with pytest.raises(ValueError, match="partials"):
            call(heads=6)
        with pytest.raises(ValueError, match="written"):
            call(written=written[:, :-1])
        with pytest.raises(ValueError, match="written"):
            call(written=written[0])
        with pytest.raises(ValueError, match="cos, sin"):
            call(cos=cos[:, :8])
        with pytest.raises(ValueError, match="k and v stacks"):
            call(v_stack=v_stack.astype(jnp.float32))
        with pytest.raises(ValueError, match="biases"):
            call(biases=biases[:2])
        with pytest.raises(ValueError, match="half heads"):
            call(tile_n=4, written=np.ones((3, parts.shape[2] // 4), bool))
        with pytest.raises(ValueError, match="half heads"):  # a half head of 8: [8, 8] arrays
            call(impl="mosaic")
        with pytest.raises(ValueError, match="impl"):
            call(impl="xla")
        with pytest.raises(ValueError, match="M >= B"):  # fewer partial rows than sequences
            call(partials=parts[:, :0])


class TestQkvRopeWriteCompiled(TestQkvRopeWrite):
    INTERPRET = False

    @pytest.mark.parametrize("impl, shape, biased, every_slot, layer", _params(CASES + MOSAIC_COMPILED))
    def test_matches_reference(self, impl, shape, biased, every_slot, layer):
        super().test_matches_reference(impl, shape, biased, every_slot, layer)

"""kernels/quant_mlp.py against quant_gemm's reference: interpreted on the CPU, lowered for CUDA on any
host, compiled on Hopper.

The interpreted cases run in a subprocess with XLA:CPU's concurrency-optimized scheduler off: with it on,
XLA:CPU may reorder the interpreter's barrier callbacks of this kernel's warpgroups (they share no data),
and two cores' worth of blocked callbacks then hold back the thread that would release them.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from interpreted import run_json

from kernels import quant_mlp as qm
from kernels.quant_gemm import UntiledShape

ON_HOPPER = jax.default_backend() == "gpu" and any(s in jax.devices()[0].device_kind for s in ("H100", "H200"))
# Outputs are ~N(0, 1). Each of the three GEMMs rounds its scaled (and offset) weights to bf16 before an
# f32 sum: at most 6·2^-8·σ per output (tests/test_kernels_quant_stream.py derives it). Gate's and up's
# errors reach h = silu(g)·u through both factors (twice theirs, relative to h), and down's sum over F
# independent terms keeps that relative size: 12·2^-8; h is rounded to bf16 from slightly different
# values (one ulp, 2^-8); down adds its own 6·2^-8.
ATOL = 19 * 2.0**-8
RTOL = 2.0**-7

CASES = {  # name: (codes, group, offsets, M, D, F, gate/up feed, codes stored in permute_k order)
    "int4_g128_offsets_m1_relabel": ("int4", 128, True, 1, 256, 512, "relabel", False),
    "int4_g32_offsets_m5_shuffle": ("int4", 32, True, 5, 256, 512, "shuffle", False),
    "int4_g128_m3_two_ksteps_three_blocks": ("int4", 128, True, 3, 512, 768, "relabel", False),
    "int8_g128_m8": ("int8", 128, False, 8, 256, 512, "relabel", False),
    # as the engine stores int4 codes: gate/up's x and down's h (made in the kernel) taken as they are
    "int4_g128_offsets_m1_relabel_permuted": ("int4", 128, True, 1, 256, 512, "relabel", True),
    "int4_g32_m5_shuffle_permuted": ("int4", 32, False, 5, 256, 512, "shuffle", True),
}

HOOK_CASE = "int4_g128_offsets_m1_relabel_permuted"  # the hook reads int4 codes as the engine stores them

_RUN = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from kernels import quant_gemm as qg, quant_mlp as qm
HOOK_CASE = sys.argv[2]

def weights(key, n, k, codes, group, offsets):
    hi = 8 if codes == "int4" else 128
    k1, k2, k3 = jax.random.split(key, 3)
    c = jax.random.randint(k1, (2, n, k), -hi, hi, jnp.int8).astype(jnp.dtype(codes))
    unit = 1.0 / (hi / np.sqrt(3) * np.sqrt(k))
    s = jax.random.uniform(k2, (2, k // group, n), jnp.float32, 0.5, 1.5) * unit
    o = jax.random.normal(k3, (2, k // group, n), jnp.float32) / np.sqrt(k) if offsets else None
    return c, s, o

out = {}
for name, (codes, group, offsets, m, d, f, feed, permuted) in json.loads(sys.argv[1]).items():
    gate, up = (weights(jax.random.key(i), f, d, codes, group, offsets) for i in (1, 2))
    down = weights(jax.random.key(3), d, f, codes, group, offsets)
    x = jax.random.normal(jax.random.key(0), (m, d), jnp.float32).astype(jnp.bfloat16)
    g, u = (qg.quant_gemm_reference(x, *w, 1, group=group, out_dtype=jnp.float32) for w in (gate, up))
    h = (jax.nn.silu(g) * u).astype(x.dtype)
    ref = qg.quant_gemm_reference(h, *down, 1, group=group, out_dtype=jnp.float32)
    blocks = qm.QuantMLPBlocks(gate_up_feed=feed)
    if permuted:
        gate, up, down = ((qg.permute_k(c), s, o) for c, s, o in (gate, up, down))
    y = qm.quant_mlp(
        x, gate, up, down, jnp.int32(1), group=group, block_sizes=blocks, permuted_codes=permuted, interpret=True
    )
    out[name] = dict(y=np.asarray(y, np.float32).tolist(), ref=np.asarray(ref).tolist())
    if name == HOOK_CASE:  # the engine's hook on the same stacks, as the looped decode hands them over: x [B, T, D]
        from jaxdecode.hooks import kernel_mlp
        from jaxdecode.looping import StackedRef

        refs = [StackedRef(a, jnp.int32(1)) for w in (gate, up, down) for a in w if a is not None]
        (yh,) = kernel_mlp(x[:, None, :], *refs, impl="fused", interpret=True)  # the leaves, weight by weight
        out["hook"] = dict(y=np.asarray(yh[:, 0], np.float32).tolist(), ref=np.asarray(ref).tolist())
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted():
    return run_json(_RUN, json.dumps(CASES), HOOK_CASE)


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_matches_reference(interpreted, name):
    y, ref = (np.asarray(interpreted[name][k]) for k in ("y", "ref"))
    assert y.shape == ref.shape == (CASES[name][3], CASES[name][4])
    np.testing.assert_allclose(y, ref, atol=ATOL, rtol=RTOL)


def test_hook_matches_reference(interpreted):
    y, ref = (np.asarray(interpreted["hook"][k]) for k in ("y", "ref"))
    np.testing.assert_allclose(y, ref, atol=ATOL, rtol=RTOL)


def test_hook_declines_dense_weights_and_the_cpu():
    from jaxdecode.hooks import kernel_mlp
    from jaxdecode.looping import StackedRef

    x = jnp.ones((1, 1, 256), jnp.bfloat16)
    dense = [StackedRef(jnp.ones((2, *shape), jnp.bfloat16), 0) for shape in ((256, 512), (256, 512), (512, 256))]
    assert kernel_mlp(x, *dense) is None  # dense weights: the swiglu and stacked-dot hooks run instead
    codes = [jnp.zeros((2, n, k), jnp.int4) for n, k in ((512, 256), (512, 256), (256, 512))]
    scales = [jnp.ones((2, k // 128, n), jnp.float32) for n, k in ((512, 256), (512, 256), (256, 512))]
    leaves = [StackedRef(a, 0) for pair in zip(codes, scales) for a in pair]  # gate, up, down: codes, scales
    if jax.default_backend() == "cpu":
        assert kernel_mlp(x, *leaves) is None  # impl None off Hopper: the call runs as written


def _abstract(codes, group, offsets, n, k, layers=32):
    dt = jnp.dtype(codes)
    groupwise = jax.ShapeDtypeStruct((layers, k // group, n), jnp.float32)
    return (jax.ShapeDtypeStruct((layers, n, k), dt), groupwise, groupwise if offsets else None)


@pytest.mark.parametrize(
    "codes,offsets,feed", [("int4", True, "relabel"), ("int4", True, "shuffle"), ("int8", False, "relabel")]
)
def test_lowers_for_cuda_at_llama_8b_shapes(codes, offsets, feed):
    d, f, g = 4096, 14336, 128
    gate, up, down = (
        _abstract(codes, g, offsets, f, d),
        _abstract(codes, g, offsets, f, d),
        _abstract(codes, g, offsets, d, f),
    )
    blocks = qm.QuantMLPBlocks(gate_up_feed=feed, ctas=132)
    op = lambda x, gw, uw, dw, layer: qm.quant_mlp(x, gw, uw, dw, layer, group=g, block_sizes=blocks)
    x = jax.ShapeDtypeStruct((1, d), jnp.bfloat16)
    text = jax.jit(op).trace(x, gate, up, down, jax.ShapeDtypeStruct((), jnp.int32)).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in text.as_text()


@pytest.mark.parametrize(
    "m,d,f,codes,match",
    [
        (9, 256, 512, ("int4",) * 3, "M <= 8"),
        (1, 256, 384, ("int4",) * 3, "multiples of 256"),
        (1, 256, 512, ("int4", "int4", "int8"), "share their codes"),
    ],
)
def test_refuses_what_it_does_not_tile(m, d, f, codes, match):
    gate = _abstract(codes[0], 128, False, f, d, 2)
    up = _abstract(codes[1], 128, False, f, d, 2)
    down = _abstract(codes[2], 128, False, d, f, 2)
    x = jax.ShapeDtypeStruct((m, d), jnp.bfloat16)
    with pytest.raises(UntiledShape, match=match):
        jax.eval_shape(lambda *a: qm.quant_mlp(*a, 0, group=128), x, gate, up, down)


@pytest.mark.parametrize("blocks,ctas", [(4, 1), (4, 4), (4, 132), (56, 132), (56, 16), (1, 3)])
def test_fixup_blocks_are_dealt_once(blocks, ctas):
    # CTA c finishes blocks c, c + C, ...: every block exactly once, none past the last (a CTA past the
    # blocks once took one, which hung the compiled kernel on any grid wider than the blocks)
    dealt = []
    for c in range(ctas):
        dealt += [c + i * ctas for i in range(int(qm.fixup_count(jnp.int32(c), blocks, ctas)))]
    assert sorted(dealt) == list(range(blocks))


@pytest.mark.skipif(not ON_HOPPER, reason="compiled Mosaic GPU kernels need a Hopper GPU")
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("ctas", [1, 4, 132])  # 132: more CTAs than h blocks (4) and than units of down
def test_compiled_matches_reference(m, ctas):
    from kernels import quant_gemm as qg

    d, f, g = 512, 1024, 128
    keys = jax.random.split(jax.random.key(0), 4)
    ws = []
    for key, (n, k) in zip(keys[1:], [(f, d), (f, d), (d, f)]):
        k1, k2, k3 = jax.random.split(key, 3)
        c = jax.random.randint(k1, (2, n, k), -8, 8, jnp.int8).astype(jnp.int4)
        s = jax.random.uniform(k2, (2, k // g, n), jnp.float32, 0.5, 1.5) / (8 / np.sqrt(3) * np.sqrt(k))
        ws.append((c, s, jax.random.normal(k3, (2, k // g, n), jnp.float32) / np.sqrt(k)))
    x = jax.random.normal(keys[0], (m, d), jnp.float32).astype(jnp.bfloat16)
    gv, uv = (qg.quant_gemm_reference(x, *w, 1, group=g, out_dtype=jnp.float32) for w in ws[:2])
    ref = qg.quant_gemm_reference((jax.nn.silu(gv) * uv).astype(x.dtype), *ws[2], 1, group=g, out_dtype=jnp.float32)
    for _ in range(3):  # each call as right as the first (a race showed as 1 call of 3 right)
        y = qm.quant_mlp(x, *ws, jnp.int32(1), group=g, block_sizes=qm.QuantMLPBlocks(ctas=ctas))
        np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref), atol=ATOL, rtol=RTOL)

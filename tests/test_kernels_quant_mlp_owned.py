"""kernels/quant_mlp_owned.py against its XLA reference: interpreted on the CPU, lowered for CUDA on any host,
compiled on Hopper.

Inputs are exact by construction, so the kernel must agree with `quant_mlp_owned_reference` to the last bits of
y's f32 sums: x is integers times a power of two per row and group with a ±127 in each (so its int8 rounding is
exact and its scale a power of two), scales are powers of two and offsets small multiples of one. Then gate's
and up's sums are exact in f32 in any order, and both sides compute h alike; down's f32 products by h's
(inexact) scales and y's sums differ in order: a relative 2^-16 of y's scale bounds them with room (D·F
products of f32 roundings, about 2^-24 each). One thing is left to the last bit: an element of h at a tie of
its rounding (bf16 h at exactly half of its group's max is common: h / s = 63.5), where the two sides' last-bit
differences in silu or in s pick either neighbour. Each such element may move y[m] by one int8 step of h times
down's column (`tie_allowance`, zero where there is no tie); anything else off (a wrong g or u, a wrong scale,
a lost unit) moves y by orders more.

The interpreted cases run in a subprocess with XLA:CPU's concurrency-optimized scheduler off (as in
test_kernels_quant_mlp: blocked barrier callbacks on two cores otherwise hold back the one that releases them).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from interpreted import run_json

from kernels import quant_mlp_owned as qo
from kernels.quant_gemm import UntiledShape

ON_HOPPER = jax.default_backend() == "gpu" and any(s in jax.devices()[0].device_kind for s in ("H100", "H200"))
TOL = 2.0**-16  # of max |y|: f32 rounding of down's products and y's sums (module docstring)

CASES = {  # name: (codes, offsets, scales' dtype, M, D, F, CTAs)
    "int4_offsets_f16_m1": ("int4", True, "float16", 1, 256, 256, 2),  # --quantize int4's format
    "int4_offsets_m5_two_blocks_a_cta": ("int4", True, "float32", 5, 512, 512, 2),
    "int8_m8_uneven_blocks": ("int8", False, "bfloat16", 8, 256, 384, 2),  # 3 blocks on 2 CTAs
    "int8_offsets_m4": ("int8", True, "float16", 4, 256, 256, 2),  # int4 weights as the CPU widens them
    "int4_m3_idle_cta": ("int4", False, "float32", 3, 256, 256, 3),  # 2 blocks on 3 CTAs
    # x in three 64-row chunks through two staging slots: the first slot is refilled once rounded
    "int4_offsets_f16_m2_x_in_three_chunks": ("int4", True, "float16", 2, 3072, 256, 2),
}
HOOK_CASE = "int4_offsets_f16_m1"

_RUN = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from kernels import quant_mlp_owned as qo
from kernels.quant_gemm import permute_k
sys.path.insert(0, "tests")
from test_kernels_quant_mlp_owned import exact_inputs, tie_allowance

out = {}
for name, case in json.loads(sys.argv[1]).items():
    codes, offsets, sdt, m, d, f, ctas = case
    x, gate, up, down = exact_inputs(codes, offsets, sdt, m, d, f)
    ref = qo.quant_mlp_owned_reference(x, gate, up, down, 1, group=128)
    stored = [(permute_k(c) if codes == "int4" else c, s, o) for c, s, o in (gate, up, down)]
    blocks = qo.OwnedMLPBlocks(ctas=ctas, stages=3)
    y = qo.quant_mlp_owned(x, *stored, jnp.int32(1), group=128, block_sizes=blocks, interpret=True)
    allow = tie_allowance(x, gate, up, down)
    out[name] = dict(y=np.asarray(y).tolist(), ref=np.asarray(ref).tolist(), allow=allow.tolist())
    if name == sys.argv[2]:  # the engine's hook on the same stacks, as the looped decode hands them over
        from jaxdecode.hooks import kernel_mlp
        from jaxdecode.looping import StackedRef

        refs = [StackedRef(a, jnp.int32(1)) for w in stored for a in w if a is not None]
        (yh,) = kernel_mlp(
            x[:, None, :], *refs, impl="fused", design="owned", owned_blocks=blocks, interpret=True
        )
        out["hook"] = dict(y=np.asarray(yh[:, 0], np.float32).tolist(), ref=np.asarray(ref).tolist())
print(json.dumps(out))
"""


def exact_inputs(codes: str, offsets: bool, scale_dtype: str, m: int, d: int, f: int, layers: int = 2, seed: int = 0):
    """x [M, D] bf16 and gate, up, down (codes [L, N, K] in their own order, scales, offsets or None) whose
    products the kernel and the reference both compute exactly (module docstring)."""
    rng = np.random.default_rng(seed)
    sdt = jnp.dtype(scale_dtype)
    hi = 8 if codes == "int4" else 128

    def weight(n, k):
        c = rng.integers(-hi, hi, (layers, n, k)).astype(jnp.dtype(codes))
        exps = (6, 7) if codes == "int4" else (10, 11)  # |w| up to about 2^-3: y of order 1..10
        s = (2.0 ** -rng.choice(exps, (layers, k // 128, n))).astype(sdt)
        # multiples of 2^-7, like the scaled codes: every product is a multiple of 2^-12 and every partial sum
        # stays far below 2^12, so f32 sums them exactly in any order
        o = (rng.integers(-8, 9, (layers, k // 128, n)) * 2.0**-7).astype(sdt) if offsets else None
        return jnp.asarray(c), jnp.asarray(s), None if o is None else jnp.asarray(o)

    q = rng.integers(-126, 127, (m, d // 128, 128))
    q[..., 0] = rng.choice([-127, 127], (m, d // 128))  # every group's max |q| is 127: its int8 scale is 2^-p
    x = q * 2.0 ** -rng.choice([3, 4, 5], (m, d // 128, 1))
    x = jnp.asarray(x.reshape(m, d), jnp.bfloat16)  # exact: |q| < 2^8
    return x, weight(f, d), weight(f, d), weight(d, f)


def tie_allowance(x, gate, up, down, layer: int = 1) -> np.ndarray:
    """[M, D]: Σ over the elements k of h[m] within 2^-12 of a rounding tie (to bf16, then to int8 in its group of
    128) of one int8 step of h (max |h| / 127 of the group) times |W_down[:, k]|. h as the reference makes it."""
    from kernels.quant_gemm_stream import quant_gemm_s8_reference

    g, u = (quant_gemm_s8_reference(x, *w, layer, group=128) for w in (gate, up))
    pre = np.asarray(g / (1.0 + jnp.exp(-g)) * u, np.float64)  # before the rounding to bf16
    h = np.asarray(jnp.asarray(pre, jnp.float32).astype(x.dtype), np.float64)
    m, f = h.shape
    step = np.repeat(np.abs(h).reshape(m, f // 128, 128).max(axis=-1) / 127, 128, axis=1)  # [M, F]
    ulp = np.abs(h) * 2.0**-7  # bf16 spacing, within a factor of 2: used to find near-ties only
    near = lambda r: np.abs(np.abs(r - np.floor(r)) - 0.5) < 2.0**-12  # noqa: E731
    ties = near(np.divide(h, step, out=np.zeros_like(h), where=step > 0)) | near(
        np.divide(pre, ulp, out=np.zeros_like(h), where=ulp > 0)
    )
    c, s, o = (None if a is None else np.asarray(a, np.float64)[layer] for a in down)  # [D, F], [F/G, D]
    w = c * np.repeat(s, 128, axis=0).T + (0 if o is None else np.repeat(o, 128, axis=0).T)  # [D, F]
    return (ties * step) @ np.abs(w).T  # [M, D]


@pytest.fixture(scope="module")
def interpreted():
    return run_json(_RUN, json.dumps(CASES), HOOK_CASE)


def _assert_close(y, ref, allow):
    assert np.isfinite(y).all()
    assert np.all(np.abs(y - ref) <= TOL * np.abs(ref).max() + allow * (1 + 2.0**-10)), np.abs(y - ref).max()


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_matches_reference(interpreted, name):
    y, ref, allow = (np.asarray(interpreted[name][k]) for k in ("y", "ref", "allow"))
    assert y.shape == ref.shape == (CASES[name][3], CASES[name][4])
    assert np.abs(ref).max() > 1  # the inputs reach y (not a vacuous agreement of zeros)
    assert np.abs(allow).max() < 0.1 * np.abs(ref).max()  # ties are few: the check stays tight
    _assert_close(y, ref, allow)


def test_hook_matches_reference(interpreted):
    y, ref = (np.asarray(interpreted["hook"][k]) for k in ("y", "ref"))
    np.testing.assert_allclose(y, ref, rtol=2.0**-8, atol=2.0**-8 * np.abs(ref).max())  # y rounded to bf16


def test_reference_equals_the_dense_mlp_of_its_rounded_activations():
    """The reference against numpy in float64: x's groups are exact in int8, so g and u are the dense products;
    h is rounded to bf16 and then to int8 per row and group of 128 (max |h| / 127), whose codes meet down's
    scaled codes, while down's offsets meet h's exact group sums (the s8 feed's rule)."""
    x, gate, up, down = exact_inputs("int4", True, "float32", 2, 256, 256)

    def parts(w, layer=1):  # scaled codes [K, N] and offsets [K/G, N], float64
        c, s, o = (np.asarray(a, np.float64)[layer] for a in w)
        return (c * np.repeat(s, 128, axis=0).T).T, o

    xf = np.asarray(x, np.float64)
    (gw, go), (uw, uo) = parts(gate), parts(up)
    xsums = xf.reshape(2, 2, 128).sum(axis=-1)  # [M, K/G]
    g, u = xf @ gw + xsums @ go, xf @ uw + xsums @ uo
    h = np.asarray(jnp.asarray(g / (1 + np.exp(-g)) * u, jnp.bfloat16), np.float64).reshape(2, 2, 128)
    s = np.abs(h).max(axis=-1, keepdims=True) / 127
    hq = (np.clip(np.round(h / s), -127, 127) * s).reshape(2, 256)
    dw, do = parts(down)
    want = hq @ dw + h.sum(axis=-1) @ do
    got = np.asarray(qo.quant_mlp_owned_reference(x, gate, up, down, 1, group=128), np.float64)
    np.testing.assert_allclose(got, want, rtol=2.0**-16, atol=2.0**-16 * np.abs(want).max())


def _abstract(codes, offsets, n, k, sdt=jnp.float16, layers=32):
    groupwise = jax.ShapeDtypeStruct((layers, k // 128, n), sdt)
    return (jax.ShapeDtypeStruct((layers, n, k), jnp.dtype(codes)), groupwise, groupwise if offsets else None)


@pytest.mark.parametrize(
    "codes,offsets,m,d,f",
    [
        ("int4", True, 1, 4096, 14336),  # Llama-3.1-8B
        ("int4", True, 8, 4096, 14336),
        ("int8", False, 1, 4096, 14336),
        ("int4", True, 1, 8192, 28672),  # Llama-3.1-70B: x in 8 chunks through the staging slots
    ],
)
def test_lowers_for_cuda_at_llama_shapes(codes, offsets, m, d, f):
    gate, up, down = _abstract(codes, offsets, f, d), _abstract(codes, offsets, f, d), _abstract(codes, offsets, d, f)
    blocks = qo.OwnedMLPBlocks(ctas=132)
    op = lambda x, gw, uw, dw, layer: qo.quant_mlp_owned(x, gw, uw, dw, layer, group=128, block_sizes=blocks)
    x = jax.ShapeDtypeStruct((m, d), jnp.bfloat16)
    lowered = (
        jax.jit(op).trace(x, gate, up, down, jax.ShapeDtypeStruct((), jnp.int32)).lower(lowering_platforms=("cuda",))
    )
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize(
    "m,d,f,group,formats,match",
    [
        (9, 256, 256, 128, ("int4",) * 3, "M <= 8, got M=9"),
        (1, 256, 256, 64, ("int4",) * 3, "groups of 128, got G=64"),
        (1, 384, 256, 128, ("int4",) * 3, "D=384 must be a multiple of 256"),
        (1, 256, 256, 128, ("int4", "int4", "int8"), "share their codes"),
        (1, 16384, 256, 128, ("int4",) * 3, "do not fit in smem_bytes"),  # x of 128 groups held
    ],
)
def test_refuses_what_it_does_not_take(m, d, f, group, formats, match):
    gate = _abstract(formats[0], False, f, d, layers=2)
    up = _abstract(formats[1], False, f, d, layers=2)
    down = _abstract(formats[2], False, d, f, layers=2)
    regroup = lambda w, k: (w[0], jax.ShapeDtypeStruct((2, k // group, w[1].shape[2]), w[1].dtype), None)  # noqa: E731
    gate, up, down = regroup(gate, d), regroup(up, d), regroup(down, f)
    x = jax.ShapeDtypeStruct((m, d), jnp.bfloat16)
    with pytest.raises(UntiledShape, match=match):
        jax.eval_shape(lambda *a: qo.quant_mlp_owned(*a, 0, group=group), x, gate, up, down)


def test_refuses_weights_that_disagree_with_x():
    gate = up = _abstract("int4", False, 256, 256, layers=2)
    down = _abstract("int4", False, 512, 256, layers=2)  # [L, D=512, F=256] for an x of width 256
    x = jax.ShapeDtypeStruct((1, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="disagree with x"):
        jax.eval_shape(lambda *a: qo.quant_mlp_owned(*a, 0, group=128), x, gate, up, down)


@pytest.mark.parametrize("blocks,ctas", [(112, 132), (224, 132), (4, 1), (3, 2), (2, 3)])
def test_every_block_is_owned_once(blocks, ctas):
    owned = []
    for c in range(ctas):
        owned += [c + i * ctas for i in range(int(qo.owned_blocks(jnp.int32(c), blocks, ctas)))]
    assert sorted(owned) == list(range(blocks))


def test_hook_declines_the_cpu_and_names_a_bad_design():
    from jaxdecode.hooks import kernel_mlp
    from jaxdecode.looping import StackedRef

    x, gate, up, down = exact_inputs("int4", True, "float32", 1, 256, 256)
    refs = [StackedRef(a, jnp.int32(1)) for w in (gate, up, down) for a in w if a is not None]
    if jax.default_backend() == "cpu":
        assert kernel_mlp(x[:, None, :], *refs, design="owned") is None  # impl None off Hopper: runs as written
    with pytest.raises(ValueError, match="design must be 'phases' or 'owned', got 'fused'"):
        kernel_mlp(x[:, None, :], *refs, impl="fused", design="fused", interpret=True)


@pytest.mark.skipif(not ON_HOPPER, reason="compiled Mosaic GPU kernels need a Hopper GPU")
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("ctas", [None, 4])  # None: one CTA per SM, more than the blocks
def test_compiled_matches_reference(name, ctas):
    from kernels.quant_gemm import permute_k

    codes, offsets, sdt, m, d, f, _ = CASES[name]
    x, gate, up, down = exact_inputs(codes, offsets, sdt, m, d, f)
    ref = np.asarray(qo.quant_mlp_owned_reference(x, gate, up, down, 1, group=128))
    allow = tie_allowance(x, gate, up, down)
    stored = [(permute_k(c) if codes == "int4" else c, s, o) for c, s, o in (gate, up, down)]
    for _ in range(3):  # each call as right as the first
        y = qo.quant_mlp_owned(x, *stored, jnp.int32(1), group=128, block_sizes=qo.OwnedMLPBlocks(ctas=ctas))
        _assert_close(np.asarray(y), ref, allow)

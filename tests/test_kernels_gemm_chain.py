"""`kernels.gemm_chain`: dependent GEMVs in one launch, phases meeting at an in-kernel grid barrier. Interpreted on
one CTA against the XLA chain (`gemm_chain_reference`), lowered for Hopper at the benchmark's 132-CTA shapes, and
compiled on Hopper, where the barrier runs."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.gemm_chain import ChainBlocks, gemm_chain, gemm_chain_reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def _inputs(m: int, d: int, layers: int):
    x = jax.random.normal(jax.random.key(0), (m, d), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(1), (layers, d, d), jnp.float32) * d**-0.5).astype(jnp.bfloat16)
    return x, w


def _close(got, x, w, first, phases):
    ref = np.asarray(gemm_chain_reference(x, w, first, phases=phases), np.float32)
    # each phase's f32 sum is rounded to bf16 by both, summed in another order: a bf16 step (2^-8 of the largest
    # value) a phase, carried into the next
    np.testing.assert_allclose(np.asarray(got, np.float32), ref, rtol=0, atol=phases * 2.0**-8 * np.abs(ref).max())


@pytest.mark.parametrize(
    "m, tile_k, stages, phases, across",
    # 4, 4 and 2 k-steps a phase: stages cross phase boundaries, with the weights streaming across or held
    [(1, 16, 2, 3, True), (5, 16, 3, 4, True), (8, 32, 2, 2, True), (5, 16, 3, 4, False)],
)
def test_interpreted_matches_reference(m, tile_k, stages, phases, across):
    x, w = _inputs(m, 64, phases + 1)
    cfg = ChainBlocks(tile_k=tile_k, stages=stages, stream_across_barrier=across)
    got = gemm_chain(x, w, 1, phases=phases, block_sizes=cfg, interpret=True)
    assert got.shape == (phases, m, 64)
    _close(got, x, w, 1, phases)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(m=9), "M <= 8"),
        (dict(d=128), "ctas · tile_n"),
        (dict(stages=5), "stages=5"),
        (dict(phases=4), "do not fit the 3 layers"),
    ],
)
def test_bad_input_is_refused(kwargs, match):
    x, w = _inputs(kwargs.get("m", 1), kwargs.get("d", 64), 3)
    cfg = ChainBlocks(tile_k=16, stages=kwargs.get("stages", 2))
    with pytest.raises(ValueError, match=match):
        gemm_chain(x, w, 0, phases=kwargs.get("phases", 2), block_sizes=cfg, interpret=True)


@pytest.mark.parametrize("m, across", [(1, True), (8, True), (1, False)])
def test_lowers_for_hopper_on_any_host(m, across):
    """Mosaic GPU's layout and tiling checks, the global semaphores and the transposed bf16 store, at the
    benchmark's shape: 132 CTAs, D = 8448."""
    d = 132 * 64
    x = jax.ShapeDtypeStruct((m, d), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4, d, d), jnp.bfloat16)
    cfg = ChainBlocks(ctas=132, stream_across_barrier=across)
    op = lambda x, w, first: gemm_chain(x, w, first, phases=3, block_sizes=cfg)  # noqa: E731
    text = jax.jit(op).trace(x, w, jax.ShapeDtypeStruct((), jnp.int32)).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in text.as_text()


def test_benchmark_dry_run_rows_are_right():
    import gemm_chain_bench

    result = gemm_chain_bench.main(["--dry-run", "--batches", "1"])
    names = {"one launch", "one launch, no stream across", "a launch per phase", "XLA per phase"}
    assert {r["variant"] for r in result["rows"]} == names
    assert all(r["right"] for r in result["rows"]), result["rows"]


ON_HOPPER = jax.default_backend() == "gpu" and any(s in jax.devices()[0].device_kind for s in ("H100", "H200"))


@pytest.mark.skipif(not ON_HOPPER, reason="the grid barrier needs a Hopper GPU")
@pytest.mark.parametrize("m", [1, 8])
def test_compiled_matches_reference(m):
    """Every SM a CTA, each phase's input written by all of them: the barrier, three calls of one executable (the
    semaphores must come back to zero after each)."""
    from kernels.flat_gemm_stream import default_ctas

    d = default_ctas() * 64
    x, w = _inputs(m, d, 6)
    for across in (True, False):
        cfg = ChainBlocks(stream_across_barrier=across)
        run = jax.jit(lambda x, w: gemm_chain(x, w, 1, phases=5, block_sizes=cfg))  # noqa: B023
        for _ in range(3):
            _close(run(x, w), x, w, 1, 5)

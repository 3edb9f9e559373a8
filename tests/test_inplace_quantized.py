"""The quantized layer of the in-place looped decode: q·k·v, gate/up and every other projection through
`kernels.quant_gemm_stream` (Mosaic GPU's interpreter on the CPU), the q·k·v partials through the same
epilogue and attention kernels as bf16 weights, against the unrolled model whose dots XLA runs on the
dequantized weights."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.config import ModelConfig
from jaxdecode.decode import Engine
from jaxdecode.looped_model import kernel_qkv_attend, kernel_quant_dot, kernel_swiglu
from jaxdecode.looping import outside_runs
from jaxdecode.model import Hook, init_random, quantize_weights
from kernels.decode_attention import BlockSizes as AttentionBlocks
from kernels.quant_gemm_stream import QuantStreamBlocks

# Widths the kernel tiles with 64-row tiles (q 128, k/v 64, F 256), head dim 64: half a head per tile.
CFG = ModelConfig("tiny-quant-stream", 97, 128, 2, 2, 1, 256, max_seq_len=64)
BLOCKS = QuantStreamBlocks(tile_n=64, tile_k=64, stages=2, compute_wgs=1, ctas=8)
# bf16 activations: each dot's f32 sum is rounded to bf16 by both (2^-8 relative) in different orders, and
# the kernel rounds each scaled weight to bf16 (2^-9) as well; over two layers, a few bf16 ulps of the logits.
RTOL = 2.0**-6


def _engine(model, calls: list):
    def counted(name, hook):
        def run(*args, **kwargs):
            out = hook(*args, **kwargs)
            calls.append((name, out is not None))
            return out

        return run

    kw = dict(quant_blocks=BLOCKS, interpret=True)
    stream_dot = functools.partial(kernel_quant_dot, impl="stream", stream_blocks=BLOCKS, interpret=True)

    def decode_dot(x, *weight):
        # Prefill's q, k and v dots are independent: XLA:CPU runs them at once, and concurrent interpreted
        # kernels of several warpgroups each block a CPU thread in a barrier (a deadlock on two cores).
        return None if x.shape[-2] > 1 else stream_dot(x, *weight)

    quant_dot = outside_runs(counted("quant_dot", decode_dot))
    hooks = {h: None for h in Hook} | {
        Hook.QUANT_DOT: quant_dot,
        Hook.SWIGLU: counted("swiglu", functools.partial(kernel_swiglu, impl="stream", **kw)),
        Hook.QKV_ATTEND: counted(
            "qkv_attend",
            functools.partial(kernel_qkv_attend, impl="stream", attention_blocks=AttentionBlocks(16, 2), **kw),
        ),
    }
    return Engine(model, loop_mode="inplace", hooks=hooks, stacked_dot=lambda *a: None)


def test_decode_step_through_the_quantized_kernels_equals_unrolled():
    """A prefill of 5 tokens (qkv_attend declines for T > 1; its dots run in XLA here) then one decode step
    (q·k·v in one launch, its epilogue and attention kernels; gate/up in one launch; o and down through
    quant_dot): the logits of both against the unrolled model, and every hook took its call."""
    model = quantize_weights(init_random(CFG, seed=3, dtype=jnp.bfloat16), "int4", group=32)
    rng = np.random.default_rng(4)
    prompt = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 5)), jnp.int32)
    step = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 1)), jnp.int32)
    calls: list = []
    results = []
    for engine in (Engine(model, loop_layers=False), _engine(model, calls)):
        cache = engine.new_cache(2, 64)
        positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
        first, cache = engine.forward(engine.params, prompt, positions, cache)
        out, _ = engine.forward(engine.params, step, jnp.full((2, 1), 5, jnp.int32), cache)
        results.append((np.asarray(first, np.float32), np.asarray(out, np.float32)))
    for got, want in zip(results[1], results[0]):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=4 * 2.0**-8 * np.abs(want).max())
    took = {name for name, ok in calls if ok}
    assert took == {"quant_dot", "swiglu", "qkv_attend"}, calls
    assert ("qkv_attend", False) in calls  # the prefill, declined


ON_HOPPER = jax.default_backend() == "gpu" and any(s in jax.devices()[0].device_kind for s in ("H100", "H200"))
# Widths the engine's default blocks tile (K = 256 and 512, N = 128..512: one unit is 256 deep).
CFG_DEFAULT_TILES = ModelConfig("tiny-quant-gpu", 97, 256, 2, 4, 2, 512, max_seq_len=64)


@pytest.mark.skipif(not ON_HOPPER, reason="compiled Mosaic GPU kernels need a Hopper GPU")
@pytest.mark.parametrize("quant_hooks", ["kernels", "xla"])
@pytest.mark.parametrize("batch", [1, 2])
def test_compiled_default_hooks_equal_unrolled(batch, quant_hooks):
    """On Hopper, the engine's own hooks (no overrides but counting): one decode step through the fused
    quantized kernels, compiled, against the unrolled model; q·k·v, gate/up and quant_dot each took a call.
    quant_hooks="xla" turns the three quantized hooks off (the in-place loop slices the int4 stacks and XLA
    dequantizes): it separates a fault of the kernels from one of the looped path around them."""
    cfg = CFG_DEFAULT_TILES
    model = quantize_weights(init_random(cfg, seed=5, dtype=jnp.bfloat16), "int4", group=32)
    calls: list = []

    def counted(name, hook):
        def run(*args, **kwargs):
            out = hook(*args, **kwargs)
            calls.append((name, out is not None))
            return out

        return outside_runs(run) if name == "quant_dot" else run

    hooks = {
        Hook.QUANT_DOT: counted("quant_dot", kernel_quant_dot),
        Hook.SWIGLU: counted("swiglu", kernel_swiglu),
        Hook.QKV_ATTEND: counted("qkv_attend", kernel_qkv_attend),
    }
    if quant_hooks == "xla":
        hooks = dict.fromkeys(hooks)
    rng = np.random.default_rng(6)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, 5)), jnp.int32)
    step = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, 1)), jnp.int32)
    results = []
    for engine in (Engine(model, loop_layers=False), Engine(model, loop_mode="inplace", hooks=hooks)):
        cache = engine.new_cache(batch, 64)
        positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (batch, 5))
        _, cache = engine.forward(engine.params, prompt, positions, cache)
        out, _ = engine.forward(engine.params, step, jnp.full((batch, 1), 5, jnp.int32), cache)
        results.append(np.asarray(out, np.float32))
    np.testing.assert_allclose(results[1], results[0], rtol=RTOL, atol=4 * 2.0**-8 * np.abs(results[0]).max())
    if quant_hooks == "kernels":
        assert {name for name, ok in calls if ok} == {"quant_dot", "swiglu", "qkv_attend"}, calls

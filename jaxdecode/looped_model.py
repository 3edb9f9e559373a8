"""The decode engine's use of the kernel-looping pass: our Transformer's forward, looped.

`LoopedForward` applies `looping.kernel_loop` to the model's forward function. The per-layer
weights are packed once (stacked to [L, ...]) when the engine is built, the per-layer KV caches once
when a cache is created, and both stay packed: every step reads the stacks directly, with no
per-step stacking or copying. One plan is traced per input shape (prefill and decode differ).

Modes (`LOOP_MODES`): "slice" (the scan slices the stacks), "whole" (the body takes row i with
`dynamic_index_in_dim`), "inplace" ("whole" plus the in-place hooks of `jaxdecode.hooks`: the layer's `x @ W` dots read
W[i] in place with `kernels.flat_gemm` where `kernels.dispatch` picks a kernel (`kernel_stacked_dot`),
the model's `swiglu` call runs as one two-weight kernel (`kernel_swiglu`), its `qkv` call as one
three-weight stream kernel (`kernel_qkv`), its `rms_norm` calls as one kernel each (`kernel_rms_norm`),
under tensor parallelism the attention's all-reduce, residual add and the MLP's input norm as one
all-reduce kernel (`kernel_residual_norm`),
the KV cache is written in place in the scan carry, and attention (the model's `sdpa` call) reads
layer i of the stacked cache in place with `kernels.decode_attention` (`kernel_attention`); for one new
token per sequence, the model's `qkv_attend` call (projections, RoPE, cache write, attention) runs as
the q·k·v GEMM, one epilogue kernel (`kernels.qkv_rope`: split sum, bias, RoPE, the cache rows
written in place) and the attention kernel (`kernel_qkv_attend`); prefill, with more tokens, goes
through the `qkv` and `sdpa` hooks and the in-place cache writes inside that call). Quantized weights
take the same shape through `kernels.quant_gemm_stream`: q·k·v in one launch into the same epilogue
and attention, gate/up in one launch, every other quantized dot one launch (`kernel_quant_dot`).
`default_loop_mode()` (the engine's default) is "inplace" on every backend: on a GPU XLA copies each
W[i] out of its stack before a dot; on the CPU the hooks decline, and the cache carried through the
scan is still written in place, where "slice" copies each layer's cache rows out and back every step
(docs/log/2026-12-03-cpu-loop.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
from flax import nnx

from jaxdecode.cache import KVCache
from jaxdecode.config import ModelConfig, get_preset
from jaxdecode.hooks import kernel_calls, kernel_stacked_dot
from jaxdecode.looping import LoopPlan, LoopReport, Packed, kernel_loop
from jaxdecode.model import Hook, Transformer

# Argument and output positions of `forward` below that the plan packs.
_PARAMS, _K, _V = 0, 3, 4
_PACKED_OUTPUTS = {1: _K, 2: _V}  # the new K and V caches come back packed like the inputs


LOOP_MODES = ("slice", "whole", "inplace")


def default_loop_mode() -> str:
    return "inplace"


def _spec(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


class LoopedForward:
    """forward(params, tokens, positions, cache) with the layers run as one `lax.scan`."""

    def __init__(
        self,
        graphdef,
        params,
        cfg: ModelConfig,
        *,
        mode: str = "slice",
        stacked_dot: Callable | None = None,
        hooks: Mapping[Hook | str, Callable | None] | None = None,
    ):
        if mode not in LOOP_MODES:
            raise ValueError(f"loop mode must be one of {LOOP_MODES}, got {mode!r}")
        self.cfg = cfg
        self.mode = mode
        self.index_mode = "slice" if mode == "slice" else "whole"
        self._stacked_dot = (stacked_dot or kernel_stacked_dot) if mode == "inplace" else None
        # in place: the model's named calls in `kernel_calls` go to kernels (`jaxdecode.looping.inplace`)
        self._calls = kernel_calls(None, hooks) if mode == "inplace" else None
        self._forward = lambda params, tokens, positions, k, v: nnx.merge(graphdef, params)(tokens, positions, k, v)
        self._param_specs = jax.tree.map(_spec, params)
        self._plans: dict[tuple, LoopPlan] = {}

    def plan(self, batch: int, tokens: int, cache_len: int, cache_dtype) -> LoopPlan:
        """The plan for one input shape, traced from shape specs on first use."""
        key = (batch, tokens, cache_len, jax.numpy.dtype(cache_dtype).name)
        if key not in self._plans:
            cfg = self.cfg
            int_spec = jax.ShapeDtypeStruct((batch, tokens), jax.numpy.int32)
            kv = [jax.ShapeDtypeStruct((batch, cache_len, cfg.n_kv_heads, cfg.head_dim), cache_dtype)] * cfg.n_layers
            self._plans[key] = kernel_loop(
                self._forward,
                self._param_specs,
                int_spec,
                int_spec,
                kv,
                kv,
                index_mode=self.index_mode,
                packed_outputs=_PACKED_OUTPUTS,
                stacked_dot=self._stacked_dot,
                stacked_calls=self._calls,
            )
        return self._plans[key]

    def finds_runs(self) -> bool:
        """Whether the pass finds consecutive equal layers to loop (not in a one-layer model, nor where
        every layer's weights are quantized differently)."""
        return bool(self.plan(1, 1, 1, jax.numpy.float32).layouts)

    def pack_params(self, params) -> Packed:
        return Packed.pack(params, self.plan(1, 1, 1, jax.numpy.float32).layouts[_PARAMS])

    def pack_cache(self, cache: KVCache) -> KVCache:
        batch, length = cache.k[0].shape[:2]
        layouts = self.plan(batch, 1, length, cache.k[0].dtype).layouts
        return KVCache(Packed.pack(cache.k, layouts[_K]), Packed.pack(cache.v, layouts[_V]))

    def forward(self, params: Packed, tokens, positions, cache: KVCache):
        stack = cache.k.stacks[0]  # [L, B, S, K, H]
        plan = self.plan(tokens.shape[0], tokens.shape[1], stack.shape[2], stack.dtype)
        logits, k, v = plan.looped(params, tokens, positions, cache.k, cache.v)
        return logits, KVCache(k, v)

    def report(self, batch: int = 1, cache_len: int = 1024, cache_dtype=jax.numpy.float32) -> LoopReport:
        return self.plan(batch, 1, cache_len, cache_dtype).report


def model_loop_report(name: str) -> LoopReport:
    """What the pass does to the decode step of a preset (traced from shapes; no weights are made)."""
    cfg = get_preset(name)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract)
    return LoopedForward(graphdef, params, cfg, mode="slice").report()

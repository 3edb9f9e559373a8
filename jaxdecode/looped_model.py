"""The decode engine's use of the kernel-looping pass: our Transformer's forward, looped.

`LoopedForward` applies `looping.kernel_loop` to the model's forward function. The per-layer
weights are packed once (stacked to [L, ...]) when the engine is built, the per-layer KV caches once
when a cache is created, and both stay packed: every step reads the stacks directly, with no
per-step stacking or copying. One plan is traced per input shape (prefill and decode differ).
"""

from __future__ import annotations

import jax
from flax import nnx

from jaxdecode.cache import KVCache
from jaxdecode.config import ModelConfig, get_preset
from jaxdecode.looping import LoopPlan, LoopReport, Packed, kernel_loop

# Argument and output positions of `forward` below that the plan packs.
_PARAMS, _K, _V = 0, 3, 4
_PACKED_OUTPUTS = {1: _K, 2: _V}  # the new K and V caches come back packed like the inputs


def _spec(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


class LoopedForward:
    """forward(params, tokens, positions, cache) with the layers run as one `lax.scan`."""

    def __init__(self, graphdef, params, cfg: ModelConfig, *, index_mode: str = "slice"):
        self.cfg = cfg
        self.index_mode = index_mode
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
            self._plans[key] = kernel_loop(self._forward, self._param_specs, int_spec, int_spec, kv, kv,
                                           index_mode=self.index_mode, packed_outputs=_PACKED_OUTPUTS)
        return self._plans[key]

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
    from jaxdecode.model import Transformer

    cfg = get_preset(name)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract)
    return LoopedForward(graphdef, params, cfg).report()

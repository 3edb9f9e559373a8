"""Memory preflight: estimate weights + KV cache + workspace before anything is allocated.

    need = weights * (2 if looped, while the per-layer weights are stacked once)
           + KV cache (2 * L * B * S * K * H * itemsize)
           + workspace (logits [B, V] in f32 and activations, with a 10% margin on the total)

With tensor parallelism over tp devices (`jaxdecode.tp`) every number is per device: the weights and
the cache of the shard config (N/tp, K/tp, F/tp, ceil(V/tp) rows; norms replicated), i.e. about
total / tp, and the full gathered logits in the workspace.

Known debt: packing for the looped engine holds the unstacked and the stacked weights at once, so
the looped engine needs twice the weight bytes at load time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax

from jaxdecode.cache import cache_bytes
from jaxdecode.config import ModelConfig, shard_config
from jaxdecode.cost import matmul_params_per_layer, projection_bytes

GB = 1e9


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    packing: int
    kv_cache: int
    workspace: int

    @property
    def total(self) -> int:
        return int(1.1 * (self.weights + self.packing + self.kv_cache + self.workspace))

    def describe(self) -> str:
        return (
            f"weights {self.weights / GB:.1f} GB + packing copy {self.packing / GB:.1f} GB + "
            f"KV cache {self.kv_cache / GB:.1f} GB + workspace {self.workspace / GB:.2f} GB, "
            f"with 10% margin {self.total / GB:.1f} GB"
        )


def estimate(
    cfg: ModelConfig,
    *,
    itemsize: int,
    batch: int = 1,
    context: int = 4096,
    looped: bool = True,
    tp: int = 1,
    quantize: str | None = None,
    weight_bytes: int | None = None,
) -> MemoryEstimate:
    """Bytes on one device; with tp > 1 those of one of tp devices (ValueError if tp cannot split cfg).
    `quantize`: the projections as `model.quantize_weights` stores them (`cost.projection_bytes`);
    `weight_bytes`: the weights' size when the caller knows it (a GGUF file kept quantized)."""
    shard = shard_config(cfg, tp) if tp != 1 else cfg
    weights = shard.n_params * itemsize if weight_bytes is None else weight_bytes
    if quantize is not None:
        projections = shard.n_layers * matmul_params_per_layer(shard) + shard.vocab_size * shard.dim
        weights += projection_bytes(shard, quantize) - projections * itemsize
    workspace = batch * cfg.vocab_size * 4 * 2 + 16 * batch * context * max(cfg.dim, shard.ffn_dim) * 4 // 1024
    return MemoryEstimate(weights, weights if looped else 0, cache_bytes(shard, batch, context, itemsize), workspace)


def device_memory_bytes(device=None) -> int:
    """Memory the device can allocate: the allocator's limit on accelerators, physical RAM on the CPU."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def preflight(
    cfg: ModelConfig,
    *,
    itemsize: int,
    batch: int = 1,
    context: int = 4096,
    looped: bool = True,
    available: int | None = None,
    tp: int = 1,
    quantize: str | None = None,
    weight_bytes: int | None = None,
) -> MemoryEstimate:
    """Raise ValueError with the numbers when the estimate exceeds the device's memory (per device)."""
    est = estimate(
        cfg,
        itemsize=itemsize,
        batch=batch,
        context=context,
        looped=looped,
        tp=tp,
        quantize=quantize,
        weight_bytes=weight_bytes,
    )
    available = device_memory_bytes() if available is None else available
    if est.total > available:
        where = f"each of {tp} devices" if tp > 1 else "the device"
        raise ValueError(
            f"{cfg.name} does not fit: needs {est.describe()}{' per device' if tp > 1 else ''}, "
            f"but {where} has {available / GB:.1f} GB"
        )
    return est

"""The KV cache: one key and one value array per layer, an explicit pytree that steps take and return."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxdecode.config import ModelConfig

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    """Attributes:
    k: L arrays [B, S, K, H], the rotated keys of every position written so far.
    v: L arrays [B, S, K, H], the values.

    Row s of sequence b is valid once position s has been written; attention masks by position, so
    rows past a sequence's length may hold anything.
    """

    k: list[Array]
    v: list[Array]

    @classmethod
    def init(cls, cfg: ModelConfig, batch: int, length: int, dtype=jnp.float32) -> KVCache:
        shape = (batch, length, cfg.n_kv_heads, cfg.head_dim)  # [B, S, K, H]
        return cls(
            [jnp.zeros(shape, dtype) for _ in range(cfg.n_layers)],
            [jnp.zeros(shape, dtype) for _ in range(cfg.n_layers)],
        )

    @property
    def length(self) -> int:
        return self.k[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)


def cache_bytes(cfg: ModelConfig, batch: int, length: int, itemsize: int) -> int:
    """Bytes of a cache: 2 (K and V) * L * B * S * K * H * itemsize."""
    return 2 * cfg.n_layers * batch * length * cfg.n_kv_heads * cfg.head_dim * itemsize

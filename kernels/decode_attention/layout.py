"""The decode attention's layouts: its tunables (`BlockSizes`), its kernel backends (`BACKENDS`), how
the cache splits over the kernel's programs (`split_layout`, `pad_cache`), and q as the kernels' rows
(`query_rows`, `to_rows`, `from_rows`). The layouts themselves are described in
kernels/decode_attention/attention.py."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.experimental import pallas as pl


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tunables. num_splits=None picks the fewest splits dividing the cache's blocks that give at least
    target_programs programs, within max_programs and max_splits; where none does, the most within them
    (`split_layout`)."""

    block_k: int = 64  # cache positions per loop step (power of two; a multiple of 64 for "mosaic")
    num_splits: int | None = None
    num_warps: int = 4  # Triton only
    num_stages: int = 2  # Triton's software pipeline; Mosaic GPU's K and V TMA buffers per program
    # Programs = batch x kv heads x splits. Aim at about 1.5 per SM (132 SMs on an H200) in as few, long
    # programs as reach it, within one wave (a one-stage program's 38 KB of shared memory lets 5 share an SM,
    # 660 in all) and below 32 splits (the combine's cost grows with them). A program streams its split's
    # blocks through `num_stages` buffers: on the H200 fewer, longer programs were faster at batch 8 and 32
    # (Llama-3.1-8B, 1k: 3 splits against 9, 1 against 2), and batch 1's 8 (b, h) pairs still take every
    # split the cache allows (docs/log/).
    target_programs: int = 192
    max_programs: int | None = 660
    max_splits: int | None = 32
    # How the synchronized kernel's split partials are combined: "kernel" (`combine_splits`: one Pallas
    # kernel writing the final layout, where it fits) or "xla" (jnp: XLA's exp, reduce and slice fusions,
    # three kernels). The one kernel was faster on the H200 at batch 1, TP1 and TP2, and equal at batch 8
    # (A/B runs; see docs/log/). "fused" (Mosaic GPU, one token: `decode_attention_sync_rows`): the
    # attention kernel's last split of each kv head combines, after the other splits signal it; no launch
    # of its own (elsewhere it means "kernel").
    combine: str = "kernel"
    combine_cols: int = 32  # head-dim columns per program of the combine kernel

    def __post_init__(self):
        if self.combine not in ("xla", "kernel", "fused"):
            raise ValueError(f"BlockSizes.combine must be 'xla', 'kernel' or 'fused', got {self.combine!r}")


BACKENDS = ("triton", "mosaic")  # Pallas-Triton (pallas_call) or Mosaic GPU (plgpu.kernel, Hopper)


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def split_layout(batch: int, kv_heads: int, cache_len: int, cfg: BlockSizes) -> tuple[int, int]:
    """(splits, padded S). S is padded up to a multiple of splits·block_k; the pad is masked by
    length like any position past `lengths`. An aligned S (the usual, preallocated cache) is not
    padded, so the cache is never copied there."""
    blocks = -(-cache_len // cfg.block_k)
    if cfg.num_splits is not None:
        splits = cfg.num_splits
    else:
        pairs = batch * kv_heads
        cap = blocks
        if cfg.max_programs is not None:
            cap = min(cap, max(1, cfg.max_programs // pairs))
        if cfg.max_splits is not None:
            cap = min(cap, cfg.max_splits)
        fit = [d for d in range(1, cap + 1) if blocks % d == 0]  # 1 always divides
        enough = [d for d in fit if pairs * d >= cfg.target_programs]
        splits = min(enough) if enough else max(fit)
    return splits, splits * cfg.block_k * -(-blocks // splits)


def pad_cache(k, v, cfg: BlockSizes, stacked: bool):
    """k, v [B, S, K, H] -> [B, S_pad, K, H] (a copy only when S is not already aligned).

    A stacked cache [L, B, S, K, H] is never padded: that would copy every layer's cache per call.
    """
    batch, cache_len, kv_heads, _ = k.shape[-4:]
    _, padded = split_layout(batch, kv_heads, cache_len, cfg)
    if padded == cache_len:
        return k, v
    if stacked:
        raise ValueError(
            f"a stacked cache is read in place, so its length {cache_len} must be a multiple of block_k={cfg.block_k}"
        )
    pad = ((0, 0), (0, padded - cache_len), (0, 0), (0, 0))
    return jnp.pad(k, pad), jnp.pad(v, pad)


def query_rows(tokens: int, group: int) -> int:
    """R, the query rows per kv head a kernel program takes: T·G padded to a power of two, at least 16
    (Triton's smallest dot)."""
    return max(16, pl.next_power_of_2(tokens * group))


def to_rows(q, kv_heads: int):
    """q [B, T, N, H] -> [B, K, R, H], rows r = t·G + g padded to R = `query_rows(T, G)`."""
    batch, tokens, heads, head_dim = q.shape
    group = heads // kv_heads
    rows = query_rows(tokens, group)
    q = q.reshape(batch, tokens, kv_heads, group, head_dim)  # [B, T, K, G, H]
    q = q.transpose(0, 2, 1, 3, 4).reshape(batch, kv_heads, tokens * group, head_dim)  # [B,K,TG,H]
    return jnp.pad(q, ((0, 0), (0, 0), (0, rows - tokens * group), (0, 0)))  # [B, K, R, H]


def from_rows(x, tokens: int, group: int):
    """x [B, K, R, ...] -> [B, T, N, ...]: drops the padded rows."""
    batch, kv_heads = x.shape[:2]
    x = x[:, :, : tokens * group].reshape(batch, kv_heads, tokens, group, *x.shape[3:])
    x = jnp.moveaxis(x, 2, 1)  # [B, T, K, G, ...]
    return x.reshape(batch, tokens, kv_heads * group, *x.shape[4:])  # [B, T, N, ...]

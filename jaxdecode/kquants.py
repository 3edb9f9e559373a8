"""GGUF's K-quant layouts made from dense weights: Q4_K and Q6_K by round to nearest, and llama.cpp's Q4_K_M mix.

`--quantize q4_k_m` gives a bf16/f32 checkpoint the layout a downloaded Q4_K_M file has on our device
(`jaxdecode.weights.repack`: two levels of scales, `kernels.superblocks`), so the two run through the same kernels:

- Q4_K: groups of 32 values, x = d·sc·q - dmin·m with q in 0..15. Per group the grid spans [min(x, 0), max(x)]
  (llama.cpp keeps 0 on the grid: the min is clamped to at most 0); per super-block of 256 the groups' scales and
  mins are 6-bit multiples of d = max scale / 63 and dmin = max min / 63, both float16.
- Q6_K: groups of 16, x = d·sc·(q - 32), symmetric; sc an int8 multiple of d = max |group scale| / 127.

The codes are chosen against the rounded two-level scales, so every value is within half a step of the grid the
kernels read (clipped where the sub-scale's rounding shrank the grid). llama.cpp searches each group's scale and min
for the least squared error (`make_qkx2_quants`); this is round to nearest, as `quantize`'s int4 and int8 are.

A weight whose K is not a multiple of 256 cannot hold super-blocks: as llama.cpp falls back to Q5_0 / Q8_0 there,
Q4_K falls back to `quantize`'s int4 in groups of 32 (float16 scale and offset: 5 bits a value) and Q6_K to
int8 in groups of 32 (Q8_0's layout).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxdecode.quantized import QUANTIZE_FORMATS, QuantizedWeight, quantize
from kernels.superblocks import OFFSET_BIAS, SUB_DTYPE, SUPER_DTYPE, SUPER_GROUP

K_FORMATS = {"q4_k": 32, "q6_k": 16}  # name → values per group
FALLBACK = {"q4_k": ("int4", 32), "q6_k": ("int8", 32)}  # where K is not a multiple of 256
MIXES = ("q4_k_m",)
QUANTIZE_CHOICES = (*QUANTIZE_FORMATS, *MIXES)  # every `--quantize`


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down take more bits in a _M mix: the first and last
    eighth, and every third layer between (its integer arithmetic)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def mix_format(mix: str, projection: str, layer: int | None, layers: int) -> str:
    """The K-quant of one projection in `mix` ("q4_k_m"): projection is a name of `model.Transformer`'s
    ("q_proj", ..., "down_proj", "lm_head": the output projection, tied or not), layer its index (None for the head).
    Q4_K_M: Q6_K for the output projection and for v_proj and down_proj of the layers `use_more_bits` picks."""
    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r}; choose one of {', '.join(MIXES)}")
    if projection == "lm_head":
        return "q6_k"
    if projection in ("v_proj", "down_proj") and use_more_bits(layer, layers):
        return "q6_k"
    return "q4_k"


def quantize_k(w, fmt: str) -> QuantizedWeight:
    """A dense [K, N] weight (numpy or jax) in the K-quant `fmt` ("q4_k" | "q6_k") by round to nearest, two levels of
    scales; K not a multiple of 256 takes `FALLBACK`'s one-level format."""
    if fmt not in K_FORMATS:
        raise ValueError(f"unknown K-quant {fmt!r}; choose one of {', '.join(K_FORMATS)}")
    k = w.shape[-2]
    if k % SUPER_GROUP:
        base, group = FALLBACK[fmt]
        return quantize(w, base, math.gcd(group, k))  # a K of no 32-value groups (tests' tiny widths) takes fewer
    arrays = (_q4_k if fmt == "q4_k" else _q6_k)(jnp.asarray(w, jnp.float32))
    return QuantizedWeight.from_codes(arrays[0], arrays[1], arrays[2], fmt.upper(), *arrays[3:])


def _rows(w, group: int):
    """w [K, N] → its rows [N, K/256, 256/G, G] (super-block, group, value)."""
    k, n = w.shape
    return w.T.reshape(n, k // SUPER_GROUP, SUPER_GROUP // group, group)


def _columns(a):
    """[N, K/256, 256/G] per group (or [N, K/256] per super-block) → [K/G, N] (or [K/256, N])."""
    return a.reshape(a.shape[0], -1).T


def _super(per_group, top: int):
    """(float16 d [N, K/256], its sub-multiples int [N, K/256, 256/G]) of positive per-group values: d = max / top,
    each group's value as round(v / d) in 0..top (0 where the whole super-block is 0)."""
    d = (jnp.max(per_group, axis=-1) / top).astype(SUPER_DTYPE)
    df = d.astype(jnp.float32)[..., None]
    sub = jnp.where(df > 0, jnp.clip(jnp.round(per_group / jnp.where(df > 0, df, 1.0)), 0, top), 0)
    return d, sub


@jax.jit
def _q4_k(w):
    g = _rows(w, K_FORMATS["q4_k"])  # [N, S, 8, 32]
    lo = jnp.minimum(jnp.min(g, axis=-1), 0.0)  # the grid keeps 0 on it
    hi = jnp.max(g, axis=-1)
    d, sc = _super((hi - lo) / 15, 63)
    dmin, m = _super(-lo, 63)
    scale = d.astype(jnp.float32)[..., None] * sc  # [N, S, 8], exact
    low = dmin.astype(jnp.float32)[..., None] * m  # the file's dmin·m, exact
    q = jnp.round((g + low[..., None]) / jnp.where(scale > 0, scale, 1.0)[..., None])
    codes = (jnp.clip(q, 0, 15) - OFFSET_BIAS).reshape(w.shape[1], -1).astype(jnp.int4)  # [N, K]
    return codes, _columns(sc).astype(SUB_DTYPE), _columns(m).astype(SUB_DTYPE), _columns(d), _columns(-dmin)


@jax.jit
def _q6_k(w):
    g = _rows(w, K_FORMATS["q6_k"])  # [N, S, 16, 16]
    d, sc = _super(jnp.max(jnp.abs(g), axis=-1) / 31, 127)
    scale = d.astype(jnp.float32)[..., None] * sc  # [N, S, 16], exact
    q = jnp.round(g / jnp.where(scale > 0, scale, 1.0)[..., None])
    codes = jnp.clip(q, -32, 31).reshape(w.shape[1], -1).astype(jnp.int8)  # [N, K]: q - 32 of the file's q
    return codes, _columns(sc).astype(SUB_DTYPE), None, _columns(d), None

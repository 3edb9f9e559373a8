"""GGUF's K-quant layouts made from dense weights: Q4_K (llama.cpp's fit) and Q6_K, and llama.cpp's Q4_K_M mix.

`--quantize q4_k_m` gives a bf16/f32 checkpoint the layout a downloaded Q4_K_M file has on our device
(`jaxdecode.weights.repack`: two levels of scales, `kernels.superblocks`), so the two run through the same kernels:

- Q4_K: groups of 32 values, x = d·sc·q - dmin·m with q in 0..15. Each group's scale and min are llama.cpp's
  weighted least-squares fit over candidate grids (`_fit_groups`; the min is at most 0: the grid keeps 0 on it); per
  super-block of 256 the groups' scales and mins are 6-bit multiples of d = max scale / 63 and dmin = max min / 63,
  both float16.
- Q6_K: groups of 16, x = d·sc·(q - 32), symmetric; sc an int8 multiple of d = max |group scale| / 127.

The codes are chosen against the rounded two-level scales, so every value is within half a step of the grid the
kernels read (clipped where the grid does not reach it). Q6_K's scales are round to nearest (llama.cpp searches
them too, `make_qx_quants`: not done here).

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


def fallback(fmt: str, k: int) -> tuple[str, int] | None:
    """(format, group) of the one-level `FALLBACK` a K-quant takes where K holds no whole super-blocks, else None:
    what `quantize_k` stores and `cost.kquant_bytes` counts."""
    if k % SUPER_GROUP == 0:
        return None
    base, group = FALLBACK[fmt]
    return base, math.gcd(group, k)  # a K of no 32-value groups (tests' tiny widths) takes fewer


def quantize_k(w, fmt: str) -> QuantizedWeight:
    """A dense [K, N] weight (numpy or jax) in the K-quant `fmt` ("q4_k" | "q6_k") as the module docstring says, two
    levels of scales; K not a multiple of 256 takes `FALLBACK`'s one-level format."""
    if fmt not in K_FORMATS:
        raise ValueError(f"unknown K-quant {fmt!r}; choose one of {', '.join(K_FORMATS)}")
    one_level = fallback(fmt, w.shape[-2])
    if one_level is not None:
        return quantize(w, *one_level)
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


SEARCH = (-1.0, 0.1, 20)  # make_qkx2_quants' candidate grids for Q4_K: 15 + rmin + rdelta·i levels over the span
SEARCH_VALUES = 1 << 24  # values × candidates a batch of rows holds while the grids are tried


def _fit_groups(g):
    """(scale, lo) [...] of groups g [..., G] on 16 levels: llama.cpp's `make_qkx2_quants`. Each candidate grid
    rounds the group, then the scale and min are fitted to those levels by weighted least squares (weights
    rms(g) + |x|; a positive min is clamped to 0 and the scale refitted); the fit of least weighted error wins,
    the plain [min(x, 0), max(x)] grid among them."""
    rmin, rdelta, steps = SEARCH
    w = jnp.sqrt(jnp.mean(g * g, axis=-1, keepdims=True)) + jnp.abs(g)  # [..., G]
    lo0 = jnp.minimum(jnp.min(g, axis=-1), 0.0)
    span = jnp.max(g, axis=-1) - lo0
    safe = jnp.where(span > 0, span, 1.0)[..., None]
    inv = (
        jnp.concatenate([jnp.full((1,), 15.0), 15 + rmin + rdelta * jnp.arange(steps + 1, dtype=jnp.float32)]) / safe
    )  # [..., C]
    levels = jnp.clip(jnp.round(inv[..., None] * (g - lo0[..., None])[..., None, :]), 0, 15)  # [..., C, G]
    wc, xc = w[..., None, :], g[..., None, :]
    sw, sx = jnp.sum(w, -1, keepdims=True), jnp.sum(w * g, -1, keepdims=True)  # [..., 1]
    sl, sl2 = jnp.sum(wc * levels, -1), jnp.sum(wc * levels * levels, -1)  # [..., C]
    sxl = jnp.sum(wc * levels * xc, -1)
    det = sw * sl2 - sl * sl
    ok = det > 0
    scale = jnp.where(ok, (sw * sxl - sx * sl) / jnp.where(ok, det, 1.0), 0.0)
    lo = jnp.where(ok, (sl2 * sx - sl * sxl) / jnp.where(ok, det, 1.0), 0.0)
    clamp = lo > 0  # the grid keeps 0 on it
    scale = jnp.where(clamp, sxl / jnp.where(sl2 > 0, sl2, 1.0), scale)
    lo = jnp.where(clamp, 0.0, lo)
    scale = scale.at[..., 0].set(span / 15)  # the plain grid as it is
    lo = lo.at[..., 0].set(lo0)
    err = jnp.sum(wc * (scale[..., None] * levels + lo[..., None] - xc) ** 2, -1)  # [..., C]
    err = jnp.where(ok | (jnp.arange(err.shape[-1]) == 0), err, jnp.inf)
    best = jnp.argmin(err, axis=-1)[..., None]
    pick = lambda a: jnp.take_along_axis(a, best, axis=-1)[..., 0]  # noqa: E731
    return pick(scale), pick(lo)


@jax.jit
def _q4_k(w):
    g = _rows(w, K_FORMATS["q4_k"])  # [N, S, 8, 32]
    rows = max(1, SEARCH_VALUES // (w.shape[0] * (SEARCH[2] + 2)))  # rows a batch: bounds the candidates' memory
    scale, lo = jax.lax.map(_fit_groups, g, batch_size=min(rows, g.shape[0]))  # [N, S, 8] each
    d, sc = _super(scale, 63)
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

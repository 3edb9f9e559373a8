"""Weight-only quantized linear weights, kept quantized on the device: integer codes and per-group scales.

One format serves every source, so one kernel family reads them all:

    w[k, n] = scales[k // G, n] · codes[n, k]  (+ offsets[k // G, n])

- `codes` [N, K] int4 or int8: output rows with K contiguous, GGUF's own [out, in] order, so a kernel
  tile [tile_n, tile_k] is the wgmma operand with K as its minor axis (`kernels.quant_gemm`).
- `scales`, `offsets` [K/G, N]: one row per group, so a group's N scales are one contiguous vector the
  kernel multiplies into its accumulator rows. `offsets` is None for symmetric formats (int8, Q8_0, ...).
- G, the group size, is K / scales.shape[-2]; stacked layers add a leading [L] to all three.
- The GGUF K-quants keep their own two levels (`kernels.superblocks`): int8 sub-scales (and sub-offsets)
  [K/G, N] and float16 `super_scales` (`super_offsets`) [K/256, N], which `QuantizedWeight.group_scales` expands to the
  float32 scales and offsets above, bit for bit.
- Int4 codes whose groups are whole 32-column blocks are stored in the Hopper kernels' K order
  (`in_kernel_order`): within each 32-column block the columns are permuted the way the kernel hands
  converted registers to wgmma (`kernels.quant_gemm.permute_k`, its own inverse). The kernel then
  takes x as it is, where codes in the weight's own order would need x permuted before every call (an
  XLA transpose per quantized GEMM). Scales and offsets are per group, so they do not move; every
  reader here (`dequantize_rows`, `embed_rows`, the CPU placement) undoes the order.

Sources: `quantize` (round to nearest, `--quantize int8|int4`) and
`jaxdecode.weights.gguf_repack` (GGUF blocks repacked without loss into this layout). The logical shape
is the dense weight's, [K, N] (`Linear.weight` is [in, out]), so shape checks read the same for both.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kernels import superblocks
from kernels.quant_gemm import SCALE_DTYPES, permute_k

Array = jax.Array

QUANTIZE_FORMATS = {"int8": 8, "int4": 4}  # --quantize name → bits
DEFAULT_GROUP = 128  # values per scale along K for --quantize: the common choice of GPTQ/AWQ/gpt-fast
# --quantize's scales and offsets: float16, as GPTQ/AWQ/Marlin store them, so int4 in groups of 128 costs 4.25
# bits a weight (4.5 with float32). f16's 11 bits cost no measurable quality against float32 and bf16's 8 did
# (SmolLM2, BENCHMARKS.md); the codes are chosen against the rounded scale and offset (`quantize`)
SCALE_DTYPE = jnp.float16


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A [K, N] weight (or a stack [L, K, N]) as codes [.., N, K] and per-group scales (+ offsets) [.., K/G, N],
    of one level (float) or two (int8 per group times float16 per super-block: `kernels.superblocks`).

    `fmt` names where it came from ("int4", "int8" for `quantize`; a GGUF type such as "Q4_K"), for
    reports; the arithmetic depends only on the arrays. The leaves, in order, are what the kernels take
    (`kernels.superblocks.weight_arrays`)."""

    codes: Array  # [..., N, K] int4 | int8, stored order (`in_kernel_order`)
    scales: Array  # [..., K/G, N] float; int8 sub-scales with super_scales
    offsets: Array | None  # [..., K/G, N] like scales, or None
    fmt: str = dataclasses.field(metadata=dict(static=True))
    super_scales: Array | None = None  # [..., K/256, N] float16, or None (one level)
    super_offsets: Array | None = None  # [..., K/256, N] float16 (with offsets), or None

    @classmethod
    def from_codes(cls, codes, scales, offsets, fmt: str, super_scales=None, super_offsets=None) -> QuantizedWeight:
        """The weight whose codes [..., N, K] are given in its own K order, stored as the layout says."""
        return cls(reorder_codes(codes, scales), scales, offsets, fmt, super_scales, super_offsets)

    @property
    def group_arrays(self) -> tuple:
        """(scales, offsets, super_scales, super_offsets), absent ones None: what `group_scales` expands."""
        return self.scales, self.offsets, self.super_scales, self.super_offsets

    def group_scales(self) -> tuple[Array, Array | None]:
        """(scales, offsets or None) [..., K/G, N] float32, two levels expanded."""
        return superblocks.expand(*self.group_arrays)

    def natural_codes(self) -> Array:
        """The codes [..., N, K] in the weight's own K order."""
        return reorder_codes(self.codes, self.scales)

    @property
    def group(self) -> int:
        return self.codes.shape[-1] // self.scales.shape[-2]

    @property
    def shape(self) -> tuple[int, ...]:
        """The dense weight's shape: [..., K, N]."""
        *lead, n, k = self.codes.shape
        return (*lead, k, n)

    @property
    def nbytes(self) -> int:
        """Bytes on the device: int4 codes count half a byte each (XLA packs them on the GPU)."""
        bits = jnp.iinfo(self.codes.dtype).bits
        groupwise = (a for a in self.group_arrays if a is not None)
        return self.codes.size * bits // 8 + sum(a.size * jnp.dtype(a.dtype).itemsize for a in groupwise)

    def dequantize(self, dtype=jnp.float32) -> Array:
        """The dense weight [..., K, N] in `dtype`, computed in float32."""
        return jnp.swapaxes(dequantize_rows(self.codes, *self.group_scales()), -1, -2).astype(dtype)

    def device_put(self) -> QuantizedWeight:
        """The same weight with numpy arrays placed on the default device. On the CPU, int4 codes are
        widened to int8 (the same values, twice the bytes): XLA:CPU converts int4 to float about three
        times slower than int8, and the CPU `quant_dot` converts every code of a step."""
        w = self
        if jax.default_backend() == "cpu" and jnp.dtype(w.codes.dtype) == jnp.int4:  # int8 codes are in K order
            codes = reorder_codes(np.asarray(w.codes), w.scales)  # in numpy: XLA:CPU moves int4 elements slowly
            w = dataclasses.replace(w, codes=codes.astype(np.int8))
        return jax.tree.map(jnp.asarray, w)


KERNEL_ORDER_BLOCK = 32  # columns per block of `permute_k`


def _permute_k(codes):
    """`permute_k` of codes [..., K]; numpy arrays of 1-byte codes move as 2-byte pairs, which `permute_k`
    keeps together: a third of the time of moving single bytes, at load time."""
    if not isinstance(codes, np.ndarray) or codes.dtype.itemsize != 1 or not codes.flags.c_contiguous:
        return permute_k(codes)
    *lead, k = codes.shape
    pairs = codes.view(np.uint16).reshape(*lead, k // 32, 4, 4)  # (block, c, t) of pairs (2t + e, e = 0, 1)
    return np.ascontiguousarray(pairs.swapaxes(-2, -1)).reshape(*lead, k // 2).view(codes.dtype)


def in_kernel_order(codes, scales) -> bool:
    """Whether codes [..., N, K] with scales [..., K/G, N] are stored in the Hopper kernels' K order:
    int4 codes whose group G is a whole number of `permute_k`'s 32-column blocks (a group then keeps
    its columns, so the scales do not move). Int8 codes, and int4 codes in groups of 16, are in K order."""
    group = codes.shape[-1] // scales.shape[-2]
    return jnp.dtype(codes.dtype) == jnp.int4 and group % KERNEL_ORDER_BLOCK == 0


def reorder_codes(codes, scales):
    """codes [..., N, K] moved between the weight's own K order and the stored one (`in_kernel_order`; the
    permutation is its own inverse), or as they are where the stored order is K order."""
    return _permute_k(codes) if in_kernel_order(codes, scales) else codes


def is_quantized(w) -> bool:
    return isinstance(w, QuantizedWeight)


def check_quantized(w: QuantizedWeight, what: str) -> None:
    """ValueError naming `what` unless the arrays fit together: integer codes [.., N, K], float scales
    (and offsets) [.., K/G, N] with G dividing K, or two levels as `kernels.superblocks.check` says."""
    codes, scales, offsets = w.codes, w.scales, w.offsets
    if codes.dtype not in (jnp.int4, jnp.int8, np.dtype(jnp.int4), np.dtype(np.int8)):
        raise ValueError(f"{what}: quantized codes must be int4 or int8, got {codes.dtype}")
    if w.super_scales is None and not jnp.issubdtype(scales.dtype, jnp.floating):
        raise ValueError(f"{what}: quantized scales must be floating point, got {scales.dtype}")
    superblocks.check(*w.group_arrays, what)
    *lead, n, k = codes.shape
    groups = scales.shape[-2] if scales.ndim >= 2 else 0
    if scales.shape != (*lead, groups, n) or groups < 1 or k % groups:
        raise ValueError(f"{what}: scales {scales.shape} do not fit codes {codes.shape} ([.., K/G, N] for [.., N, K])")
    if offsets is not None and offsets.shape != scales.shape:
        raise ValueError(f"{what}: offsets {offsets.shape} differ from scales {scales.shape}")


def dequantize_rows(codes: Array, scales: Array, offsets: Array | None) -> Array:
    """codes [..., N, K], scales (offsets) [..., K/G, N] (one level: `QuantizedWeight.group_scales` expands two)
    → w [..., N, K] float32 (rows of the weight's transpose)."""
    *lead, n, k = codes.shape
    groups = scales.shape[-2]
    codes = reorder_codes(codes, scales)
    c = codes.astype(jnp.float32).reshape(*lead, n, groups, k // groups)  # [..., N, K/G, G]
    w = c * jnp.swapaxes(scales, -1, -2).astype(jnp.float32)[..., None]  # [..., N, K/G, G]
    if offsets is not None:
        w = w + jnp.swapaxes(offsets, -1, -2).astype(jnp.float32)[..., None]
    return w.reshape(*lead, n, k)


CPU_TILE_BYTES = 1 << 22  # float32 bytes of one dequantized row tile on the CPU: a size the last-level cache holds


@jax.jit
def quant_dot(x: Array, codes: Array, scales: Array, *rest: Array) -> Array:
    """x [..., K] @ the dequantized weight ([K, N] from codes [N, K], scales (offsets) [K/G, N], or two levels:
    `rest` is the weight's leaves after its scales) → [..., N] in x's dtype, the dot in float32. One
    module-level jitted function, so the in-place looped decode can hand it to a kernel that reads the
    stacked codes in place (`hooks.kernel_quant_dot`).

    Plain JAX: the dequantized rows times x. On the CPU backend (read at trace time: the engine's
    process runs one backend) the rows are dequantized tile by tile after x exists (`_quant_dot_cpu`);
    the same arithmetic, summed in another order."""
    scales, offsets = superblocks.expand(*superblocks.weight_arrays((codes, scales, *rest))[1:])  # [K/G, N] f32 each
    if jax.default_backend() == "cpu":
        return _quant_dot_cpu(x, codes, scales, offsets)
    w = dequantize_rows(codes, scales, offsets)  # [N, K]
    y = jnp.einsum("...k,nk->...n", x.astype(jnp.float32), w)  # [..., N]
    return y.astype(x.dtype)


def _quant_dot_cpu(x: Array, codes: Array, scales: Array, offsets: Array | None) -> Array:
    """`quant_dot` for XLA:CPU, which runs a dot only on materialized float operands: each weight's
    dequantized rows are written to a buffer and read back by the dot. Two things keep that buffer
    small enough to stay in the cache. The codes are made to depend on x (`_after`): a dequantization
    that depends on parameters only is hoisted out of the decode loop by XLA's loop-invariant code
    motion (or scheduled at the start of a step), and the step then holds the whole model in float32
    (an optimization barrier does not prevent it: XLA:CPU removes barriers). Row tiles of at most
    `CPU_TILE_BYTES` (a `lax.map`) bound the buffer of the large output projection. Int4 codes convert
    slowly here: `device_put` widens them to int8 on the CPU. Speed: BENCHMARKS.md, "Quantized weights"."""
    xf = x.astype(jnp.float32)
    n, k = codes.shape[-2:]
    rows = _tile_rows(n, max(1, CPU_TILE_BYTES // (4 * k)))
    if rows == n:
        y = jnp.einsum("...k,nk->...n", xf, dequantize_rows(_after(x, codes), scales, offsets))  # [..., N]
        return y.astype(x.dtype)
    tiles = n // rows
    split = lambda a: jnp.moveaxis(a.reshape(a.shape[0], tiles, rows), 1, 0)  # [K/G, N] -> [N/R, K/G, R]
    parts = (codes.reshape(tiles, rows, k), split(scales)) + (() if offsets is None else (split(offsets),))

    def tile(part):  # one tile of R rows: codes [R, K], scales (offsets) [K/G, R] -> [..., R]
        w = dequantize_rows(_after(x, part[0]), part[1], part[2] if len(part) > 2 else None)  # [R, K]
        return jnp.einsum("...k,nk->...n", xf, w)

    y = jax.lax.map(tile, parts)  # [N/R, ..., R]
    return jnp.moveaxis(y, 0, -2).reshape(*x.shape[:-1], n).astype(x.dtype)


def _after(x: Array, codes: Array) -> Array:
    """`codes`, unchanged, as a value computed from x too: selected against zeros on a condition that
    is always false (an arithmetic shift of x's first element's bits by 31 is 0 or -1, never > 0) but
    that XLA cannot prove so, and that fuses into the dequantization."""
    bits = jax.lax.bitcast_convert_type(x.reshape(-1)[0].astype(jnp.float32), jnp.int32)
    never = jax.lax.shift_right_arithmetic(bits, jnp.int32(31)) > 0
    return jnp.where(never, jnp.zeros((), codes.dtype), codes)


def _tile_rows(n: int, cap: int) -> int:
    """Rows per tile: the largest divisor of n that is at most cap; n (one tile) when n <= cap or when
    the divisor would be under cap/8 (an N with no fitting divisor: correct, with a larger buffer)."""
    rows = next(d for d in range(min(n, cap), 0, -1) if n % d == 0)
    return n if rows < cap // 8 else rows


def matmul(x: Array, w) -> Array:
    """x [..., K] @ w, where w is a dense [K, N] array or a `QuantizedWeight`: what `Linear` computes."""
    if isinstance(w, QuantizedWeight):
        return quant_dot(x, *jax.tree.leaves(w))
    return x @ w


def embed_rows(w, ids: Array, dtype) -> Array:
    """Rows `ids` [...] of an embedding table: dense [V, D], or a `QuantizedWeight` whose dense [K, N] = [D, V]
    is the tied output projection (codes [V, D]); returns [..., D] in `dtype`."""
    if not isinstance(w, QuantizedWeight):
        return jnp.take(w, ids, axis=0).astype(dtype)
    codes = reorder_codes(jnp.take(w.codes, ids, axis=0), w.scales)  # [..., D] in K order
    take = lambda a: None if a is None else jnp.take(a, ids, axis=1)  # noqa: E731  [D/G, V] -> [D/G, ...]
    scales, offsets = superblocks.expand(*map(take, w.group_arrays))  # [D/G, ...] f32 each
    d, groups = codes.shape[-1], scales.shape[0]
    c = codes.astype(jnp.float32).reshape(*ids.shape, groups, d // groups)  # [..., D/G, G]
    rows = c * jnp.moveaxis(scales, 0, -1).astype(jnp.float32)[..., None]
    if offsets is not None:
        rows = rows + jnp.moveaxis(offsets, 0, -1).astype(jnp.float32)[..., None]
    return rows.reshape(*ids.shape, d).astype(dtype)


def quantize(w, fmt: str, group: int = DEFAULT_GROUP, scale_dtype=SCALE_DTYPE) -> QuantizedWeight:
    """Round-to-nearest quantization of a dense [K, N] weight (numpy or jax), per group of `group` values
    along K, scales (and offsets) stored in `scale_dtype`:
    - "int8", symmetric: scale = max|w| / 127, codes = round(w / scale) in -127..127;
    - "int4", asymmetric (min to max over 16 levels, as Q4_1 and gpt-fast's int4): scale = (max - min) / 15,
      offset = min + 8·scale, codes = round((w - offset) / scale) in -8..7. At 4 bits a symmetric grid
      wastes a level and the half of its range a skewed group does not use: on SmolLM2 it raised the
      next-token KL divergence tenfold (docs/log/).
    Scale and offset are rounded to `scale_dtype` first and the codes chosen against the rounded values, so a
    value is within half a step of the grid the kernels see, up to that grid's own shift by the rounding (at
    its ends, where a value would fall off the grid, it is clipped)."""
    if fmt not in QUANTIZE_FORMATS:
        raise ValueError(f"unknown quantization {fmt!r}; choose one of {', '.join(QUANTIZE_FORMATS)}")
    if jnp.dtype(scale_dtype) not in map(jnp.dtype, SCALE_DTYPES):
        names = ", ".join(jnp.dtype(d).name for d in SCALE_DTYPES)
        raise ValueError(f"scale dtype {jnp.dtype(scale_dtype)} is not one of {names}")
    k, n = w.shape[-2:]
    if group < 1 or k % group:
        raise ValueError(f"group size {group} does not divide K={k} (weight {tuple(w.shape)})")
    rows = jnp.swapaxes(jnp.asarray(w, jnp.float32), -1, -2)  # [..., N, K]
    g = rows.reshape(*rows.shape[:-1], k // group, group)  # [..., N, K/G, G]
    stored = lambda a: a.astype(scale_dtype).astype(jnp.float32)  # noqa: E731  (the value a kernel reads)
    t = lambda a: jnp.swapaxes(a, -1, -2).astype(scale_dtype)  # noqa: E731  [..., N, K/G] -> [..., K/G, N]
    if fmt == "int8":
        amax = jnp.max(jnp.abs(g), axis=-1)  # [..., N, K/G]
        scale = stored(jnp.where(amax > 0, amax / 127, 1.0))
        codes = jnp.clip(jnp.round(g / scale[..., None]), -127, 127).reshape(rows.shape)  # [..., N, K]
        return QuantizedWeight.from_codes(codes.astype(jnp.int8), t(scale), None, fmt)
    lo, hi = jnp.min(g, axis=-1), jnp.max(g, axis=-1)  # [..., N, K/G]
    scale = stored(jnp.where(hi > lo, (hi - lo) / 15, 1.0))
    offset = stored(lo + 8 * scale)
    codes = jnp.clip(jnp.round((g - offset[..., None]) / scale[..., None]), -8, 7)  # [..., N, K/G, G]
    return QuantizedWeight.from_codes(codes.reshape(rows.shape).astype(jnp.int4), t(scale), t(offset), fmt)


def weight_bytes(w) -> int:
    """Bytes a dense array or a `QuantizedWeight` occupies on the device."""
    return w.nbytes if isinstance(w, QuantizedWeight) else int(np.prod(w.shape)) * jnp.dtype(w.dtype).itemsize

"""GGUF blocks → `QuantizedWeight`: the device layout (codes [N, K], per-group scales and offsets [K/G, N]).

Every supported GGML type is an affine map of small integers per group of 16 or 32 values along a row:
x = s·q + o. The repack keeps q as the codes (recentred to be signed, so one kernel converts int4 and
int8 alike) and s, o per group, so nothing is rounded that the file did not round:

| type | codes | G | scale s | offset o |
|---|---|---|---|---|
| Q8_0 | q, int8 | 32 | d (f16) | — |
| Q4_0 | q − 8, int4 | 32 | d (f16) | — |
| Q4_1 | q − 8, int4 | 32 | d (f16) | m + 8d |
| Q5_0 | q − 16, int8 | 32 | d (f16) | — |
| Q5_1 | q − 16, int8 | 32 | d (f16) | m + 16d |
| Q2_K | q − 2, int4 | 16 | d·sc (f32) | 2·d·sc − dmin·m (f32) |
| Q3_K | q − 4(1 − h), int4 | 16 | d (f16) · sc (int8) | — |
| Q4_K | q − 8, int4 | 32 | d (f16) · sc (int8) | 8·s + (−dmin) (f16) · m (int8) |
| Q5_K | q − 8, int8 | 32 | d (f16) · sc (int8) | 8·s + (−dmin) (f16) · m (int8) |
| Q6_K | q − 32, int8 | 16 | d (f16) · sc (int8) | — |

The K-quants but Q2_K keep the file's two levels (`kernels.superblocks`): the integer sub-scales and mins
per group, d and dmin per super-block of 256, multiplied in the kernels. Expanded, their products are exact in
float32 and the offset's sum rounds once, which is also how Q2_K's float32 offsets are made (in float64,
rounded once; Q2_K keeps one level: its 2-bit codes already take 4 bits here). The recentring moves a constant
from the codes into the offset, so a value s·q' + o' equals the file's s·q + o up to that one rounding of o'
(exact whenever o' fits float32's 24 bits, which it does for every f16 d and m within 2^13 of each other).

Bytes against the file (`repacked_bytes`): Q8_0, Q4_0, Q4_1 equal; Q4_K 4.625 bits a value against 4.5; Q6_K 8.56
against 6.56 and Q5_0 8.5 against 5.5 (5- and 6-bit codes in int8: the kernels convert int4 and int8 codes only).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from gguf.constants import GGMLQuantizationType

from jaxdecode.quantized import QuantizedWeight
from jaxdecode.weights.checks import WeightsError
from jaxdecode.weights.quant import block_format, f16, k_scales_mins, q3_k_scales, unpack
from kernels.superblocks import OFFSET_BIAS

QT = GGMLQuantizationType
REPACKED = (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K)
INT4_CODES = (QT.Q4_0, QT.Q4_1, QT.Q2_K, QT.Q3_K, QT.Q4_K)  # recentred codes within -8..7


def _q5_codes(f) -> np.ndarray:
    high = np.unpackbits(f["qh"], axis=1, bitorder="little")  # [n, 32]
    return unpack(f["qs"], 16, 4) | (high << 4)


def _blocks(f, qtype) -> tuple:
    """(codes int [n, values], scales [n, groups], offsets [n, groups] or None, supers) of n blocks: one level
    (float scales, float64 offsets, supers None) or two (int8 sub-scales and sub-offsets, supers = (d, -dmin or
    None) float16 [n, 1])."""
    if qtype == QT.Q8_0:
        return f["qs"].view(np.int8), f["d"].view("<f2"), None, None
    if qtype in (QT.Q4_0, QT.Q4_1):
        d = f["d"].view("<f2")
        codes = unpack(f["qs"], 16, 4).astype(np.int8) - 8
        if qtype == QT.Q4_0:
            return codes, d, None, None
        return codes, d, f["m"].view("<f2").astype(np.float64) + 8.0 * d, None
    if qtype in (QT.Q5_0, QT.Q5_1):
        d = f["d"].view("<f2")
        codes = _q5_codes(f).astype(np.int8) - 16
        if qtype == QT.Q5_0:
            return codes, d, None, None
        return codes, d, f["m"].view("<f2").astype(np.float64) + 16.0 * d, None
    if qtype == QT.Q2_K:
        sc = f["scales"]  # [n, 16]: scale in the low nibble, min in the high one
        s = f16(f["d"]) * (sc & 0x0F).astype(np.float32)  # [n, 16], exact
        m = f16(f["dmin"]).astype(np.float64) * (sc >> 4)
        return unpack(f["qs"], 32, 2).astype(np.int8) - 2, s, 2.0 * s - m, None
    d = f["d"].view("<f2")  # [n, 1]: one super-block per block
    if qtype == QT.Q3_K:
        codes = unpack(f["qs"], 32, 2).astype(np.int8) - 4 * (1 - unpack(f["hmask"], 32, 1).astype(np.int8))
        return codes, q3_k_scales(f["scales"]).astype(np.int8), None, (d, None)
    if qtype in (QT.Q4_K, QT.Q5_K):
        sc, mins = k_scales_mins(f["scales"])  # [n, 8] each, 0..63
        q = unpack(f["qs"], 32, 4)
        if qtype == QT.Q5_K:
            q = q | (unpack(f["qh"], 32, 1) << 4)
        return q.astype(np.int8) - OFFSET_BIAS, sc.astype(np.int8), mins.astype(np.int8), (d, -f["dmin"].view("<f2"))
    if qtype == QT.Q6_K:
        q = unpack(f["ql"], 64, 4) | (unpack(f["qh"], 32, 2) << 4)  # [n, 256]
        return q.astype(np.int8) - 32, f["scales"].view(np.int8), None, (d, None)
    raise AssertionError(qtype)  # callers check REPACKED


def repack(blocks: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int], what: str) -> QuantizedWeight:
    """blocks: uint8 [rows, bytes per row] of a [rows, K] tensor (GGUF's [out, in]) → QuantizedWeight with
    codes [rows, K] (int4 where the codes fit 4 bits), scales and offsets [K/G, rows], numpy arrays."""
    if qtype not in REPACKED:
        names = ", ".join(q.name for q in REPACKED)
        raise WeightsError(f"{what}: {qtype.name} has no quantized device layout; supported: {names}")
    fmt = block_format(qtype, what)
    rows, k = shape
    if k % fmt.block_values or blocks.shape != (rows, fmt.row_bytes(k)):
        raise WeightsError(f"{what}: {blocks.shape} bytes do not hold a [{rows}, {k}] {qtype.name} tensor")
    per_row = k // fmt.block_values
    codes, scales, offsets, supers = _blocks(fmt.split(blocks.reshape(rows * per_row, fmt.block_bytes)), qtype)
    to_columns = lambda a: None if a is None else np.ascontiguousarray(a.reshape(rows, -1).T)  # noqa: E731  [K/., rows]
    if supers is None:
        offsets = None if offsets is None else offsets.astype(np.float32)
    codes = codes.reshape(rows, k).astype(ml_dtypes.int4 if qtype in INT4_CODES else np.int8)
    return QuantizedWeight.from_codes(
        codes, to_columns(scales), to_columns(offsets), qtype.name, *map(to_columns, supers or (None, None))
    )


# per type: (code bits, group size, bytes per group, bytes per super-block of 256) of the layout `repack` makes
_LAYOUT = {
    QT.Q8_0: (8, 32, 2, 0),
    QT.Q4_0: (4, 32, 2, 0),
    QT.Q4_1: (4, 32, 2 + 4, 0),
    QT.Q5_0: (8, 32, 2, 0),
    QT.Q5_1: (8, 32, 2 + 4, 0),
    QT.Q2_K: (4, 16, 4 + 4, 0),
    QT.Q3_K: (4, 16, 1, 2),
    QT.Q4_K: (4, 32, 1 + 1, 2 + 2),
    QT.Q5_K: (8, 32, 1 + 1, 2 + 2),
    QT.Q6_K: (8, 16, 1, 2),
}


def repacked_bytes(qtype: GGMLQuantizationType, rows: int, k: int) -> int:
    """Device bytes of a [rows, K] tensor of `qtype` after `repack` (the memory preflight reads this)."""
    bits, group, per_group, per_super = _LAYOUT[qtype]
    return rows * k * bits // 8 + rows * (k // group) * per_group + rows * (k // 256) * per_super


def permute_rows(w: QuantizedWeight, permute) -> QuantizedWeight:
    """The same weight with its output rows reordered by `permute` (a function of a [rows, ...] array):
    codes' rows and the scales' and offsets' columns move together (the codes' stored K order stays)."""
    cols = lambda a: None if a is None else np.ascontiguousarray(permute(a.T).T)  # noqa: E731
    return QuantizedWeight(permute(w.codes), *map(cols, w.group_arrays[:2]), w.fmt, *map(cols, w.group_arrays[2:]))

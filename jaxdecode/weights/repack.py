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
| Q2_K | q − 2, int4 | 16 | d·sc | 2·d·sc − dmin·m |
| Q3_K | q − 4(1 − h), int4 | 16 | d·sc | — |
| Q4_K | q − 8, int4 | 32 | d·sc | 8·d·sc − dmin·m |
| Q5_K | q − 16, int8 | 32 | d·sc | 16·d·sc − dmin·m |
| Q6_K | q − 32, int8 | 16 | d·sc | — |

Products d·sc of an f16 and a 6- or 8-bit integer are exact in float32, so scales are float32 where
they are products and the file's float16 where they are not; offsets are float32 (computed in float64,
rounded once). The recentring moves a constant from the codes into the offset, so a value s·q' + o' equals
the file's s·q + o up to that one rounding of o' (exact whenever o' fits float32's 24 bits, which it does
for every f16 d and m within 2^13 of each other). Byte cost against the file: Q8_0, Q4_0 and Q6_K's codes
as int8 are the file's size or close; the K-quants' float32 scales and offsets add 2 bits a value
(Q4_K: 6 against 4.5 bits), the price of one layout for every type (docs/kernels.md).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from gguf.constants import GGMLQuantizationType

from jaxdecode.quantized import QuantizedWeight
from jaxdecode.weights.checks import WeightsError
from jaxdecode.weights.quant import block_format, f16, k_scales_mins, q3_k_scales, unpack

QT = GGMLQuantizationType
REPACKED = (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K)
INT4_CODES = (QT.Q4_0, QT.Q4_1, QT.Q2_K, QT.Q3_K, QT.Q4_K)  # recentred codes within -8..7


def _q5_codes(f) -> np.ndarray:
    high = np.unpackbits(f["qh"], axis=1, bitorder="little")  # [n, 32]
    return unpack(f["qs"], 16, 4) | (high << 4)


def _blocks(f, qtype) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(codes int [n, values], scales [n, groups], offsets float64 [n, groups] or None) of n blocks."""
    if qtype == QT.Q8_0:
        return f["qs"].view(np.int8), f["d"].view("<f2"), None
    if qtype in (QT.Q4_0, QT.Q4_1):
        d = f["d"].view("<f2")
        codes = unpack(f["qs"], 16, 4).astype(np.int8) - 8
        if qtype == QT.Q4_0:
            return codes, d, None
        return codes, d, f["m"].view("<f2").astype(np.float64) + 8.0 * d
    if qtype in (QT.Q5_0, QT.Q5_1):
        d = f["d"].view("<f2")
        codes = _q5_codes(f).astype(np.int8) - 16
        if qtype == QT.Q5_0:
            return codes, d, None
        return codes, d, f["m"].view("<f2").astype(np.float64) + 16.0 * d
    if qtype == QT.Q2_K:
        sc = f["scales"]  # [n, 16]: scale in the low nibble, min in the high one
        s = f16(f["d"]) * (sc & 0x0F).astype(np.float32)  # [n, 16], exact
        m = f16(f["dmin"]).astype(np.float64) * (sc >> 4)
        return unpack(f["qs"], 32, 2).astype(np.int8) - 2, s, 2.0 * s - m
    if qtype == QT.Q3_K:
        codes = unpack(f["qs"], 32, 2).astype(np.int8) - 4 * (1 - unpack(f["hmask"], 32, 1).astype(np.int8))
        return codes, f16(f["d"]) * q3_k_scales(f["scales"]), None
    if qtype in (QT.Q4_K, QT.Q5_K):
        sc, mins = k_scales_mins(f["scales"])  # [n, 8] each
        s = f16(f["d"]) * sc.astype(np.float32)  # [n, 8], exact
        m = f16(f["dmin"]).astype(np.float64) * mins
        q = unpack(f["qs"], 32, 4)
        if qtype == QT.Q4_K:
            return q.astype(np.int8) - 8, s, 8.0 * s - m
        return (q | (unpack(f["qh"], 32, 1) << 4)).astype(np.int8) - 16, s, 16.0 * s - m
    if qtype == QT.Q6_K:
        q = unpack(f["ql"], 64, 4) | (unpack(f["qh"], 32, 2) << 4)  # [n, 256]
        return q.astype(np.int8) - 32, f16(f["d"]) * f["scales"].view(np.int8).astype(np.float32), None
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
    codes, scales, offsets = _blocks(fmt.split(blocks.reshape(rows * per_row, fmt.block_bytes)), qtype)
    groups = scales.shape[1] * per_row  # per row
    to_columns = lambda a: np.ascontiguousarray(a.reshape(rows, groups).T)  # [K/G, rows]
    return QuantizedWeight.from_codes(
        codes.reshape(rows, k).astype(ml_dtypes.int4 if qtype in INT4_CODES else np.int8),
        to_columns(scales),
        None if offsets is None else to_columns(offsets).astype(np.float32),
        qtype.name,
    )


# per type: (code bits, group size, scale bytes, offset bytes) of the layout `repack` makes
_LAYOUT = {
    QT.Q8_0: (8, 32, 2, 0),
    QT.Q4_0: (4, 32, 2, 0),
    QT.Q4_1: (4, 32, 2, 4),
    QT.Q5_0: (8, 32, 2, 0),
    QT.Q5_1: (8, 32, 2, 4),
    QT.Q2_K: (4, 16, 4, 4),
    QT.Q3_K: (4, 16, 4, 0),
    QT.Q4_K: (4, 32, 4, 4),
    QT.Q5_K: (8, 32, 4, 4),
    QT.Q6_K: (8, 16, 4, 0),
}


def repacked_bytes(qtype: GGMLQuantizationType, rows: int, k: int) -> int:
    """Device bytes of a [rows, K] tensor of `qtype` after `repack` (the memory preflight reads this)."""
    bits, group, scale, offset = _LAYOUT[qtype]
    return rows * k * bits // 8 + rows * (k // group) * (scale + offset)


def permute_rows(w: QuantizedWeight, permute) -> QuantizedWeight:
    """The same weight with its output rows reordered by `permute` (a function of a [rows, ...] array):
    codes' rows and the scales' and offsets' columns move together (the codes' stored K order stays)."""
    cols = lambda a: None if a is None else np.ascontiguousarray(permute(a.T).T)
    return QuantizedWeight(permute(w.codes), cols(w.scales), cols(w.offsets), w.fmt)

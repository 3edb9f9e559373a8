"""GGML block formats: each type's block layout as data, and a vectorized numpy dequantize per type.

A GGML tensor is stored row by row (a row is the last numpy axis, ggml's ne[0]); each row is a run of
blocks, and each block holds `block_values` values in a fixed sequence of byte fields: float16 scales
and packed integers. The layouts are llama.cpp's `block_*` structs (ggml-common.h). K-quants pack 256
values per super-block, split into 8 or 16 sub-blocks with their own small integer scales. Each decoder
follows ggml-quants.c's `dequantize_row_*` operation for operation (same products, same order), so the
float32 results are bit for bit those of llama.cpp and of `gguf.quants.dequantize`, the tests' reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from gguf.constants import GGMLQuantizationType

from jaxdecode.weights.checks import WeightsError

QT = GGMLQuantizationType
QK_K = 256  # values in a K-quant super-block

Fields = dict[str, np.ndarray]  # field name → its bytes in every block, uint8 [n_blocks, field bytes]


@dataclass(frozen=True)
class BlockFormat:
    """One GGML type: `block_values` values stored in the byte `fields` (name, bytes), in this order."""

    qtype: GGMLQuantizationType
    block_values: int
    fields: tuple[tuple[str, int], ...]
    decode: Callable[[Fields], np.ndarray] = field(repr=False, compare=False)  # → float32 [n_blocks, values]

    @property
    def block_bytes(self) -> int:
        return sum(n for _, n in self.fields)

    def split(self, blocks: np.ndarray) -> Fields:
        """blocks: uint8 [n_blocks, block_bytes] → each field's columns, as views."""
        out, start = {}, 0
        for name, n in self.fields:
            out[name] = blocks[:, start : start + n]
            start += n
        return out

    def row_bytes(self, n_values: int) -> int:
        """Bytes of a row of `n_values` values (a multiple of block_values)."""
        return n_values // self.block_values * self.block_bytes


# --- bit unpacking ----------------------------------------------------------------------------------


def f16(x: np.ndarray) -> np.ndarray:
    """uint8 [n, 2] little-endian float16 → float32 [n, 1]."""
    return x.view("<f2").astype(np.float32)


def unpack(packed: np.ndarray, width: int, bits: int) -> np.ndarray:
    """Fields of `bits` bits packed into groups of `width` bytes, in ggml's order.

    packed: uint8 [n, m * width]. Returns uint8 [n, m * (8 // bits) * width]: group by group; within a
    group, first the lowest `bits` of each of its bytes, then the next `bits` up, and so on. This is how
    every ggml type lays out its quants (e.g. Q4_0: the low nibbles are values 0..15, the high ones 16..31).
    """
    n = packed.shape[0]
    shifts = np.arange(0, 8, bits, dtype=np.uint8)[:, None]  # [8 / bits, 1]
    fields = packed.reshape(n, -1, 1, width) >> shifts  # [n, m, 8 / bits, width]
    return (fields & np.uint8((1 << bits) - 1)).reshape(n, -1)


def k_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 scale bytes → 8 six-bit scales and 8 six-bit mins, uint8 [n, 8] each.

    Bytes 0..3 hold scales 0..3 in their low 6 bits, bytes 4..7 mins 0..3; scales and mins 4..7 take
    their low 4 bits from bytes 8..11 (low and high nibble) and their top 2 bits from the top 2 bits of
    bytes 0..3 (scales) and 4..7 (mins): ggml-quants.c's get_scale_min_k4.
    """
    a, b, c = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]  # [n, 4] each
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=1)
    mins = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc, mins


def q3_k_scales(scales: np.ndarray) -> np.ndarray:
    """Q3_K's 12 scale bytes → 16 signed six-bit scales, float32 [n, 16].

    Scale i takes its low 4 bits from byte i % 8 (low nibble for i < 8, high for i >= 8) and its top 2
    bits from byte 8 + i % 4, at bit 2 * (i // 4); the stored value is offset by 32.
    """
    low = unpack(scales[:, :8], 8, 4)  # [n, 16]
    high = unpack(scales[:, 8:], 4, 2)  # [n, 16]
    return ((low | (high << 4)).astype(np.float32)) - 32.0


# --- decoders: fields of n blocks → float32 [n, block_values] ------------------------------------


def _f32(f: Fields) -> np.ndarray:
    return f["x"].view("<f4").astype(np.float32)


def _f16(f: Fields) -> np.ndarray:
    return f16(f["x"])


def _bf16(f: Fields) -> np.ndarray:
    return (f["x"].view("<u2").astype(np.uint32) << 16).view(np.float32)


def _q8_0(f: Fields) -> np.ndarray:  # x = d * q, q int8
    return f16(f["d"]) * f["qs"].view(np.int8).astype(np.float32)


def _q4_0(f: Fields) -> np.ndarray:  # x = d * (q - 8), q 4 bits
    return f16(f["d"]) * (unpack(f["qs"], 16, 4).astype(np.float32) - 8.0)


def _q4_1(f: Fields) -> np.ndarray:  # x = d * q + m
    return f16(f["d"]) * unpack(f["qs"], 16, 4).astype(np.float32) + f16(f["m"])


def _q5(f: Fields) -> np.ndarray:
    """Q5_0/Q5_1's 5-bit quants: low nibbles as in Q4_0, the fifth bit of value j is bit j of qh (LE u32)."""
    high = np.unpackbits(f["qh"], axis=1, bitorder="little")  # [n, 32]
    return (unpack(f["qs"], 16, 4) | (high << 4)).astype(np.float32)


def _q5_0(f: Fields) -> np.ndarray:  # x = d * (q - 16)
    return f16(f["d"]) * (_q5(f) - 16.0)


def _q5_1(f: Fields) -> np.ndarray:  # x = d * q + m
    return f16(f["d"]) * _q5(f) + f16(f["m"])


def _q2_k(f: Fields) -> np.ndarray:
    """16 sub-blocks of 16: x = (d * scale) * q - (dmin * min), scale and min the nibbles of one byte."""
    n = f["qs"].shape[0]
    d, dmin, sc = f16(f["d"]), f16(f["dmin"]), f["scales"]  # sc: [n, 16]
    dl = (d * (sc & 0x0F).astype(np.float32))[:, :, None]  # [n, 16, 1]
    ml = (dmin * (sc >> 4).astype(np.float32))[:, :, None]  # [n, 16, 1]
    q = unpack(f["qs"], 32, 2).reshape(n, 16, 16).astype(np.float32)  # [n, sub-block, 16]
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(f: Fields) -> np.ndarray:
    """16 sub-blocks of 16: x = (d * scale) * (q - 4 * (1 - h)), q 2 low bits, h the hmask bit."""
    n = f["qs"].shape[0]
    dl = (f16(f["d"]) * q3_k_scales(f["scales"]))[:, :, None]  # [n, 16, 1]
    low = unpack(f["qs"], 32, 2).astype(np.int8)  # [n, 256]
    high = unpack(f["hmask"], 32, 1).astype(np.int8)  # [n, 256]
    q = (low - 4 * (1 - high)).astype(np.float32).reshape(n, 16, 16)  # [n, sub-block, 16]
    return (dl * q).reshape(n, QK_K)


def _k_affine(f: Fields, q: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: 8 sub-blocks of 32, x = (d * scale) * q - (dmin * min). q: uint8 [n, 256]."""
    n = q.shape[0]
    sc, mins = k_scales_mins(f["scales"])  # [n, 8] each
    dl = (f16(f["d"]) * sc.astype(np.float32))[:, :, None]  # [n, 8, 1]
    ml = (f16(f["dmin"]) * mins.astype(np.float32))[:, :, None]  # [n, 8, 1]
    return (dl * q.reshape(n, 8, 32).astype(np.float32) - ml).reshape(n, QK_K)


def _q4_k(f: Fields) -> np.ndarray:
    return _k_affine(f, unpack(f["qs"], 32, 4))


def _q5_k(f: Fields) -> np.ndarray:  # the fifth bit of sub-block s, value l: bit s of qh[l]
    return _k_affine(f, unpack(f["qs"], 32, 4) | (unpack(f["qh"], 32, 1) << 4))


def _q6_k(f: Fields) -> np.ndarray:
    """16 sub-blocks of 16: x = (d * scale) * (q - 32), q = 4 low bits (ql) | 2 high bits (qh) << 4."""
    n = f["ql"].shape[0]
    q = unpack(f["ql"], 64, 4) | (unpack(f["qh"], 32, 2) << 4)  # [n, 256]
    dl = (f16(f["d"]) * f["scales"].view(np.int8).astype(np.float32))[:, :, None]  # [n, 16, 1]
    return (dl * (q.astype(np.float32) - 32.0).reshape(n, 16, 16)).reshape(n, QK_K)


# --- the table ---------------------------------------------------------------------------------------

FORMATS: dict[GGMLQuantizationType, BlockFormat] = {
    fmt.qtype: fmt
    for fmt in [
        BlockFormat(QT.F32, 1, (("x", 4),), _f32),
        BlockFormat(QT.F16, 1, (("x", 2),), _f16),
        BlockFormat(QT.BF16, 1, (("x", 2),), _bf16),
        BlockFormat(QT.Q4_0, 32, (("d", 2), ("qs", 16)), _q4_0),
        BlockFormat(QT.Q4_1, 32, (("d", 2), ("m", 2), ("qs", 16)), _q4_1),
        BlockFormat(QT.Q5_0, 32, (("d", 2), ("qh", 4), ("qs", 16)), _q5_0),
        BlockFormat(QT.Q5_1, 32, (("d", 2), ("m", 2), ("qh", 4), ("qs", 16)), _q5_1),
        BlockFormat(QT.Q8_0, 32, (("d", 2), ("qs", 32)), _q8_0),
        BlockFormat(QT.Q2_K, QK_K, (("scales", 16), ("qs", 64), ("d", 2), ("dmin", 2)), _q2_k),
        BlockFormat(QT.Q3_K, QK_K, (("hmask", 32), ("qs", 64), ("scales", 12), ("d", 2)), _q3_k),
        BlockFormat(QT.Q4_K, QK_K, (("d", 2), ("dmin", 2), ("scales", 12), ("qs", 128)), _q4_k),
        BlockFormat(QT.Q5_K, QK_K, (("d", 2), ("dmin", 2), ("scales", 12), ("qh", 32), ("qs", 128)), _q5_k),
        BlockFormat(QT.Q6_K, QK_K, (("ql", 128), ("qh", 64), ("scales", 16), ("d", 2)), _q6_k),
    ]
}


def block_format(qtype: GGMLQuantizationType, what: str) -> BlockFormat:
    """The format of `qtype`, or a WeightsError naming `what` (e.g. "model.gguf: tensor blk.0.attn_q.weight")."""
    fmt = FORMATS.get(qtype)
    if fmt is None:
        raise WeightsError(
            f"{what} has unsupported quant type {qtype.name}; supported: {', '.join(q.name for q in FORMATS)}"
        )
    return fmt


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType, what: str = "tensor") -> np.ndarray:
    """Stored bytes (uint8, flat) of one tensor → its values, flat float32. Vectorized over blocks.

    Scales that are inf or NaN give inf or NaN values, silently, as in llama.cpp.
    """
    fmt = block_format(qtype, what)
    if raw.size % fmt.block_bytes:
        raise WeightsError(f"{what}: {raw.size} bytes is not a whole number of {qtype.name} blocks")
    blocks = raw.reshape(-1, fmt.block_bytes)  # [n_blocks, block_bytes]
    with np.errstate(invalid="ignore", over="ignore"):
        return fmt.decode(fmt.split(blocks)).reshape(-1)  # [n_blocks * block_values]

"""How quantized codes and activations enter wgmma in the quantized Stream-K GEMM (`kernels.quant_gemm_stream`).

Mosaic GPU loads int4 codes from SMEM in WGMMA_UPCAST_4X. Three ways into a wgmma operand without its relayout
(two warp shuffles and a byte permute per register), each fixing an order of K that x (or the stored codes)
must share: relabelled registers in x's 16-bit dtype (`relabel_as_wgmma`, `quant_gemm.permute_k`), biased
codes (`biased_as_wgmma`, `permute_pairs`), and int8 codes + 8 for an s8 wgmma against x rounded to int8
(`s8_as_wgmma`, `permute_s8`; x rounded by `quantize_activations`' rule, handed over by `x_as_s8_operand`).
Each helper works on one warpgroup's registers inside a kernel (`plgpu.inline_mgpu`); the permutations are
plain JAX, for the wrappers and Mosaic GPU's interpreter.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.quant_gemm import permute_k

# ---------------------------------------------------------------------------------------------
# int4 codes as wgmma's register operand without a relayout
#
# Mosaic GPU loads int4 codes from SMEM in WGMMA_UPCAST_4X: thread (row r, lane column c = 0..3) holds
# columns 8c..8c+7 of each 32-column block in one 32-bit register. wgmma's register operand
# (WGMMA_LAYOUT) wants that thread to hold columns {2c, 2c+1} of each 8-column tile of the block instead:
# the rows agree, the columns do not, and Mosaic GPU's relayout moves them with two warp shuffles and a
# byte permute per register (a quarter of the kernel's instructions at M = 1). Any order of K is fine
# for a dot product as long as x is in the same order. So the upcast registers are relabelled as they
# are (register column block b, element 2t + e becomes column 8t + 2c + e of block b), which makes the
# operand wgmma sees W'[:, 32b + 8t + 2c + e] = W[:, 32b + 8c + 2t + e], and x is permuted the same way
# once per call (`quant_gemm.permute_k`, its own inverse), or the codes are stored in that order
# (`permuted_codes`). A group of G >= 32 columns keeps its columns.


# Biased codes. Mosaic GPU's exact int4 → bf16 conversion spends three instructions on two codes: a byte
# permute that puts codes 2t and 2t+1 of a register in the two halves of a 32-bit word, a lop3 that
# masks them and ORs in the exponent of 128 (flipping the sign bit: 128 + 8 + code, exact), and a bf16x2
# subtract of 136. Pairing codes t and t+4 instead needs no permute (they sit 16 bits apart: one shift of
# the register by 4t serves both), and the subtract can wait: the wgmma sums (bias + code) · x over a
# group, and bias · Σx (which the all-ones wgmma of scale_in="acc" gives) comes off in f32 once per
# group. One lop3 per pair and a shift per four pairs; the bias is exact in f32 (bf16: 136, f16: 1032).
# The register's pair t becomes wgmma's columns (2c, 2c + 1) of 8-column tile t, so the operand wgmma
# sees is W'[:, 32b + 8t + 2c + e] = W[:, 32b + 8c + t + 4e], and x is permuted the same way
# (`permute_pairs`).

BIAS_BITS = {jnp.dtype(jnp.bfloat16): (136, 0x4308), jnp.dtype(jnp.float16): (1032, 0x6408)}  # bias, its half-word


def permute_pairs(a):
    """a [..., K] with column 32b + 8c + t + 4e moved to 32b + 8t + 2c + e (K a multiple of 32)."""
    *lead, k = a.shape
    return jnp.moveaxis(a.reshape(*lead, k // 32, 4, 2, 4), -1, -3).reshape(*lead, k)


def _as_wgmma(a, dtype, pair):
    """a [rows, cw] (WGMMA_UPCAST_4X layout) as a [rows, cw] `dtype` WGMMA_LAYOUT array whose register for
    8-column tile t of 32-column block b is `pair(a's register of block b, t)`: a vector of two `dtype`s.
    The upcast and wgmma layouts agree on rows, so each register maps to one source register."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA_UPCAST_4X,),
        return_type=plgpu.ShapeDtypeStruct(a.shape, dtype, plgpu.Layout.WGMMA),
    )
    def convert(_, arr):
        old = arr.registers  # [1, cw/32, 1, 1, 2, 1, ...] of vector<8>: (32-column block, row half)
        new = np.empty(fa.WGMMA_LAYOUT.registers_shape(arr.shape), dtype=object)  # (8-column tile, half)
        assert old.shape[1] * 4 == new.shape[1] and old.shape[4] == new.shape[4] == 2, (old.shape, new.shape)
        for idx in np.ndindex(new.shape):
            src = list(idx)
            src[1], t = divmod(idx[1], 4)
            new[idx] = pair(old[tuple(src)], t)
        return fa.FragmentedArray(_registers=new, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

    return convert(a)


def biased_as_wgmma(codes, dtype):
    """codes [rows, cw] int4 (WGMMA_UPCAST_4X layout) as bias + codes in `dtype` (WGMMA_LAYOUT), their
    columns in `permute_pairs` order."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    half = BIAS_BITS[jnp.dtype(dtype)][1]

    def pair(reg, t):  # (word >> 4t & 0x000F000F) ^ the bias's half-words: codes t and t + 4 as bias + code
        i32 = ir.IntegerType.get_signless(32)
        word = mgpu_utils.bitcast(reg, i32)
        word = word if t == 0 else arith.shrui(word, mgpu_utils.c(4 * t, i32))
        out = llvm.inline_asm(i32, [word], f"lop3.b32 $0, $1, 0x000F000F, {half * 0x10001:#x}, 0x6a;", "=r,r")
        return mgpu_utils.bitcast(out, ir.VectorType.get((2,), mgpu_utils.dtype_to_ir_type(dtype)))

    return _as_wgmma(codes, dtype, pair)


# Int8 activations ("s8"). Converting int4 codes to x's 16-bit dtype costs ~2.3 instructions a code, about
# as many as the memory's pace leaves an SM. With x rounded to int8 per group (as llama.cpp's GPU kernels
# quantize activations to 8 bits), the codes go to an s8 wgmma instead: a register of eight codes becomes
# two registers of four bytes, each (nibble ^ 8) & 0xF = code + 8 (unsigned, so no sign extension), by one
# lop3 each and a shift: 3 instructions per 8 codes. The +8 comes off per group with Σ xq, exactly, in
# int32. Byte i of the low register is code 2i of the upcast register (8c + 2i of the 32-column block),
# of the high one code 2i + 1; WGMMA_LAYOUT_8BIT hands thread column c bytes 4c..4c+3 of 16-column tile
# 2b + e, so wgmma sees column 16e + 4c + i of block b where the codes hold column 8c + 2i + e: x is
# permuted the same way (`permute_s8`).

S8_BIAS = 8  # code + 8: the s8 codes are 0..15


def permute_s8(a):
    """a [..., K] with column 32b + 8c + 2i + e moved to 32b + 16e + 4c + i (K a multiple of 32)."""
    *lead, k = a.shape
    return jnp.moveaxis(a.reshape(*lead, k // 32, 4, 4, 2), -1, -3).reshape(*lead, k)


def s8_as_wgmma(codes):
    """codes [rows, 128] int4 (WGMMA_UPCAST_4X layout) as codes + 8 in a [rows, 128] int8 WGMMA_LAYOUT_8BIT
    array, columns in `permute_s8` order."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA_UPCAST_4X,),
        return_type=plgpu.ShapeDtypeStruct(codes.shape, jnp.int8, plgpu.Layout.WGMMA_8BIT),
    )
    def convert(_, arr):
        i32 = ir.IntegerType.get_signless(32)
        i8x4 = ir.VectorType.get((4,), ir.IntegerType.get_signless(8))
        old = arr.registers  # [1, 128/32, 1, 1, 2, ...] of vector<8 x i4>: (32-column block, row half)
        new = np.empty(fa.WGMMA_LAYOUT_8BIT.registers_shape(arr.shape), dtype=object)  # (16-column tile, half)
        assert old.shape[1] * 2 == new.shape[1] and old.shape[4] == new.shape[4] == 2, (old.shape, new.shape)
        for idx in np.ndindex(new.shape):
            src = list(idx)
            src[1], e = divmod(idx[1], 2)
            word = mgpu_utils.bitcast(old[tuple(src)], i32)
            word = arith.shrui(word, mgpu_utils.c(4, i32)) if e else word
            # (word ^ 0x88888888) & 0x0F0F0F0F: the four codes 2i + e as code + 8 in bytes i
            out = llvm.inline_asm(i32, [word], "lop3.b32 $0, $1, 0x88888888, 0x0F0F0F0F, 0x28;", "=r,r")
            new[idx] = mgpu_utils.bitcast(out, i8x4)
        return fa.FragmentedArray(_registers=new, _layout=fa.WGMMA_LAYOUT_8BIT, _is_signed=True)

    return convert(codes)


def x_as_s8_operand(xq):
    """xq [64, cols] int8 (WGMMA layout) as the WGMMA_LAYOUT_8BIT array whose column 32b + 16e + 4c + i holds
    xq's column 32b + 8i + 2c + e, which is `permute_s8(permute_k(xq))`: the x order that `s8_as_wgmma` needs
    for codes stored in `permute_k` order. A WGMMA thread (lane column c) holds columns 8i + 2c + e of every
    32-column block, exactly those its WGMMA_LAYOUT_8BIT registers take, so only bytes move, within a thread."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import vector
    from jax.experimental.mosaic.gpu import fragmented_array as fa

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA,),
        return_type=plgpu.ShapeDtypeStruct(xq.shape, jnp.int8, plgpu.Layout.WGMMA_8BIT),
    )
    def convert(_, arr):
        i8x4 = ir.VectorType.get((4,), ir.IntegerType.get_signless(8))
        old = arr.registers  # [1, cols/8, 1, 1, 2, ...] of vector<2 x i8>: (8-column tile, row half)
        new = np.empty(fa.WGMMA_LAYOUT_8BIT.registers_shape(arr.shape), dtype=object)  # (16-column tile, half)
        assert old.shape[1] == 2 * new.shape[1] and old.shape[4] == new.shape[4] == 2, (old.shape, new.shape)
        for idx in np.ndindex(new.shape):
            b, e = divmod(idx[1], 2)  # 16-column tile 2b + e of 32-column block b
            parts = []
            for i in range(4):  # byte i: element e of 8-column tile 4b + i
                src = list(idx)
                src[1] = 4 * b + i
                pos = ir.DenseI64ArrayAttr.get([e])
                parts.append(vector.extract(old[tuple(src)], dynamic_position=[], static_position=pos))
            new[idx] = vector.from_elements(i8x4, parts)
        return fa.FragmentedArray(_registers=new, _layout=fa.WGMMA_LAYOUT_8BIT, _is_signed=True)

    return convert(xq)


def quantize_activations(x, group: int, offsets: bool):
    """x [M8, K] (16-bit, K in the kernel's order) -> (xq [M8, K] int8, consts [K/G, 2 or 3, M8] f32): per row
    and group of G columns, xq = round(x / s) with s = max |x| / 127 (1 for an all-zero group), and the
    group's constants s, -8 · s · Σ xq (the codes' bias taken off) and, with offsets, Σ x (exact x)."""
    m8, k = x.shape
    xf = x.astype(jnp.float32).reshape(m8, k // group, group)
    amax = jnp.abs(xf).max(axis=-1)  # [M8, K/G]
    s = jnp.where(amax > 0, amax / 127, 1.0)
    xq = jnp.clip(jnp.round(xf / s[..., None]), -127, 127).astype(jnp.int8)  # [M8, K/G, G]
    qsum = xq.astype(jnp.int32).sum(axis=-1).astype(jnp.float32)  # [M8, K/G], |.| <= 127 G: exact in f32
    consts = [s, -S8_BIAS * s * qsum] + ([xf.sum(axis=-1)] if offsets else [])
    return xq.reshape(m8, k), jnp.stack(consts).transpose(2, 0, 1)  # [K/G, 2 or 3, M8]


def round_rows_to_s8(src, dst_q, dst_c, rows, *, bits: int, interpret: bool) -> None:
    """Inside a kernel, one warpgroup: `quantize_activations` of `src` [64, G] (16-bit, SMEM; rows (group, m))
    into rows `rows` of `dst_q` (int8, the s8 wgmma's operand order: int4 codes are stored in `permute_k` order
    and converted in `permute_s8` order, int8 codes are in K order, the WGMMA_LAYOUT_8BIT registers as loaded)
    and of `dst_c` [2 or 3, ..] f32: the scale, the codes' bias term -8·scale·Σxq (int4 codes go in as
    code + 8; exact in f32, |Σxq| <= 127·G) and, where dst_c has a third row, Σx for the offsets."""
    layout = plgpu.Layout.WGMMA if bits == 4 else plgpu.Layout.WGMMA_8BIT
    xf = plgpu.load(src, layout=layout).astype(jnp.float32)  # [64, G]
    amax = jnp.max(jnp.abs(xf), axis=1)  # [64]
    s = jnp.where(amax > 0, amax / 127, jnp.float32(1))
    q = jnp.round(xf / lax.broadcast_in_dim(s, xf.shape, [0]))
    q = jnp.minimum(jnp.maximum(q, jnp.float32(-127)), jnp.float32(127))
    dst_c.at[0, rows][...] = s
    dst_c.at[1, rows][...] = -(S8_BIAS if bits == 4 else 0) * s * q.sum(axis=1)
    if dst_c.shape[0] == 3:
        dst_c.at[2, rows][...] = xf.sum(axis=1)
    q = q.astype(jnp.int8)
    if bits == 8:
        dst_q.at[rows][...] = q
    else:
        dst_q.at[rows][...] = permute_s8(permute_k(q)) if interpret else x_as_s8_operand(q)


def relabel_as_wgmma(w):
    """w [rows, cw] (16-bit, WGMMA_UPCAST_4X layout) as a WGMMA_LAYOUT array of the same registers."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    return _as_wgmma(w, w.dtype, lambda reg, t: mgpu_utils.vector_slice(reg, slice(2 * t, 2 * t + 2)))

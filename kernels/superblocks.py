"""Two-level scales, the GGUF K-quants' own: a small integer per group of G values, a float16 per super-block.

A weight's arrays (`weight_arrays` names them), beside its codes [.., N, K]:

  scales         [.., K/G, N]  int8     sub-scales (Q4_K, Q5_K: 6-bit; Q3_K: 6-bit signed; Q6_K: 8-bit signed)
  offsets        [.., K/G, N]  int8     sub-mins (Q4_K, Q5_K: 6-bit), or None
  super_scales   [.., K/S, N]  float16  d of each super-block of S = 256 values
  super_offsets  [.., K/S, N]  float16  -dmin, or None (with the offsets)

  scale[g]  = super_scales[g // (S/G)] · scales[g]
  offset[g] = BIAS · scale[g] + super_offsets[g // (S/G)] · offsets[g]

BIAS = 8 (`OFFSET_BIAS`) is what the repack took off the file's unsigned codes: code = q - 8, in int4 for
Q4_K's 4-bit q and in int8 for Q5_K's 5-bit q. The file's value d·sc·q - dmin·m is then scale · code + offset.
One constant for every code width, so codes widened from int4 to int8 (the CPU placement) mean the same.

Why two levels: the expanded float32 scale and offset per group of 32 cost 2 bits a value on top of Q4_K's
4.5; these cost 0.625. Every product is exact in float32 (a float16 times an integer under 2^7) and the
offset's one sum rounds once, so the expanded values equal the one-level float32 ones bit for bit.
A weight with one level has float scales (and offsets) and no super arrays.
"""

from __future__ import annotations

import jax.numpy as jnp

SUPER_GROUP = 256  # values per super-block: every K-quant's
OFFSET_BIAS = 8  # code = q - OFFSET_BIAS for the unsigned q of a K-quant with mins
SUPER_DTYPE = jnp.float16  # the file's d and dmin
SUB_DTYPE = jnp.int8
ROLES = ("scales", "offsets", "super_scales", "super_offsets")  # a weight's arrays after its codes, in leaf order


def values_per_row(role: str, group: int, super_group: int) -> int:
    """Values of K that one row of the role's array covers: the group's G, or a super-block's."""
    return super_group if role.startswith("super") else group


def weight_arrays(leaves) -> tuple:
    """(codes, scales, offsets, super_scales, super_offsets), absent ones None, from one weight's leaves in
    their pytree order (codes, scales[, offsets][, super_scales[, super_offsets]]): two or three leaves with
    float scales, three or five with integer ones."""
    codes, scales, *rest = leaves
    if not jnp.issubdtype(scales.dtype, jnp.integer):
        if len(rest) > 1:
            raise ValueError(f"a weight with float scales has codes, scales and offsets at most, got {len(leaves)}")
        return codes, scales, (rest[0] if rest else None), None, None
    if len(rest) == 1:
        return codes, scales, None, rest[0], None
    if len(rest) == 3:
        return codes, scales, rest[0], rest[1], rest[2]
    raise ValueError(f"a weight with integer sub-scales has 3 or 5 arrays, got {len(leaves)}")


def scale_offset(row, offsets: bool, two_level: bool):
    """(scale, offset or None) in float32 from `row(role)`, the float32 values of one array ("scales", "offsets",
    "super_scales", "super_offsets") at the same places: the formula above, written once for the kernels (a
    group's [rows] vectors in registers) and for `expand` (whole arrays)."""
    s = row("scales")
    o = row("offsets") if offsets else None
    if two_level:  # the products are exact in f32, the offset's sum rounds once
        s = s * row("super_scales")
        if offsets:
            o = OFFSET_BIAS * s + row("super_offsets") * o
    return s, o


def expand(scales, offsets, super_scales, super_offsets):
    """(scales, offsets or None) per group [.., K/G, N] float32 from two levels; one-level arrays as float32."""
    arrays = dict(zip(ROLES, (scales, offsets, super_scales, super_offsets)))
    per = 1 if super_scales is None else scales.shape[-2] // super_scales.shape[-2]  # groups per super-block

    def row(role):  # the role's array, one row per group: super-block rows repeated [.., K/S, N] -> [.., K/G, N]
        return jnp.repeat(arrays[role].astype(jnp.float32), values_per_row(role, 1, per), axis=-2)

    return scale_offset(row, offsets is not None, super_scales is not None)


def check(scales, offsets, super_scales, super_offsets, what: str) -> None:
    """ValueError naming `what` unless the two levels fit together (no-op for one-level weights)."""
    if super_scales is None:
        if super_offsets is not None:
            raise ValueError(f"{what}: super-block offsets without super-block scales")
        return
    if jnp.dtype(scales.dtype) != SUB_DTYPE or (offsets is not None and jnp.dtype(offsets.dtype) != SUB_DTYPE):
        raise ValueError(f"{what}: two-level sub-scales and sub-offsets must be int8, got {scales.dtype}")
    if (offsets is None) != (super_offsets is None):
        raise ValueError(f"{what}: two-level offsets need both sub-offsets and super-block offsets")
    groups, supers = scales.shape[-2], super_scales.shape[-2]
    *lead, _, n = scales.shape
    if super_scales.shape != (*lead, supers, n) or supers < 1 or groups % supers:
        raise ValueError(f"{what}: super-block scales {super_scales.shape} do not fit sub-scales {scales.shape}")
    if super_offsets is not None and super_offsets.shape != super_scales.shape:
        raise ValueError(f"{what}: super-block offsets {super_offsets.shape} differ from {super_scales.shape}")

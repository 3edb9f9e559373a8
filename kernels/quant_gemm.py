"""Flat GEMM / GEMV against 4- or 8-bit weight-only quantized weights, read in place from a stacked [L, ...] array.

The format (fixed; GGUF's native [out, in] layout for the codes):
  codes   [L, N, K] (or [N, K]) int4 or int8, signed: output rows, K contiguous
  scales  [L, K/G, N] (or [K/G, N]) f16, bf16 or f32; G = group size along K (32, 128, ..., or K)
  offsets optional, like scales, f32 or f16
  w[l, k, n] = f32(scales[l, k // G, n]) · f32(codes[l, n, k]) (+ offsets[l, k // G, n])

Design. As in `kernels/flat_gemm.py` the operands are swapped for wgmma, so that weight rows fill its
64-row M side and the small batch (M8 = M rounded up to 8) is the narrow N side: yᵀ[N, M8] = W[l]ᵀ ·
xᵀ. The codes' [N, K] layout makes a [tile_n, tile_k] tile the wgmma LHS with K minor, which is the
operand wgmma takes from registers: per pipeline stage TMA brings the codes tile of layer `layer`
(`codes.at[layer]`, a view: the stack is never copied), the x tile [M8, tile_k] and the scales tile
[tile_k/G, tile_n]; per group of G columns the codes are loaded from SMEM in the layout Mosaic GPU
upcasts from without shuffles (WGMMA_UPCAST_2X for int8, _4X for int4), converted to x's dtype in
registers (exact: |code| <= 128) and multiplied with wgmma. The scales are per (group, output row),
so they scale rows of the LHS, or of a per-group accumulator: two variants (`QuantBlocks.scale_in`):
- "acc": each group's wgmma goes to a fresh f32 accumulator, which is scaled row-wise by the group's
  scales (a [tile_n] vector in the accumulator's row layout) and added to a running f32 sum carried
  through the pipeline. The scales stay f32-exact; the price is a wgmma wait per group.
- "w": the scales multiply the converted codes in registers (in x's dtype), and the offsets are
  added there too, and every group accumulates into one wgmma accumulator (each group's wgmma waited on:
  its register operand must outlive it, `mma_from_registers`).
  Each weight is rounded to x's dtype (bf16: 2^-9 relative), which averages out over K. This is how
  tokamax's quantized ragged dot does it on Hopper. The default for weights with offsets (int4 and
  Q4_1-like formats), where "acc" would need them in the wrapper.
Every SMEM tile is tiled and swizzled by the bytes of one group's row (capped at 128), so slicing a
group out of a tile is a whole number of swizzle tiles: Mosaic GPU slices tiled refs at tile
granularity only. Groups of G > tile_k span several steps; each step then takes its one group's
scale row (per-channel scales: G = K). K is split over CTAs where N / tile_n alone gives fewer than
`target_ctas`; the split partial sums [splits, N, M8] f32 are added in the wrapper, as in flat_gemm.

Under "acc", offsets contribute Σ_g offsets[g, n] · Σ_{k∈g} x[m, k] in the jitted wrapper with XLA,
xsum [M, K/G] · offsets[l] [K/G, N] (XLA slices offsets[l] out of the stack: K/G · N values, 1/G of
the codes' count): folding that into an "acc" kernel would need a per-group column sum of x in the
accumulator's column layout, while "w" adds the offsets to the weights for free.

Implementations (`impl`): "mosaic" (the above; Hopper only; tested on the CPU through Mosaic GPU's
interpreter) and "xla" (`quant_gemm_reference`: dequantize W[l] to f32, then one dot).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels import flat_gemm, superblocks

CODE_DTYPES = (jnp.int4, jnp.int8)
SCALE_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
X_DTYPES = (jnp.bfloat16, jnp.float16)  # the kernel's wgmma dtypes; f32 x goes through impl="xla"


@dataclasses.dataclass(frozen=True)
class QuantBlocks:
    """Tunables. k_splits=None picks the fewest splits that give `target_ctas` CTAs."""

    tile_n: int = 128  # weight rows per CTA: the wgmma M side (multiple of 64)
    tile_k: int = 256  # reduction depth per pipeline stage: a multiple of G, or a divisor of it
    max_concurrent_steps: int = 4  # TMA stages in flight; cut to what fits in smem_bytes
    k_splits: int | None = None
    target_ctas: int = 132  # SMs on an H200
    smem_bytes: int = 220 * 1024  # H200: 227 KiB per block
    # "acc": f32 scale of a per-group accumulator; "w": scale (and offset) the codes in registers;
    # "auto": "w" for weights with offsets, "acc" otherwise
    scale_in: str = "auto"

    def resolved(self, has_offsets: bool) -> QuantBlocks:
        """These blocks with "auto" replaced by the placement used for weights with or without offsets."""
        if self.scale_in != "auto":
            return self
        return dataclasses.replace(self, scale_in="w" if has_offsets else "acc")


def code_bits(dtype) -> int:
    return jnp.iinfo(dtype).bits


def smem_transforms(minor_elems: int, bits: int):
    """Tile and swizzle a 2D SMEM tile by `minor_elems` (one group's row) so a group is whole tiles."""
    swizzle = min(128, minor_elems * bits // 8)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def load_width(gw: int, bits: int) -> int:
    """Codes columns per SMEM load: one group, or more where a group's row is under Mosaic GPU's
    smallest swizzle (32 bytes: int4 G = 32 loads two groups and slices them apart in registers)."""
    return max(gw, 256 // bits)


def tile_k_fits(tile_k: int, group: int, bits: int) -> bool:
    """tile_k holds whole groups or lies inside one; a group's columns in a step fill the upcast
    layouts' column tiles (128 bits); the codes load in whole chunks."""
    gw = min(group, tile_k)
    return (
        (tile_k % group == 0 or group % tile_k == 0) and gw % (128 // bits) == 0 and tile_k % load_width(gw, bits) == 0
    )


# ---------------------------------------------------------------------------------------------
# Kernel body


def mma_from_registers(acc, w, x_t, interpret: bool, stage=None):
    """acc [rows, M8] += w [rows, cols] (registers) · x_t [cols, M8] (SMEM), complete on return. Mosaic GPU's
    interpreter takes wgmma operands from SMEM only, so there (alone) w goes through SMEM first: `stage`
    (a [rows, >= cols] tile of the caller's, for kernels whose scoped SMEM all warpgroups must share) or
    a scoped buffer.

    Why it waits: wgmma reads a register operand asynchronously, and the compiler frees w's registers once
    the wgmma is issued, so the next group's conversion may overwrite them before they are read. Compiled
    on the H200 that corrupted runs of 8 rows of the result (warps 1-3's A fragments), in
    `kernels.quant_mlp` and at the 8B shapes in `kernels.quant_gemm_stream`'s int4 path, in some calls
    and not others (docs/kernels.md). Every register-operand wgmma of the quantized kernels goes through
    here."""
    if not interpret:
        plgpu.wgmma(acc, w, x_t)
        plgpu.wgmma_wait(0)
        return

    def via_smem(w_smem):
        w_smem = w_smem.at[:, pl.ds(0, w.shape[1])]
        w_smem[...] = w
        plgpu.commit_smem()
        plgpu.wgmma(acc, w_smem, x_t)
        plgpu.wgmma_wait(0)

    if stage is None:
        pl.run_scoped(via_smem, plgpu.SMEM(w.shape, w.dtype))
    else:
        via_smem(stage)


def mma_from_smem(acc, w_smem, x_t):
    """acc [rows, M8] += w_smem [rows, cols] · x_t [cols, M8], both in SMEM, complete on return (so the stage
    they sit in can be released after the unit's last group)."""
    plgpu.wgmma(acc, w_smem, x_t)
    plgpu.wgmma_wait(0)


def _kernel(
    layer_gmem,  # [1] int32
    x_gmem,  # [M8, K]
    codes_gmem,  # [L, N, K] int4 / int8
    *rest,  # the `roles`' arrays ([L, K/G, N], super-blocks [L, K/256, N]), o_gmem [splits, N, M8] f32
    roles: tuple[str, ...],  # "scales"(, "offsets": under scale_in="w")(, "super_scales"(, "super_offsets"))
    tile_n: int,
    tile_k: int,
    group: int,
    super_group: int,  # K per super-block of two-level scales (`kernels.superblocks`); 0: one level
    steps: int,
    stages: int,
    scale_in: str,
    interpret: bool,
):
    *group_gmems, o_gmem = rest
    offsets = "offsets" in roles
    m8 = x_gmem.shape[0]
    cdt = x_gmem.dtype
    layer = layer_gmem[0]
    ni, si = lax.axis_index("n"), lax.axis_index("k")
    gw = min(group, tile_k)  # columns of one group inside a step
    bits = code_bits(codes_gmem.dtype)
    cw = load_width(gw, bits)  # codes columns loaded from SMEM at once: whole swizzle tiles
    upcast = plgpu.Layout.WGMMA_UPCAST_4X if bits == 4 else plgpu.Layout.WGMMA_UPCAST_2X
    row = plgpu.Layout.WGMMA.reduce(1)  # a [tile_n] vector along the accumulator's rows

    def groups(c_smem):  # yields (g, codes of group g [tile_n, gw] in x's dtype, WGMMA layout: a wgmma LHS)
        for c in range(tile_k // cw):
            chunk = plgpu.load(c_smem.at[:, pl.ds(c * cw, cw)], layout=upcast)  # [tile_n, cw]
            chunk = plgpu.layout_cast(chunk, plgpu.Layout.WGMMA).astype(cdt)
            for j in range(cw // gw):
                yield c * (cw // gw) + j, chunk[:, j * gw : (j + 1) * gw]

    def scale_offset(g_smems, g):  # (scales, offsets or None) of group g: [tile_n] f32 in the row layout
        smem = dict(zip(roles, g_smems))

        def load(role):
            at = (g * gw) // super_group if role.startswith("super") else g
            return plgpu.load(smem[role].at[at], layout=row).astype(jnp.float32)

        return superblocks.scale_offset(load, offsets, bool(super_group))

    def x_cols(x_smem, g):  # xᵀ of group g: [gw, M8], the wgmma RHS
        return x_smem.at[:, pl.ds(g * gw, gw)].T

    t0 = si * steps  # this CTA's first global k-step

    # rows of the scales (offsets) tile: its gps groups, or the one group (G > tile_k) that step t lies in
    def rows_of(per: int):  # the rows of a per-group (or per-super-block) array that step k covers
        count = max(1, tile_k // per)
        return plgpu.BlockSpec((count, tile_n), lambda k: ((t0 + k) * tile_k // (count * per), ni))

    specs = [
        plgpu.BlockSpec((m8, tile_k), lambda k: (0, t0 + k), transforms=smem_transforms(gw, 16)),
        plgpu.BlockSpec((tile_n, tile_k), lambda k: (ni, t0 + k), transforms=smem_transforms(cw, bits)),
    ] + [rows_of(superblocks.values_per_row(role, group, super_group)) for role in roles]
    # views: layer l read in place
    gmems = (x_gmem, codes_gmem.at[layer], *(a.at[layer] for a in group_gmems))

    if scale_in == "acc":
        assert not offsets, "offsets are added in the wrapper under scale_in='acc'"

        def step(_, x_smem, c_smem, *refs):  # refs: the roles' SMEM tiles, then total [tile_n, M8] f32
            *g_smems, total = refs
            for g, w in groups(c_smem):

                def part_scope(acc):
                    mma_from_registers(acc, w, x_cols(x_smem, g), interpret)  # accᵀ = codesᵀ · xᵀ of one group
                    return acc[...]

                part = pl.run_scoped(part_scope, plgpu.ACC((tile_n, m8), jnp.float32))  # [tile_n, M8]
                s, _ = scale_offset(g_smems, g)  # [tile_n]
                total = total + part * lax.broadcast_in_dim(s, part.shape, [0])
            return total

        zeros = plgpu.layout_cast(jnp.zeros((tile_n, m8), jnp.float32), plgpu.Layout.WGMMA)
        out = plgpu.emit_pipeline(step, grid=(steps,), in_specs=specs, max_concurrent_steps=stages, init_carry=zeros)(
            *gmems
        )
    elif scale_in == "w":

        def acc_scope(acc):  # acc [tile_n, M8] f32
            def step(_, x_smem, c_smem, *g_smems):
                for g, w in groups(c_smem):  # w [tile_n, gw]
                    s, o = scale_offset(g_smems, g)  # [tile_n]
                    w = w * lax.broadcast_in_dim(s.astype(cdt), w.shape, [0])
                    if offsets:
                        w = w + lax.broadcast_in_dim(o.astype(cdt), w.shape, [0])
                    mma_from_registers(acc, w, x_cols(x_smem, g), interpret)  # complete on return

            plgpu.emit_pipeline(step, grid=(steps,), in_specs=specs, max_concurrent_steps=stages)(*gmems)
            return acc[...]

        out = pl.run_scoped(acc_scope, plgpu.ACC((tile_n, m8), jnp.float32))
    else:
        raise ValueError(f"scale_in must be 'acc' or 'w', got {scale_in!r}")

    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((tile_n, m8), jnp.float32))
    def _store(o_smem):
        o_smem[...] = out
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[si, pl.ds(ni * tile_n, tile_n)])
        plgpu.wait_smem_to_gmem(0)


# ---------------------------------------------------------------------------------------------
# Kernel wrapper: partial sums [splits, N, M8] f32 of the scaled codes (offsets not included)


class UntiledShape(ValueError):
    """A shape, dtype or block size the Mosaic kernel does not tile (the XLA reference still computes it)."""


def check_shapes(x, codes, scales, offsets, group: int, cfg: QuantBlocks | None):
    """ValueError with the numbers for what the op (cfg=None: the reference; else the kernel) cannot take."""
    m, k = x.shape
    if codes.ndim != 3 or scales.ndim != 3:
        raise ValueError(f"codes [L, N, K] / scales [L, K/G, N] expected, got {codes.shape} / {scales.shape}")
    n = codes.shape[1]
    if codes.dtype not in CODE_DTYPES:
        raise ValueError(f"codes must be int4 or int8, got {codes.dtype}")
    if scales.dtype not in SCALE_DTYPES:
        raise ValueError(f"scales must be f16, bf16 or f32, got {scales.dtype}")
    if group < 1 or k % group:
        raise ValueError(f"group G={group} must divide K={k}")
    if codes.shape[2] != k or scales.shape[1:] != (k // group, n) or scales.shape[0] != codes.shape[0]:
        raise ValueError(
            f"x [M, K]={x.shape}, codes [L, N, K]={codes.shape}, scales [L, K/G, N]={scales.shape} "
            f"disagree at G={group}"
        )
    if offsets is not None and offsets.shape != scales.shape:
        raise ValueError(f"offsets {offsets.shape} must have the scales' shape {scales.shape}")
    if cfg is None:
        return
    if cfg.scale_in not in ("acc", "w", "auto"):
        raise UntiledShape(f"scale_in must be 'acc', 'w' or 'auto', got {cfg.scale_in!r}")
    if x.dtype not in X_DTYPES:
        raise UntiledShape(f"the mosaic kernel takes bf16 or f16 x, got {x.dtype}: use impl='xla' (f32 throughout)")
    m8 = -(-m // 8) * 8
    if m8 > 256:
        raise UntiledShape(f"the mosaic quant GEMM takes M <= 256 (the wgmma N side), got M={m}")
    if cfg.tile_n % 64 or n % cfg.tile_n:
        raise UntiledShape(f"N={n} must be a multiple of tile_n={cfg.tile_n}, itself a multiple of 64")
    bits = code_bits(codes.dtype)
    if k % cfg.tile_k:
        raise UntiledShape(f"K={k} must be a multiple of tile_k={cfg.tile_k}")
    if not tile_k_fits(cfg.tile_k, group, bits):
        raise UntiledShape(
            f"tile_k={cfg.tile_k} must be a multiple or divisor of G={group}; {codes.dtype} codes need min(G, "
            f"tile_k) a multiple of {128 // bits} and tile_k a multiple of {load_width(min(group, cfg.tile_k), bits)}"
        )


def _mosaic_call(layer, x, codes, group_arrays, group: int, cfg: QuantBlocks, interpret: bool):
    """Partial sums [splits, N, M8] f32. group_arrays: {role: array} of `superblocks.scale_offset`'s roles, offsets
    (and super_offsets) only where they go into the kernel, which needs scale_in="w"."""
    m, k = x.shape  # x [M, K]
    n = codes.shape[1]  # codes [L, N, K]
    m8 = -(-m // 8) * 8
    bits = code_bits(codes.dtype)
    roles = tuple(r for r in superblocks.ROLES if r in group_arrays)
    super_group = k // group_arrays["super_scales"].shape[1] if "super_scales" in group_arrays else 0

    def stage_bytes(c: QuantBlocks) -> int:  # x tile + codes tile + the groupwise tiles
        per = functools.partial(superblocks.values_per_row, group=group, super_group=super_group)
        rows = sum(max(1, c.tile_k // per(r)) * c.tile_n * group_arrays[r].dtype.itemsize for r in roles)
        return c.tile_k * (m8 * x.dtype.itemsize + c.tile_n * bits // 8) + rows

    # Large M: halve tile_k (while the halves still tile the groups) until two stages fit.
    while 2 * stage_bytes(cfg) > cfg.smem_bytes and tile_k_fits(cfg.tile_k // 2, group, bits):
        cfg = dataclasses.replace(cfg, tile_k=cfg.tile_k // 2)
    splits = flat_gemm.k_splits(n, k, cfg)
    steps = k // cfg.tile_k
    if steps % splits:
        raise UntiledShape(f"K={k} has {steps} steps of tile_k={cfg.tile_k}: not divisible by k_splits={splits}")
    per_stage = stage_bytes(cfg)
    stages = max(1, min(cfg.max_concurrent_steps, steps // splits, cfg.smem_bytes // per_stage))
    if per_stage > cfg.smem_bytes:
        raise UntiledShape(f"one pipeline stage of {per_stage} bytes exceeds smem_bytes={cfg.smem_bytes} at M={m}")
    if super_group and cfg.tile_k % super_group and super_group % cfg.tile_k:
        raise UntiledShape(f"super-blocks of {super_group} must tile tile_k={cfg.tile_k} or be tiled by it")
    kernel = functools.partial(
        _kernel,
        roles=roles,
        tile_n=cfg.tile_n,
        tile_k=cfg.tile_k,
        group=group,
        super_group=super_group,
        steps=steps // splits,
        stages=stages,
        scale_in=cfg.scale_in,
        interpret=interpret,
    )
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((splits, n, m8), jnp.float32),
        grid=(n // cfg.tile_n, splits),
        grid_names=("n", "k"),
        interpret=plgpu.InterpretGPUParams(uninitialized_memory="nan") if interpret else None,
    )(layer.reshape(1), jnp.pad(x, ((0, m8 - m), (0, 0))), codes, *(group_arrays[r] for r in roles))


def _stacked(arrays, layer):
    """Unstacked [N, K] / [K/., N] arrays (None kept) -> stacked with L = 1 and layer 0; stacked ones need a layer."""
    if arrays[0].ndim == 2:
        return tuple(None if a is None else a[None] for a in arrays), jnp.zeros((), jnp.int32)
    if layer is None:
        raise ValueError("stacked codes [L, N, K] need a layer index")
    return arrays, jnp.asarray(layer, jnp.int32)


def _offset_term(x, offsets, group: int):
    """Σ_g xsum[m, g] · offsets[g, n]: [M, N] f32 (xsum: x summed over each group's K columns; offsets [K/G, N])."""
    m, k = x.shape
    xsum = x.astype(jnp.float32).reshape(m, k // group, group).sum(axis=-1)  # [M, K/G]
    return jnp.dot(xsum, offsets.astype(jnp.float32), precision=lax.Precision.HIGHEST)  # [M, N]


def permute_k(a):
    """a [..., K] with columns 32b + 8c + 2t + e moved to 32b + 8t + 2c + e (K a multiple of 32): the K
    order in which `quant_gemm_stream` hands converted int4 registers to wgmma. Its own inverse."""
    *lead, k = a.shape
    return a.reshape(*lead, k // 32, 4, 4, 2).swapaxes(-3, -2).reshape(*lead, k)


# ---------------------------------------------------------------------------------------------
# Public op


@functools.partial(
    jax.jit, static_argnames=("group", "impl", "block_sizes", "permuted_codes", "interpret", "out_dtype")
)
def quant_gemm(
    x: jax.Array,  # [M, K]
    codes: jax.Array,  # [L, N, K] or [N, K], int4 / int8
    scales: jax.Array,  # [L, K/G, N] or [K/G, N]
    offsets: jax.Array | None = None,  # like scales
    layer: jax.Array | int | None = None,  # [] int32, may be traced
    *,
    group: int,
    impl: str = "mosaic",
    block_sizes: QuantBlocks = QuantBlocks(),
    permuted_codes: bool = False,
    interpret: bool = False,
    out_dtype=None,
    super_scales: jax.Array | None = None,  # two levels (`kernels.superblocks`): [L, K/256, N] or [K/256, N]
    super_offsets: jax.Array | None = None,
) -> jax.Array:
    """y [M, N] = x · dequantize(codes, scales, offsets)[layer], f32 accumulation, cast to out_dtype
    (default x.dtype). The stacked codes are read in place (no copy of layer l); the kernel does not
    clamp `layer`, which must lie in [0, L). permuted_codes: the codes' columns are in `permute_k`
    order (whole 32-column groups; x is permuted to match, which leaves the group sums alone). With
    super_scales (super_offsets), scales (offsets) are int8 sub-scales and the kernel multiplies the levels.

    Equivalent to the following JAX code:

      s, o = superblocks.expand(scales, offsets, super_scales, super_offsets)
      w = dequantize_reference(codes[layer], s[layer], o[layer], group=group)  # [K, N] f32
      y = jnp.dot(x.astype(jnp.float32), w).astype(out_dtype)
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    (codes, scales, offsets, super_scales, super_offsets), layer = _stacked(
        (codes, scales, offsets, super_scales, super_offsets), layer
    )
    two_level = super_scales is not None
    if two_level:
        superblocks.check(scales, offsets, super_scales, super_offsets, "quant_gemm")
    # what the format's formula reads, two levels expanded (the kernel takes them as they are; XLA drops what the
    # mosaic path leaves unused)
    groupwise = superblocks.expand(scales, offsets, super_scales, super_offsets) if two_level else (scales, offsets)
    if permuted_codes:
        if group % 32:
            raise UntiledShape(f"permuted_codes needs groups of whole 32-column blocks, got G={group}")
        x = permute_k(x)
    if impl == "xla":
        return quant_gemm_reference(x, codes, *groupwise, layer, group=group, out_dtype=out_dtype)
    if impl != "mosaic":
        raise ValueError(f"unknown impl {impl!r}: 'mosaic' or 'xla'")
    check_shapes(x, codes, *groupwise, group, block_sizes)
    cfg = block_sizes.resolved(offsets is not None)
    in_kernel = cfg.scale_in == "w"  # offsets into the kernel, else added here
    roles = zip(superblocks.ROLES, (scales, offsets, super_scales, super_offsets))
    roles = {r: a for r, a in roles if a is not None and (in_kernel or "offsets" not in r)}
    m = x.shape[0]
    y = _mosaic_call(layer, x, codes, roles, group, cfg, interpret)  # [splits, N, M8]
    y = y.sum(axis=0)[:, :m].T  # [M, N]
    if offsets is not None and not in_kernel:
        pick = lambda a: None if a is None else lax.dynamic_index_in_dim(a, layer, axis=0, keepdims=False)  # noqa: E731
        _, layer_offsets = superblocks.expand(*map(pick, (scales, offsets, super_scales, super_offsets)))  # [K/G, N]
        y = y + _offset_term(x, layer_offsets, group)
    return y.astype(out_dtype)


# ---------------------------------------------------------------------------------------------
# References


def dequantize_reference(codes, scales, offsets=None, *, group: int) -> jax.Array:
    """codes [..., N, K], scales / offsets [..., K/G, N] -> w [..., K, N] f32 (the format's formula)."""
    k = codes.shape[-1]
    c = jnp.swapaxes(codes.astype(jnp.float32), -1, -2)  # [..., K, N]
    expand = lambda a: jnp.repeat(a.astype(jnp.float32), group, axis=-2, total_repeat_length=k)  # [..., K, N]
    w = expand(scales) * c
    return w if offsets is None else w + expand(offsets)


def quant_gemm_reference(x, codes, scales, offsets=None, layer=None, *, group: int, out_dtype=None) -> jax.Array:
    """x [M, K] · dequantize(...)[layer] in f32 ([L, N, K] stacks need `layer`), cast to out_dtype
    (default x.dtype)."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if codes.ndim == 3:
        if layer is None:
            raise ValueError("stacked codes [L, N, K] need a layer index")
        pick = lambda a: None if a is None else lax.dynamic_index_in_dim(a, layer, axis=0, keepdims=False)
        codes, scales, offsets = pick(codes), pick(scales), pick(offsets)
    check_shapes(x, codes[None], scales[None], None if offsets is None else offsets[None], group, None)
    w = dequantize_reference(codes, scales, offsets, group=group)  # [K, N] f32
    y = jnp.dot(x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST)  # [M, N]
    return y.astype(out_dtype)

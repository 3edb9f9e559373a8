"""RMSNorm of a few rows in one kernel, reading the layer's norm weight in place from its stack.

The looped decode normalizes x [M, D] twice per layer (before q·k·v and before gate·up). XLA runs
each norm as two kernels on the GPU, a reduction and then the scale, because a reduction is the
root of its fusion; at batch 1 each is a launch around a few KB of data. This kernel does
both in one launch per norm, and takes the stacked weights [L, D] with the layer index, so no row
of the stack is sliced out first.

Values follow `jaxdecode.model.RMSNorm` exactly in order of operations: in float32, r = rsqrt(mean(x²)
+ eps); x·r is rounded to x's dtype, then multiplied by the weight and rounded again. Only the
order of the sum of squares differs, so results can differ by one rounding step.

`residual_rms_norm` is the attention block's end on one GPU in the same launch: the o projection's
split-K partial sums (the GEMV's [splits, M, D] f32), their rounding, the residual add and the
MLP's input norm. XLA ran the first three as one fusion and the norm as this file's first kernel.

Implementations (`impl`); both run one program per row, as rows are independent and each row's
reduction fits one SM: M rows (M <= 64 at decode, fewer than the SMs) run side by side in the time
of one, where one program for all rows would pay each row's memory latency in turn.
- "triton": a `pl.pallas_call` kernel (Pallas-Triton, deprecated in jax 0.11), the row read in
  power-of-two blocks (`chunk_size`) with a plain `sum`. Tested on the CPU with `interpret=True`.
- "mosaic": a `plgpu.kernel` of one warpgroup per row. The row lies in registers across the
  warpgroup's 128 threads (D <= 8192: at most 64 elements a thread); its sum of squares is Mosaic
  GPU's whole-array reduction (within each thread, warp shuffles, then the four warps through SMEM).
  Where D is a multiple of 128, x (or the residual) and the weight row are loaded straight from GMEM
  in the warpgroup-strided layout, up to 16 bytes a load, all of them ahead of any use: the few KB
  of a row cost one memory round trip, with no SMEM buffer, TMA descriptor or barrier in between;
  outputs are stored the same way. Other widths (D a multiple of 64: SmolLM2's 576) take the WGMMA row-vector
  layout, which Mosaic GPU loads and stores only through SMEM, so those rows are staged by TMA.
  The partial sums (splits·D·4 bytes a row, up to 512 KB: more than registers hold in flight)
  stream through SMEM by TMA bulk copies, as many splits in flight as `SMEM_BYTES` holds, and are
  summed in split order in float32; the residual and weight rows are loaded before the stream, so
  their latency hides behind it. The kernel bodies are functions of refs (GMEM or SMEM) apart
  from their `plgpu.kernel` wrapper, so that a persistent kernel can call them as phases. Tested on
  the CPU with Mosaic GPU's interpreter (`plgpu.InterpretGPUParams`), whose outputs start as NaN:
  `poison` holds there only, as `plgpu.kernel` takes no input_output_aliases in jax 0.11.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as pltriton

SMEM_BYTES = 192 * 1024  # the Mosaic kernels' SMEM: partials' pipeline stages, staged rows (H200: 227 KiB a block)


def chunk_size(dim: int, cap: int = 4096) -> int:
    """The largest power of two that divides `dim`, at most `cap`: Triton loads power-of-two blocks."""
    return min(dim & -dim, cap)


# ---------------------------------------------------------------------------------------------
# Kernel bodies


def _norm_kernel(layer_ref, x_ref, w_ref, o_ref, *, eps: float, chunk: int):
    """x_ref [D] (one row), w_ref [L, D] (the whole stack), o_ref [D]."""
    dim = x_ref.shape[0]
    layer = layer_ref[()]
    steps = dim // chunk

    def sum_squares(i, acc):
        x = x_ref[pl.ds(i * chunk, chunk)].astype(jnp.float32)
        return acc + jnp.sum(x * x)

    total = lax.fori_loop(0, steps, sum_squares, jnp.zeros((), jnp.float32))
    r = lax.rsqrt(total / dim + eps)

    def scale(i, carry):
        cols = pl.ds(i * chunk, chunk)
        normed = (x_ref[cols].astype(jnp.float32) * r).astype(x_ref.dtype)  # the model's first rounding
        o_ref[cols] = (normed.astype(jnp.float32) * w_ref[layer, cols].astype(jnp.float32)).astype(o_ref.dtype)
        return carry

    lax.fori_loop(0, steps, scale, 0)


def _residual_kernel(layer_ref, p_ref, r_ref, w_ref, s_ref, o_ref, *, eps: float, chunk: int):
    """p_ref [splits, D] (one row's f32 partials), r_ref [D], w_ref [L, D] (the whole stack); s_ref, o_ref [D].
    The row stays in registers between the sum of squares and the scale: chunks are a static loop."""
    splits, dim = p_ref.shape
    layer = layer_ref[()]
    sums = []
    total = jnp.zeros((), jnp.float32)
    for start in range(0, dim, chunk):
        cols = pl.ds(start, chunk)
        part = p_ref[0, cols]
        for split in range(1, splits):  # in split order, as `residual_rms_norm_reference` sums
            part = part + p_ref[split, cols]
        block_out = part.astype(s_ref.dtype)  # the projection's rounding
        s = (r_ref[cols].astype(jnp.float32) + block_out.astype(jnp.float32)).astype(s_ref.dtype)  # the add's
        s_ref[cols] = s
        s32 = s.astype(jnp.float32)
        sums.append(s32)
        total = total + jnp.sum(s32 * s32)
    r = lax.rsqrt(total / dim + eps)
    for i, start in enumerate(range(0, dim, chunk)):
        cols = pl.ds(start, chunk)
        normed = (sums[i] * r).astype(o_ref.dtype)  # the model's first rounding, then the weight's
        o_ref[cols] = (normed.astype(jnp.float32) * w_ref[layer, cols].astype(jnp.float32)).astype(o_ref.dtype)


def row_layout(dim: int, dtype) -> plgpu.Layout:
    """A row [D] over one warpgroup: strided (each thread holds `vec` consecutive elements every 128·vec,
    one load of at most 16 bytes) where D is a multiple of 128, else the WGMMA row-vector layout (D a
    multiple of 64; SMEM only). Every array of a row shares it, whatever its dtype."""
    if dim % 128:
        return plgpu.Layout.WGMMA.reduce(1)
    vec = 16 // jnp.dtype(dtype).itemsize
    while dim % (128 * vec):
        vec //= 2
    return plgpu.Layout.WG_STRIDED((dim,), vec_size=vec)


def _scale_row(s, w, o_ref, *, eps: float):
    """o_ref [D] = the model's RMSNorm of the float32 row s [D] with the weight row w [D]."""
    r = lax.rsqrt(jnp.sum(s * s) / s.shape[0] + eps)  # one reduction over the warpgroup
    normed = (s * r).astype(o_ref.dtype)  # the model's first rounding, then the weight's
    o_ref[...] = (normed.astype(jnp.float32) * w.astype(jnp.float32)).astype(o_ref.dtype)


def mosaic_norm_body(x_ref, w_ref, o_ref, *, eps: float):
    """One row in one warpgroup: x_ref, w_ref (the layer's weight row), o_ref [D], in GMEM or SMEM
    (SMEM where D is not a multiple of 128)."""
    layout = row_layout(x_ref.shape[0], x_ref.dtype)
    x = plgpu.load(x_ref, layout=layout).astype(jnp.float32)
    _scale_row(x, plgpu.load(w_ref, layout=layout), o_ref, eps=eps)


def mosaic_residual_body(p_gmem, r_ref, w_ref, s_ref, o_ref, *, eps: float, stages: int):
    """One row in one warpgroup: p_gmem [splits, D] f32 (GMEM: streamed through SMEM, `stages` splits in
    flight), r_ref, w_ref (the layer's weight row), s_ref, o_ref [D] in GMEM or SMEM."""
    splits, dim = p_gmem.shape
    layout = row_layout(dim, r_ref.dtype)
    residual = plgpu.load(r_ref, layout=layout)  # loaded first: their latency hides behind the stream
    w = plgpu.load(w_ref, layout=layout)

    def add_split(_, p_smem, total):  # p_smem [1, D]
        return total + plgpu.load(p_smem.at[0], layout=layout)

    # -0.0 is the f32 sum's identity (+0.0 would turn a -0.0 into +0.0): total is p[0] + p[1] + ..., in order
    start = plgpu.layout_cast(jnp.full((dim,), -0.0, jnp.float32), layout)
    spec = plgpu.BlockSpec((1, dim), lambda i: (i, 0), oob_fill_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
    total = plgpu.emit_pipeline(
        add_split, grid=(splits,), in_specs=[spec], max_concurrent_steps=stages, init_carry=start
    )(p_gmem)
    block_out = total.astype(s_ref.dtype)  # the projection's rounding
    s = (residual.astype(jnp.float32) + block_out.astype(jnp.float32)).astype(s_ref.dtype)  # the add's
    s_ref[...] = s
    _scale_row(s.astype(jnp.float32), w, o_ref, eps=eps)


def _staged(body, ins, outs):
    """body(*ins, *outs) on SMEM copies of the GMEM rows `ins` (TMA in), then the SMEM `outs` copied out."""

    def scope(*refs):
        *smems, barrier = refs
        in_smems, out_smems = smems[: len(ins)], smems[len(ins) :]
        for gmem, smem in zip(ins, in_smems):
            plgpu.copy_gmem_to_smem(gmem, smem, barrier, oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
        plgpu.barrier_wait(barrier)
        body(*in_smems, *out_smems)
        plgpu.commit_smem()
        for gmem, smem in zip(outs, out_smems):
            plgpu.copy_smem_to_gmem(smem, gmem)
        plgpu.wait_smem_to_gmem(0)

    smem = [plgpu.SMEM(ref.shape, ref.dtype) for ref in (*ins, *outs)]
    pl.run_scoped(scope, *smem, plgpu.Barrier(num_arrivals=len(ins)))


def _mosaic_norm_kernel(layer_gmem, x_gmem, w_gmem, o_gmem, *, eps: float, launch_dependents: bool):
    """layer_gmem [1] int32, x_gmem [M, D], w_gmem [L, D] (the whole stack), o_gmem [M, D]: row m of the grid.
    launch_dependents: the next kernel may start now (a GEMM that waits for it, `StreamBlocks.pdl`, loads its
    first weight tiles meanwhile); a kernel launched the usual way still starts after this one."""
    if launch_dependents:
        plgpu.griddepcontrol_launch_dependents()
    m = lax.axis_index("m")
    rows = (x_gmem.at[m], w_gmem.at[layer_gmem[0]], o_gmem.at[m])  # views: the weight row is read in place
    body = functools.partial(mosaic_norm_body, eps=eps)
    if x_gmem.shape[1] % 128:
        _staged(body, rows[:2], rows[2:])
    else:
        body(*rows)


def _mosaic_residual_kernel(
    layer_gmem, p_gmem, r_gmem, w_gmem, s_gmem, o_gmem, *, eps: float, stages: int, launch_dependents: bool
):
    """layer_gmem [1] int32, p_gmem [splits, M, D] f32, r_gmem [M, D], w_gmem [L, D] (the whole stack);
    s_gmem, o_gmem [M, D]: row m of the grid. launch_dependents: as `_mosaic_norm_kernel`'s."""
    if launch_dependents:
        plgpu.griddepcontrol_launch_dependents()
    m = lax.axis_index("m")
    rows = (r_gmem.at[m], w_gmem.at[layer_gmem[0]], s_gmem.at[m], o_gmem.at[m])
    body = functools.partial(mosaic_residual_body, p_gmem.at[:, m], eps=eps, stages=stages)
    if r_gmem.shape[1] % 128:
        _staged(body, rows[:2], rows[2:])
    else:
        body(*rows)


# ---------------------------------------------------------------------------------------------
# Kernel wrappers


def _norm_call(x, weights, layer, *, eps: float, num_warps: int, interpret: bool, poison: bool) -> jax.Array:
    """The pallas_call of `rms_norm`: one program per row of x [M, D]; weights [L, D] whole."""
    rows, dim = x.shape
    layer = jnp.asarray(layer, jnp.int32)
    body = functools.partial(_norm_kernel, eps=eps, chunk=chunk_size(dim))
    in_specs = [
        pl.BlockSpec((), lambda m: ()),  # the layer index
        pl.BlockSpec((None, dim), lambda m: (m, 0)),  # one row of x
        pl.BlockSpec(),
    ]  # the whole weight stack
    inputs = [layer, x, weights]
    out_spec = pl.BlockSpec((None, dim), lambda m: (m, 0))
    if poison:
        inputs.append(jnp.full(x.shape, jnp.nan, x.dtype))
        in_specs.append(out_spec)
        unpoisoned = body
        body = lambda layer_ref, x_ref, w_ref, _, o_ref: unpoisoned(layer_ref, x_ref, w_ref, o_ref)  # noqa: E731
    return pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(rows,),
        in_specs=in_specs,
        out_specs=out_spec,
        input_output_aliases={3: 0} if poison else {},
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="rms_norm",
    )(*inputs)


def _residual_call(
    partials, residual, weights, layer, *, eps: float, num_warps: int, interpret: bool, poison: bool
) -> tuple[jax.Array, jax.Array]:
    """The pallas_call of `residual_rms_norm`: one program per row; weights [L, D] whole."""
    splits, rows, dim = partials.shape
    layer = jnp.asarray(layer, jnp.int32)
    body = functools.partial(_residual_kernel, eps=eps, chunk=chunk_size(dim))
    row_spec = pl.BlockSpec((None, dim), lambda m: (m, 0))
    in_specs = [
        pl.BlockSpec((), lambda m: ()),  # the layer index
        pl.BlockSpec((splits, None, dim), lambda m: (0, m, 0)),  # one row's partials
        row_spec,  # one row of the residual
        pl.BlockSpec(),
    ]  # the whole weight stack
    inputs = [layer, partials, residual, weights]
    out_shape = jax.ShapeDtypeStruct(residual.shape, residual.dtype)
    if poison:
        inputs += [jnp.full(residual.shape, jnp.nan, residual.dtype)] * 2
        in_specs += [row_spec, row_spec]
        unpoisoned = body
        body = lambda layer_ref, p_ref, r_ref, w_ref, _a, _b, s_ref, o_ref: unpoisoned(  # noqa: E731
            layer_ref, p_ref, r_ref, w_ref, s_ref, o_ref
        )
    return pl.pallas_call(
        body,
        out_shape=(out_shape, out_shape),
        grid=(rows,),
        in_specs=in_specs,
        out_specs=(row_spec, row_spec),
        input_output_aliases={4: 0, 5: 1} if poison else {},
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="residual_rms_norm",
    )(*inputs)


def mosaic_fits(dim: int) -> bool:
    """Whether the Mosaic GPU kernels take rows of D: a multiple of 64 (a row over one warpgroup)."""
    return dim % 64 == 0


def _mosaic_checks(dim: int, *, interpret: bool, poison: bool):
    if not mosaic_fits(dim):
        raise ValueError(f"the mosaic kernels take D a multiple of 64 (a row over one warpgroup), got D={dim}")
    if poison and not interpret:
        raise ValueError(
            "poison needs interpret mode for the mosaic kernels: plgpu.kernel takes no input_output_aliases in jax 0.11"
        )


def _interpret_params(interpret: bool):
    # The interpreter's GMEM outputs start as NaN: an unwritten element shows (`poison`).
    return plgpu.InterpretGPUParams(uninitialized_memory="nan") if interpret else None


def _mosaic_norm_call(x, weights, layer, *, eps: float, interpret: bool, poison: bool) -> jax.Array:
    """The plgpu.kernel of `rms_norm`: one warpgroup per row of x [M, D]; weights [L, D] whole."""
    rows, dim = x.shape
    _mosaic_checks(dim, interpret=interpret, poison=poison)
    return plgpu.kernel(
        functools.partial(_mosaic_norm_kernel, eps=eps, launch_dependents=not interpret),
        out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(rows,),
        grid_names=("m",),
        interpret=_interpret_params(interpret),
    )(jnp.asarray(layer, jnp.int32).reshape(1), x, weights)


def _mosaic_residual_call(
    partials, residual, weights, layer, *, eps: float, interpret: bool, poison: bool, smem_bytes: int = SMEM_BYTES
) -> tuple[jax.Array, jax.Array]:
    """The plgpu.kernel of `residual_rms_norm`: one warpgroup per row; weights [L, D] whole."""
    splits, rows, dim = partials.shape
    _mosaic_checks(dim, interpret=interpret, poison=poison)
    staged = 4 * dim * residual.dtype.itemsize if dim % 128 else 0  # rows staged through SMEM: 2 in, 2 out
    stages = min(splits, (smem_bytes - staged) // (4 * dim))  # one f32 split of the row a stage
    if stages < 1:
        raise ValueError(f"one split of the row ({4 * dim} bytes) and {staged} staged bytes exceed {smem_bytes=}")
    out = jax.ShapeDtypeStruct(residual.shape, residual.dtype)
    return plgpu.kernel(
        functools.partial(_mosaic_residual_kernel, eps=eps, stages=stages, launch_dependents=not interpret),
        out_type=(out, out),
        grid=(rows,),
        grid_names=("m",),
        interpret=_interpret_params(interpret),
    )(jnp.asarray(layer, jnp.int32).reshape(1), partials, residual, weights)


# ---------------------------------------------------------------------------------------------
# Public ops


@functools.partial(jax.jit, static_argnames=("eps", "num_warps", "interpret", "poison", "impl"))
def rms_norm(
    x: jax.Array,  # [M, D]
    weights: jax.Array,  # [L, D]
    layer: jax.Array | int,  # int32 scalar, may be traced
    *,
    eps: float,
    num_warps: int = 4,
    interpret: bool = False,
    poison: bool = False,
    impl: str = "triton",
) -> jax.Array:
    """weights[layer] * (x / sqrt(mean(x², axis=-1) + eps)) for x [M, D] and a stack weights [L, D].

    The weight row is read in place (the kernel gets the whole stack and the index, which it does not
    clamp: it must lie in [0, L)). impl: "triton" | "mosaic" (D a multiple of 64). num_warps: Triton
    only. poison=True (tests) hands the kernel a NaN-filled output buffer, so an unwritten element shows
    as NaN (mosaic: interpret mode only).
    """
    if x.ndim != 2 or weights.ndim != 2 or weights.shape[1] != x.shape[1]:
        raise ValueError(f"rms_norm takes x [M, D] and weights [L, D], got {x.shape} and {weights.shape}")
    if x.dtype != weights.dtype:
        raise ValueError(f"x and weights must share a dtype, got {x.dtype} and {weights.dtype}")
    if impl == "mosaic":
        return _mosaic_norm_call(x, weights, layer, eps=eps, interpret=interpret, poison=poison)
    if impl != "triton":
        raise ValueError(f"unknown impl {impl!r}: 'triton' or 'mosaic'")
    return _norm_call(x, weights, layer, eps=eps, num_warps=num_warps, interpret=interpret, poison=poison)


@functools.partial(jax.jit, static_argnames=("eps", "num_warps", "interpret", "poison", "impl"))
def residual_rms_norm(
    partials: jax.Array,  # [splits, M, D] f32
    residual: jax.Array,  # [M, D]
    weights: jax.Array,  # [L, D]
    layer: jax.Array | int,  # int32 scalar, may be traced
    *,
    eps: float,
    num_warps: int = 16,
    interpret: bool = False,
    poison: bool = False,
    impl: str = "triton",
) -> tuple[jax.Array, jax.Array]:
    """(s, rms_norm(s) · weights[layer]) for s = residual + Σ partials: partials [splits, M, D] f32 (a GEMM's
    split-K partial sums), residual [M, D], weights a stack [L, D] read in place. One program per row.

    Equivalent to the following JAX code (the model's o projection, residual add and `rms_norm`):

      block_out = partials.sum(axis=0).astype(residual.dtype)   # the splits summed in order
      s = residual + block_out
      return s, rms_norm(s, weights[layer], eps)

    impl: "triton" | "mosaic" (D a multiple of 64). poison=True (tests) hands the kernel NaN-filled output
    buffers, so an unwritten element shows as NaN (mosaic: interpret mode only). num_warps: Triton only. One
    program reads the row's partials alone (64 KB for Llama's o GEMV at batch 1), so Triton takes 16 warps to
    keep enough loads in flight: in Llama-3.1-8B decode on the H200 at batch 1, 4 warps were slower than XLA's
    fusion and the norm kernel, 16 never slower (A/B runs; see docs/log/). Mosaic keeps them in flight as
    TMA bulk copies instead.
    """
    if (
        partials.ndim != 3
        or residual.ndim != 2
        or weights.ndim != 2
        or partials.shape[1:] != residual.shape
        or weights.shape[1] != residual.shape[1]
    ):
        raise ValueError(
            f"residual_rms_norm takes partials [splits, M, D], residual [M, D] and weights [L, D], got "
            f"{partials.shape}, {residual.shape} and {weights.shape}"
        )
    if partials.dtype != jnp.float32 or residual.dtype != weights.dtype:
        raise ValueError(
            f"partials must be float32 and residual and weights share a dtype, got {partials.dtype}, "
            f"{residual.dtype} and {weights.dtype}"
        )
    if impl == "mosaic":
        return _mosaic_residual_call(partials, residual, weights, layer, eps=eps, interpret=interpret, poison=poison)
    if impl != "triton":
        raise ValueError(f"unknown impl {impl!r}: 'triton' or 'mosaic'")
    return _residual_call(
        partials, residual, weights, layer, eps=eps, num_warps=num_warps, interpret=interpret, poison=poison
    )


# ---------------------------------------------------------------------------------------------
# References


def rms_norm_reference(x: jax.Array, weights: jax.Array, layer: int, *, eps: float) -> jax.Array:
    """What `jaxdecode.model.RMSNorm` computes with weight weights[layer], in jnp."""
    x32 = x.astype(jnp.float32)
    normed = (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return weights[layer] * normed


def residual_rms_norm_reference(partials, residual, weights, layer: int, *, eps: float):
    """What `residual_rms_norm` computes, in jnp: the splits summed in order, then the model's ops."""
    total = partials[0]
    for split in range(1, partials.shape[0]):
        total = total + partials[split]
    s = residual + total.astype(residual.dtype)
    return s, rms_norm_reference(s, weights, layer, eps=eps)

"""Flat GEMM for decode: y = x·W[l] with small M, reading a stacked weight [L, K, N] in place.

Decode GEMMs are flat: M = batch·tokens is 1..64 while K, N are thousands, so they are bound by the
weight read. FlashDecoding++ (arXiv 2311.01282 §4) pads M to 8 instead of 64. On Hopper the wgmma
M side is 64 rows per warpgroup, so the Mosaic GPU kernel swaps the operands and computes
yᵀ[N, M8] = W[l]ᵀ[N, K]·xᵀ[K, M8]: weight rows fill the 64-row side and the padded batch is the
narrow wgmma N side (8..256). The weight streams through shared memory in `max_concurrent_steps`
TMA stages (`plgpu.emit_pipeline`). K is split over CTAs when N alone gives too few of them; the
split partial sums, the transpose and the epilogue run in one small XLA fusion over [M, N].

The layer index is a traced int32 scalar read inside the kernel (`w_gmem.at[layer]`), so a
`lax.scan` over layers passes the whole stacked array and XLA never slices (copies) W[l] out of it.

Epilogues: `residual` (y + r) and SwiGLU (silu(x·Wg)·(x·Wu), one kernel reading x once for both
weights). Both land in the split-K combine fusion, which touches only [M, N] values.

Implementations (`impl`):
- "mosaic": the Mosaic GPU kernel (`plgpu.kernel`, wgmma, TMA). Hopper only. Tested on the CPU
  with `interpret=plgpu.InterpretGPUParams()` (Mosaic GPU's own interpreter: SMEM, TMA, barriers).
- "triton": a `pl.pallas_call` kernel (Pallas-Triton on the GPU, deprecated in jax 0.11; kept as
  the portable fallback). M is padded to 16, Triton's smallest dot. With gemv=True it uses CUDA-core
  multiply-adds instead of a dot, for M = 1. Tested on the CPU with `interpret=True`.
- "xla": `flat_gemm_reference` (cuBLAS on the GPU via XLA's dot).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as pltriton


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tunables. k_splits=None picks the fewest splits that give `target_ctas` CTAs."""

    tile_n: int = 64  # weight columns per CTA: the wgmma M side (multiple of 64)
    tile_k: int = 256  # reduction depth per pipeline stage
    max_concurrent_steps: int = 4  # TMA stages in flight
    k_splits: int | None = None
    target_ctas: int = 132  # SMs on an H200
    smem_bytes: int = 220 * 1024  # stages are cut to fit (H200: 227 KiB per block)
    num_warps: int = 4  # Triton only
    num_stages: int = 3  # Triton only


def _stages(per_stage_bytes: int, cfg: BlockSizes, wanted: int) -> int:
    """The most pipeline stages (<= wanted) whose buffers fit in shared memory."""
    fit = cfg.smem_bytes // per_stage_bytes
    if fit < 1:
        raise ValueError(f"one stage of {per_stage_bytes} bytes exceeds {cfg.smem_bytes=}")
    return max(1, min(wanted, fit))


def k_splits(n: int, k: int, cfg) -> int:
    """Split K over CTAs: cfg.k_splits, or the fewest halvings of K's steps that give cfg.target_ctas CTAs
    with N / cfg.tile_n tiles (any block-size dataclass with those fields: `quant_gemm.QuantBlocks` too)."""
    if cfg.k_splits is not None:
        return cfg.k_splits
    steps, splits = k // cfg.tile_k, 1
    while (n // cfg.tile_n) * splits < cfg.target_ctas and steps % (2 * splits) == 0:
        splits *= 2
    return splits


# ---------------------------------------------------------------------------------------------
# Kernel bodies


def _mosaic_kernel(
    # inputs
    layer_gmem,  # [1] int32
    x_gmem,  # [M8, K]
    *refs,  # weights [L, K, N] (1 or 2 of them), then the output [splits, n_w, N, M8] f32
    tile_n: int,
    tile_k: int,
    steps: int,
    max_concurrent_steps: int,
):
    *w_gmems, o_gmem = refs
    m8 = x_gmem.shape[0]
    layer = layer_gmem[0]
    ni, si = lax.axis_index("n"), lax.axis_index("k")

    def acc_scope(*accs):  # accs: [tile_n, M8] f32 each
        def step(_, x_smem, *w_smems):  # x_smem [M8, tile_k], w_smem [tile_k, tile_n]
            for acc, w_smem in zip(accs, w_smems):
                plgpu.wgmma(acc, w_smem.T, x_smem.T)  # accᵀ += W tileᵀ · x tileᵀ
            plgpu.wgmma_wait(len(accs))  # the previous step's wgmmas are done with their buffers

        x_spec = plgpu.BlockSpec((m8, tile_k), lambda k: (0, si * steps + k), delay_release=1)
        w_spec = plgpu.BlockSpec((tile_k, tile_n), lambda k: (si * steps + k, ni), delay_release=1)
        plgpu.emit_pipeline(
            step,
            grid=(steps,),
            in_specs=[x_spec] + [w_spec] * len(w_gmems),
            max_concurrent_steps=max_concurrent_steps,
        )(x_gmem, *(w.at[layer] for w in w_gmems))  # W[l] in place: a view, not a copy
        return tuple(acc[...] for acc in accs)

    accs = pl.run_scoped(acc_scope, *[plgpu.ACC((tile_n, m8))] * len(w_gmems))

    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((tile_n, m8), jnp.float32))
    def _store(o_smem):
        for j, acc in enumerate(accs):
            o_smem[...] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[si, j, pl.ds(ni * tile_n, tile_n)])
            plgpu.wait_smem_to_gmem(0)


def _triton_kernel(
    # inputs
    layer_ref,  # [] int32
    x_ref,  # [Mp, K/splits]
    *refs,  # weights [L, K/splits, tile_n] (1 or 2), then the output [n_w, Mp, tile_n] f32
    tile_k: int,
    gemv: bool,
):
    *w_refs, o_ref = refs
    layer = layer_ref[()]
    m_pad, k_len = x_ref.shape
    tile_n = o_ref.shape[-1]

    def body(i, accs):
        ks = pl.ds(i * tile_k, tile_k)
        x = x_ref[:, ks]  # [Mp, tile_k]
        out = []
        for acc, w_ref in zip(accs, w_refs):
            w = w_ref[layer, ks, :]  # [tile_k, tile_n], read in place from the stacked weight
            if gemv:  # CUDA cores: Mp = 1
                prod = (x[0].astype(jnp.float32)[:, None] * w.astype(jnp.float32)).sum(axis=0)
                out.append(acc + prod[None, :])
            else:
                out.append(acc + jnp.dot(x, w, preferred_element_type=jnp.float32))
        return tuple(out)

    init = tuple(jnp.zeros((m_pad, tile_n), jnp.float32) for _ in w_refs)
    accs = lax.fori_loop(0, k_len // tile_k, body, init)
    for j, acc in enumerate(accs):
        o_ref[j] = acc


# ---------------------------------------------------------------------------------------------
# Kernel wrappers: both return partial sums [splits, n_w, N, M_pad] f32


def _mosaic_call(layer, x, ws, cfg: BlockSizes, interpret: bool, poison: bool):
    m, k = x.shape  # x [M, K]
    n = ws[0].shape[2]  # ws [L, K, N]
    m8 = -(-m // 8) * 8
    if m8 > 256:
        raise ValueError(f"the mosaic flat GEMM takes M <= 256 (wgmma N), got {m=}")
    if n % cfg.tile_n or k % cfg.tile_k:
        raise ValueError(f"{n=} / {k=} must be multiples of {cfg.tile_n=} / {cfg.tile_k=}")
    if poison and not interpret:
        raise ValueError(
            "poison needs interpret mode for the mosaic kernel: plgpu.kernel takes no input_output_aliases in jax 0.11"
        )

    def stage_bytes(c: BlockSizes) -> int:  # bf16 x tile + weight tiles
        return 2 * c.tile_k * (m8 + len(ws) * c.tile_n)

    # The pipeline releases each stage one step late (delay_release=1), so it needs two stages in
    # shared memory: where two do not fit (SwiGLU at M = 128: 128 KiB a stage), halve tile_k.
    while 2 * stage_bytes(cfg) > cfg.smem_bytes and cfg.tile_k > 64:
        cfg = dataclasses.replace(cfg, tile_k=cfg.tile_k // 2)
    splits = k_splits(n, k, cfg)
    x = jnp.pad(x, ((0, m8 - m), (0, 0)))  # [M8, K]
    per_stage = stage_bytes(cfg)
    stages = _stages(per_stage, cfg, cfg.max_concurrent_steps)
    if stages < 2:
        raise ValueError(
            f"two pipeline stages of {per_stage} bytes exceed {cfg.smem_bytes=}: M={m} is too "
            f"large for {len(ws)} weight(s) at tile_n={cfg.tile_n}"
        )
    kernel = functools.partial(
        _mosaic_kernel,
        tile_n=cfg.tile_n,
        tile_k=cfg.tile_k,
        steps=k // cfg.tile_k // splits,
        max_concurrent_steps=stages,
    )
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((splits, len(ws), n, m8), jnp.float32),
        grid=(n // cfg.tile_n, splits),
        grid_names=("n", "k"),
        # The interpreter's GMEM outputs start as NaN: with poison, every unwritten element shows.
        interpret=plgpu.InterpretGPUParams(uninitialized_memory="nan") if interpret else None,
    )(layer.reshape(1), x, *ws)


def _triton_call(layer, x, ws, cfg: BlockSizes, interpret: bool, gemv: bool, poison: bool):
    m, k = x.shape  # x [M, K]
    num_layers, _, n = ws[0].shape  # ws [L, K, N]
    m_pad = 1 if gemv else max(16, pl.next_power_of_2(m))
    if gemv and m != 1:
        raise ValueError(f"gemv takes M = 1, got {m=}")
    if n % cfg.tile_n or k % cfg.tile_k:
        raise ValueError(f"{n=} / {k=} must be multiples of {cfg.tile_n=} / {cfg.tile_k=}")
    splits = k_splits(n, k, cfg)
    k_len = k // splits
    x = jnp.pad(x, ((0, m_pad - m), (0, 0)))  # [Mp, K]
    out_shape = jax.ShapeDtypeStruct((splits, len(ws), m_pad, n), jnp.float32)
    out_spec = pl.BlockSpec((None, len(ws), m_pad, cfg.tile_n), lambda j, s: (s, 0, 0, j))
    in_specs = [pl.BlockSpec((None,), lambda j, s: (0,)), pl.BlockSpec((m_pad, k_len), lambda j, s: (0, s))]
    in_specs += [pl.BlockSpec((num_layers, k_len, cfg.tile_n), lambda j, s: (0, s, j))] * len(ws)
    inputs = [layer.reshape(1), x, *ws]
    body = functools.partial(_triton_kernel, tile_k=cfg.tile_k, gemv=gemv)
    if poison:  # a NaN-filled output buffer, aliased in: unwritten tiles stay NaN
        inputs.append(jnp.full(out_shape.shape, jnp.nan, out_shape.dtype))
        in_specs.append(out_spec)
        unpoisoned = body
        body = lambda *refs: unpoisoned(*refs[:-2], refs[-1])  # drop the aliased input ref
    out = pl.pallas_call(
        body,
        out_shape=out_shape,
        grid=(n // cfg.tile_n, splits),
        in_specs=in_specs,
        out_specs=out_spec,
        input_output_aliases={len(inputs) - 1: 0} if poison else {},
        compiler_params=None
        if interpret
        else pltriton.CompilerParams(
            num_warps=cfg.num_warps,
            num_stages=_stages(2 * cfg.tile_k * (m_pad + len(ws) * cfg.tile_n), cfg, cfg.num_stages),
        ),
        interpret=interpret,
        name="flat_gemm_triton",
    )(*inputs)
    return out.transpose(0, 1, 3, 2)  # [splits, n_w, N, Mp]


def _stacked(w, layer):
    """[K, N] -> [1, K, N] with layer 0; [L, K, N] stays."""
    if w.ndim == 2:
        return w[None], jnp.zeros((), jnp.int32)
    if layer is None:
        raise ValueError("a stacked weight [L, K, N] needs a layer index")
    return w, jnp.asarray(layer, jnp.int32)


def _partials(x, ws, layer, impl, cfg, interpret, poison):
    if impl == "mosaic":
        return _mosaic_call(layer, x, ws, cfg, interpret, poison)
    if impl in ("triton", "gemv"):
        return _triton_call(layer, x, ws, cfg, interpret, gemv=impl == "gemv", poison=poison)
    raise ValueError(f"unknown impl {impl!r}")


# ---------------------------------------------------------------------------------------------
# Public ops


@functools.partial(jax.jit, static_argnames=("impl", "block_sizes", "interpret", "poison"))
def flat_gemm(
    x: jax.Array,  # [M, K]
    w: jax.Array,  # [L, K, N] or [K, N]
    layer: jax.Array | int | None = None,  # [] int32, may be traced
    residual: jax.Array | None = None,  # [M, N]
    *,
    impl: str = "mosaic",
    block_sizes: BlockSizes = BlockSizes(),
    interpret: bool = False,
    poison: bool = False,
) -> jax.Array:
    """Small-M matmul against one layer of a stacked weight, read in place.

    impl: "mosaic" | "triton" | "gemv" (M = 1) | "xla"; `kernels.dispatch.choose_gemm` picks one.
    poison=True (tests) runs the kernel on a NaN-filled output buffer (mosaic: interpret mode only).

    Equivalent to the following JAX code:

      y = jnp.dot(x, w[layer], preferred_element_type=jnp.float32)
      y = y + residual if residual is not None else y
      y = y.astype(x.dtype)
    """
    m = x.shape[0]
    w, layer = _stacked(w, layer)
    if impl == "xla":
        return flat_gemm_reference(x, w, layer, residual)
    y = _partials(x, (w,), layer, impl, block_sizes, interpret, poison)  # [splits, 1, N, Mp]
    y = y.sum(axis=(0, 1))[:, :m].T  # [M, N]
    if residual is not None:
        y = y + residual.astype(jnp.float32)
    return y.astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("impl", "block_sizes", "interpret"))
def flat_gemm_partials(
    x: jax.Array,  # [M, K]
    w: jax.Array,  # [L, K, N] or [K, N]
    layer: jax.Array | int | None = None,  # [] int32, may be traced
    *,
    impl: str = "gemv",
    block_sizes: BlockSizes = BlockSizes(),
    interpret: bool = False,
) -> jax.Array:
    """The Triton kernel's split-K partial sums [splits, M, N] f32, not yet added: for a consumer that
    sums them itself (`kernels.rms_norm.residual_rms_norm`). impl: "gemv" (M = 1) or "triton", whose
    partials are laid out batch-major, so taking M of the padded rows copies nothing at M = 1.

    `flat_gemm(x, w, layer, impl=impl)` equals `flat_gemm_partials(...).sum(axis=0).astype(x.dtype)`.
    """
    if impl not in ("gemv", "triton"):
        raise ValueError(f"flat_gemm_partials takes impl 'gemv' or 'triton', got {impl!r}")
    w, layer = _stacked(w, layer)
    y = _partials(x, (w,), layer, impl, block_sizes, interpret, poison=False)  # [splits, 1, N, Mp]
    return y[:, 0, :, : x.shape[0]].transpose(0, 2, 1)  # [splits, M, N]


@functools.partial(jax.jit, static_argnames=("impl", "block_sizes", "interpret", "poison"))
def flat_gemm_swiglu(
    x: jax.Array,  # [M, D]
    w_gate: jax.Array,  # [L, D, F] or [D, F]
    w_up: jax.Array,  # [L, D, F] or [D, F]
    layer: jax.Array | int | None = None,  # [] int32, may be traced
    *,
    impl: str = "mosaic",
    block_sizes: BlockSizes = BlockSizes(),
    interpret: bool = False,
    poison: bool = False,
) -> jax.Array:
    """The SwiGLU half of an MLP in one kernel: x is read once for both weights.

    Equivalent to the following JAX code:

      g = jnp.dot(x, w_gate[layer], preferred_element_type=jnp.float32)
      u = jnp.dot(x, w_up[layer], preferred_element_type=jnp.float32)
      y = (jax.nn.silu(g) * u).astype(x.dtype)
    """
    m = x.shape[0]
    w_gate, layer = _stacked(w_gate, layer)
    w_up, _ = _stacked(w_up, layer)
    if impl == "xla":
        return flat_gemm_swiglu_reference(x, w_gate, w_up, layer)
    if impl == "gemv":
        raise ValueError("flat_gemm_swiglu has no gemv path")
    gu = _partials(x, (w_gate, w_up), layer, impl, block_sizes, interpret, poison).sum(axis=0)
    g, u = gu[0, :, :m].T, gu[1, :, :m].T  # [M, F] each
    return (jax.nn.silu(g) * u).astype(x.dtype)


# ---------------------------------------------------------------------------------------------
# References


def flat_gemm_reference(x, w, layer=None, residual=None):
    """x [M, K] · w[layer] ([L, K, N] or [K, N]) in f32, + residual [M, N], cast to x.dtype."""
    w_l = w if w.ndim == 2 else lax.dynamic_index_in_dim(w, layer, axis=0, keepdims=False)
    y = jnp.dot(x, w_l, preferred_element_type=jnp.float32)  # [M, N]
    if residual is not None:
        y = y + residual.astype(jnp.float32)
    return y.astype(x.dtype)


def flat_gemm_swiglu_reference(x, w_gate, w_up, layer=None):
    """silu(x·w_gate[layer]) · (x·w_up[layer]) in f32, cast to x.dtype."""
    pick = lambda w: w if w.ndim == 2 else lax.dynamic_index_in_dim(w, layer, 0, keepdims=False)
    g = jnp.dot(x, pick(w_gate), preferred_element_type=jnp.float32)  # [M, F]
    u = jnp.dot(x, pick(w_up), preferred_element_type=jnp.float32)  # [M, F]
    return (jax.nn.silu(g) * u).astype(x.dtype)

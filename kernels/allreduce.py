"""One-shot all-reduce for tensor-parallel decode: Mosaic GPU kernels, peer to peer over NVLink.

A tensor-parallel decode step all-reduces a [B, D] activation twice per layer. At batch 1 that is
8 KB, so its cost is latency, not bandwidth: NCCL's fixed cost per call dominates, 64 calls per
Llama-3.1-8B token. The Kernel Looping paper streams the all-reduce
peer to peer into the next kernel's memory instead (papers.md, SN40L); these kernels are the GPU
analogue: each device writes its partial straight into the peer's mailbox over NVLink
(`plgpu.remote_ref`), the two handshake, and each sums the slots in float32 in slot order, rounded
once, so both devices hold bit-identical activations (for 2 devices this equals a bf16 psum exactly:
the sum of two bf16 values is exact in float32). One CTA, 128 threads, one launch.

Two kernels:
- `all_reduce_kernel` (n devices): semaphores and mailbox are the kernel's scratch and output, so
  XLA runs it behind a cross-device NCCL barrier kernel and a fusion that zeroes the semaphores.
  Measured slower than psum at every size (docs/log/); kept for comparison, never picked by `all_reduce`.
- `all_reduce_persistent` (2 devices): flags and mailbox are inputs the caller keeps alive across
  calls (`persistent_buffers`), epoch-numbered instead of zeroed, so it runs with no barrier
  (`skip_device_barrier=True`). `all_reduce` picks it for small x when given the buffers; the
  tensor-parallel engine passes them with its params (`TPForward.step_params`) down to every call. They must be
  arguments of the jitted program: closed over, jax embeds them as HLO constants, which XLA may
  materialize as fresh zeroed temporaries, and the decode hung that way.

Backend: Mosaic GPU (`plgpu.kernel`, remote refs, semaphores, `inline_mgpu` for the flag spin-waits);
in one process with several GPUs XLA supplies the peers' buffer addresses (its collective metadata).
Mosaic GPU's interpreter in jax 0.11.2 does not model semaphores or peer memory, so on the CPU
`all_reduce` runs `lax.psum`, and both kernels are tested compiled on 2 H200s (tests/test_allreduce.py)
against psum, bit for bit, also over 50 dependent calls.

`all_reduce(x, axis, residual=r)` is r + psum(x): the barrier-free kernel then also does the residual
add that follows each tensor-parallel block (rounded exactly as the two ops round), one XLA kernel
fewer per all-reduce. `all_reduce_persistent(..., norm=(weights, layer, eps))` also does the RMSNorm
that follows the attention block's all-reduce (`model.residual_norm`, through the in-place loop's
hook): one reduction over the warpgroup per row, the weight row read in place from its stack.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, scf

MAX_ELEMENTS = 64 * 1024  # 128 KB of bf16 ([16, 4096]): beyond this, bandwidth matters and NCCL wins
_CHUNK = 4096  # elements per step: 32 per thread in registers


def _kernel(x_ref, y_ref, mailbox_ref, ready, arrived, *, axis: str, devices: int, chunk: int):
    """x_ref, y_ref [N]; mailbox_ref [devices, N] (peers write here); ready, arrived: semaphores."""
    me = lax.axis_index(axis)
    peers = [lax.rem(me + offset, devices) for offset in range(1, devices)]
    for peer in peers:
        pl.semaphore_signal(ready, device_id=peer)
    pl.semaphore_wait(ready, devices - 1)
    size = x_ref.shape[0]
    for start in range(0, size, chunk):
        part = pl.ds(start, chunk)
        x = x_ref[part]
        mailbox_ref[me, part] = x
        for peer in peers:
            plgpu.remote_ref(mailbox_ref.at[me, part], peer)[...] = x
    for peer in peers:
        pl.semaphore_signal(arrived, device_id=peer)
    pl.semaphore_wait(arrived, devices - 1)
    for start in range(0, size, chunk):
        part = pl.ds(start, chunk)
        total = mailbox_ref[0, part].astype(jnp.float32)
        for slot in range(1, devices):
            total = total + mailbox_ref[slot, part].astype(jnp.float32)
        y_ref[part] = total.astype(y_ref.dtype)


# -- the barrier-free variant: flags and mailbox that persist across calls -----------------------------
#
# XLA puts a cross-device barrier before every kernel above because the kernel's semaphores are
# scratch that XLA zeroes at each call, and its mailbox is an output buffer that is someone else's
# memory until the kernel starts. This variant takes both as inputs that the caller keeps alive across
# calls (`persistent_buffers`): state [4] int32 = (calls so far, `arrived` flag, unused, unused) and a
# mailbox [4, MAX_ELEMENTS] of two sets of two slots (row 2·set + device); call k uses set k % 2.
# Call k writes its x into its slot of the set on both devices, then the epoch k+1 into the peer's
# `arrived` flag, and waits until its own flag is at least k+1. Flags only grow, so they never need
# resetting. A device can run at most one call ahead of its peer (its call k+1 waits for the epoch
# k+2, which the peer writes in its own call k+1), so it writes only into the other set while the
# peer still reads this one: no handshake before the writes. Two devices only. Every device must make
# the same sequence of calls on the same buffers (SPMD programs do). The counter is a 32-bit integer
# that wraps after 2^32 calls on one pair of buffers (about 67 M tokens of an 8B model at 64 calls a
# token): the wait compares the signed difference flag - epoch with 0, which stays right across the
# wrap because the flag is never more than one call away from the epoch (tested on the GPU from a
# counter started 3 calls before the wrap, `persistent_buffers(start=...)`).

STATE_WORDS = 4
MAILBOX_ROWS = 4
_COUNT, _ARRIVED = 0, 1


def _exchange(ctx, count_ref, own_flag, peer_flag):
    """One thread: epoch = calls so far + 1; store it into the peer's flag (release, system scope); spin
    until our own flag has reached the epoch (acquire; flag - epoch >= 0 as a signed difference, so the
    32-bit wrap is harmless); store the epoch as the new call count. A warpgroup barrier before
    (everyone's stores are done) and after (everyone sees what arrived)."""
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    mgpu_utils.warpgroup_barrier()
    with mgpu_utils.single_thread(scope=mgpu_utils.ThreadSubset.WARPGROUP):
        count = mgpu_utils.inline_ptx(
            "ld.relaxed.gpu.global.b32 $0, [$1];",
            mgpu_utils.memref_ptr(count_ref),
            result_types=i32,
            has_side_effects=True,
        )
        epoch = arith.addi(count, mgpu_utils.c(1, i32))
        mgpu_utils.inline_ptx(
            "st.release.sys.global.b32 [$0], $1;", mgpu_utils.memref_ptr(peer_flag), epoch, has_side_effects=True
        )
        spin = scf.WhileOp([], [])
        with ir.InsertionPoint(spin.before.blocks.append()):
            seen = mgpu_utils.inline_ptx(
                "ld.acquire.sys.global.b32 $0, [$1];",
                mgpu_utils.memref_ptr(own_flag),
                result_types=i32,
                has_side_effects=True,
            )
            behind = arith.cmpi(arith.CmpIPredicate.slt, arith.subi(seen, epoch), mgpu_utils.c(0, i32))
            scf.condition(behind, [])
        with ir.InsertionPoint(spin.after.blocks.append()):
            scf.yield_([])
        mgpu_utils.inline_ptx(
            "st.relaxed.gpu.global.b32 [$0], $1;", mgpu_utils.memref_ptr(count_ref), epoch, has_side_effects=True
        )
    mgpu_utils.warpgroup_barrier()


_exchange_flags = plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 3)(_exchange)


def _persistent_kernel(
    x_ref, state_ref, mailbox_ref, *refs, axis: str, chunk: int, residual: bool, norm: tuple[int, float] | None
):
    """x_ref [N]; state_ref [4] int32 and mailbox_ref [4, MAX] persist across calls (inputs); refs: the
    residual r [N] when `residual`; the layer index [1] int32 and the norm weights [L, D] when `norm` =
    (D, eps); then the output y [N] = Σ x (+ r), rounded as `r + psum(x)` rounds, and with `norm` the
    RMSNorm of each row of y (D elements) [N], rounded as `model.rms_norm` rounds."""
    refs = list(refs)
    r_ref = refs.pop(0) if residual else None
    layer_ref, w_ref = (refs.pop(0), refs.pop(0)) if norm else (None, None)
    y_ref, *normed_ref = refs
    me = lax.axis_index(axis)
    peer = 1 - me
    # This call's set: rows first, first + 1. The parity is the count's low bit, right for negative
    # counts too (past 2^31 calls and across the 32-bit wrap), where lax.rem would go negative.
    first = 2 * jnp.bitwise_and(state_ref[_COUNT] + 1, 1)
    word = lambda i: state_ref.at[pl.ds(i, 1)]
    size = x_ref.shape[0]
    parts = [pl.ds(start, chunk) for start in range(0, size, chunk)]
    for part in parts:
        x = x_ref[part]
        mailbox_ref[first + me, part] = x
        plgpu.remote_ref(mailbox_ref.at[first + me, part], peer)[...] = x
    # What does not come from the peer is loaded before the wait, so its latency hides behind the peer's.
    residuals = [r_ref[part].astype(jnp.float32) for part in parts] if r_ref is not None else None
    if norm:
        dim, eps = norm
        layer = layer_ref[0]
        weights = [w_ref[layer, pl.ds(col, chunk)].astype(jnp.float32) for col in range(0, dim, chunk)]
    _exchange_flags(word(_COUNT), word(_ARRIVED), plgpu.remote_ref(word(_ARRIVED), peer))

    def summed(i):  # y's chunk i, stored, and returned in float32
        part = parts[i]
        total = mailbox_ref[first, part].astype(jnp.float32) + mailbox_ref[first + 1, part].astype(jnp.float32)
        total = total.astype(y_ref.dtype)  # the psum's rounding
        if residuals is not None:  # then the residual add's: one rounding of r + sum, as XLA adds two bf16 values
            total = (residuals[i] + total.astype(jnp.float32)).astype(y_ref.dtype)
        y_ref[part] = total
        return total.astype(jnp.float32)

    if not norm:
        for i in range(len(parts)):
            summed(i)
        return
    per_row = dim // chunk
    for row in range(0, len(parts), per_row):  # each row's chunks stay in registers between the two passes
        totals = [summed(row + j) for j in range(per_row)]
        squares = totals[0] * totals[0]
        for total in totals[1:]:
            squares = squares + total * total
        scale = lax.rsqrt(jnp.sum(squares) / dim + eps)  # one reduction over the warpgroup per row
        for j, total in enumerate(totals):
            normed = (total * scale).astype(y_ref.dtype)  # the model's first rounding, then the weight's
            normed_ref[0][parts[row + j]] = (normed.astype(jnp.float32) * weights[j]).astype(y_ref.dtype)


def persistent_buffers(mesh, axis: str, dtype, start: int = 0) -> tuple[jax.Array, jax.Array]:
    """Zeroed (state, mailbox) for `all_reduce_persistent` on a 1-D mesh of 2 devices, sharded over
    `axis`: keep them alive and pass the same arrays to every call (inside shard_map each device sees
    state [4] and mailbox [4, MAX_ELEMENTS]). `start` (tests) sets the call counter and both flags, as
    if `start` calls had run (an int32 bit pattern: -3 is 3 calls before the 32-bit wrap)."""
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = NamedSharding(mesh, PartitionSpec(axis))
    n = mesh.shape[axis]
    words = jnp.zeros((STATE_WORDS,), jnp.int32).at[_COUNT].set(start).at[_ARRIVED].set(start)
    state = jax.device_put(jnp.tile(words, n), sharding)
    mailbox = jax.device_put(jnp.zeros((n * MAILBOX_ROWS, MAX_ELEMENTS), dtype), sharding)
    return state, mailbox


def all_reduce_persistent(
    x: jax.Array,
    axis: str,
    state: jax.Array,
    mailbox: jax.Array,
    residual: jax.Array | None = None,
    norm: tuple | None = None,
):
    """Σ over the 2-device mesh axis `axis` of x (plus `residual`, of x's shape and dtype, when given:
    the block's residual add in the same kernel), by the barrier-free kernel (no XLA barrier, no
    zeroing): state [4] int32 and mailbox [4, MAX_ELEMENTS] are this device's shards of
    `persistent_buffers`, the same arrays at every call. Inside shard_map on Hopper GPUs.

    norm = (weights [L, D], layer, eps): also the RMSNorm that follows the sum, `weights[layer] * y /
    rms(y)` over each row of y [..., D] (`model.residual_norm`); returns (y, normed) then, else y. The
    weight row is read in place from its stack."""
    flat, chunk = _flat_chunks(x)
    if (
        lax.axis_size(axis) != 2
        or state.shape != (STATE_WORDS,)
        or mailbox.shape != (MAILBOX_ROWS, MAX_ELEMENTS)
        or mailbox.dtype != x.dtype
    ):
        raise ValueError(
            f"all_reduce_persistent runs on 2 devices with state [{STATE_WORDS}] and a mailbox "
            f"[{MAILBOX_ROWS}, {MAX_ELEMENTS}] of x's dtype; got {lax.axis_size(axis)} devices, "
            f"{state.shape}, {mailbox.dtype}{list(mailbox.shape)} for {x.dtype}"
        )
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"the residual must have x's shape and dtype {x.dtype}{list(x.shape)}; got "
            f"{residual.dtype}{list(residual.shape)}"
        )
    extra = [] if residual is None else [residual.reshape(-1)]
    norm_params = None
    if norm is not None:
        weights, layer, eps = norm
        dim = x.shape[-1]
        if weights.ndim != 2 or weights.shape[1] != dim or weights.dtype != x.dtype or dim % 128:
            raise ValueError(
                f"the norm weights must be a stack [L, {dim}] of {x.dtype} with D a multiple of 128; "
                f"got {weights.dtype}{list(weights.shape)}"
            )
        chunk = next(c for c in (_CHUNK, 2048, 1024, 512, 256, 128) if dim % c == 0)  # a chunk stays in one row
        extra += [jnp.asarray(layer, jnp.int32).reshape(1), weights]
        norm_params = (dim, float(eps))
    out = jax.ShapeDtypeStruct(flat.shape, x.dtype)
    y = plgpu.kernel(
        functools.partial(_persistent_kernel, axis=axis, chunk=chunk, residual=residual is not None, norm=norm_params),
        out_type=out if norm is None else (out, out),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane, skip_device_barrier=True),
    )(flat, state, mailbox, *extra)
    if norm is None:
        return y.reshape(x.shape)
    return y[0].reshape(x.shape), y[1].reshape(x.shape)


def fits(x: jax.Array) -> bool:
    """Whether the kernel takes x: 16-bit floats, a multiple of 128 elements, at most MAX_ELEMENTS."""
    return x.dtype in (jnp.bfloat16, jnp.float16) and x.size % 128 == 0 and x.size <= MAX_ELEMENTS


def _flat_chunks(x: jax.Array) -> tuple[jax.Array, int]:
    """x flattened and the elements each kernel step moves; a clear error where x does not `fit`."""
    if not fits(x):
        raise ValueError(
            f"the all-reduce kernel takes 16-bit floats, a multiple of 128 and at most "
            f"{MAX_ELEMENTS} elements; got {x.dtype} of shape {x.shape}"
        )
    flat = x.reshape(-1)
    return flat, next(c for c in (_CHUNK, 2048, 1024, 512, 256, 128) if flat.size % c == 0)


def all_reduce_kernel(x: jax.Array, axis: str, devices: int) -> jax.Array:
    """Σ over the mesh axis `axis` (of size `devices`) of x, by the Mosaic GPU kernel. Call it inside
    shard_map on Hopper GPUs; x must satisfy `fits`."""
    flat, chunk = _flat_chunks(x)
    y, _ = plgpu.kernel(
        functools.partial(_kernel, axis=axis, devices=devices, chunk=chunk),
        out_type=(jax.ShapeDtypeStruct(flat.shape, x.dtype), jax.ShapeDtypeStruct((devices, flat.size), x.dtype)),
        scratch_types=[plgpu.SemaphoreType.REGULAR, plgpu.SemaphoreType.REGULAR],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )(flat)
    return y.reshape(x.shape)


# The largest x (elements) the barrier-free kernel takes in `all_reduce`: above it psum was faster on 2
# H200s; a 70B row at batch 1 (8192) still takes the kernel (measurements: docs/log/).
PERSISTENT_MAX_ELEMENTS = 8192


def takes(x: jax.Array, axis: str, buffers: tuple[jax.Array, ...]) -> bool:
    """Whether `all_reduce` runs x through the barrier-free kernel with `buffers` (state, mailbox) of
    `persistent_buffers`, or () for none: 2 devices on `axis`, Hopper GPUs, 16-bit x of at most
    PERSISTENT_MAX_ELEMENTS in a mailbox of its dtype."""
    if len(buffers) not in (0, 2):
        raise ValueError(f"all-reduce buffers are (state, mailbox) or nothing, got {len(buffers)} arrays")
    return (
        len(buffers) == 2
        and lax.axis_size(axis) == 2
        and fits(x)
        and x.size <= PERSISTENT_MAX_ELEMENTS
        and buffers[1].dtype == x.dtype
        and on_hopper()
    )


def all_reduce(
    x: jax.Array, axis: str, residual: jax.Array | None = None, buffers: tuple[jax.Array, ...] = ()
) -> jax.Array:
    """lax.psum(x, axis) (plus `residual` when given, the residual add that follows a block's
    all-reduce), by the barrier-free kernel where it pays (`takes`: with `buffers`, this device's shards
    of `persistent_buffers`, on 2 Hopper GPUs, for 16-bit x of at most PERSISTENT_MAX_ELEMENTS; with the
    residual added in the kernel: one launch fewer); by `lax.psum` (then the add) everywhere else. The
    buffers must be arguments of the jitted program, not constants it closes over (see the module
    docstring). (The kernel behind XLA's barrier, `all_reduce_kernel`, is slower than psum at every size
    measured, so it is never picked here.)"""
    if takes(x, axis, buffers) and (residual is None or (residual.shape, residual.dtype) == (x.shape, x.dtype)):
        return all_reduce_persistent(x, axis, *buffers, residual=residual)
    total = lax.psum(x, axis)
    return total if residual is None else residual + total


@functools.cache
def on_hopper() -> bool:
    """Whether JAX's first device is a Hopper GPU (compute capability 9.0), where these kernels run."""
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"

"""Tensor-parallel (Megatron-style) decode over a 1-D device mesh with `jax.shard_map`.

Every device runs our own `Transformer` forward on a shard config (`config.shard_config`): N/tp query
heads, K/tp kv heads, F/tp ffn columns and ceil(V/tp) vocab rows, built with a `config.TensorParallel`
setting, so that attention psums after o_proj and the MLP psums after down_proj (`jaxdecode.model`).
The weights are sliced:

    q/k/v_proj [D, N*H] and their biases: by columns (whole heads)   o_proj [N*H, D]: by rows
    gate/up_proj [D, F]: by columns                                   down_proj [F, D]: by rows
    embed_tokens [V, D]: by rows          lm_head [D, V]: by columns (vocab padded to a multiple of tp)
    norms and RoPE frequencies: replicated                            KV cache [B, S, K, H]: by kv heads

Quantized weights (`QuantizedWeight`: codes [N, K], scales and offsets [K/G, N]) are split the same way,
each array along its dense weight's axis (`quantized_specs`), so every device keeps its shard quantized;
a row-parallel shard must hold whole groups (K/tp a multiple of G).

Contiguous head blocks keep GQA groups whole: device i holds q heads iN/tp.. and kv heads iK/tp..,
and q head n still reads kv head n // G. The embedding is a masked local lookup + psum; the LM head
gives local logits [B, T, V_pad/tp], all-gathered (tiled) to [B, T, V_pad] and cut to [B, T, V], so
the zero-padded vocab rows never reach sampling. Per step: one psum of [B, T, D] for the embedding,
two per layer, and one all-gather of the logits.

With kernel looping the per-device forward goes through `looping.kernel_loop` like the one-device
forward: the psums sit inside the layer calls, the calls stay identical, and they become one scan.
On 2 Hopper GPUs the layer psums of small activations run as one peer-to-peer kernel instead of NCCL
(`kernels.allreduce`, `allreduce="kernel"`, the default; "psum" keeps NCCL): its flags and mailbox
are made once here, passed with the weights (`step_params`) and handed down to every all-reduce.
The plan is traced inside a shard_map, where the axis name is bound.

tp must divide n_heads, n_kv_heads and ffn_dim. The default model, SmolLM2-135M (9 heads, 3 kv
heads), splits over 3 devices, not 2. On the CPU, fake devices come from
XLA_FLAGS=--xla_force_host_platform_device_count=N (set before JAX starts).

Known debt: `TPForward.from_model` needs the whole model on one device first; only random weights
(`TPForward.random`) are made directly in place, shard by shard.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import NamedTuple

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off, before any NCCL communicator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdecode.cache import KVCache
from jaxdecode.config import ModelConfig, TensorParallel, shard_config
from jaxdecode.hooks import kernel_calls, kernel_stacked_dot
from jaxdecode.looped_model import LOOP_MODES
from jaxdecode.looping import LoopPlan, Packed, kernel_loop
from jaxdecode.model import Hook, Transformer, rope_cos_sin, rope_inv_freq
from jaxdecode.quantized import is_quantized
from kernels import allreduce as kernels_allreduce

AXIS = "tp"
_PARAMS, _K, _V = 0, 3, 4  # argument positions of `TPForward._local_forward` that the loop plan packs


class TPParams(NamedTuple):
    """`TPForward.step_params` with the all-reduce kernel: the weights and its persistent buffers."""

    weights: object
    comm: tuple


def make_mesh(tp: int, devices=None) -> Mesh:
    """A 1-D mesh ("tp",) over the first tp devices; ValueError when there are fewer."""
    devices = list(jax.devices() if devices is None else devices)
    if tp > len(devices):
        hint = (
            f"; on the CPU set XLA_FLAGS=--xla_force_host_platform_device_count={tp}"
            if devices[0].platform == "cpu"
            else ""
        )
        raise ValueError(f"--tp {tp} needs {tp} devices, but JAX sees {len(devices)} ({devices[0].platform}){hint}")
    return Mesh(np.array(devices[:tp]), (AXIS,))


def _partition(global_shape, local_shape) -> P:
    """The spec that slices global_shape into local_shape: AXIS on each axis that shrinks."""
    return P(*(AXIS if g != l else None for g, l in zip(global_shape, local_shape)))


def _under_axis(mesh: Mesh, fn):
    """fn(), called while a shard_map over `mesh` is traced, so that collectives over AXIS trace."""
    out = []

    def body(x):
        out.append(fn())
        return x

    jax.eval_shape(
        jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False),
        jax.ShapeDtypeStruct((), jnp.float32),
    )
    return out[0]


def _spec(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def quantized_specs(state, global_specs, local_specs):
    """(global, local) spec trees in `state`'s structure: where `state` holds a `QuantizedWeight`, its codes
    [N, K], scales and offsets [K/G, N] at the dense spec's global shape (the vocab padded) and shard
    shape, in the dense weight's orientation ([K, N], or [N, K] for the embedding table). ValueError where
    a shard would cut a group of K."""

    def orient(w, g, shape):  # (K, N) of a dense [A, B] spec, as the quantized weight lays them out
        k, n = w.shape
        same = k == g.shape[0] and n <= g.shape[1]  # judged on the global spec: a shard shrinks A or B
        return tuple(shape) if same else tuple(shape[::-1])

    def convert(path, w, g, loc, which: int):
        if not is_quantized(w):
            return (g, loc)[which]
        k, n = orient(w, g, (g, loc)[which].shape)
        two_level = w.super_scales is not None
        block = w.shape[-2] // w.super_scales.shape[-2] if two_level else w.group  # K per row of the top scales
        if which == 1 and k % block:
            keys = (str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))) for p in path)
            name = ".".join(key for key in keys if key != "value")
            unit = "super-block" if two_level else "group"
            raise ValueError(
                f"{name}: a quantized weight of {w.shape[0]} inputs in {unit}s of {block} splits into shards of "
                f"{k} inputs, which cut a {unit}; use a tp that leaves a multiple of {block}, or --dequantize"
            )
        rows = lambda a, per: None if a is None else jax.ShapeDtypeStruct((k // per, n), a.dtype)  # noqa: E731
        return dataclasses.replace(
            w,
            codes=jax.ShapeDtypeStruct((n, k), w.codes.dtype),
            scales=rows(w.scales, w.group),
            offsets=rows(w.offsets, w.group),
            super_scales=rows(w.super_scales, block),
            super_offsets=rows(w.super_offsets, block),
        )

    return tuple(
        jax.tree_util.tree_map_with_path(
            lambda path, w, g, loc: convert(path, w, g, loc, i), state, global_specs, local_specs, is_leaf=is_quantized
        )
        for i in (0, 1)
    )


class TPForward:
    """forward(params, tokens, positions, cache) over tp devices: the Engine's tensor-parallel path.

    Build it with `from_model` (slice a loaded model) or `random` (random weights made in place).
    `params` are the global arrays (vocab padded), placed with NamedSharding; with `loop_layers`
    they are packed (stacked [L, ...]) for the looped forward, like `LoopedForward.pack_params`.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        tp: int,
        *,
        dtype,
        loop_layers: bool = True,
        loop_mode: str = "slice",
        devices=None,
        allreduce: str = "kernel",
        embed_kernel: bool = False,
        stacked_dot: Callable | None = None,
        hooks: Mapping[Hook | str, Callable | None] | None = None,
        like=None,
    ):
        """`like`: the state of the model to be split (`from_model`), whose quantized weights replace the
        dense shapes of the shard model's parameters with their codes, scales and offsets."""
        if loop_mode not in LOOP_MODES:
            raise ValueError(f"loop mode must be one of {LOOP_MODES}, got {loop_mode!r}")
        self.cfg, self.tp, self.dtype = cfg, tp, jnp.dtype(dtype)
        self.shard_cfg = shard_config(cfg, tp)
        self.settings = TensorParallel(AXIS, allreduce, embed_kernel)
        self._stacked_dot = stacked_dot or kernel_stacked_dot
        self._hooks = hooks
        self.mesh = make_mesh(tp, devices)
        # The barrier-free all-reduce kernel's flags and mailbox (kernels.allreduce.persistent_buffers):
        # made once, they ride in `step_params`, so every jitted step gets the same arrays as arguments.
        self._comm = ()
        if (
            allreduce == "kernel"
            and tp == 2
            and self.dtype in (jnp.bfloat16, jnp.float16)
            and kernels_allreduce.on_hopper()
        ):
            self._comm = kernels_allreduce.persistent_buffers(self.mesh, AXIS, self.dtype)
        self.loop_layers, self.mode = loop_layers, loop_mode
        local = nnx.eval_shape(lambda: Transformer(self.shard_cfg, dtype=dtype, rngs=nnx.Rngs(0), tp=self.settings))
        self.graphdef, local_state = nnx.split(local)
        padded = cfg.replace(vocab_size=self.shard_cfg.vocab_size * tp)
        _, self._global_specs = nnx.split(nnx.eval_shape(lambda: Transformer(padded, dtype=dtype, rngs=nnx.Rngs(0))))
        self._local_specs = jax.tree.map(_spec, local_state)
        if like is not None:
            self._global_specs, self._local_specs = quantized_specs(like, self._global_specs, self._local_specs)
        self._plans: dict[tuple, LoopPlan] = {}
        self.layout = self.plan(1, 1, 1, jnp.float32).layouts[_PARAMS] if loop_layers else None
        global_p, local_p = self._packed(self._global_specs), self._packed(self._local_specs)
        self.param_specs = jax.tree.map(lambda g, l: _partition(g.shape, l.shape), global_p, local_p)
        self.param_shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.param_specs)
        self.params = None  # set by from_model / random

    def _packed(self, tree):
        return jax.eval_shape(lambda t: Packed.pack(t, self.layout), tree) if self.loop_layers else tree

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_model(cls, model: Transformer, tp: int, **kwargs) -> TPForward:
        """Slice a model's weights over tp devices (the model stays as it is). Quantized weights are split
        as they are: codes, scales and offsets along the dense weight's split axis (`quantized_specs`)."""
        _, state = nnx.split(model)
        quantized = any(is_quantized(w) for w in jax.tree.leaves(state, is_leaf=is_quantized))
        self = cls(model.cfg, tp, dtype=model.embed_tokens.dtype, like=state if quantized else None, **kwargs)
        flat, treedef = jax.tree_util.tree_flatten_with_path(state)
        if treedef != jax.tree.structure(self._global_specs):
            raise ValueError(f"model structure differs from {model.cfg.name}'s")
        unpacked_shardings = jax.tree.leaves(
            jax.tree.map(
                lambda g, l: NamedSharding(self.mesh, _partition(g.shape, l.shape)),
                self._global_specs,
                self._local_specs,
            )
        )
        placed = []
        for (_, x), spec, sharding in zip(flat, jax.tree.leaves(self._global_specs), unpacked_shardings):
            if x.shape != spec.shape:  # the vocab axis: zero rows (codes and scales: zero columns) up to V_pad
                x = jnp.pad(x, [(0, g - n) for g, n in zip(spec.shape, x.shape)])
            placed.append(jax.device_put(x, sharding))
        state = jax.tree.unflatten(treedef, placed)
        if self.loop_layers:
            state = jax.jit(lambda s: Packed.pack(s, self.layout), out_shardings=self.param_shardings)(state)
        self.params = state
        return self

    @classmethod
    def random(cls, cfg: ModelConfig, tp: int, *, dtype, seed: int = 0, **kwargs) -> TPForward:
        """Random weights made directly as shards on their devices, already packed: no full copy anywhere.

        Values are a hash of (seed, global index): uniform with std 1/sqrt(fan_in) for projections
        (1/sqrt(D) for the embedding), ones for norms, zeros for biases. They do not depend on tp (they
        do differ between looped and unrolled, and from `init_random`).
        """
        self = cls(cfg, tp, dtype=dtype, **kwargs)
        flat, treedef = jax.tree_util.tree_flatten_with_path(self._global_specs)
        paths = [jax.tree_util.keystr(p) for p, _ in flat]
        specs = [s for _, s in flat]

        def make(i: int, shape, sharding):  # leaf i of the unpacked state, at shape (stacked or not)
            path = paths[i]
            if path.endswith("['inv_freq'].value"):
                return jax.device_put(rope_inv_freq(cfg), sharding)
            if "bias" in path or "norm" in path:
                fill = 0.0 if "bias" in path else 1.0
                return jax.jit(lambda: jnp.full(shape, fill, self.dtype), out_shardings=sharding)()
            std = specs[i].shape[-1 if "embed_tokens" in path else -2] ** -0.5
            return jax.jit(lambda: _hash_uniform(shape, seed * 7919 + i, std, self.dtype), out_shardings=sharding)()

        if not self.loop_layers:
            shardings = jax.tree.leaves(self.param_shardings)
            self.params = jax.tree.unflatten(
                treedef, [make(i, s.shape, sh) for i, (s, sh) in enumerate(zip(specs, shardings))]
            )
            return self
        lay, sh = self.layout, self.param_shardings  # a Packed of shardings
        stacks = [make(g[0], (len(g), *specs[g[0]].shape), s) for g, s in zip(lay.groups, sh.stacks)]
        rest = [make(i, specs[i].shape, s) for i, s in zip(lay.rest, sh.rest)]
        self.params = Packed(stacks, rest, lay)
        return self

    # -- the forward ----------------------------------------------------------------------------

    @property
    def step_params(self):
        """What the Engine passes to `forward` as params: the weights, and the all-reduce kernel's
        persistent buffers when it has them (as jit arguments they stay the same arrays every call)."""
        return TPParams(self.params, self._comm) if self._comm else self.params

    def _local_forward(self, params, tokens, positions, k_caches, v_caches, *comm):
        """One device's forward: local weights and caches, full logits [B, T, V] out. `comm`: this
        device's shards of the all-reduce kernel's persistent buffers, or nothing."""
        model = nnx.merge(self.graphdef, params)
        vocab = model.cfg.vocab_size  # V_pad / tp rows here
        with jax.named_scope("embed"):
            local = tokens - jax.lax.axis_index(AXIS) * vocab  # [B, T], index into this device's rows
            mine = (local >= 0) & (local < vocab)  # [B, T]
            x = jnp.where(mine[..., None], model.embed_tokens(jnp.where(mine, local, 0)), 0)  # [B, T, D]
            # [B, T, D]; with embed_kernel: by the all-reduce kernel where it takes x (decode on 2 Hopper GPUs)
            if self.settings.embed_kernel:
                x = kernels_allreduce.all_reduce(x, AXIS, buffers=comm)
            else:
                x = jax.lax.psum(x, AXIS)
            cos, sin = rope_cos_sin(model.inv_freq[...], positions)  # [B, T, H]
        x, new_k, new_v = model.run_layers(x, k_caches, v_caches, positions, cos, sin, comm)
        with jax.named_scope("lm_head"):
            x = model.norm(x)
            logits = model.embed_tokens.attend(x) if model.lm_head is None else model.lm_head(x)  # [B, T, V_pad/tp]
            logits = jax.lax.all_gather(logits, AXIS, axis=2, tiled=True)[..., : self.cfg.vocab_size]  # [B, T, V]
        return logits.astype(jnp.float32), new_k, new_v

    def plan(self, batch: int, tokens: int, cache_len: int, cache_dtype) -> LoopPlan:
        """The loop plan of the per-device forward for one input shape (traced under the mesh axis)."""
        key = (batch, tokens, cache_len, jnp.dtype(cache_dtype).name)
        if key not in self._plans:
            c = self.shard_cfg
            ints = jax.ShapeDtypeStruct((batch, tokens), jnp.int32)
            kv = [jax.ShapeDtypeStruct((batch, cache_len, c.n_kv_heads, c.head_dim), cache_dtype)] * c.n_layers
            comm = [jax.ShapeDtypeStruct((a.shape[0] // self.tp, *a.shape[1:]), a.dtype) for a in self._comm]
            args = (self._local_specs, ints, ints, kv, kv, *comm)
            self._plans[key] = _under_axis(
                self.mesh,
                lambda: kernel_loop(
                    self._local_forward,
                    *args,
                    index_mode="slice" if self.mode == "slice" else "whole",
                    packed_outputs={1: _K, 2: _V},
                    stacked_dot=self._stacked_dot if self.mode == "inplace" else None,
                    stacked_calls=kernel_calls(self.settings, self._hooks) if self.mode == "inplace" else None,
                ),
            )
        return self._plans[key]

    def forward(self, params, tokens, positions, cache: KVCache):
        """Logits [B, T, V] (replicated) and the new cache, for tokens and positions [B, T]."""
        b, t = tokens.shape
        fn = self._local_forward
        if self.loop_layers:
            stack = cache.k.stacks[0]  # [L, B, S, K, H]
            fn = self.plan(b, t, stack.shape[2], stack.dtype).looped
        kv_spec = jax.tree.map(lambda a: P(*(None,) * (a.ndim - 2), AXIS, None), (cache.k, cache.v))  # K axis
        params, comm = (params.weights, params.comm) if isinstance(params, TPParams) else (params, ())
        if len(comm) != len(self._comm):
            raise ValueError(
                "this TPForward runs the all-reduce kernel: pass `step_params` (the weights and its "
                "buffers) as params, not `params`"
            )
        logits, k, v = jax.shard_map(
            fn,
            mesh=self.mesh,
            in_specs=(self.param_specs, P(), P(), *kv_spec, *(P(AXIS),) * len(comm)),
            out_specs=(P(), *kv_spec),
            check_vma=False,
        )(params, tokens, positions, cache.k, cache.v, *comm)
        return logits, KVCache(k, v)

    def new_cache(self, batch: int, length: int, dtype) -> KVCache:
        """A zero cache sharded by kv heads (packed when looping); made in place on each device."""

        def make():
            cache = KVCache.init(self.cfg, batch, length, dtype)
            if self.loop_layers:
                layouts = self.plan(batch, 1, length, dtype).layouts
                cache = KVCache(Packed.pack(cache.k, layouts[_K]), Packed.pack(cache.v, layouts[_V]))
            return cache

        shape = jax.eval_shape(make)
        shardings = jax.tree.map(lambda a: NamedSharding(self.mesh, P(*(None,) * (a.ndim - 2), AXIS, None)), shape)
        return jax.jit(make, out_shardings=shardings)()


def _hash_uniform(shape, seed: int, std: float, dtype):
    """Uniform values in [-sqrt(3), sqrt(3)) * std from a hash of each element's global index."""
    h = jnp.full(shape, seed * 0x9E3779B1 & 0xFFFFFFFF, jnp.uint32)
    for axis, mult in zip(range(len(shape)), (0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F, 0x165667B1)):
        h = (h + jax.lax.broadcasted_iota(jnp.uint32, shape, axis)) * jnp.uint32(mult)
        h = h ^ (h >> 15)
    h = (h ^ (h >> 13)) * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 16)
    u = (h >> 8).astype(jnp.float32) * (2.0**-24)  # [0, 1)
    return ((u * 2 - 1) * (3**0.5 * std)).astype(dtype)

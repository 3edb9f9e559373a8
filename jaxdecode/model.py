"""Flax NNX Llama-family decoder: RMSNorm, RoPE (with llama3 scaling), GQA attention, SwiGLU MLP.

Parameter names follow the Hugging Face checkpoint names (`embed_tokens`, `layers.i.self_attn.q_proj`,
`mlp.gate_proj`, `input_layernorm`, ...) so that loaders need no table. One difference: linear weights
are stored as [in, out] (x @ weight), the transpose of the checkpoint's [out, in].

Tensor parallelism (`jaxdecode.tp`) runs this same model on a per-device shard config, built with a
`TensorParallel` setting: attention and the MLP each return this device's partial sum (its heads, its
ffn columns), and the decoder layer all-reduces it into the residual stream (`tp_residual_add`).

The layer loop is a plain Python loop. Each layer is applied through `decoder_layer_call`, one
module-level `jax.jit` function, so every layer call appears in the jaxpr as a call of the same jaxpr:
that is the call boundary the kernel-looping pass (`jaxdecode.looping`) finds and turns into a scan.
"""

from __future__ import annotations

import enum
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdecode.config import ModelConfig, TensorParallel
from jaxdecode.kquants import K_FORMATS, MIXES, mix_format, quantize_k
from jaxdecode.quantized import DEFAULT_GROUP, SCALE_DTYPE, check_quantized, embed_rows, is_quantized, matmul, quantize
from kernels import allreduce

Array = jax.Array


class Hook(enum.StrEnum):
    """The model's named calls that the in-place looped decode may hand to kernels.

    Each is a module-level `jax.jit` function (below, or `jaxdecode.quantized.quant_dot`), so it appears in
    the jaxpr as a call whose name is the member's value; the engine's hook table
    (`hooks.KERNEL_CALLS`) and `rdu`'s GPU model key on these members, and a test checks that each
    appears in the traced decode step (QUANT_DOT: of a model with quantized weights).
    """

    QKV_ATTEND = "qkv_attend"  # projections, RoPE, cache write and attention for one new token
    QKV = "qkv"  # the three projections
    SDPA = "sdpa"  # attention over the cache
    SWIGLU = "swiglu"  # the MLP's gate and up projections and their product
    MLP = "mlp"  # the whole MLP block: gate, up, their product and down
    RMS_NORM = "rms_norm"  # a norm
    RESIDUAL_NORM = "residual_norm"  # the attention's residual add and the MLP's input norm
    QUANT_DOT = "quant_dot"  # x times a quantized weight (codes and scales)


def tp_residual_add(x: Array, block_out: Array, tp: TensorParallel | None, comm: tuple[Array, ...] = ()) -> Array:
    """x + the block's output. Under tensor parallelism (`tp` given) `block_out` is this device's
    partial sum and is all-reduced first: by XLA's psum, or with tp.allreduce == "kernel" by
    `kernels.allreduce.all_reduce`, a peer-to-peer kernel that also does the add where it pays, with
    `comm` its persistent buffers (or none)."""
    if tp is None:
        return x + block_out
    if tp.allreduce == "kernel":
        return allreduce.all_reduce(block_out, tp.axis, residual=x, buffers=comm)
    return x + jax.lax.psum(block_out, tp.axis)


@functools.partial(jax.jit, static_argnames=("tp",))
def residual_norm(
    x: Array, block_out: Array, weight: Array, eps: Array | float, *comm: Array, tp: TensorParallel | None
) -> tuple[Array, Array]:
    """(s, rms_norm(s) · weight) for s = `tp_residual_add(x, block_out, tp, comm)`: the attention block's
    residual add and the MLP's input norm. x, block_out [..., D]; weight [D]; `comm` as in
    `decoder_layer_call`. One module-level jitted call, so that the in-place looped decode can run the
    split sum or the all-reduce, the add and the norm as one kernel (`Hook.RESIDUAL_NORM`)."""
    s = tp_residual_add(x, block_out, tp, comm)
    return s, rms_norm(s, weight, eps)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies [H/2] in float32, with llama3 frequency scaling when configured.

    inv_freq[i] = theta^(-2i/H). Llama 3 scaling divides low frequencies (wavelength above
    original_max / low_freq_factor) by `factor`, keeps high ones, and interpolates in between.
    """
    h = cfg.head_dim
    inv_freq = 1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, h, 2, dtype=np.float32) / np.float32(h)))
    inv_freq = inv_freq.astype(np.float32)
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = (2 * np.pi / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq).astype(np.float32)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(inv_freq: Array, positions: Array) -> tuple[Array, Array]:
    """cos and sin [B, T, H] (float32) for integer positions [B, T], halves repeated (rotate-half form)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [B, T, H]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate x [B, T, N, H] by the angles in cos, sin [B, T, H] (the rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # [B, T, N, H]
    out = x.astype(jnp.float32) * cos[:, :, None, :] + rotated.astype(jnp.float32) * sin[:, :, None, :]
    return out.astype(x.dtype)


class Linear(nnx.Module):
    """y = x @ weight (+ bias); weight [in, out]."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool = False, dtype, rngs: nnx.Rngs):
        std = d_in**-0.5
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (d_in, d_out), jnp.float32).astype(dtype) * std)
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None

    def __call__(self, x: Array) -> Array:  # x: [..., in]
        y = matmul(x, self.weight.get_value())  # [..., out]
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class Embedding(nnx.Module):
    """Token embeddings [V, D] (dense, or a `QuantizedWeight` whose codes are [V, D]); `attend` is the tied
    output projection x @ embeddingᵀ. `dtype` is the activations' dtype, also for a quantized table."""

    def __init__(self, vocab: int, dim: int, *, dtype, rngs: nnx.Rngs):
        init = nnx.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)  # nnx.Embed's default
        self.embedding = nnx.Param(init(rngs.params(), (vocab, dim), dtype))  # [V, D]
        self.dtype = dtype

    def __call__(self, ids: Array) -> Array:  # ids: [B, T] int32
        return embed_rows(self.embedding.get_value(), ids, self.dtype)  # [B, T, D]

    def attend(self, x: Array) -> Array:  # x: [..., D]
        table = self.embedding.get_value()
        return matmul(x, table) if is_quantized(table) else x @ table.T  # [..., V]


class RMSNorm(nnx.Module):
    """x / rms(x) * weight, computed in float32."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: Array) -> Array:  # x: [..., D]
        return rms_norm(x, self.weight[...], np.float32(self.eps))  # a strong f32: no convert in the call


@jax.jit
def rms_norm(x: Array, weight: Array, eps: Array | float) -> Array:
    """weight * x / rms(x) over the last axis, in float32, rounded to x's dtype before the weight.
    One module-level jitted function, so the in-place looped decode can run it as one kernel that
    reads the stacked weight in place (`kernel_rms_norm`); eps stays an argument the hook can read."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.q_proj = Linear(cfg.dim, cfg.q_dim, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(cfg.dim, cfg.kv_dim, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(cfg.dim, cfg.kv_dim, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(cfg.q_dim, cfg.dim, dtype=dtype, rngs=rngs)

    def __call__(
        self,
        x: Array,  # [B, T, D]
        k_cache: Array,  # [B, S, K, H]
        v_cache: Array,  # [B, S, K, H]
        positions: Array,  # [B, T] int32, position of each query token
        cos: Array,  # [B, T, H]
        sin: Array,  # [B, T, H]
    ) -> tuple[Array, Array, Array]:
        cfg = self.cfg
        b, t, _ = x.shape
        projs = (self.q_proj, self.k_proj, self.v_proj)
        biases = [p.bias[...] for p in projs] if cfg.qkv_bias else []
        out, k_cache, v_cache = qkv_attend(
            x, k_cache, v_cache, positions, cos, sin, *(p.weight.get_value() for p in projs), *biases
        )  # [B, T, N, H]
        out = out.reshape(b, t, cfg.q_dim)  # [B, T, N*H]
        out = self.o_proj(out)  # [B, T, D]; under tensor parallelism a partial sum over this device's heads
        return out, k_cache, v_cache


@jax.jit
def qkv_attend(
    x: Array,
    k_cache: Array,
    v_cache: Array,
    positions: Array,
    cos: Array,
    sin: Array,
    w_q: Array,
    w_k: Array,
    w_v: Array,
    *biases: Array,
) -> tuple[Array, Array, Array]:
    """The projections (`qkv`), RoPE on q and k, then `attend` (the cache write and the attention):
    x [B, T, D] -> (out [B, T, N, H], k_cache, v_cache); caches [B, S, K, H]; cos, sin [B, T, H].
    One module-level jitted call, so the in-place looped decode can run everything between the q·k·v
    GEMM and the attention (split sum, bias, RoPE, the cache writes) as one kernel
    (`hooks.kernel_qkv_attend`); where that hook declines, the inner calls' hooks apply."""
    b, t, _ = x.shape
    kv_heads, head_dim = k_cache.shape[-2:]
    q, k, v = qkv(x, w_q, w_k, w_v, *biases)  # [B, T, N*H], [B, T, K*H] x 2
    q = q.reshape(b, t, -1, head_dim)  # [B, T, N, H]
    k = k.reshape(b, t, kv_heads, head_dim)  # [B, T, K, H]
    v = v.reshape(b, t, kv_heads, head_dim)  # [B, T, K, H]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return attend(q, k.astype(k_cache.dtype), v.astype(v_cache.dtype), k_cache, v_cache, positions)


@jax.jit
def qkv(x: Array, w_q: Array, w_k: Array, w_v: Array, *biases: Array) -> tuple[Array, Array, Array]:
    """(x @ w_q, x @ w_k, x @ w_v), each plus its bias when `biases` = (b_q, b_k, b_v) is given: what
    three `Linear`s compute. x [..., D]; w_q [D, N*H], w_k, w_v [D, K*H]. One module-level jitted
    function, so the in-place looped decode can run it as one three-weight kernel (`kernel_qkv`)."""
    with jax.named_scope("qkv"):
        outs = [matmul(x, w) for w in (w_q, w_k, w_v)]  # [..., N*H], [..., K*H], [..., K*H]
        if biases:
            outs = [y + bias for y, bias in zip(outs, biases, strict=True)]
        return tuple(outs)


@jax.jit
def attend(
    q: Array, k: Array, v: Array, k_cache: Array, v_cache: Array, positions: Array
) -> tuple[Array, Array, Array]:
    """Writes each sequence's T new rows k, v [B, T, K, H] into the cache [B, S, K, H] at its start
    position positions[:, 0], then attends (`sdpa`); returns (out [B, T, N, H], k_cache, v_cache).
    One module-level jitted call: the in-place looped decode writes the rows into its carried cache
    stacks in place, and `qkv_attend`'s hook replaces it with its own epilogue kernel."""
    b = q.shape[0]
    with jax.named_scope("kv_cache_update"):
        # One sequence is one dynamic_update_slice: vmap would make it a scatter, which XLA guards
        # with an out-of-range check (two more kernels per cache write on a GPU; the values are equal).
        if b == 1:
            write = lambda c, new, p: jax.lax.dynamic_update_slice(c, new, (0, p[0], 0, 0))  # noqa: E731
        else:
            write = jax.vmap(lambda c, new, p: jax.lax.dynamic_update_slice(c, new, (p, 0, 0)))
        k_cache = write(k_cache, k, positions[:, 0])  # [B, S, K, H]
        v_cache = write(v_cache, v, positions[:, 0])  # [B, S, K, H]
    return sdpa(q, k_cache, v_cache, positions), k_cache, v_cache


@jax.jit
def sdpa(q: Array, k_cache: Array, v_cache: Array, positions: Array) -> Array:
    """Causal attention of q [B, T, N, H] over the cache [B, S, K, H]; returns [B, T, N, H] in q's dtype.

    A query at position p sees cache rows 0..p (positions [B, T]); rows past a sequence's length hold
    stale or padding values and are always in the future. One module-level jitted function, so the
    in-place looped decode (`jaxdecode.looping.inplace`) can hand it to a kernel that reads the stacked cache.

    The softmax of the scaled scores is exp(scale * (x - max x)) over its sum, in f32: the max is subtracted
    before the scale, so the argument is exactly 0 at the max and <= 0 elsewhere: there is no multiply-add
    for XLA to contract (scale * x - max was one, rounded unlike the max's own product; half an ulp is 256
    at scores near 4e9, far past exp's range, and every term underflowed to 0/0). The sum is therefore >= 1
    for finite scores; a row with every score masked gives zeros; a score that overflowed to +inf gives
    NaN, which the sampler refuses.
    """
    b, t, n, h = q.shape
    s, kv_heads = k_cache.shape[1], k_cache.shape[2]
    with jax.named_scope("sdpa"):
        q = q.reshape(b, t, kv_heads, n // kv_heads, h)  # [B, T, K, G, H]
        scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k_cache, preferred_element_type=jnp.float32)
        visible = jnp.arange(s)[None, None, :] <= positions[:, :, None]  # [B, T, S]
        scores = jnp.where(visible[:, None, None, :, :], scores, -jnp.inf)  # [B, K, G, T, S]
        top = jnp.max(scores, axis=-1, keepdims=True)  # [B, K, G, T, 1]
        top = jnp.where(top == -jnp.inf, 0.0, top)  # a fully masked row: exp(-inf) terms, not -inf - -inf
        e = jnp.exp((scores - top) * (h**-0.5))  # [B, K, G, T, S]
        total = jnp.sum(e, axis=-1, keepdims=True)  # [B, K, G, T, 1]
        probs = (e / jnp.where(total > 0, total, 1.0)).astype(v_cache.dtype)  # [B, K, G, T, S]
        out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v_cache, preferred_element_type=jnp.float32)
        return out.astype(q.dtype).reshape(b, t, n, h)  # [B, T, N, H]


@jax.jit
def swiglu(x: Array, w_gate: Array, w_up: Array) -> Array:
    """silu(x @ w_gate) * (x @ w_up): x [..., D], weights [D, F] -> [..., F]. One module-level jitted
    function, so the in-place looped decode can run it as one two-weight kernel (`kernel_swiglu`)."""
    return jax.nn.silu(matmul(x, w_gate)) * matmul(x, w_up)


@jax.jit
def mlp(x: Array, w_gate: Array, w_up: Array, w_down: Array) -> Array:
    """swiglu(x, w_gate, w_up) @ w_down: x [..., D], w_down [F, D] -> [..., D]. One module-level jitted
    function, so the in-place looped decode can run the block as one kernel (`kernel_mlp`)."""
    return matmul(swiglu(x, w_gate, w_up), w_down)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.gate_proj = Linear(cfg.dim, cfg.ffn_dim, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(cfg.dim, cfg.ffn_dim, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(cfg.ffn_dim, cfg.dim, dtype=dtype, rngs=rngs)
        self.cfg = cfg

    def __call__(self, x: Array) -> Array:  # x: [B, T, D]
        # [B, T, D]; under tensor parallelism a partial sum over this device's F/tp columns
        weights = (self.gate_proj, self.up_proj, self.down_proj)
        return mlp(x, *(w.weight.get_value() for w in weights))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, tp: TensorParallel | None = None):
        self.cfg = cfg
        self.tp = tp
        self.input_layernorm = RMSNorm(cfg.dim, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x, k_cache, v_cache, positions, cos, sin, comm=()):  # x: [B, T, D]; caches [B, S, K, H]
        with jax.named_scope("attention"):
            attn, k_cache, v_cache = self.self_attn(self.input_layernorm(x), k_cache, v_cache, positions, cos, sin)
        with jax.named_scope("mlp"):
            norm = self.post_attention_layernorm
            x, h = residual_norm(
                x, attn, norm.weight[...], np.float32(norm.eps), *comm, tp=self.tp
            )  # the attention's residual add, the MLP's input norm
            x = tp_residual_add(x, self.mlp(h), self.tp, comm)
        return x, k_cache, v_cache


@jax.jit(static_argnums=0)
def decoder_layer_call(graphdef, state, x, k_cache, v_cache, positions, cos, sin, *comm):
    """Apply one decoder layer given as (graphdef, state): the call boundary the looping pass finds.

    `comm`: the tensor-parallel all-reduce kernel's persistent buffers (`kernels.allreduce.all_reduce`),
    or nothing. They are arguments, never state read from the caller's context, because jit caches this
    function's trace: a trace that had read them from a context would keep the first caller's tracers."""
    return nnx.merge(graphdef, state)(x, k_cache, v_cache, positions, cos, sin, comm)


class Transformer(nnx.Module):
    """The decoder. `__call__` maps tokens [B, T] and a KV cache to logits [B, T, V] and the new cache.

    `tp`: set on one device's shard of a tensor-parallel model (`jaxdecode.tp`), None otherwise."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs, tp: TensorParallel | None = None):
        self.cfg = cfg
        self.tp = tp
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.dim, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, dtype=dtype, rngs=rngs, tp=tp) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = None if cfg.tie_embeddings else Linear(cfg.dim, cfg.vocab_size, dtype=dtype, rngs=rngs)
        self.inv_freq = nnx.Variable(jnp.asarray(rope_inv_freq(cfg)))  # [H/2], a constant, not a parameter

    def __call__(
        self,
        tokens: Array,  # [B, T] int32
        positions: Array,  # [B, T] int32
        k_caches: list[Array],  # L x [B, S, K, H]
        v_caches: list[Array],  # L x [B, S, K, H]
    ) -> tuple[Array, list[Array], list[Array]]:
        with jax.named_scope("embed"):
            x = self.embed_tokens(tokens)  # [B, T, D]
            cos, sin = rope_cos_sin(self.inv_freq[...], positions)  # [B, T, H]
        x, new_k, new_v = self.run_layers(x, k_caches, v_caches, positions, cos, sin)
        with jax.named_scope("lm_head"):
            x = self.norm(x)
            if self.lm_head is None:
                logits = self.embed_tokens.attend(x)  # [B, T, V]
            else:
                logits = self.lm_head(x)  # [B, T, V]
        return logits.astype(jnp.float32), new_k, new_v

    def run_layers(self, x, k_caches, v_caches, positions, cos, sin, comm=()):
        """The decoder layers in order, each one `decoder_layer_call` (the calls the looping pass finds).
        x [B, T, D]; caches L x [B, S, K, H]; comm: the all-reduce kernel's buffers under tensor
        parallelism, or (); returns x and the new caches."""
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"layers_{i}"):
                graphdef, state = nnx.split(layer)
                x, k, v = decoder_layer_call(graphdef, state, x, k_caches[i], v_caches[i], positions, cos, sin, *comm)
            new_k.append(k)
            new_v.append(v)
        return x, new_k, new_v


def init_random(
    cfg: ModelConfig, *, seed: int = 0, dtype=jnp.float32, quantize: str | None = None, group: int = DEFAULT_GROUP
) -> Transformer:
    """A model with random weights (normal, scaled 1/sqrt(fan_in)) for any config: tests and benchmarks.

    With `quantize` the projections are drawn and quantized one at a time (`quantize_weights`' layout), so
    the dense model never exists: a 70B at 4 bits fits where its bf16 weights would not. The values then
    differ from the dense model of the same seed."""
    if quantize is None:
        return Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(seed))
    model = nnx.eval_shape(lambda: Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(seed)))
    model.inv_freq.set_value(jnp.asarray(rope_inv_freq(cfg)))
    key = jax.random.key(seed)
    tied_table = (("embed_tokens", "embedding"),) if model.lm_head is None else ()
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Param):
            continue
        key, sub = jax.random.split(key)
        shape = node.get_value().shape
        if path[-1] == "weight" and len(shape) == 2 or tuple(path[-2:]) in tied_table:
            k, n = shape[::-1] if tuple(path[-2:]) in tied_table else shape  # the table [V, D] is the head's [N, K]
            layer = path[1] if path[0] == "layers" else None
            fmt = projection_format(quantize, "lm_head" if layer is None else path[-2], layer, cfg.n_layers)
            node.set_value(_random_quantized(sub, k, n, fmt, math.gcd(group, k)))
        elif len(shape) == 2:  # an untied embedding table [V, D]
            node.set_value((jax.random.normal(sub, shape, jnp.float32) * shape[1] ** -0.5).astype(dtype))
        else:  # norm weights, biases
            node.set_value(jnp.ones(shape, dtype) if path[-1] == "weight" else jnp.zeros(shape, dtype))
    return model


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _random_quantized(key, k: int, n: int, fmt: str, group: int):
    """A normal [K, N] weight scaled 1/sqrt(K), quantized, in one jitted call (the dense draw is freed)."""
    return quantize_projection(jax.random.normal(key, (k, n), jnp.float32) * k**-0.5, fmt, group)


def projection_format(quantize: str, projection: str, layer: int | None, layers: int) -> str:
    """The format one projection takes under `--quantize` (a format, or a mix's choice: `kquants.mix_format`)."""
    return mix_format(quantize, projection, layer, layers) if quantize in MIXES else quantize


def quantize_projection(w, fmt: str, group: int = DEFAULT_GROUP, scale_dtype=SCALE_DTYPE):
    """A dense [K, N] weight as `fmt`: int8 / int4 per `group` (`quantized.quantize`) or a K-quant
    (`kquants.quantize_k`, whose groups and scales are the format's)."""
    if fmt in K_FORMATS:
        return quantize_k(w, fmt)
    return quantize(w, fmt, group, scale_dtype)


def place_quantized(model: Transformer) -> Transformer:
    """Every quantized weight placed as `load_state_dict` places a checkpoint's (`QuantizedWeight.device_put`:
    int4 codes widened to int8 on the CPU), in place: for models quantized after loading or drawn quantized.
    Not part of `quantize_weights`, whose stored format rdu traces and cost.py counts on any host."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param) and is_quantized(node.get_value()):
            node.set_value(node.get_value().device_put())
    return model


def load_state_dict(model: Transformer, tensors: dict[str, np.ndarray]) -> Transformer:
    """Copy Hugging Face-named tensors (Linear weights [out, in]) into the model, in place. A tensor may be
    a `QuantizedWeight` (codes in the same [out, in] rows): the parameter then stays quantized.

    Raises ValueError naming the tensor when one is missing, unexpected or of the wrong shape.
    """
    remaining = dict(tensors)

    def take(name: str, param: nnx.Param, transpose: bool = False):
        if name not in remaining:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        value = remaining.pop(name)
        if is_quantized(value):  # codes keep the checkpoint's [out, in] rows, whatever `transpose` says
            check_quantized(value, f"tensor {name!r}")
            rows = param.shape[::-1] if transpose else param.shape
            if value.codes.shape != tuple(rows):
                raise ValueError(f"tensor {name!r} has shape {value.codes.shape}, expected {tuple(rows)}")
            param.set_value(value.device_put())
            return
        value = np.asarray(value)
        if transpose:
            value = value.T
        if value.shape != param.shape:
            raise ValueError(f"tensor {name!r} has shape {value.shape}, expected {param.shape}")
        param.set_value(jnp.asarray(value, dtype=param.dtype))

    take("model.embed_tokens.weight", model.embed_tokens.embedding)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            linear = getattr(layer.self_attn, proj)
            take(p + f"self_attn.{proj}.weight", linear.weight, transpose=True)
            if linear.bias is not None:
                take(p + f"self_attn.{proj}.bias", linear.bias)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            take(p + f"mlp.{proj}.weight", getattr(layer.mlp, proj).weight, transpose=True)
        take(p + "input_layernorm.weight", layer.input_layernorm.weight)
        take(p + "post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
    take("model.norm.weight", model.norm.weight)
    if model.lm_head is not None:
        take("lm_head.weight", model.lm_head.weight, transpose=True)
    remaining.pop("lm_head.weight", None)  # a tied checkpoint may still carry a copy
    remaining = {k: v for k, v in remaining.items() if "rotary_emb" not in k}
    if remaining:
        raise ValueError(f"checkpoint has unexpected tensors: {sorted(remaining)[:5]}")
    return model


def quantize_weights(model: Transformer, fmt: str, group: int = DEFAULT_GROUP, scale_dtype=SCALE_DTYPE) -> Transformer:
    """Quantize every projection in place, and the output projection: lm_head, or the embedding table a tied
    model shares with it. An untied embedding stays dense (decode reads B rows of it a step).
    `fmt`: "int8" | "int4" (`jaxdecode.quantized.quantize`: round to nearest, per group of `group` values along
    the input axis, scales in `scale_dtype`), a K-quant ("q4_k" | "q6_k") or a mix of them ("q4_k_m"), as
    `jaxdecode.kquants` makes them. Weights already quantized are left as they are."""
    layers = len(model.layers)

    def convert(param: nnx.Param, projection: str, layer: int | None, transposed: bool = False) -> None:
        w = param.get_value()
        if not is_quantized(w):
            w = w.T if transposed else w  # [K, N]
            # a width that `group` does not divide (SmolLM2's 576) takes the largest divisor of both
            kind = projection_format(fmt, projection, layer, layers)
            param.set_value(quantize_projection(w, kind, math.gcd(group, w.shape[0]), scale_dtype))

    for i, layer in enumerate(model.layers):
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            convert(getattr(layer.self_attn, p).weight, p, i)
        for p in ("gate_proj", "up_proj", "down_proj"):
            convert(getattr(layer.mlp, p).weight, p, i)
    if model.lm_head is not None:
        convert(model.lm_head.weight, "lm_head", None)
    else:
        convert(model.embed_tokens.embedding, "lm_head", None, transposed=True)  # [V, D]: the projection's [N, K]
    return model

"""Analytic FLOPs and bytes of one decode step (one new token per sequence).

Symbols follow the dimension key: B batch, S context (tokens already in the cache), D width,
N query heads, K kv heads, H head dim, F ffn width, V vocab, L layers, and `w` bytes per element.

Per step, for the whole batch:
- weight bytes read   = w * (L * P_layer + D + V*D [lm head, or the tied embedding] + B*D [embedding rows]);
                        quantized, the projections and V*D at their codes' bits plus a scale per group
                        (`projection_bytes`; a mix such as Q4_K_M per projection)
- KV bytes read       = w * 2 * L * B * S * K * H
- KV bytes written    = w * 2 * L * B * K * H
- matmul FLOPs        = 2 * B * (L * P_matmul_layer + V*D)
- attention FLOPs     = 4 * B * L * N * H * S   (q.k and p.v, 2 FLOPs per multiply-add each)

where P_layer counts every parameter of a layer and P_matmul_layer only its projection weights
(D*(N*H + 2*K*H) + N*H*D + 3*D*F). Elementwise work (norms, RoPE, softmax, SwiGLU) is left out:
it is under 0.1% of the FLOPs of every preset.

The Kernel Looping paper's Table 1 uses a coarser convention, reproduced by `paper_table1` for
comparison: FLOPs = 2 * n_params + 8 * L * D * S, bytes = w * n_params + KV read (in GiB).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from gguf.constants import GGMLQuantizationType

from jaxdecode.config import ModelConfig
from jaxdecode.kquants import MIXES, fallback, mix_format
from jaxdecode.quantized import DEFAULT_GROUP, QUANTIZE_FORMATS, SCALE_DTYPE, QuantizedWeight, weight_bytes
from jaxdecode.weights.repack import repacked_bytes

GIB = 2**30


@dataclass(frozen=True)
class DecodeCost:
    weight_bytes: int
    kv_read_bytes: int
    kv_write_bytes: int
    matmul_flops: int
    attention_flops: int

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes

    @property
    def flops(self) -> int:
        return self.matmul_flops + self.attention_flops

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops / self.bytes


def matmul_params_per_layer(cfg: ModelConfig) -> int:
    """Projection weights of one layer: D*(N*H + 2*K*H) + N*H*D + 3*D*F."""
    return cfg.dim * (cfg.q_dim + 2 * cfg.kv_dim) + cfg.q_dim * cfg.dim + 3 * cfg.dim * cfg.ffn_dim


def quantized_bytes(params: int, quantize: str, group: int = DEFAULT_GROUP, scale_dtype=SCALE_DTYPE) -> int:
    """Bytes of `params` weights quantized by `jaxdecode.quantized.quantize`: the codes and a scale per
    group, and for int4 an offset, each of `scale_dtype` (a width the group does not divide takes a smaller
    group there; counted at `group`)."""
    per_group = (1 if quantize == "int8" else 2) * jnp.dtype(scale_dtype).itemsize
    return params * QUANTIZE_FORMATS[quantize] // 8 + params // group * per_group


def kquant_bytes(k: int, n: int, fmt: str) -> int:
    """Bytes of a [K, N] weight in K-quant `fmt` as `kquants.quantize_k` stores it: the layout a GGUF tensor of that
    type is repacked into (`weights.repack.repacked_bytes`); a K not a multiple of 256 in its fallback (float16
    scales)."""
    one_level = fallback(fmt, k)
    if one_level is not None:
        return quantized_bytes(k * n, *one_level)  # quantize's default scale dtype, as `quantize_k` stores it
    return repacked_bytes(GGMLQuantizationType[fmt.upper()], n, k)


def projection_bytes(cfg: ModelConfig, quantize: str, group: int = DEFAULT_GROUP, scale_dtype=SCALE_DTYPE) -> int:
    """Bytes of every projection and the output projection (V·D) under `--quantize` `quantize`: a uniform format
    (`quantized_bytes`) or a mix, each projection at its format (`kquant_bytes`)."""
    projections = cfg.n_layers * matmul_params_per_layer(cfg) + cfg.vocab_size * cfg.dim
    if quantize not in MIXES:
        return quantized_bytes(projections, quantize, group, scale_dtype)
    shapes = {  # [K, N] of each projection of a layer
        "q_proj": (cfg.dim, cfg.q_dim),
        "k_proj": (cfg.dim, cfg.kv_dim),
        "v_proj": (cfg.dim, cfg.kv_dim),
        "o_proj": (cfg.q_dim, cfg.dim),
        "gate_proj": (cfg.dim, cfg.ffn_dim),
        "up_proj": (cfg.dim, cfg.ffn_dim),
        "down_proj": (cfg.ffn_dim, cfg.dim),
    }
    total = kquant_bytes(cfg.dim, cfg.vocab_size, mix_format(quantize, "lm_head", None, cfg.n_layers))
    for layer in range(cfg.n_layers):
        for name, (k, n) in shapes.items():
            total += kquant_bytes(k, n, mix_format(quantize, name, layer, cfg.n_layers))
    return total


def decode_cost(
    cfg: ModelConfig,
    *,
    batch: int = 1,
    context: int = 4096,
    itemsize: int = 2,
    quantize: str | None = None,
    group: int = DEFAULT_GROUP,
    weight_bytes: int | None = None,
    scale_dtype=SCALE_DTYPE,
) -> DecodeCost:
    """FLOPs and bytes of one decode step at `context` cached tokens (formulas in the module docstring).
    `quantize` ("int8" | "int4" | "q4_k_m"): the projections and the output projection (lm_head or the tied
    table) are read as `model.quantize_weights` stores them (`projection_bytes`; int8/int4's scales and offsets in
    `scale_dtype`); norms, the cache and the activations stay at `itemsize`.
    `weight_bytes` (`step_weight_bytes` of a built model) replaces the weights' count."""
    if batch < 1 or context < 0:
        raise ValueError(f"need batch >= 1 and context >= 0, got batch={batch}, context={context}")
    kv_row = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim  # K and V elements per token per sequence
    projections = cfg.n_layers * matmul_params_per_layer(cfg) + cfg.vocab_size * cfg.dim
    rest = cfg.n_layers * (cfg.layer_params - matmul_params_per_layer(cfg)) + cfg.dim + batch * cfg.dim
    if weight_bytes is None and quantize is None:
        weight_bytes = itemsize * (projections + rest)
    elif weight_bytes is None:
        weight_bytes = projection_bytes(cfg, quantize, group, scale_dtype) + itemsize * rest
    return DecodeCost(
        weight_bytes=weight_bytes,
        kv_read_bytes=itemsize * batch * context * kv_row,
        kv_write_bytes=itemsize * batch * kv_row,
        matmul_flops=2 * batch * (cfg.n_layers * matmul_params_per_layer(cfg) + cfg.vocab_size * cfg.dim),
        attention_flops=4 * batch * cfg.n_layers * cfg.n_heads * cfg.head_dim * context,
    )


def step_weight_bytes(model, batch: int = 1) -> int:
    """Weight bytes one decode step of a built model reads, each parameter at its stored size (dense or
    quantized): every parameter once, except that an untied embedding table is read for B rows only."""
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, QuantizedWeight))
    total = sum(weight_bytes(w) for w in leaves)
    if model.lm_head is not None:  # untied: the table is looked up, not read whole
        table = model.embed_tokens.embedding.get_value()
        total += batch * table.shape[-1] * jax.numpy.dtype(model.embed_tokens.dtype).itemsize - weight_bytes(table)
    return total


def paper_table1(cfg: ModelConfig, *, batch: int = 1, context: int = 4096, itemsize: int = 2) -> dict:
    """One row of the Kernel Looping paper's Table 1, in its own convention (GiB, GFLOPs)."""
    kv = itemsize * batch * context * 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim
    params = itemsize * cfg.n_params
    gflops = (2 * batch * cfg.n_params + 8 * batch * cfg.n_layers * cfg.dim * context) / 1e9
    gib = (params + kv) / GIB
    return {
        "params_gib": params / GIB,
        "kv_gib": kv / GIB,
        "gflops": gflops,
        "gib": gib,
        "flops_per_byte": gflops / gib,
    }

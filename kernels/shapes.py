"""One catalog of named decode shapes, shared by kernel tests, benchmarks and `rdu/`.

Dimension key (as in `jaxdecode/__init__.py`): B batch, T query tokens, S key/cache length, D model
width, N query heads, K kv heads, G = N/K, H head dim, F ffn width, L layers.

A name such as `llama3_8b_b1_s4096_decode` joins a measured GPU number and an `rdu/` estimate.
GEMM shapes use the matmul convention y[M, Nout] = x[M, Kin] · W[Kin, Nout] with M = B·T; they are
called `m, k, n` below to keep them apart from the attention letters.
"""

from __future__ import annotations

import dataclasses
import itertools


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """The few widths of a Llama-family decoder that fix its kernel shapes."""

    name: str
    d_model: int  # D
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    ffn: int  # F
    num_layers: int  # L

    @property
    def group(self) -> int:  # G = N / K
        return self.num_heads // self.num_kv_heads


MODELS: dict[str, ModelDims] = {
    "llama3_8b": ModelDims("llama3_8b", 4096, 32, 8, 128, 14336, 32),  # Llama-3.1-8B
    "qwen25_7b": ModelDims("qwen25_7b", 3584, 28, 4, 128, 18944, 28),  # Qwen2.5-7B
    "smollm2_135m": ModelDims("smollm2_135m", 576, 9, 3, 64, 1536, 30),  # SmolLM2-135M
}


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """Decode attention: q [B, T, N, H] against a kv cache [B, S, K, H]."""

    name: str
    batch: int  # B
    tokens: int  # T
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    cache_len: int  # S

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V read once in bf16 (the memory floor of decode attention)."""
        return 2 * 2 * self.batch * self.cache_len * self.num_kv_heads * self.head_dim


@dataclasses.dataclass(frozen=True)
class GemmShape:
    """One per-layer projection: y[m, n] = x[m, k] · W[l][k, n] with W stacked as [L, k, n]."""

    name: str
    m: int
    k: int
    n: int
    layers: int
    op: str  # "qkv" | "o" | "gate" | "up" | "down"

    @property
    def weight_bytes(self) -> int:
        """Bytes of one layer's bf16 weight (the memory floor of a flat GEMM)."""
        return 2 * self.k * self.n


@dataclasses.dataclass(frozen=True)
class DecodeShapes:
    """Everything one decode step of one model runs per layer."""

    name: str
    model: ModelDims
    attention: AttentionShape
    gemms: tuple[GemmShape, ...]


def decode_shapes(model: ModelDims, batch: int, cache_len: int, tokens: int = 1) -> DecodeShapes:
    """The attention shape and the per-layer GEMM shapes of one decode step."""
    name = f"{model.name}_b{batch}_s{cache_len}_decode"
    m, d, h = batch * tokens, model.d_model, model.head_dim
    qkv_out = (model.num_heads + 2 * model.num_kv_heads) * h
    projections = (
        ("qkv", d, qkv_out),
        ("o", model.num_heads * h, d),
        ("gate", d, model.ffn),
        ("up", d, model.ffn),
        ("down", model.ffn, d),
    )
    gemms = tuple(GemmShape(f"{name}_{op}", m, k, n, model.num_layers, op) for op, k, n in projections)
    attention = AttentionShape(f"{name}_attn", batch, tokens, model.num_heads, model.num_kv_heads, h, cache_len)
    return DecodeShapes(name, model, attention, gemms)


CATALOG: dict[str, DecodeShapes] = {
    s.name: s
    for s in (
        decode_shapes(model, batch, ctx)
        for model, batch, ctx in itertools.product(MODELS.values(), (1, 8, 32), (1024, 8192))
    )
}
# The long-context point of h200-anchors.md.
CATALOG["llama3_8b_b1_s32768_decode"] = decode_shapes(MODELS["llama3_8b"], 1, 32768)

# Small shapes for interpret-mode tests on the CPU: GQA groups 1, 3, 4 and 8, head dims 64 and 128,
# batch up to 64, T > 1, and cache lengths that are not multiples of the block (the wrapper pads S).
TEST_ATTENTION: dict[str, AttentionShape] = {
    s.name: s
    for s in (
        AttentionShape("tiny_gqa4_b2_s256", 2, 1, 8, 2, 64, 256),
        AttentionShape("tiny_gqa3_b3_s128", 3, 1, 9, 3, 64, 128),  # SmolLM2's group
        AttentionShape("tiny_mha_b1_s128", 1, 1, 2, 2, 64, 128),
        AttentionShape("tiny_gqa4_t3_b2_s128", 2, 3, 8, 2, 64, 128),  # T > 1 (causal rows)
        AttentionShape("tiny_gqa8_b2_s1_h128", 2, 1, 8, 1, 128, 1),  # one cache entry
        AttentionShape("tiny_gqa4_b3_s63_h128", 3, 1, 8, 2, 128, 63),  # one short of a block
        AttentionShape("tiny_mha_b2_s65", 2, 1, 2, 2, 64, 65),  # one past a block
        AttentionShape("tiny_gqa8_b2_s200_h128", 2, 1, 16, 2, 128, 200),  # Llama-3's group
        AttentionShape("tiny_gqa4_b64_s40", 64, 1, 4, 1, 64, 40),  # large batch, small S
    )
}
TEST_GEMM: dict[str, GemmShape] = {
    s.name: s
    for s in (
        GemmShape("tiny_m1_k256_n128", 1, 256, 128, 3, "gemv"),
        GemmShape("tiny_m2_k256_n64", 2, 256, 64, 2, "m2"),
        GemmShape("tiny_m5_k256_n192", 5, 256, 192, 2, "odd_m"),
        GemmShape("tiny_m8_k512_n128", 8, 512, 128, 4, "m8"),
        GemmShape("tiny_m19_k256_n128", 19, 256, 128, 2, "m_not_8"),
        GemmShape("tiny_m64_k256_n64", 64, 256, 64, 2, "m64"),
        GemmShape("tiny_m128_k256_n64", 128, 256, 64, 2, "m128"),
    )
}

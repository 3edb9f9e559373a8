"""Build Hugging Face transformers models (PyTorch, CPU) that mirror our tiny configs: the independent reference."""

from __future__ import annotations

import numpy as np
import torch
from transformers import LlamaForCausalLM, Qwen2ForCausalLM

from jaxdecode.bench_peers import hf_config
from jaxdecode.config import ModelConfig


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

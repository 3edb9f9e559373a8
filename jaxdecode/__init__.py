"""jaxdecode: a JAX decode engine for Llama-family models, with kernel looping.

Dimension key, used in every shape comment and einsum in the project:

    B  batch                     T  query tokens in this step
    S  key / cache length        D  model width
    N  query heads               K  key/value heads
    G  = N / K, query heads per kv head
    H  head dim                  F  ffn width
    V  vocab                     L  layers

The names below are imported on first use (PEP 562): `import jaxdecode` alone must not import JAX, so that
the command line can show its first line before the imports that take seconds (`jaxdecode.__main__`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = [
    "DEFAULT_MODEL",
    "PRESETS",
    "ModelConfig",
    "RopeScaling",
    "TensorParallel",
    "get_preset",
    "DecodeState",
    "Engine",
    "Generation",
    "LLM",
    "Completion",
    "Hook",
    "Transformer",
    "init_random",
    "load_state_dict",
    "quantize_weights",
    "QuantizedWeight",
    "quantize",
    "SamplingParams",
]
_MODULES = {  # where each name of __all__ lives
    "jaxdecode.config": ("DEFAULT_MODEL", "PRESETS", "ModelConfig", "RopeScaling", "TensorParallel", "get_preset"),
    "jaxdecode.decode": ("DecodeState", "Engine", "Generation"),
    "jaxdecode.llm": ("LLM", "Completion"),
    "jaxdecode.model": ("Hook", "Transformer", "init_random", "load_state_dict", "quantize_weights"),
    "jaxdecode.quantized": ("QuantizedWeight", "quantize"),
    "jaxdecode.sampling": ("SamplingParams",),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}

if TYPE_CHECKING:
    from jaxdecode.config import DEFAULT_MODEL, PRESETS, ModelConfig, RopeScaling, TensorParallel, get_preset
    from jaxdecode.decode import DecodeState, Engine, Generation
    from jaxdecode.llm import LLM, Completion
    from jaxdecode.model import Hook, Transformer, init_random, load_state_dict, quantize_weights
    from jaxdecode.quantized import QuantizedWeight, quantize
    from jaxdecode.sampling import SamplingParams


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxdecode' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

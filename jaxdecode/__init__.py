"""jaxdecode: a JAX decode engine for Llama-family models, with kernel looping.

Dimension key, used in every shape comment and einsum in the project:

    B  batch                     T  query tokens in this step
    S  key / cache length        D  model width
    N  query heads               K  key/value heads
    G  = N / K, query heads per kv head
    H  head dim                  F  ffn width
    V  vocab                     L  layers
"""

from jaxdecode.config import DEFAULT_MODEL, PRESETS, ModelConfig, RopeScaling, TensorParallel, get_preset
from jaxdecode.decode import DecodeState, Engine, Generation
from jaxdecode.llm import LLM, Completion
from jaxdecode.model import Hook, Transformer, init_random, load_state_dict, quantize_weights
from jaxdecode.quantized import QuantizedWeight, quantize
from jaxdecode.sampling import SamplingParams

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

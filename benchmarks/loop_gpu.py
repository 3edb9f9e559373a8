"""Unrolled vs looped (copying) vs looped in place on one GPU: first call, ms/token, copies in the HLO.

    python benchmarks/loop_gpu.py --model llama-3.1-8b --batch 1 8 --out results.json [--hf]

Random bf16 weights. Variants: `unrolled` (layers unrolled in one jit), `looped_copy` (the scan
slices the [L, ...] stacks: XLA copies each W[l] out before its dot), `looped_inplace` (the scan
body reads the stacks in place: `kernels.flat_gemm` for the dots, the KV cache updated in the scan
carry; `jaxdecode.inplace`). For each it times the first `generate` call (trace + compile +
prefill + decode) and a second identical call, and reads the optimized HLO of one decode step:
- weight copies: `dynamic-slice` results at least as large as a layer's smallest weight matrix;
- cache copies: `dynamic-slice` results the size of one layer's K or V cache;
- custom calls: kernel launches per step (the Mosaic GPU GEMMs appear as custom calls).
The HBM read ceiling is measured in the same run (a sum over a 4 GiB bf16 array). With `--hf`,
HF transformers (eager, then static cache + torch.compile) run the same config on a copy of the
same weights at batch 1, while `--deadline-s` allows; their rows time the decode steps only.
Results are written after every row. `jaxdecode bench --suite gpu` is the broader comparison (more
configs and contexts, the plain-JAX peers, a plot); this script adds the HLO copy counts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.bench import measure_decode, read_ceiling_gb_s
from jaxdecode.config import get_preset
from jaxdecode.cost import decode_cost
from jaxdecode.decode import Engine
from jaxdecode.model import init_random

VARIANTS = {
    "unrolled": dict(loop_layers=False),
    "looped_copy": dict(loop_mode="slice"),
    "looped_inplace": dict(loop_mode="inplace"),
}
_DS = re.compile(r"= (bf16|f32|f16)\[([\d,]*)\]\{[^}]*\} (dynamic-slice|fusion)\(")


def hlo_counts(engine: Engine, batch: int, cache_len: int, weight_bytes: int, cache_bytes: int) -> dict:
    """Copies and kernel launches in the optimized HLO of one decode step (see the module doc)."""
    cache = engine.new_cache(batch, cache_len)
    tokens = jnp.zeros((batch, 1), jnp.int32)
    hlo = jax.jit(engine.forward).lower(engine.params, tokens, tokens, cache).compile().as_text()
    weights, caches = [], []
    for line in hlo.splitlines():
        m = _DS.search(line)
        if not m or "dynamic-update-slice" in line or ("dynamic-slice" not in line and "dynamic_slice" not in line):
            continue
        dims = [int(d) for d in m.group(2).split(",") if d]
        n = int(np.prod(dims)) * (4 if m.group(1) == "f32" else 2)
        entry = {"shape": f"{m.group(1)}[{m.group(2)}]", "bytes": n, "op": m.group(3)}
        if n >= weight_bytes:
            weights.append(entry)
        elif n == cache_bytes:
            caches.append(entry)
    customs = sorted({c for c in re.findall(r'custom_call_target="([^"]+)"', hlo)})
    return {
        "weight_copies": len(weights),
        "weight_copy_bytes": sum(c["bytes"] for c in weights),
        "weight_copy_examples": weights[:4],
        "cache_copies": len(caches),
        "custom_calls": len(re.findall(r" custom-call\(", hlo)),
        "custom_call_targets": customs,
    }


def hf_rows(
    model,
    new_tokens: int,
    prompt_len: int,
    deadline: float,
    moved: float,
    ceiling: float,
    on_row,
    only_static: bool = False,
) -> None:
    """HF transformers peers at batch 1 on a copy of our weights (`jaxdecode.bench_peers`): eager, then a
    static cache with the forward compiled by HF (torch.compile, CUDA graphs); decode steps only."""
    from jaxdecode import bench_peers

    hf = bench_peers.build_hf(model)
    prompts = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (1, prompt_len))
    for variant, compiled in (("hf_eager", False), ("hf_static_compile", True)):
        if (only_static and not compiled) or (compiled and time.perf_counter() >= deadline):
            continue
        timing, extra = bench_peers.hf_runner(hf, compiled=compiled)(prompts, context=0, steps=new_tokens)
        ms = timing.decode_s / timing.steps * 1e3
        on_row(
            {
                "variant": variant,
                "batch": 1,
                "first_call_s": round(timing.first_call_s, 2),
                "prefill_ms": round(timing.prefill_s * 1e3, 2),
                "decode_ms_per_step": round(ms, 3),
                "decode_tok_s": round(1e3 / ms, 1),
                "pct_of_read_ceiling": round(100 * moved / (ms / 1e3) / 1e9 / ceiling, 1),
                "note": extra["note"],
            }
        )
    del hf
    bench_peers.release_memory()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", default=None)
    parser.add_argument("--ceiling-gib", type=int, default=4)
    parser.add_argument("--hf", action="store_true", help="add HF transformers peers at batch 1")
    parser.add_argument("--hf-only-static", action="store_true", help="skip the eager HF row")
    parser.add_argument("--deadline-s", type=float, default=1e9, help="skip optional work after this many seconds")
    args = parser.parse_args()
    if args.hf:  # jax would take 75% of the GPU at its first allocation, leaving torch too little
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    t0 = time.perf_counter()
    cfg = get_preset(args.model)
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    itemsize = jnp.dtype(dtype).itemsize
    ceiling = read_ceiling_gb_s(args.ceiling_gib)
    model = init_random(cfg, dtype=dtype)
    weight_bytes = itemsize * cfg.dim * cfg.kv_dim
    result = {
        "hardware": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "model": args.model,
        "dtype": jnp.dtype(dtype).name,
        "read_ceiling_gb_s": round(ceiling, 1),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rows": [],
    }

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)

    def on_row(row):
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        save()

    for batch in args.batch:
        if batch != args.batch[0] and time.perf_counter() - t0 > args.deadline_s:
            result.setdefault("skipped", []).append(f"batch {batch}: deadline")
            continue
        moved = decode_cost(cfg, batch=batch, context=args.prompt_len + args.new_tokens // 2, itemsize=itemsize).bytes
        for name in args.variants:
            try:
                engine = Engine(model, **VARIANTS[name])
                m = measure_decode(
                    engine, model_name=args.model, batch=batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens
                )
            except Exception as e:  # one variant failing must not lose the others
                result.setdefault("errors", []).append(f"{name} B{batch}: {type(e).__name__}: {str(e)[-800:]}")
                print(result["errors"][-1], flush=True)
                continue
            row = json.loads(m.to_json())
            row["variant"] = name
            cache_bytes = itemsize * batch * 1024 * cfg.kv_dim
            row.update(hlo_counts(engine, batch, 1024, weight_bytes, cache_bytes))
            row["pct_of_read_ceiling"] = round(100 * moved / (m.decode_ms_per_step / 1e3) / 1e9 / ceiling, 1)
            on_row(row)
            del engine
    if args.hf:
        moved = decode_cost(cfg, batch=1, context=args.prompt_len + args.new_tokens // 2, itemsize=itemsize).bytes
        try:
            hf_rows(
                model,
                args.new_tokens,
                args.prompt_len,
                t0 + args.deadline_s,
                moved,
                ceiling,
                on_row,
                args.hf_only_static,
            )
        except Exception as e:  # a peer failing must not lose the rows above
            result["hf_error"] = f"{type(e).__name__}: {e}"[:500]
        save()
    print(
        f"{'variant':15} {'B':>2} {'first call s':>12} {'ms/token':>9} {'tok/s':>8} {'% read BW':>9} "
        f"{'W copies':>8} {'KV copies':>9} {'custom calls':>12}"
    )
    for r in result["rows"]:
        print(
            f"{r['variant']:15} {r['batch']:>2} {r['first_call_s']:12.1f} {r['decode_ms_per_step']:9.2f} "
            f"{r['decode_tok_s']:8.1f} {r['pct_of_read_ceiling']:9.1f} {r.get('weight_copies', '-'):>8} "
            f"{r.get('cache_copies', '-'):>9} {r.get('custom_calls', '-'):>12}"
        )
    print(json.dumps(result))
    save()


if __name__ == "__main__":
    main()

"""Looped vs unrolled decode on one GPU: first-call time, ms/token, and weight copies left in the HLO.

    python benchmarks/loop_gpu.py --model llama-3.1-8b --out results.json

Random bf16 weights, batch 1. For each variant it times the first `generate` call (trace + compile +
prefill + decode) and a second identical call, and reads the optimized HLO of one decode step: every
`dynamic-slice` whose result is as large as a layer's weight matrix is a per-layer weight copy.
The HBM read ceiling is measured in the same run (a sum over a 4 GiB bf16 array).
"""

from __future__ import annotations

import argparse
import json
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.bench import measure_decode
from jaxdecode.config import get_preset
from jaxdecode.cost import decode_cost
from jaxdecode.decode import Engine
from jaxdecode.model import init_random


def read_ceiling_gb_s(gib: int = 4, repeats: int = 10) -> float:
    x = jnp.ones((gib * 2**30 // 2,), jnp.bfloat16)
    total = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    total(x).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        out = total(x)
    out.block_until_ready()
    return x.nbytes * repeats / (time.perf_counter() - start) / 1e9


def weight_copies(engine: Engine, min_bytes: int) -> dict:
    """Large dynamic-slice results in the optimized HLO of one decode step (per-layer weight copies)."""
    cache = engine.new_cache(1, 1024)
    tokens = jnp.zeros((1, 1), jnp.int32)
    hlo = jax.jit(engine.forward).lower(engine.params, tokens, tokens, cache).compile().as_text()
    copies = []
    for line in hlo.splitlines():
        m = re.search(r"= (bf16|f32)\[([\d,]+)\]\{[^}]*\} (dynamic-slice|fusion)\(", line)
        if not m or ("dynamic-slice" not in line and "dynamic_slice" not in line):
            continue
        n = int(np.prod([int(d) for d in m.group(2).split(",")])) * (2 if m.group(1) == "bf16" else 4)
        if n >= min_bytes:
            copies.append({"shape": f"{m.group(1)}[{m.group(2)}]", "bytes": n, "op": m.group(3)})
    return {"count": len(copies), "bytes": sum(c["bytes"] for c in copies), "examples": copies[:6]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--out", default=None)
    parser.add_argument("--ceiling-gib", type=int, default=4)
    args = parser.parse_args()
    cfg = get_preset(args.model)
    ceiling = read_ceiling_gb_s(args.ceiling_gib)
    model = init_random(cfg, dtype=jnp.bfloat16)
    smallest_weight = 2 * cfg.dim * cfg.kv_dim
    rows = []
    for loop in (True, False):
        engine = Engine(model, loop_layers=loop)
        m = measure_decode(engine, model_name=args.model, batch=1, prompt_len=32, new_tokens=args.new_tokens)
        row = json.loads(m.to_json())
        row["weight_copies"] = weight_copies(engine, smallest_weight)
        moved = decode_cost(cfg, batch=1, context=32 + args.new_tokens // 2, itemsize=2).bytes
        row["pct_of_read_ceiling"] = round(100 * moved / (m.decode_ms_per_step / 1e3) / 1e9 / ceiling, 1)
        rows.append(row)
        del engine
    result = {"hardware": jax.devices()[0].device_kind, "jax": jax.__version__, "read_ceiling_gb_s": round(ceiling, 1),
              "date": time.strftime("%Y-%m-%d"), "rows": rows}
    print(f"{'variant':10} {'first call s':>12} {'ms/token':>9} {'tok/s':>7} {'% read BW':>9} {'weight copies':>14}")
    for r in rows:
        print(f"{r['variant']:10} {r['first_call_s']:12.1f} {r['decode_ms_per_step']:9.2f} {r['decode_tok_s']:7.1f} "
              f"{r['pct_of_read_ceiling']:9.1f} {r['weight_copies']['count']:>6} ({r['weight_copies']['bytes'] / 1e9:.2f} GB)")
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

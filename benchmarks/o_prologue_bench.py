"""The o projection with the attention's split combine as its x prologue, against the two launches it replaces.

  JAX_PLATFORMS=cuda python benchmarks/o_prologue_bench.py --out $OUT/o_prologue.json

Llama-3.1-8B's o projection (4096 × 4096, int4 codes stored permuted, group 128, f32 scales and offsets: what
`--quantize int4` stores) after the synchronized decode attention at a 1152-position cache (the suite's 1k
context), batch 1 and 8, the attention's splits as `split_layout` picks them. Per batch, 32 layers unrolled in one
jit, each layer's call with its own traced layer index:
- "two launches": the combine kernel (`decode_attention` mosaic `combine_call`), then `quant_gemm_multi` on its output;
- "prologue": `quant_gemm_from_attention`, each CTA combining the heads it holds while its first weights land.
µs per layer: the GPU time of all the jit's kernels from one profiled run / 32 (benchmarks/gpu_trace.py), and the
median wall time / 32. The two outputs are compared (max |diff| / max |y|): they differ only where exp's
approximation or a rounding of x to int8 lands on the other side. Ends with a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernels import decode_attention as da  # noqa: E402
from kernels import quant_gemm as qg  # noqa: E402
from kernels import quant_gemm_stream as qs  # noqa: E402
from kernels.decode_attention import mosaic  # noqa: E402
from kernels.decode_attention.layout import split_layout  # noqa: E402

LAYERS, KV_HEADS, KV_GROUP, HEAD_DIM, CACHE, DIM, GROUP = 32, 8, 4, 128, 1152, 4096, 128


def partials(batch: int, key):
    """Split partials as the synchronized attention leaves them: acc [B, K, S, R, H], l, m [B, K, S, R] f32."""
    splits, _ = split_layout(batch, KV_HEADS, CACHE, da.BlockSizes())
    rows = da.query_rows(1, KV_GROUP)
    k = jax.random.split(key, 3)
    shape = (batch, KV_HEADS, splits, rows)
    l = jax.random.uniform(k[1], shape, jnp.float32, 1, 64)
    acc = jax.random.normal(k[0], (*shape, HEAD_DIM), jnp.float32) * l[..., None] / 4
    return acc, l, jax.random.normal(k[2], shape, jnp.float32) * 3


def weights(key):
    k = jax.random.split(key, 3)
    codes = jax.random.randint(k[0], (LAYERS, DIM, DIM), -8, 8, jnp.int32).astype(jnp.int4)
    groups = DIM // GROUP
    scales = jax.random.uniform(k[1], (LAYERS, groups, DIM), jnp.float32, 0.5, 1.5) / (8 / np.sqrt(3) * np.sqrt(DIM))
    offsets = jax.random.normal(k[2], (LAYERS, groups, DIM), jnp.float32) / np.sqrt(DIM)
    return ((qg.permute_k(codes), scales, offsets),)


def two_launches(acc, l, m, w, layer):
    x = mosaic.combine_call(acc, l, m, group=KV_GROUP, out_dtype=jnp.bfloat16)  # [B, K, G, H]
    return qs.quant_gemm_multi(x.reshape(acc.shape[0], -1), w, layer, group=GROUP, permuted_codes=True)[0]


def prologue(acc, l, m, w, layer):
    return qs.quant_gemm_from_attention(acc, l, m, w, layer, group=GROUP, kv_group=KV_GROUP)[0]


def time_variant(op, acc, l, m, w, runs: int = 20) -> tuple[float, float, list]:
    """(GPU µs per layer, wall µs per layer, outputs) of op over 32 layers unrolled in one jit."""
    import gpu_trace

    @jax.jit
    def loop(acc, l, m, w, index):
        return tuple(op(acc, l, m, w, index[i]) for i in range(LAYERS))

    index = jnp.arange(LAYERS, dtype=jnp.int32)
    outs = jax.block_until_ready(loop(acc, l, m, w, index))
    for _ in range(3):
        jax.block_until_ready(loop(acc, l, m, w, index))
    walls = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(acc, l, m, w, index))
        walls.append(time.perf_counter() - t0)
    kernels = gpu_trace.run_kernels(lambda: jax.block_until_ready(loop(acc, l, m, w, index)))
    gpu = sum(e["dur"] for e in kernels) / LAYERS
    return gpu, statistics.median(walls) * 1e6 / LAYERS, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the JSON here")
    args = ap.parse_args()
    w = weights(jax.random.key(1))
    rows = []
    for batch in (1, 8):
        acc, l, m = partials(batch, jax.random.key(batch))
        row = dict(batch=batch, splits=acc.shape[2])
        ys = {}
        for name, op in (("two_launches", two_launches), ("prologue", prologue)):
            gpu, wall, ys[name] = time_variant(op, acc, l, m, w)
            row[name] = dict(gpu_us=round(gpu, 2), wall_us=round(wall, 2))
        ref = np.stack([np.asarray(y, np.float32) for y in ys["two_launches"]])
        got = np.stack([np.asarray(y, np.float32) for y in ys["prologue"]])
        row["max_rel_diff"] = float(np.abs(got - ref).max() / np.abs(ref).max())
        rows.append(row)
        print(
            f"B={batch} splits={row['splits']}: two launches {row['two_launches']['gpu_us']} µs GPU "
            f"({row['two_launches']['wall_us']} wall), prologue {row['prologue']['gpu_us']} µs GPU "
            f"({row['prologue']['wall_us']} wall), max rel diff {row['max_rel_diff']:.2e}",
            flush=True,
        )
    result = dict(bench="o_prologue", device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows)
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

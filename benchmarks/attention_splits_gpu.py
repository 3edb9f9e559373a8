"""GPU: the decode attention kernel's split count (`decode_attention.BlockSizes`) at batch 1, 8 and 32.

    JAX_PLATFORMS=cuda,cpu python benchmarks/attention_splits_gpu.py   # table last, JSON to $OUT

Llama-3.1-8B's attention (32 query heads over 8 kv heads, or 4 kv heads per GPU under TP2; hd 128,
bf16), one new token per sequence, lengths 1040 in a 1152-row stacked cache [32, B, S, K, H] read in
place at each layer (the engine's decode at 1k context): `decode_attention_sync_rows` over the 32
layers in one jit (each call reads another layer's cache, 32 x the bytes, more than L2), µs per
layer by wall clock (median of 15 runs, command buffers as XLA makes them), for split counts from 1
to 18 (the divisors of the 18 blocks of 64 rows). Every configuration's output is checked against
the default's. The default's rule is `decode_attention_kernels._layout` (since 2026-12-01: about 576
programs, at most 660 and 32 splits; before, the fewest splits that gave 264 programs).
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels import decode_attention as da
from kernels.decode_attention.layout import split_layout as _layout

LAYERS, S, H, GROUP, LENGTH = 32, 1152, 128, 4, 1040


def time_config(q, k, v, lengths, blocks) -> tuple[float, np.ndarray]:
    @jax.jit
    def run(q, k, v, lengths):
        return [
            da.decode_attention_sync_rows(
                q, k, v, lengths, group=GROUP, layer=jnp.int32(i), block_sizes=blocks, length_offset=1
            )
            for i in range(LAYERS)
        ]

    out = jax.block_until_ready(run(q, k, v, lengths))
    times = []
    for _ in range(15):
        start = time.perf_counter()
        jax.block_until_ready(run(q, k, v, lengths))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) / LAYERS * 1e6, np.asarray(out[3], np.float32)


def main():
    rows = []
    for batch, kv_heads in [(1, 8), (8, 8), (8, 4), (32, 8)]:
        key = jax.random.split(jax.random.key(batch * 10 + kv_heads), 3)
        q = jax.random.normal(key[0], (batch, kv_heads, 16, H), jnp.bfloat16)
        q = q.at[:, :, GROUP:].set(0)  # rows past the group are zero, as qkv_rope writes them
        k = jax.random.normal(key[1], (LAYERS, batch, S, kv_heads, H), jnp.bfloat16)
        v = jax.random.normal(key[2], (LAYERS, batch, S, kv_heads, H), jnp.bfloat16)
        lengths = jnp.full((batch,), LENGTH - 1, jnp.int32)
        nbytes = 2 * batch * LENGTH * kv_heads * H * 2
        default_us, ref = time_config(q, k, v, lengths, da.BlockSizes())
        default_splits = _layout(batch, kv_heads, S, da.BlockSizes())[0]
        configs = [da.BlockSizes(num_splits=s) for s in (1, 2, 3, 6, 9, 18)]
        configs += [da.BlockSizes(num_splits=s, num_warps=8) for s in (9, 18)]
        for blocks in configs:
            us, out = time_config(q, k, v, lengths, blocks)
            err = float(np.abs(out - ref).max())
            row = dict(
                batch=batch,
                kv_heads=kv_heads,
                splits=blocks.num_splits,
                warps=blocks.num_warps,
                stages=blocks.num_stages,
                us=round(us, 2),
                default_us=round(default_us, 2),
                default_splits=default_splits,
                gb_s=round(nbytes / us / 1e3, 1),
                max_abs_vs_default=err,
            )
            rows.append(row)
            print(row, flush=True)
        del k, v
    with open(os.path.join(os.environ.get("OUT", "."), "attention_splits_gpu.json"), "w") as fh:
        json.dump(
            dict(
                device=jax.devices()[0].device_kind,
                jax=jax.__version__,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                rows=rows,
            ),
            fh,
            indent=1,
        )
    print(
        f"\n{'B':>3s} {'K':>2s} {'splits':>6s} {'warps':>5s} {'stages':>6s} {'us/layer':>9s} {'GB/s':>7s} "
        f"{'default (splits)':>17s}"
    )
    for r in rows:
        print(
            f"{r['batch']:3d} {r['kv_heads']:2d} {r['splits']:6d} {r['warps']:5d} {r['stages']:6d} {r['us']:9.2f} "
            f"{r['gb_s']:7.1f} {r['default_us']:9.2f} ({r['default_splits']})"
        )


if __name__ == "__main__":
    main()

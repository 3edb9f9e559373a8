"""L2 prefetch microbench: per layer [prefetch W[i]] -> busy tiny kernels -> GEMM W[i]; scan of 32 layers."""

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels.flat_gemm_stream import flat_gemm_multi
from kernels.l2_prefetch import prefetch_l2

L = 32
K, N = int(sys.argv[1]), int(sys.argv[2])
M = 1
W = jax.random.normal(jax.random.key(0), (L, K, N), jnp.bfloat16) * 0.02
x0 = jax.random.normal(jax.random.key(1), (M, K), jnp.bfloat16)
y_ref = np.asarray(prefetch_l2(x0, W, 3))
print("passthrough equal:", np.array_equal(y_ref, np.asarray(x0)), flush=True)


def make(pf_mib, busy, gemm=True):
    def body(x, i):
        if pf_mib:
            x = prefetch_l2(x, W, i, max_bytes=int(pf_mib * 2**20))
        for _ in range(busy):
            x = lax.optimization_barrier(jnp.tanh(x.astype(jnp.float32) * 1.01).astype(jnp.bfloat16))
        if gemm:
            y = flat_gemm_multi(x, (W,), i)[0]
            x = (
                (y[:, :K] * lax.rsqrt(jnp.mean(jnp.square(y.astype(jnp.float32))) + 1e-6)).astype(jnp.bfloat16)
                if N >= K
                else x
            )
        return x, None

    return jax.jit(lambda x: lax.scan(body, x, jnp.arange(L))[0])


rows = []
# (prefetch MiB or None: the whole layer, busy kernels, GEMM): the two runs cited in docs/log/2026-12-03.md
VARIANTS = [
    (0, 4, True),
    (None, 4, True),
    (16, 4, True),
    (0, 4, False),
    (None, 4, False),
    (0, 0, False),
    (None, 0, False),
]
for pf, busy, gemm in VARIANTS:
    pfm = (K * N * 2 / 2**20) if pf is None else pf
    f = make(pfm, busy, gemm)
    f(x0).block_until_ready()
    ts = []
    for _ in range(8):
        t = time.perf_counter()
        f(x0).block_until_ready()
        ts.append(time.perf_counter() - t)
    us = np.median(ts) / L * 1e6
    rows.append(dict(K=K, N=N, prefetch_mib=pfm, busy=busy, gemm=gemm, us_per_layer=us))
    print(f"K{K} N{N} prefetch {pfm:6.1f} MiB busy {busy} gemm {gemm}: {us:7.2f} us/layer", flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), f"prefetch_{K}x{N}.json"), "w"))

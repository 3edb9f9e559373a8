"""GPU: the first call (compile + prefill + one decode chunk) of a fresh process, compiled in one thread or two.

    JAX_PLATFORMS=cuda,cpu python benchmarks/first_call_gpu.py   (writes $OUT/first_call.json)

Each measurement is a new Python process (nothing compiled yet): Llama-3.1-8B with random bf16
weights, batch 1, a 16-token prompt after a 1k context, and `bench.time_engine`'s first call, the
number `jaxdecode bench` reports. "two threads" is the code as it is (prefill and the decode chunk
compile at once, `decode.compile_at_once` in `bench.time_engine`); "one thread" runs the same two
compilations one after the other. Then the same with JAX's persistent compilation cache in a fresh
directory: the first process fills it, the second reads it.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

_CHILD = r"""
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
mode, cache_dir = sys.argv[1], sys.argv[2]
if cache_dir != "-":
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from jaxdecode import bench
from jaxdecode.config import get_preset
from jaxdecode.decode import Engine
from jaxdecode.model import init_random

if mode == "one":  # the same compile jobs, one after the other
    bench.compile_at_once = lambda *jobs: [job() for job in jobs]
engine = Engine(init_random(get_preset("llama-3.1-8b"), dtype=jnp.bfloat16))
jax.block_until_ready(engine.params)
start = time.perf_counter()
t = bench.time_engine(engine, np.ones((1, 16), np.int32), context=1024, steps=32)
print("RESULT", json.dumps(dict(first_call_s=t.first_call_s, wall_s=time.perf_counter() - start,
                                ms_per_token=t.decode_s / t.steps * 1e3)))
"""


def child(mode: str, cache_dir: str = "-") -> dict:
    proc = subprocess.run([sys.executable, "-c", _CHILD, mode, cache_dir], capture_output=True, text=True, timeout=300)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not line:
        return dict(mode=mode, error=proc.stderr[-800:])
    return dict(mode=mode, cache=cache_dir != "-", **json.loads(line[0][7:]))


def main():
    rows = []
    for mode in ("one", "two", "one", "two"):
        rows.append(child(mode))
        print(rows[-1], flush=True)
    with tempfile.TemporaryDirectory() as cache_dir:
        for label in ("fills the cache", "reads the cache"):
            rows.append(dict(child("two", cache_dir), note=label))
            print(rows[-1], flush=True)
    out = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), rows=rows)
    with open(os.path.join(os.environ.get("OUT", "."), "first_call.json"), "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()

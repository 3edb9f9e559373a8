"""The latency of one small all-reduce over 2 GPUs under NCCL and XLA settings, each in a fresh process.

Tensor-parallel decode does two psums of [B, D] per layer, so at batch 1 their latency, not their
bandwidth, decides the speedup (64 psums per Llama-3.1-8B token). This times
`tp_gpu.allreduce_us` (a jitted chain of 100 psums of [B, 4096] bf16, time / 100) once per
environment variant, then prints the table and writes JSON to $OUT/allreduce_variants.json.

    python benchmarks/allreduce_variants.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

VARIANTS = {
    "default": {},
    "NCCL_PROTO=LL": {"NCCL_PROTO": "LL"},
    "one-shot all-reduce kernel": {"XLA_FLAGS": "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true"},
    "sync all-reduce": {"XLA_FLAGS": "--xla_gpu_disable_async_collectives=ALLREDUCE"},
}
_PROBE = "import sys; sys.path.insert(0, 'benchmarks'); import tp_gpu; print('US', tp_gpu.allreduce_us(4096, {batch}))"


def probe(env: dict[str, str], batch: int) -> float | str:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE.format(batch=batch)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("US "):
            return float(line.split()[1])
    return (proc.stderr.strip().splitlines() or ["no output"])[-1][-200:]


def main() -> int:
    rows = []
    for name, env in VARIANTS.items():
        for batch in (1, 8):
            rows.append({"variant": name, "env": env, "batch": batch, "us_per_psum": probe(env, batch)})
            print(rows[-1], file=sys.stderr)
    print(f"\n{'variant':30s} {'B':>3s}  µs per psum [B, 4096] bf16")
    for r in rows:
        value = f"{r['us_per_psum']:.1f}" if isinstance(r["us_per_psum"], float) else f"failed: {r['us_per_psum']}"
        print(f"{r['variant']:30s} {r['batch']:>3d}  {value}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "allreduce_variants.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

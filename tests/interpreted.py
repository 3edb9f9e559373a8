"""Mosaic GPU's interpreter in a process of its own, for kernels whose warpgroups wait on each other.

XLA:CPU's concurrency-optimized scheduler may reorder the interpreter's barrier callbacks of warpgroups that share
no data, and on two cores the blocked callbacks then hold back the thread that would release them: such kernels
run with it off, which XLA reads once per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_json(code: str, *args: str, timeout: int = 900):
    """Run `code` (Python, which prints one JSON line last) on the CPU with the scheduler off, from the repo root,
    with `args` as sys.argv[1:]; returns that line, parsed."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_enable_concurrency_optimized_scheduler=false").strip()
    done = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])

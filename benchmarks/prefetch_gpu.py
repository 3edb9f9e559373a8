"""L2 prefetch of the next projection's weights (`kernels.l2_prefetch`) in the looped decode: A/B on the GPU.

    python benchmarks/prefetch_gpu.py [--tp2] [--batch 1,8] [--profile NAME] [--variants a,b]
        # writes $OUT/prefetch_gpu.json; the table last

Llama-3.1-8B, random bf16 weights, 1k context, the default looped in-place engine. Each variant sets
`looped_model.PREFETCH_BYTES` (which markers prefetch, and how many bytes) before its engine is traced;
"none" is the engine as it was. Per variant and batch: the best of three 64-step decode timings
(`bench.time_engine`), with "none" measured first and last to show the drift within the run, and
greedy tokens compared with "none" (a prefetch changes no value, so they must be equal). With --tp2,
the same variants on 2 GPUs (`TPForward`, the all-reduce kernel). First: the compiled kernel passes x
through bit for bit. With --profile NAME: GPU kernel durations of one decode chunk of that variant
(batch 1, one GPU), per kernel name, against the same for "none".
"""

from __future__ import annotations

import gc
import json
import os
import sys
from collections import defaultdict

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxdecode import looped_model  # noqa: E402
from jaxdecode.bench import read_ceiling_gb_s, time_engine  # noqa: E402
from jaxdecode.config import get_preset  # noqa: E402
from jaxdecode.cost import decode_cost  # noqa: E402
from jaxdecode.decode import Engine  # noqa: E402
from jaxdecode.model import init_random  # noqa: E402
from kernels.l2_prefetch import prefetch_l2  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
MB = 1 << 20
VARIANTS = {
    "none": {},
    "o": {"o": None},
    "o+qkv32": {"o": None, "next_qkv": 32 * MB},
    "all16": {"o": None, "mlp": 16 * MB, "down": 8 * MB, "next_qkv": 32 * MB},
    "o+mlp32": {"o": None, "mlp": 32 * MB},
    "qkv_whole": {"o": None, "next_qkv": None},
}


def arg(name, default):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def check_passthrough(out):
    x = jax.random.normal(jax.random.key(0), (8, 4096), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (4, 4096, 4096), jnp.bfloat16)
    y = jax.block_until_ready(prefetch_l2(x, [w], jnp.int32(3)))
    out["passthrough_equal"] = bool(np.array_equal(np.asarray(y, np.float32), np.asarray(x, np.float32)))
    print("compiled prefetch_l2 passes x through bit for bit:", out["passthrough_equal"], flush=True)


def make_engine(model, tp: int):
    if tp == 1:
        return Engine(model)
    from jaxdecode.tp import TPForward
    return Engine(None, tp=TPForward.from_model(model, 2, loop_mode="inplace"))


def measure(model, cfg, name, tp, batches, ceiling, out, tokens):
    looped_model.PREFETCH_BYTES = dict(VARIANTS[name])
    engine = make_engine(model, tp)
    for b in batches:
        prompts = np.random.default_rng(b).integers(0, cfg.vocab_size, (b, 16))
        first = time_engine(engine, prompts, context=1024, steps=32)  # compiles
        runs = [time_engine(engine, prompts, context=1024, steps=64) for _ in range(3)]
        best = min(runs, key=lambda t: t.decode_s / t.steps)
        ms = best.decode_s / best.steps * 1e3
        moved = decode_cost(cfg, batch=b, context=1024 + 16 + 32, itemsize=2).bytes
        key = (name.split("#")[0], tp, b)
        equal = bool(np.array_equal(best.tokens, tokens[("none", tp, b)])) if ("none", tp, b) in tokens else None
        tokens.setdefault(key, best.tokens)
        row = {"variant": name, "tp": tp, "batch": b, "ms_per_token": round(ms, 3),
               "all_ms": [round(t.decode_s / t.steps * 1e3, 3) for t in runs],
               "first_call_s": round(first.first_call_s, 2), "tokens_equal_none": equal,
               "pct_roofline": round(100 * moved / (ms / 1e3) / 1e9 / (ceiling * tp), 1)}
        out["rows"].append(row)
        print(row, flush=True)
    looped_model.PREFETCH_BYTES = {}
    return engine


def profile(engine, out, name):
    from gpu_trace import gpu_pids, track_names, traced_events
    prompts = np.ones((1, 16), np.int32)
    events = traced_events(lambda: time_engine(engine, prompts, context=1024, steps=32),
                           os.path.join(os.environ.get("OUT", "/tmp"), f"trace_{name}"))
    on_gpu = gpu_pids(track_names(events))
    by_tid = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in on_gpu and "memcpy" not in e.get("name", "").lower():
            by_tid[(e["pid"], e["tid"])].append(e)
    evs = sorted(max(by_tid.values(), key=len), key=lambda e: e["ts"])
    per = defaultdict(list)
    for e in evs:
        per[e["name"][:60]].append(e["dur"])
    summary = sorted(([n, len(d), round(float(np.median(d)), 2), round(sum(d), 1)] for n, d in per.items()),
                     key=lambda r: -r[3])[:20]
    tail = evs[-60:]
    out["profiles"][name] = {"kernels": summary, "sequence": [[e["name"][:50], round(e["dur"], 2)] for e in tail]}
    print(f"profile {name}:", flush=True)
    for n, c, med, tot in summary:
        print(f"  {n:60s} {c:6d} x {med:7.2f} us = {tot / 1e3:8.2f} ms", flush=True)


def main() -> int:
    out = {"device": jax.devices()[0].device_kind, "devices": len(jax.devices()), "jax": jax.__version__,
           "rows": [], "profiles": {}}
    check_passthrough(out)
    cfg = get_preset("llama-3.1-8b")
    out["read_ceiling_gb_s"] = ceiling = round(read_ceiling_gb_s(4), 1)
    model = init_random(cfg, seed=0, dtype=jnp.bfloat16)
    batches = [int(b) for b in arg("--batch", "1").split(",")]
    names = arg("--variants", "o,o+qkv32,all16,o+mlp32,qkv_whole").split(",")
    tokens = {}
    to_profile = arg("--profile", None)
    for tp in ((1, 2) if "--tp2" in sys.argv else (1,)):
        order = ["none", *names, "none#again"]
        for name in order:
            engine = measure(model, cfg, name, tp, batches, ceiling, out, tokens)
            if tp == 1 and to_profile and name.split("#")[0] in ("none", to_profile) and name != "none#again":
                looped_model.PREFETCH_BYTES = dict(VARIANTS[name.split("#")[0]])
                profile(engine, out, name)
                looped_model.PREFETCH_BYTES = {}
            engine = None
            gc.collect()
    with open(os.path.join(os.environ.get("OUT", "."), "prefetch_gpu.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"\n{out['device']}, read ceiling {ceiling} GB/s")
    print(f"{'variant':12s} {'tp':>3s} {'B':>3s} {'ms/token':>9s} {'% roof':>7s} {'tokens eq':>9s}")
    for r in out["rows"]:
        print(f"{r['variant']:12s} {r['tp']:3d} {r['batch']:3d} {r['ms_per_token']:9.3f} {r['pct_roofline']:7.1f} "
              f"{str(r['tokens_equal_none']):>9s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tensor-parallel scaling: TP 1, 2, 4, 8 for Llama-3.1-8B and -70B, measured and modeled, with the
all-reduce the engine runs timed against XLA's psum.

    python benchmarks/tp_scaling.py                  # every tp <= visible GPUs: 8B and 70B, batch 1 and 8, ctx 4096
    python benchmarks/tp_scaling.py --tp 1,2 --models llama-3.1-8b --context 1024 --allreduce psum,kernel
    python benchmarks/tp_scaling.py --dry-run        # the same code path on the CPU: tiny configs, 8 fake devices

Random bf16 weights, the engine's default decode (looped; in place through kernels on a GPU): 16
prompt tokens after a `--context` zero prefix, 32 greedy decode steps in one on-device chunk, after a
first compiling run (`jaxdecode.bench.time_engine`). TP 1 is the one-device engine (`init_random` +
`Engine(model)`); tp > 1 makes the weights shard by shard in place (`TPForward.random`), so the 70B
model never exists whole anywhere, once per `--allreduce` implementation ("kernel": the engine's
default, the barrier-free all-reduce kernel where it takes the activation, psum elsewhere; "psum":
XLA's all-reduce everywhere). A (model, tp) is skipped, with the reason printed, when tp exceeds the
visible devices, when tp does not divide the heads / ffn, when the per-device memory preflight says
it does not fit (70B at TP 1), or past `--budget-s`.

Per row: ms/token, tok/s, GB/s (`cost.decode_cost` bytes / step time), % of the aggregate read
roofline (the read ceiling of device 0, measured here, times tp), the speedup over the smallest
measured tp of that model and batch and the scaling efficiency = speedup / (tp / that tp), the
all-reduce time per token = measured µs per all-reduce of [B, D] bf16 over tp devices (a jitted chain
of `--psum-chain` dependent all-reduces, time / chain length; psum, and with "kernel" the engine's
`kernels.allreduce.all_reduce`, whose result must equal psum's bit for bit) x (2 L + 1) all-reduces
per token (two per layer, one for the embedding; the logits all-gather is not counted), and the `rdu`
GPU model's prediction for the same configuration (`rdu.validate.predict_tp`, fitted constants): the
"xla" mode (what validate.py's TP2 rows use) and "looped_inplace" (rdu/gpu_modes.py: our engine's
kernels), each with Δ% = (model - measured) / measured and the MAPE over the rows. The predictions
take ctx = `--context` cached tokens (as validate.py's TP2 rows do). Then the paper's DGX H100 numbers
(TensorRT-LLM, Llama-3.1-8B, TP 8, batch 1, 4K: ~300 tok/s, 21 % of 24 TB/s, 1.42x from 1 to 8 GPUs)
beside ours, where TP 1 and 8 ran.

NCCL and XLA settings are environment variables read once per process: run the script under them to
time their all-reduce, e.g. `NCCL_PROTO=LL python benchmarks/tp_scaling.py --tp 2 --models
llama-3.1-8b` (benchmarks/ab.py runs such variants of the decode side by side).

In the dry run the models are two tiny configs defined here (8 heads and 8 kv heads, and 16 and 8, so
that 8 fake devices split them), the context is 32 and the all-reduce chain 20 long; the rdu
predictions are still those of an H200, so their Δ% only shows that the path runs. Output: JSON to
--out, else to $OUT/tp_scaling.json, else to stdout; the table is printed last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

DRY = "--dry-run" in sys.argv
if DRY:  # before JAX starts: 8 fake CPU devices
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # the 70B shards need ~72 GB of 141 per GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxdecode.bench import cache_length, loop_mode, read_ceiling_gb_s, time_engine  # noqa: E402
from jaxdecode.bench.report import device_name  # noqa: E402
from jaxdecode.config import PRESETS, ModelConfig, get_preset, shard_config  # noqa: E402
from jaxdecode.cost import decode_cost  # noqa: E402
from jaxdecode.decode import Engine, default_dtype  # noqa: E402
from jaxdecode.looped_model import default_loop_mode  # noqa: E402
from jaxdecode.memory import GB, device_memory_bytes, preflight  # noqa: E402
from jaxdecode.model import init_random  # noqa: E402
from jaxdecode.tp import AXIS, TPForward, make_mesh  # noqa: E402
from kernels import allreduce as kernels_allreduce  # noqa: E402

PROMPT, STEPS = 16, 32  # prompt tokens, greedy decode steps timed (one on-device chunk)
ALLREDUCE = ("psum", "kernel")
# Tiny configs for the dry run (name, V, D, L, N, K, F): every tp in 1, 2, 4, 8 splits them.
DRY_MODELS = {
    "tiny-tp8": ModelConfig("tiny-tp8", 97, 64, 2, 8, 8, 128, max_seq_len=256),  # MHA, like 8B's K = 8
    "tiny-tp8-gqa": ModelConfig("tiny-tp8-gqa", 97, 128, 3, 16, 8, 256, max_seq_len=256),  # GQA 2:1
}
PAPER = {
    "source": "Kernel Looping (arXiv 2410.23668) / papers.md §1.1, §1.8: DGX H100, TensorRT-LLM, "
    "Llama-3.1-8B, TP 8, batch 1, 4K context",
    "tok_s": 300.0,
    "pct_of_24_tb_s": 21.0,
    "speedup_1_to_8": 1.42,
}
RDU_MODES = ("xla", "looped_inplace")


def allreduce_chain(dim: int, batch: int, *, n: int, devices: int, impl: str) -> tuple[float, np.ndarray]:
    """(µs per all-reduce of one [B, D] bf16 array over `devices` devices, the chain's result): a jitted
    chain of n dependent all-reduces, each input made device-dependent by a fused add so that XLA
    cannot fold them. impl "psum": `lax.psum`; "kernel": the engine's `kernels.allreduce.all_reduce`
    with its persistent buffers (the barrier-free kernel where it takes x, psum elsewhere)."""
    mesh = make_mesh(devices)
    buffers = kernels_allreduce.persistent_buffers(mesh, AXIS, jnp.bfloat16) if impl == "kernel" else ()

    def chain(x, *comm):  # x: [B, D] on each device
        bump = (jax.lax.axis_index(AXIS) + 1).astype(x.dtype) * 1e-3
        for _ in range(n):
            total = kernels_allreduce.all_reduce(x, AXIS, buffers=comm) if comm else jax.lax.psum(x, AXIS)
            x = total * 0.5 + bump  # [B, D]
        return x

    in_specs = (P(),) + (P(AXIS),) * len(buffers)  # the buffers' shards: this device's flags and mailbox
    fn = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=in_specs, out_specs=P(AXIS), check_vma=False))
    x = jnp.ones((batch, dim), jnp.bfloat16)
    out = np.asarray(jax.block_until_ready(fn(x, *buffers)), np.float32)  # compiles
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(fn(x, *buffers))
        best = min(best, time.perf_counter() - start)
    return best / n * 1e6, out


def measure(name: str, cfg, engine: Engine, batch: int, context: int, ceiling: float) -> dict:
    """One row: prefill PROMPT random tokens after `context` zero rows, time STEPS greedy steps."""
    prompts = np.random.default_rng(batch).integers(0, cfg.vocab_size, (batch, PROMPT))
    timing = time_engine(engine, prompts, context=context, steps=STEPS)
    step_s = timing.decode_s / timing.steps
    itemsize = jnp.dtype(engine.cache_dtype).itemsize
    moved = decode_cost(cfg, batch=batch, context=context + PROMPT + STEPS // 2, itemsize=itemsize).bytes
    return {
        "model": name,
        "tp": engine.tp,
        "batch": batch,
        "context": context,
        "loop_mode": loop_mode(engine),
        "first_call_s": round(timing.first_call_s, 2),
        "ms_per_token": round(step_s * 1e3, 3),
        "tok_s": round(batch / step_s, 1),
        "gb_s": round(moved / step_s / 1e9, 1),
        "pct_roofline": round(100 * moved / step_s / 1e9 / (ceiling * engine.tp), 1),
    }


def model_config(name: str) -> ModelConfig:
    return DRY_MODELS[name] if name in DRY_MODELS else get_preset(name)


def rdu_ms(cfg: ModelConfig, batch: int, ctx: int, tp: int, mode: str, gpu_name: str) -> float:
    """rdu's predicted ms per decode step: `predict_tp` for a preset; its same three lines for a dry-run config."""
    if PRESETS.get(cfg.name) == cfg:
        from rdu.validate import predict_tp

        return predict_tp(cfg.name, batch, ctx, tp, gpu_name, constants="fitted", mode=mode)
    from rdu.gpu import gpu_estimate
    from rdu.hardware import gpu
    from rdu.trace import trace_decode_step

    g = trace_decode_step(cfg, batch, ctx, looped=False)
    return gpu_estimate(
        g, gpu(gpu_name, "fitted"), batch=batch, dim=cfg.dim, kv_heads=cfg.n_kv_heads, mode=mode, n_gpus=tp
    ).ms_per_token


def build_engine(cfg: ModelConfig, tp: int, mode: str, dtype, allreduce: str) -> Engine:
    if tp == 1:  # the one-device engine, the baseline every scaling number refers to
        return Engine(init_random(cfg, seed=0, dtype=dtype), loop_mode=mode)
    return Engine(None, tp=TPForward.random(cfg, tp, dtype=dtype, loop_mode=mode, allreduce=allreduce))


def skip_reason(
    cfg: ModelConfig, tp: int, devices: int, *, itemsize: int, batch: int, cache_len: int, available: int
) -> str | None:
    """Why (cfg, tp) cannot run here, or None."""
    if tp > devices:
        return f"tp {tp} > {devices} visible devices"
    try:
        shard_config(cfg, tp)
        est = preflight(
            cfg, itemsize=itemsize, batch=batch, context=cache_len, looped=tp == 1, tp=tp, available=available
        )
    except ValueError as e:
        return str(e)
    print(f"{cfg.name} tp{tp}: preflight {est.describe()} per device", file=sys.stderr)
    return None


def add_derived(rows: list[dict]) -> None:
    """Speedup and scaling efficiency against the smallest measured tp of the same model and batch (and
    the same all-reduce, where that tp is above 1)."""
    for r in rows:
        same = [
            x
            for x in rows
            if x["model"] == r["model"] and x["batch"] == r["batch"] and x["allreduce"] in (None, r["allreduce"])
        ]
        base = min(same, key=lambda x: x["tp"])
        r["base_tp"] = base["tp"]
        r["speedup_vs_base"] = round(r["tok_s"] / base["tok_s"], 3)
        r["scaling_eff"] = round(r["tok_s"] / (base["tok_s"] * r["tp"] / base["tp"]), 3)


def summary(out: dict) -> list[str]:
    """The paper's DGX H100 numbers beside ours (first model, batch 1), where TP 1 and TP 8 were measured,
    then the scaling of every model and batch, with the first `--allreduce`."""
    primary = out["allreduce_impls"][0]  # rows of the first --allreduce (and TP 1)
    rows = [r for r in out["rows"] if r["allreduce"] in (None, primary)]
    first = out["models"][0]
    mine = {r["tp"]: r for r in rows if r["model"] == first and r["batch"] == 1}
    lines = [
        f"paper (DGX H100, TensorRT-LLM, Llama-3.1-8B, TP 8, batch 1, 4K): {PAPER['tok_s']:.0f} tok/s, "
        f"{PAPER['pct_of_24_tb_s']:.0f}% of 24 TB/s, {PAPER['speedup_1_to_8']:.2f}x from 1 to 8 GPUs"
    ]
    if 8 in mine:
        r8 = mine[8]
        sp = f"{r8['tok_s'] / mine[1]['tok_s']:.2f}x from 1 to 8" if 1 in mine else "TP 1 not measured"
        ceil8, peak8 = 8 * out["read_ceiling_gb_s_per_device"] / 1e3, 8 * out["spec_peak_tb_s_per_device"]
        lines.append(
            f"ours ({out['device']}, {first}, TP 8, batch 1, ctx {out['context']}): {r8['tok_s']:.0f} tok/s, "
            f"{r8['pct_roofline']:.1f}% of 8x the measured read ceiling ({ceil8:.1f} TB/s), "
            f"{r8['pct_spec_peak']:.1f}% of 8x the spec peak ({peak8:.1f} TB/s), {sp}; "
            f"all-reduce {r8['allreduce_ms_per_token']:.2f} ms of {r8['ms_per_token']:.2f} ms/token"
        )
        out["paper_comparison"] = {
            "paper": PAPER,
            "ours": {
                "model": first,
                "tok_s": r8["tok_s"],
                "pct_roofline": r8["pct_roofline"],
                "pct_spec_peak": r8["pct_spec_peak"],
                "speedup_1_to_8": (round(r8["tok_s"] / mine[1]["tok_s"], 3) if 1 in mine else None),
            },
        }
    else:
        lines.append(f"ours: TP 8 of {first} at batch 1 not measured here, nothing to set beside it")
    for model in out["models"]:
        for b in out["batches"]:
            rs = sorted((r for r in rows if r["model"] == model and r["batch"] == b), key=lambda r: r["tp"])
            if len(rs) > 1:
                lines.append(
                    f"{model} batch {b}: "
                    + ", ".join(
                        f"TP{r['tp']} {r['tok_s']:.0f} tok/s (x{r['speedup_vs_base']:.2f}, eff {r['scaling_eff']:.2f})"
                        for r in rs
                    )
                    + f"  [vs TP{rs[0]['tp']}; all-reduce: {primary}]"
                )
    if "dry" in out["backend_note"]:
        lines.append("dry run: CPU with fake devices; times show that the path runs, not GPU speeds")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny configs, 8 fake devices")
    parser.add_argument("--tp", default="1,2,4,8")
    parser.add_argument(
        "--models", default=None, help=f"default: llama-3.1-8b,llama-3.1-70b (dry run: {','.join(DRY_MODELS)})"
    )
    parser.add_argument("--batches", default="1,8")
    parser.add_argument(
        "--context", type=int, default=None, help="cached tokens before the prompt (default 4096; dry run 32)"
    )
    parser.add_argument(
        "--memory-gb",
        type=float,
        default=None,
        help="per-device memory for the preflight (default: what the device reports)",
    )
    parser.add_argument("--psum-chain", type=int, default=None, help="all-reduces per timing (100; dry run 20)")
    parser.add_argument(
        "--allreduce", default="kernel", help="comma-separated from psum,kernel: the engines' all-reduce (kernel)"
    )
    parser.add_argument("--rdu-gpu", default=None, help="rdu GPU spec: h200 or h100 (default: from the device name)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="skip the configurations left past this")
    parser.add_argument("--out", default=None, help="JSON path (default $OUT/tp_scaling.json, else stdout)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    tps = sorted({int(t) for t in args.tp.split(",")})
    models = (args.models or (",".join(DRY_MODELS) if args.dry_run else "llama-3.1-8b,llama-3.1-70b")).split(",")
    batches = [int(b) for b in args.batches.split(",")]
    context = args.context if args.context is not None else (32 if args.dry_run else 4096)
    chain = args.psum_chain or (20 if args.dry_run else 100)
    impls = list(dict.fromkeys(args.allreduce.split(",")))
    if not set(impls) <= set(ALLREDUCE):
        parser.error(f"--allreduce takes {', '.join(ALLREDUCE)}, got {args.allreduce!r}")
    cache_len = cache_length(context, PROMPT, STEPS)
    dtype = default_dtype()
    itemsize = jnp.dtype(dtype).itemsize
    devices = len(jax.devices())
    available = int(args.memory_gb * GB) if args.memory_gb else device_memory_bytes()
    dev = device_name()
    rdu_gpu = args.rdu_gpu or ("h100" if "H100" in dev else "h200")
    from rdu.hardware import gpu

    spec_peak = gpu(rdu_gpu, "fitted").hbm_bw / 1e12  # TB/s per device
    ceiling = read_ceiling_gb_s(0.25 if args.dry_run else 4)
    out = {
        "device": dev,
        "devices": devices,
        "backend": jax.default_backend(),
        "backend_note": "dry run (CPU, fake devices)" if args.dry_run else jax.default_backend(),
        "read_ceiling_gb_s_per_device": round(ceiling, 1),
        "spec_peak_tb_s_per_device": spec_peak,
        "rdu_gpu": rdu_gpu,
        "rdu_constants": "fitted",
        "date": time.strftime("%Y-%m-%d"),
        "models": models,
        "tps": tps,
        "batches": batches,
        "context": context,
        "cache_len": cache_len,
        "prompt": PROMPT,
        "steps": STEPS,
        "allreduce_impls": impls,
        "psum_chain": chain,
        "rows": [],
        "allreduce": [],
        "skipped": [],
        "errors": [],
    }
    print(f"{dev} x{devices}: read ceiling {ceiling:.0f} GB/s per device", file=sys.stderr)
    modes = list(dict.fromkeys([default_loop_mode(), "slice"]))  # on an error, fall back to the sliced scan

    for name in models:
        cfg = model_config(name)
        for tp in tps:
            why = skip_reason(
                cfg, tp, devices, itemsize=itemsize, batch=max(batches), cache_len=cache_len, available=available
            )
            if why is None and time.perf_counter() - t0 > args.budget_s:
                why = f"past the budget: {time.perf_counter() - t0:.0f} s used of {args.budget_s:.0f} s"
            if why is not None:
                out["skipped"].append({"model": name, "tp": tp, "reason": why})
                print(f"skip {name} tp{tp}: {why}", file=sys.stderr)
                continue
            timed = {}  # (impl, batch) -> µs per all-reduce of [B, D] over tp devices
            for b in batches if tp > 1 else ():
                results = {}  # impl -> the chain's result, measured here
                for impl in ("psum", "kernel") if "kernel" in impls else ("psum",):
                    key = (cfg.dim, b, tp, impl)
                    done = [a for a in out["allreduce"] if (a["dim"], a["batch"], a["tp"], a["impl"]) == key]
                    if not done:
                        try:
                            us, result = allreduce_chain(cfg.dim, b, n=chain, devices=tp, impl=impl)
                        except Exception as e:  # keep the other rows
                            out["errors"].append(f"{impl} [{b}, {cfg.dim}] tp{tp}: {type(e).__name__}: {str(e)[-800:]}")
                            print(out["errors"][-1], file=sys.stderr)
                            continue
                        entry = {"tp": tp, "batch": b, "dim": cfg.dim, "dtype": "bfloat16", "impl": impl}
                        entry["us_per_call"] = round(us, 2)
                        results[impl] = result
                        if impl != "psum":  # the same sums as psum's, bit for bit, on every device
                            same = np.array_equal(result, results["psum"]) if "psum" in results else None
                            entry["equal_to_psum"] = same if same is None else bool(same)
                        out["allreduce"].append(entry)
                        done = [entry]
                        print(f"{impl} [{b}, {cfg.dim}] bf16 over {tp}: {us:.1f} us", file=sys.stderr)
                    timed[(impl, b)] = done[0]["us_per_call"]
            for impl in impls if tp > 1 else (None,):
                engine = None
                for mode in modes:
                    try:
                        start = time.perf_counter()
                        engine = build_engine(cfg, tp, mode, dtype, impl or "kernel")
                        jax.block_until_ready(engine.params)
                        made_s = time.perf_counter() - start
                        for b in batches:
                            r = measure(name, cfg, engine, b, context, ceiling)
                            moved = decode_cost(cfg, batch=b, context=context + PROMPT + STEPS // 2, itemsize=itemsize)
                            step_s = r["ms_per_token"] / 1e3
                            n_psums = 2 * cfg.n_layers + 1 if tp > 1 else 0
                            psum_us, engine_us = timed.get(("psum", b), 0.0), timed.get((impl, b), 0.0)
                            r.update(
                                {
                                    "allreduce": impl,
                                    "weights_s": round(made_s, 1),
                                    "pct_spec_peak": round(100 * moved.bytes / step_s / (spec_peak * 1e12 * tp), 1),
                                    "allreduce_us_per_psum": psum_us,
                                    "psums_per_token": n_psums,
                                    "allreduce_ms_per_token": round(psum_us * n_psums / 1e3, 3),
                                    "allreduce_pct_of_step": round(
                                        100 * psum_us * n_psums / 1e3 / r["ms_per_token"], 1
                                    ),
                                    "engine_allreduce_us": engine_us,  # the row's all-reduce: psum or the kernel's path
                                    "engine_allreduce_ms_per_token": round(engine_us * n_psums / 1e3, 3),
                                }
                            )
                            out["rows"].append(r)
                            print(r, file=sys.stderr)
                        break
                    except Exception as e:  # keep the other rows
                        out["rows"] = [
                            r
                            for r in out["rows"]
                            if not (r["model"] == name and r["tp"] == tp and r["allreduce"] == impl)
                        ]
                        out["errors"].append(f"{name} tp{tp} {impl or ''} {mode}: {type(e).__name__}: {str(e)[-800:]}")
                        print(out["errors"][-1], file=sys.stderr)
                    finally:
                        engine = None
                        gc.collect()
    add_derived(out["rows"])

    for r in out["rows"]:  # the rdu GPU model for the same configuration
        cfg = model_config(r["model"])
        for mode in RDU_MODES:
            try:
                ms = rdu_ms(cfg, r["batch"], context, r["tp"], mode, rdu_gpu)
                r[f"rdu_{mode}_ms"] = round(ms, 3)
                r[f"rdu_{mode}_delta_pct"] = round(100 * (ms - r["ms_per_token"]) / r["ms_per_token"], 1)
            except Exception as e:
                out["errors"].append(f"rdu {r['model']} tp{r['tp']} b{r['batch']} {mode}: {type(e).__name__}: {e}")
    out["rdu_mape_pct"] = {}
    for mode in RDU_MODES:
        d = [abs(r[f"rdu_{mode}_delta_pct"]) for r in out["rows"] if f"rdu_{mode}_delta_pct" in r]
        if d:
            out["rdu_mape_pct"][mode] = round(sum(d) / len(d), 1)
            out["rdu_mape_pct"][f"{mode}_max_abs"] = round(max(d), 1)
            out["rdu_mape_pct"][f"{mode}_rows"] = len(d)
    lines = summary(out)
    out["wall_s"] = round(time.perf_counter() - t0, 1)

    text = json.dumps(out, indent=1)
    path = args.out or (os.path.join(os.environ["OUT"], "tp_scaling.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            f.write(text)
        print(f"wrote {path}")
    else:
        print(text)

    print(
        f"\n{out['device']} x{devices} ({out['backend_note']}), ctx {context}, read ceiling "
        f"{ceiling:.0f} GB/s per device; rdu: {rdu_gpu}, fitted constants"
    )
    print(
        f"{'model':14} {'tp':>2} {'B':>2} {'mode':>7} {'AR':>6} {'ms/tok':>8} {'tok/s':>8} {'GB/s':>7} {'%roof':>6} "
        f"{'xbase':>5} {'eff':>5} {'AR us':>6} {'AR ms':>6} {'AR%':>5} {'eng us':>6} {'rdu xla':>8} {'Δ%':>6} "
        f"{'rdu inpl':>8} {'Δ%':>6}"
    )
    for r in out["rows"]:
        print(
            f"{r['model'][:14]:14} {r['tp']:>2} {r['batch']:>2} {r['loop_mode'][:7]:>7} {r['allreduce'] or '-':>6} "
            f"{r['ms_per_token']:>8.3f} "
            f"{r['tok_s']:>8.1f} {r['gb_s']:>7.0f} {r['pct_roofline']:>6.1f} {r['speedup_vs_base']:>5.2f} "
            f"{r['scaling_eff']:>5.2f} {r['allreduce_us_per_psum']:>6.1f} {r['allreduce_ms_per_token']:>6.2f} "
            f"{r['allreduce_pct_of_step']:>5.1f} {r['engine_allreduce_us']:>6.1f} "
            f"{r.get('rdu_xla_ms', float('nan')):>8.3f} "
            f"{r.get('rdu_xla_delta_pct', float('nan')):>+6.1f} {r.get('rdu_looped_inplace_ms', float('nan')):>8.3f} "
            f"{r.get('rdu_looped_inplace_delta_pct', float('nan')):>+6.1f}"
        )
    m = out["rdu_mape_pct"]
    if m:
        print(
            "rdu vs measured: "
            + "; ".join(
                f"{mode} MAPE {m[mode]:.1f}% (max {m[mode + '_max_abs']:.1f}%, {m[mode + '_rows']} rows)"
                for mode in RDU_MODES
                if mode in m
            )
        )
    print(
        "xbase / eff: speedup and scaling efficiency vs the smallest measured tp of the model and batch; "
        "AR: the engines' all-reduce; AR us: per psum of [B, D] bf16, x (2L+1) per token; eng us: per call of "
        "the engines' all-reduce"
    )
    for s in out["skipped"]:
        print(f"skipped {s['model']} tp{s['tp']}: {s['reason'][:300]}")
    for e in out["errors"]:
        print(f"error: {e[:500]}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

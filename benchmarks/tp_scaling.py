"""Tensor-parallel scaling (issue #10): TP 1, 2, 4, 8 for Llama-3.1-8B and -70B, measured and modeled.

    python benchmarks/tp_scaling.py                  # every tp <= visible GPUs: 8B and 70B, batch 1 and 8, ctx 4096
    python benchmarks/tp_scaling.py --tp 1,2,4 --models llama-3.1-8b --batches 1
    python benchmarks/tp_scaling.py --dry-run        # the same code path on the CPU: tiny configs, 8 fake devices

Random bf16 weights, the engine's default decode (looped; in place through kernels on a GPU), timed
with the helpers of benchmarks/tp_gpu.py (`row`: 16 prompt tokens after a `--context` zero prefix,
32 greedy decode steps in one on-device chunk, after a first compiling run). TP 1 is the one-device
engine (`init_random` + `Engine(model)`); tp > 1 makes the weights shard by shard in place
(`TPForward.random`), so the 70B model never exists whole anywhere. A (model, tp) is skipped, with
the reason printed, when tp exceeds the visible devices, when tp does not divide the heads / ffn, when
the per-device memory preflight says it does not fit (70B at TP 1), or past `--budget-s`.

Per row: ms/token, tok/s, GB/s (`cost.decode_cost` bytes / step time), % of the aggregate read
roofline (the read ceiling of device 0, measured here, times tp), the speedup over the smallest
measured tp of that model and batch and the scaling efficiency = speedup / (tp / that tp), the
all-reduce time per token = measured µs per psum of [B, D] bf16 over tp devices (`tp_gpu.allreduce_us`:
a jitted chain of psums, time / chain length) x (2 L + 1) psums per token (two per layer, one for the
embedding; the logits all-gather is not counted), and the `rdu` GPU model's prediction for the same
configuration (`rdu.validate.predict_tp`, fitted constants): the "xla" mode (what validate.py's TP2
rows use) and "looped_inplace" (rdu/gpu_modes.py: our engine's kernels), each with Δ% = (model -
measured) / measured and the MAPE over the rows. The predictions take ctx = `--context` cached tokens
(as validate.py's TP2 rows do). Then the paper's DGX H100 numbers (TensorRT-LLM, Llama-3.1-8B, TP 8,
batch 1, 4K: ~300 tok/s, 21 % of 24 TB/s, 1.42x from 1 to 8 GPUs) beside ours, where TP 1 and 8 ran.

In the dry run the models are two tiny configs defined here (8 heads and 8 kv heads, and 16 and 8, so
that 8 fake devices split them), the context is 32 and the psum chain 20 long; the rdu predictions are
still those of an H200, so their Δ% only shows that the path runs. Output: JSON to --out, else to
$OUT/tp_scaling.json, else to stdout; the table is printed last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

DRY = "--dry-run" in sys.argv
if DRY:  # before JAX starts (and before tp_gpu, which keeps a device count already set): 8 fake CPU devices
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import tp_gpu  # noqa: E402  (sets NCCL_NVLS_ENABLE=0 and the memory fraction before JAX starts)

from jaxdecode.bench import read_ceiling_gb_s  # noqa: E402
from jaxdecode.bench_report import device_name  # noqa: E402
from jaxdecode.config import PRESETS, ModelConfig, get_preset  # noqa: E402
from jaxdecode.cost import decode_cost  # noqa: E402
from jaxdecode.decode import Engine, default_dtype  # noqa: E402
from jaxdecode.looped_model import default_loop_mode  # noqa: E402
from jaxdecode.memory import GB, device_memory_bytes, preflight  # noqa: E402
from jaxdecode.model import init_random  # noqa: E402
from jaxdecode.tp import TPForward, shard_config  # noqa: E402

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


def model_config(name: str) -> ModelConfig:
    return DRY_MODELS[name] if name in DRY_MODELS else get_preset(name)


def rdu_ms(cfg: ModelConfig, batch: int, ctx: int, tp: int, mode: str, gpu_name: str) -> float:
    """rdu's predicted ms per decode step: `predict_tp` for a preset; its same three lines for a dry-run config."""
    if PRESETS.get(cfg.name) == cfg:
        from rdu.validate import predict_tp

        return predict_tp(cfg.name, batch, ctx, tp, gpu_name, constants="fitted", mode=mode)
    from rdu.hardware import gpu
    from rdu.simulate import gpu_estimate
    from rdu.trace import trace_decode_step

    g = trace_decode_step(cfg, batch, ctx, looped=False)
    return gpu_estimate(
        g, gpu(gpu_name, "fitted"), batch=batch, dim=cfg.dim, kv_heads=cfg.n_kv_heads, mode=mode, n_gpus=tp
    ).ms_per_token


def build_engine(cfg: ModelConfig, tp: int, mode: str, dtype) -> Engine:
    if tp == 1:  # the one-device engine, the baseline every scaling number refers to
        return Engine(init_random(cfg, seed=0, dtype=dtype), loop_mode=mode)
    return Engine(None, tp=TPForward.random(cfg, tp, dtype=dtype, loop_mode=mode))


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
    """Speedup and scaling efficiency against the smallest measured tp of the same model and batch."""
    for r in rows:
        base = min((x for x in rows if x["model"] == r["model"] and x["batch"] == r["batch"]), key=lambda x: x["tp"])
        r["base_tp"] = base["tp"]
        r["speedup_vs_base"] = round(r["tok_s"] / base["tok_s"], 3)
        r["scaling_eff"] = round(r["tok_s"] / (base["tok_s"] * r["tp"] / base["tp"]), 3)


def summary(out: dict) -> list[str]:
    """The paper's DGX H100 numbers beside ours (first model, batch 1), where TP 1 and TP 8 were measured."""
    rows = out["rows"]
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
                    + f"  [vs TP{rs[0]['tp']}]"
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
    parser.add_argument("--psum-chain", type=int, default=None, help="psums per all-reduce timing (100; dry run 20)")
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
    cache_len = -(-(context + tp_gpu.PROMPT + tp_gpu.STEPS) // 64) * 64
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
        "prompt": tp_gpu.PROMPT,
        "steps": tp_gpu.STEPS,
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
            psum = {}
            for b in batches:  # µs per psum of [B, D] over tp devices
                key = (cfg.dim, b, tp)
                done = [a for a in out["allreduce"] if (a["dim"], a["batch"], a["tp"]) == key]
                if tp > 1 and not done:
                    us = tp_gpu.allreduce_us(cfg.dim, b, n=chain, devices=tp)
                    out["allreduce"].append(
                        {"tp": tp, "batch": b, "dim": cfg.dim, "dtype": "bfloat16", "us_per_psum": round(us, 2)}
                    )
                    print(f"psum [{b}, {cfg.dim}] bf16 over {tp}: {us:.1f} us", file=sys.stderr)
                psum[b] = (
                    0.0
                    if tp == 1
                    else next(a["us_per_psum"] for a in out["allreduce"] if (a["dim"], a["batch"], a["tp"]) == key)
                )
            engine = None
            for mode in modes:
                try:
                    start = time.perf_counter()
                    engine = build_engine(cfg, tp, mode, dtype)
                    jax.block_until_ready(engine.params)
                    made_s = time.perf_counter() - start
                    for b in batches:
                        r, _ = tp_gpu.row(name, cfg, engine, b, context, ceiling, np.random.default_rng(b))
                        moved = decode_cost(
                            cfg, batch=b, context=context + tp_gpu.PROMPT + tp_gpu.STEPS // 2, itemsize=itemsize
                        ).bytes
                        step_s = r["ms_per_token"] / 1e3
                        n_psums = 2 * cfg.n_layers + 1
                        ar_ms = psum[b] * n_psums / 1e3
                        r.update(
                            {
                                "weights_s": round(made_s, 1),
                                "pct_spec_peak": round(100 * moved / step_s / (spec_peak * 1e12 * tp), 1),
                                "allreduce_us_per_psum": psum[b],
                                "psums_per_token": n_psums if tp > 1 else 0,
                                "allreduce_ms_per_token": round(ar_ms, 3),
                                "allreduce_pct_of_step": round(100 * ar_ms / r["ms_per_token"], 1),
                            }
                        )
                        out["rows"].append(r)
                        print(r, file=sys.stderr)
                    break
                except Exception as e:  # keep the other rows
                    out["rows"] = [r for r in out["rows"] if not (r["model"] == name and r["tp"] == tp)]
                    out["errors"].append(f"{name} tp{tp} {mode}: {type(e).__name__}: {str(e)[-800:]}")
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
        f"{'model':14} {'tp':>2} {'B':>2} {'mode':>7} {'ms/tok':>8} {'tok/s':>8} {'GB/s':>7} {'%roof':>6} "
        f"{'xbase':>5} {'eff':>5} {'AR us':>6} {'AR ms':>6} {'AR%':>5} {'rdu xla':>8} {'Δ%':>6} "
        f"{'rdu inpl':>8} {'Δ%':>6}"
    )
    for r in out["rows"]:
        print(
            f"{r['model'][:14]:14} {r['tp']:>2} {r['batch']:>2} {r['loop_mode'][:7]:>7} {r['ms_per_token']:>8.3f} "
            f"{r['tok_s']:>8.1f} {r['gb_s']:>7.0f} {r['pct_roofline']:>6.1f} {r['speedup_vs_base']:>5.2f} "
            f"{r['scaling_eff']:>5.2f} {r['allreduce_us_per_psum']:>6.1f} {r['allreduce_ms_per_token']:>6.2f} "
            f"{r['allreduce_pct_of_step']:>5.1f} {r.get('rdu_xla_ms', float('nan')):>8.3f} "
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
        "AR: us per psum of [B, D] bf16, x (2L+1) per token"
    )
    for s in out["skipped"]:
        print(f"skipped {s['model']} tp{s['tp']}: {s['reason'][:300]}")
    for e in out["errors"]:
        print(f"error: {e[:500]}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The `jaxdecode bench` suite: our engine against its peers, with the memory roofline, as JSON lines.

`run_suite` (`jaxdecode bench --suite gpu`, or any of --models/--batches/--contexts/--peers/--out)
measures the HBM read ceiling, then, per model and per (batch B, context C) config, our decode (the
default engine: looped, in place on a GPU) and the peers of `PEERS`: plain JAX unrolled and plain JAX
scan, and, when torch and transformers are installed (the extra `jaxdecode[peers]`), HF transformers
eager and HF static cache + torch.compile (`jaxdecode.bench.peers`, imported only when asked for).

**Context without a long prefill.** A config's context C is the number of tokens already in the KV
cache when the prompt arrives. Every system gets the same state: cache rows 0..C-1 hold zeros (a
prefilled prefix; no system can tell zeros from real keys in its timing: every step reads the rows
it attends to), then a short real prompt of P random tokens is prefilled at positions C..C+P-1, and
`steps` greedy decode steps follow. This is the cheapest correct setup: a real 8k-token prefill at
batch 32 would cost more time than the whole run (and our prefill materializes [B, N, T, S] scores).
Our cache and HF's static cache hold `cache_length(C, P, steps)` rows; HF's dynamic cache grows.

**Numbers per row.** first_call_s: compile + prefill + the first chunk of decode steps, on a fresh
shape. prefill_ms: the P-token prefill of the second, timed run. ms_per_token: time per decode step
(one token for each of the B sequences), so tok_s = B / (ms_per_token / 1000). bytes_per_step:
`cost.decode_cost` at the mean context of the timed steps (C + P + steps / 2). pct_roofline =
bytes_per_step / step time / the read ceiling. On peer rows, ours_over_peer = our tok/s / the peer's
tok/s (above 1: ours is faster) and tokens_agree = how many leading tokens equal ours in every
sequence (the peers must compute the same thing; in float32 all of them do, in bf16 they may drift).
"""

from __future__ import annotations

import gc
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.bench.report import device_name, plot, print_row, summarize
from jaxdecode.bench.timing import (
    Timing,
    cache_length,
    chunking,
    loop_mode,
    read_ceiling_gb_s,
    time_engine,
    tokens_agree,
)
from jaxdecode.config import get_preset
from jaxdecode.cost import decode_cost
from jaxdecode.decode import Engine, default_dtype
from jaxdecode.memory import preflight
from jaxdecode.model import init_random
from jaxdecode.progress import phase

PEERS = ("unrolled", "scan", "hf_eager", "hf_static")
HF_PEERS = ("hf_eager", "hf_static")
ENGINES = {"ours": dict(), "unrolled": dict(loop_layers=False), "scan": dict(loop_mode="slice")}
SUITES = {"gpu": dict(models=("llama-3.1-8b", "qwen2.5-7b"), batches=(1, 8, 32), contexts=(1024, 8192))}
# Rough costs for the printed estimate: seconds for compile + first chunk of a new shape, and the
# fraction of the read ceiling a decode step reaches (H200: BENCHMARKS.md, shared/reference/h200-anchors.md).
EST = {
    "gpu": {"ours": (7, 0.6), "unrolled": (15, 0.6), "scan": (5, 0.27), "hf_eager": (3, 0.15), "hf_static": (35, 0.45)},
    "cpu": {"ours": (3, 0.3), "unrolled": (3, 0.3), "scan": (3, 0.3), "hf_eager": (1, 0.1), "hf_static": (40, 0.1)},
}
SETUP_S = {"gpu": 15.0, "cpu": 1.0}  # per model: random weights (and the HF copy, when asked)
CEILING_GUESS = {"gpu": 4246.0, "cpu": 15.0}  # GB/s, for estimates before the ceiling is measured


def load_peers():
    """The HF peers module, imported only when a plan asks for an HF peer: torch and transformers are
    the optional extra `jaxdecode[peers]`, not dependencies of the engine. A clear error without them."""
    try:
        import jaxdecode.bench.peers as peers
    except ModuleNotFoundError as e:
        if e.name not in ("torch", "transformers", "accelerate"):
            raise
        raise ValueError(
            f"the HF peers ({', '.join(HF_PEERS)}) need {e.name}: install the extra "
            f"(pip install 'jaxdecode[peers]') or leave them out (--peers unrolled,scan)"
        ) from None
    return peers


def make_row(
    *,
    model: str,
    system: str,
    cfg,
    batch: int,
    context: int,
    prompt_len: int,
    timing: Timing,
    itemsize: int,
    ceiling: float,
    cache_len: int,
    extra: dict,
    quantize: str | None = None,
) -> dict:
    step_s = timing.decode_s / timing.steps
    mean_context = context + prompt_len + timing.steps // 2
    moved = decode_cost(cfg, batch=batch, context=mean_context, itemsize=itemsize, quantize=quantize).bytes
    return {
        "model": model,
        "system": system,
        "quantize": quantize,
        "batch": batch,
        "context": context,
        "prompt_len": prompt_len,
        "steps": timing.steps,
        "cache_len": cache_len,
        "first_call_s": round(timing.first_call_s, 3),
        "prefill_ms": round(timing.prefill_s * 1e3, 3),
        "ms_per_token": step_s * 1e3,
        "tok_s": batch / step_s,
        "bytes_per_step": moved,
        "gb_s": moved / step_s / 1e9,
        "read_ceiling_gb_s": ceiling,
        "pct_roofline": 100 * moved / step_s / 1e9 / ceiling,
        **extra,
    }


def estimate_s(
    system: str,
    cfg,
    *,
    batch: int,
    context: int,
    prompt_len: int,
    steps: int,
    backend: str,
    ceiling: float,
    quantize: str | None = None,
) -> float:
    """Seconds for one row: compile + first chunk, then the timed prefill and steps (see `EST`)."""
    compile_s, eff = EST["gpu" if backend == "gpu" else "cpu"][system]
    itemsize = 2 if backend == "gpu" else 4
    moved = decode_cost(
        cfg, batch=batch, context=context + prompt_len + steps // 2, itemsize=itemsize, quantize=quantize
    )
    step_s = moved.bytes / (ceiling * 1e9 * eff)
    return compile_s + (steps + chunking(steps)[0]) * step_s


@dataclass
class SuitePlan:
    models: list[str]
    batches: list[int]
    contexts: list[int]
    peers: list[str]
    prompt_len: int = 16
    steps: int = 64
    seed: int = 0
    budget_s: float | None = None  # skip a row whose estimate no longer fits
    ceiling_gib: float | None = None
    only: dict[str, set[tuple[int, int]]] = field(default_factory=dict)  # peer -> its only (batch, context)s
    quantize: str | None = None  # "int8" | "int4": our engine and the unrolled peer on quantized weights

    @property
    def systems(self) -> list[str]:
        return ["ours"] + [p for p in PEERS if p in self.peers]

    def configs(self, system: str = "ours") -> list[tuple[int, int]]:
        return [
            (b, c)
            for b in sorted(self.batches)
            for c in sorted(self.contexts)
            if system not in self.only or (b, c) in self.only[system]
        ]

    def validate(self):
        bad = [p for p in self.peers if p not in PEERS]
        if bad:
            raise ValueError(f"unknown peer {bad[0]!r}; peers: {', '.join(PEERS)}")
        hf = [p for p in self.peers if p.startswith("hf")]
        if self.quantize and hf:
            raise ValueError(f"--quantize: the HF peers ({', '.join(hf)}) run bf16 weights; time them without it")
        if min(self.batches) < 1 or min(self.contexts) < 0 or self.prompt_len < 1 or self.steps < 1:
            raise ValueError("need batches >= 1, contexts >= 0, --prompt-len >= 1 and --steps >= 1")
        for name in self.models:
            cfg = get_preset(name)
            need = max(self.contexts) + self.prompt_len + self.steps
            if need > cfg.max_seq_len:
                raise ValueError(
                    f"{name}: context {max(self.contexts)} + prompt {self.prompt_len} + {self.steps} "
                    f"steps exceeds the model's context of {cfg.max_seq_len} tokens"
                )

    def estimates(self, backend: str, ceiling: float) -> dict[tuple[str, int, int], dict[str, float]]:
        return {
            (m, b, c): {
                s: estimate_s(
                    s,
                    get_preset(m),
                    batch=b,
                    context=c,
                    prompt_len=self.prompt_len,
                    steps=self.steps,
                    backend=backend,
                    ceiling=ceiling,
                    quantize=self.quantize,
                )
                for s in self.systems
                if (b, c) in self.configs(s)
            }
            for m in self.models
            for b, c in self.configs()
        }


def print_estimates(plan: SuitePlan, backend: str, ceiling: float, out=sys.stderr) -> float:
    """One line per config with the estimated seconds per system; returns the total."""
    est = plan.estimates(backend, ceiling)
    setup = SETUP_S["gpu" if backend == "gpu" else "cpu"] * len(plan.models)
    print(f"estimated seconds ({backend}; compile + first chunk + timed run, rough):", file=out)
    for (m, b, c), per in est.items():
        cells = "  ".join(f"{s} {v:5.1f}" for s, v in per.items())
        print(f"  {m:14} B{b:<3} ctx {c:<6} {sum(per.values()):6.1f} s   [{cells}]", file=out)
    total = setup + sum(sum(per.values()) for per in est.values())
    print(f"  + model setup {setup:.0f} s; total about {total:.0f} s", file=out)
    return total


def run_suite(plan: SuitePlan, *, out_dir: str | None = None, emit=print) -> dict:
    """Measure every (model, system, batch, context) of the plan; rows go to `emit` as they come.

    Per model: the memory preflight, random weights (reused by every system and config), then the
    systems in order (ours first, so that peer rows carry the ratio), each built once and freed after
    its configs. Returns the summary object (also emitted last).
    """
    plan.validate()
    peers = load_peers() if any(p in HF_PEERS for p in plan.peers) else None  # before any work: a clear error
    t0 = time.perf_counter()
    backend = jax.default_backend()
    dtype = default_dtype()
    itemsize = jnp.dtype(dtype).itemsize
    with phase("measuring the read ceiling"):
        ceiling = read_ceiling_gb_s(plan.ceiling_gib or (4 if backend == "gpu" else 0.25))
    print(f"read ceiling {ceiling:.1f} GB/s on {device_name()}", file=sys.stderr)
    print_estimates(plan, backend, ceiling)
    estimates = plan.estimates(backend, ceiling)
    rows, skipped, errors = [], [], []
    out_path = Path(out_dir) if out_dir else None
    if out_path:
        out_path.mkdir(parents=True, exist_ok=True)
        (out_path / "bench.jsonl").write_text("")

    def put(obj: dict):
        line = json.dumps(obj)
        emit(line)
        if out_path:
            with open(out_path / "bench.jsonl", "a") as f:
                f.write(line + "\n")

    for name in plan.models:
        cfg = get_preset(name)
        max_len = cache_length(max(plan.contexts), plan.prompt_len, plan.steps + chunking(plan.steps)[0])
        try:  # the largest cache of the model's configs, with the packed copy of the weights
            est = preflight(
                cfg, itemsize=itemsize, batch=max(plan.batches), context=max_len, looped=True, quantize=plan.quantize
            )
            print(f"{name}: memory preflight {est.describe()}", file=sys.stderr)
        except ValueError as e:
            errors.append(f"{name}: {e}")
            print(errors[-1], file=sys.stderr)
            continue
        with phase(f"{name}: drawing random weights"):
            model = init_random(cfg, seed=plan.seed, dtype=dtype, quantize=plan.quantize)
        rng = np.random.default_rng(plan.seed)
        prompts = {b: rng.integers(0, cfg.vocab_size, (b, plan.prompt_len)) for b in sorted(plan.batches)}
        ours: dict[tuple[int, int], tuple[dict, np.ndarray]] = {}
        hf = None
        for system in plan.systems:
            runner = None
            for b, c in plan.configs(system):
                label = f"{name} {system} B{b} ctx {c}"
                guess = estimates[(name, b, c)][system]
                if plan.budget_s is not None and time.perf_counter() - t0 + guess > plan.budget_s:
                    skipped.append(f"{label}: estimated {guess:.0f} s, past the {plan.budget_s:.0f} s budget")
                    print(f"skip {skipped[-1]}", file=sys.stderr)
                    continue
                start = time.perf_counter()
                try:
                    if runner is None:
                        with phase(f"{name} {system}: building"):
                            if system in HF_PEERS:
                                hf = hf or peers.build_hf(model)
                                runner = peers.hf_runner(hf, compiled=system == "hf_static")
                            else:
                                engine = Engine(model, **ENGINES[system])
                                runner = engine_runner(engine)
                    with phase(f"{label}: compiling, then {plan.steps} timed steps (about {guess:.0f} s)"):
                        timing, extra = runner(prompts[b], context=c, steps=plan.steps)
                except Exception as e:  # one system failing must not lose the others
                    errors.append(f"{label}: {type(e).__name__}: {str(e)[-600:]}")
                    print(errors[-1], file=sys.stderr)
                    continue
                row = make_row(
                    model=name,
                    system=system,
                    cfg=cfg,
                    batch=b,
                    context=c,
                    prompt_len=plan.prompt_len,
                    timing=timing,
                    itemsize=itemsize,
                    ceiling=ceiling,
                    cache_len=cache_length(c, plan.prompt_len, timing.steps),
                    extra=extra,
                    quantize=plan.quantize,
                )
                row.update(
                    est_s=round(guess, 1),
                    wall_s=round(time.perf_counter() - start, 2),
                    device=device_name(),
                    backend=backend,
                    dtype=jnp.dtype(dtype).name,
                )
                if system == "ours":
                    ours[(b, c)] = (row, timing.tokens)
                elif (b, c) in ours:
                    row["ours_over_peer"] = ours[(b, c)][0]["tok_s"] / row["tok_s"]
                    row["tokens_agree"] = tokens_agree(timing.tokens, ours[(b, c)][1])
                rows.append(row)
                put(row)
                print_row(row)
            runner = engine = None
        used_torch = hf is not None
        del model, hf
        gc.collect()
        if used_torch:
            peers.release_memory()
        if out_path and rows:
            plot(rows, out_path / "bench.png")  # after each model, in case a later one runs out of time
    summary = summarize(
        rows,
        skipped=skipped,
        errors=errors,
        ceiling=ceiling,
        wall_s=time.perf_counter() - t0,
        plot_path=str(out_path / "bench.png") if out_path and rows else None,
    )
    put(summary)
    return summary


def engine_runner(engine: Engine):
    """run(prompts, context=, steps=) -> (Timing, extra row fields) for one of our engines."""
    mode = loop_mode(engine)

    def run(prompts, *, context, steps):
        return time_engine(engine, prompts, context=context, steps=steps), {"loop_mode": mode}

    return run

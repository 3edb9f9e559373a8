"""`jaxdecode bench`: its flags made into a suite plan (`jaxdecode.bench.suite`), or the plain timing
of one engine through `Engine.generate` on the given model."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass

import jax
import numpy as np
from rich.console import Console
from rich.table import Table

from jaxdecode.bench.report import device_name
from jaxdecode.bench.suite import CEILING_GUESS, HF_PEERS, PEERS, SUITES, SuitePlan, print_estimates, run_suite
from jaxdecode.cost import decode_cost, step_weight_bytes
from jaxdecode.decode import Engine, default_dtype
from jaxdecode.loading import load_engine, load_model
from jaxdecode.progress import phase


@dataclass
class DecodeMeasurement:
    model: str
    variant: str  # "looped" or "unrolled"
    backend: str
    device: str
    batch: int
    prompt_len: int
    new_tokens: int
    tp: int  # devices the model is split over
    first_call_s: float  # trace + compile + prefill + decode of the first run
    prefill_ms: float
    decode_ms_per_step: float
    decode_tok_s: float  # tokens per second summed over the batch
    weight_gb_s: float  # bytes the step must move (cost.py) / step time
    date: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def measure_decode(
    engine: Engine,
    *,
    model_name: str,
    batch: int = 1,
    prompt_len: int = 32,
    new_tokens: int = 128,
    chunk: int = 32,
    seed: int = 0,
    engine_model=None,
) -> DecodeMeasurement:
    """Time one engine: a first (compiling) run, then the same run again. `engine_model`: the model the
    engine runs, whose weights' stored sizes the GB/s counts (else `cost.decode_cost`'s dense bytes)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, engine.cfg.vocab_size, prompt_len).tolist() for _ in range(batch)]
    kwargs = dict(max_new_tokens=new_tokens, chunk=chunk)
    variant = "looped" if engine.loop_layers else "unrolled"
    start = time.perf_counter()
    with phase(f"{model_name} {variant}: compiling, first run"):
        engine.generate(prompts, **kwargs)
    first_call = time.perf_counter() - start
    with phase(f"{model_name} {variant}: timed run of {new_tokens} tokens"):
        gen = engine.generate(prompts, **kwargs)
    step_s = gen.decode_s / gen.decode_steps
    itemsize = np.dtype(engine.cache_dtype).itemsize
    read = step_weight_bytes(engine_model, batch) if engine_model is not None else None
    moved = decode_cost(
        engine.cfg, batch=batch, context=prompt_len + new_tokens // 2, itemsize=itemsize, weight_bytes=read
    ).bytes
    return DecodeMeasurement(
        model=model_name,
        variant=variant,
        backend=jax.default_backend(),
        device=device_name(),
        batch=batch,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        tp=engine.tp,
        first_call_s=round(first_call, 3),
        prefill_ms=round(gen.prefill_s * 1e3, 2),
        decode_ms_per_step=round(step_s * 1e3, 3),
        decode_tok_s=round(batch / step_s, 2),
        weight_gb_s=round(moved / step_s / 1e9, 2),
        date=time.strftime("%Y-%m-%d"),
    )


def parse_ints(text: str, what: str) -> list[int]:
    """ "1,8,1k" -> [1, 8, 1024]; a clear error naming the flag --`what` otherwise."""
    try:
        vals = [int(float(t[:-1]) * 1024) if t.lower().endswith("k") else int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--{what} takes comma-separated integers (1k = 1024), got {text!r}") from None
    if not vals:
        raise ValueError(f"--{what} is empty")
    return vals


def parse_peers(text: str | None) -> tuple[list[str], dict[str, set[tuple[int, int]]]]:
    """ "unrolled,hf_static@1x1k+32x1k" -> peers, and the only (batch, context)s of the restricted ones."""
    if text is None:
        return list(PEERS), {}
    peers, only = [], {}
    for item in (t.strip() for t in text.split(",")):
        if not item or item == "none":
            continue
        name, _, configs = item.partition("@")
        if name in peers:  # "hf_static@1x1k,hf_static@8x1k" reads as hf_static@1x1k+8x1k
            if name not in only or not configs:
                raise ValueError(f"--peers names {name!r} twice; restrict it once as {name}@BxC+BxC")
        else:
            peers.append(name)
        if configs:
            try:
                only.setdefault(name, set()).update(
                    (b, c) for b, c in (parse_ints(bc.replace("x", ","), "peers") for bc in configs.split("+"))
                )
            except ValueError:
                raise ValueError(f"--peers {item!r}: restrict a peer as NAME@BxC[+BxC], e.g. hf_static@1x1k") from None
    return peers, only


def suite_plan(args) -> SuitePlan:
    base = (
        SUITES[args.suite] if args.suite else dict(models=(args.model,), batches=(args.batch or 1,), contexts=(1024,))
    )
    peers, only = parse_peers(args.peers)
    return SuitePlan(
        models=args.models.split(",") if args.models else list(base["models"]),
        batches=parse_ints(args.batches, "batches") if args.batches else list(base["batches"]),
        contexts=parse_ints(args.contexts, "contexts") if args.contexts else list(base["contexts"]),
        peers=peers,
        only=only,
        prompt_len=args.prompt_len or 16,
        steps=args.steps,
        seed=args.seed,
        budget_s=args.budget_s,
        ceiling_gib=args.ceiling_gib,
        quantize=args.quantize,
    )


def run_cli_bench(args) -> int:
    """`jaxdecode bench`: the suite (see `run_suite`) when any suite flag is given, else the plain
    timing of the looped engine (and with --compare-unrolled the unrolled one) on the given model."""
    if (
        args.suite
        or args.models
        or args.batches
        or args.contexts
        or args.peers is not None
        or args.out
        or args.dry_run
        or args.budget_s is not None
    ):
        if args.tp != 1:
            raise ValueError("--tp works in plain `jaxdecode bench` only, not with the suite flags")
        plan = suite_plan(args)
        plan.validate()
        if args.dry_run:
            backend = args.dry_run
            print_estimates(plan, backend, CEILING_GUESS[backend], out=sys.stdout)
            return 0
        if any(p in HF_PEERS for p in plan.peers):
            # jax would otherwise take 75% of the GPU at its first allocation, leaving torch too little.
            os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        summary = run_suite(plan, out_dir=args.out)
        if not summary["rows"]:  # every row refused, failed or skipped: a run that measured nothing fails
            refused = len(summary["errors"]) + len(summary["skipped"])
            raise ValueError(f"bench measured nothing: {refused} refused, failed or skipped (the lines above say why)")
        return 0
    return run_plain(args)


def run_plain(args) -> int:
    """Plain `jaxdecode bench`: a table on stderr and one JSON line per engine timed."""
    batch, prompt_len, new_tokens = args.batch or 1, args.prompt_len or 32, args.max_new_tokens
    if batch < 1 or prompt_len < 1 or new_tokens < 2:
        raise ValueError("need --batch >= 1, --prompt-len >= 1 and --max-new-tokens >= 2")
    variants = [not args.no_loop] + ([False] if args.compare_unrolled and not args.no_loop else [])
    loaded = (
        load_model(args.model, dtype=default_dtype(), quantize=args.quantize, dequantize=args.dequantize)
        if args.tp == 1
        else None
    )
    rows = []
    for loop in variants:
        if args.tp == 1:
            with phase(f"preparing the {'looped' if loop else 'unrolled'} engine"):
                engine = Engine(loaded.model, loop_layers=loop)
        else:  # dense random presets are made on the devices, split; the rest loaded, then split
            engine = load_engine(
                args.model, args.tp, loop_layers=loop, quantize=args.quantize, dequantize=args.dequantize
            )[0]
        rows.append(
            measure_decode(
                engine,
                model_name=args.model,
                batch=batch,
                prompt_len=prompt_len,
                new_tokens=new_tokens,
                engine_model=loaded.model if loaded else None,
            )
        )
    table = Table(title=f"decode, {rows[0].device}, {rows[0].date}")
    for col in ("variant", "batch", "first call s", "prefill ms", "ms/step", "tok/s", "GB/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r.variant + (f" tp{r.tp}" if r.tp > 1 else ""),
            str(r.batch),
            f"{r.first_call_s:.2f}",
            f"{r.prefill_ms:.1f}",
            f"{r.decode_ms_per_step:.2f}",
            f"{r.decode_tok_s:.1f}",
            f"{r.weight_gb_s:.1f}",
        )
    Console(file=sys.stderr).print(table)
    for r in rows:
        print(r.to_json())
    return 0

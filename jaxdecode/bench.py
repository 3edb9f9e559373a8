"""Decode benchmark harness: our engine against its peers, with the memory roofline, as JSON lines.

Two entry points share the measurement code here:
- `measure_decode` times one engine through `Engine.generate` (the plain `jaxdecode bench` and
  `benchmarks/loop_gpu.py`).
- `run_suite` (`jaxdecode bench --suite gpu`, or any of --models/--batches/--contexts/--peers/--out)
  measures the HBM read ceiling, then, per model and per (batch B, context C) config, our decode (the
  default engine: looped, in place on a GPU) and the peers of `PEERS`: HF transformers eager, HF
  static cache + torch.compile (`jaxdecode.bench_peers`), plain JAX unrolled and plain JAX scan.

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
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.bench_report import device_name, plot, print_row, summarize
from jaxdecode.config import get_preset
from jaxdecode.cost import decode_cost
from jaxdecode.decode import DecodeState, Engine, compile_at_once
from jaxdecode.sampling import SamplingParams, sample

PEERS = ("unrolled", "scan", "hf_eager", "hf_static")
HF_PEERS = ("hf_eager", "hf_static")
_ENGINES = {"ours": dict(), "unrolled": dict(loop_layers=False), "scan": dict(loop_mode="slice")}
SUITES = {"gpu": dict(models=("llama-3.1-8b", "qwen2.5-7b"), batches=(1, 8, 32), contexts=(1024, 8192))}
# Rough costs for the printed estimate: seconds for compile + first chunk of a new shape, and the
# fraction of the read ceiling a decode step reaches (H200: BENCHMARKS.md, shared/reference/h200-anchors.md).
_EST = {
    "gpu": {"ours": (7, 0.6), "unrolled": (15, 0.6), "scan": (5, 0.27), "hf_eager": (3, 0.15), "hf_static": (35, 0.45)},
    "cpu": {"ours": (3, 0.3), "unrolled": (3, 0.3), "scan": (3, 0.3), "hf_eager": (1, 0.1), "hf_static": (40, 0.1)},
}
_SETUP_S = {"gpu": 15.0, "cpu": 1.0}  # per model: random weights (and the HF copy, when asked)
_CEILING_GUESS = {"gpu": 4246.0, "cpu": 15.0}  # GB/s, for estimates before the ceiling is measured
GREEDY = SamplingParams()


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
) -> DecodeMeasurement:
    """Time one engine: a first (compiling) run, then the same run again."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, engine.cfg.vocab_size, prompt_len).tolist() for _ in range(batch)]
    kwargs = dict(max_new_tokens=new_tokens, chunk=chunk)
    start = time.perf_counter()
    engine.generate(prompts, **kwargs)
    first_call = time.perf_counter() - start
    gen = engine.generate(prompts, **kwargs)
    step_s = gen.decode_s / gen.decode_steps
    itemsize = np.dtype(engine.cache_dtype).itemsize
    moved = decode_cost(engine.cfg, batch=batch, context=prompt_len + new_tokens // 2, itemsize=itemsize).bytes
    return DecodeMeasurement(
        model=model_name,
        variant="looped" if engine.loop_layers else "unrolled",
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


def read_ceiling_gb_s(gib: float = 4, repeats: int = 10) -> float:
    """HBM (or RAM) read bandwidth: a float32 sum over `gib` GiB of bf16, after a warm-up call."""
    x = jnp.ones((int(gib * 2**30) // 2,), jnp.bfloat16)
    total = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    total(x).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        out = total(x)
    out.block_until_ready()
    return x.nbytes * repeats / (time.perf_counter() - start) / 1e9


# -- one timed run of one system -----------------------------------------------------------------


@dataclass
class Timing:
    """A first (compiling) run and a second, timed run of prefill + decode at one config."""

    first_call_s: float
    prefill_s: float
    decode_s: float
    steps: int  # decode steps in the timed run
    tokens: np.ndarray = field(repr=False)  # [B, 1 + steps]: the prefill's token, then the decoded ones


def cache_length(context: int, prompt_len: int, steps: int) -> int:
    """Rows of our cache (and HF's static cache): the prefix, the prompt and every step, rounded up to 64."""
    return -(-(context + prompt_len + steps) // 64) * 64


def chunking(steps: int, chunk: int = 32) -> tuple[int, int]:
    """(chunk, number of chunks) for `steps` decode steps run in on-device chunks."""
    chunk = max(1, min(chunk, steps))
    return chunk, -(-steps // chunk)


# Each engine keeps {(batch, prompt, cache length, chunk): [compiled prefill, compiled chunk]} across calls
# in this attribute. (A module-level WeakKeyDictionary leaked engines: its values close over their key.)
_COMPILED_ATTR = "_bench_compiled"


def time_engine(engine: Engine, prompts: np.ndarray, *, context: int, steps: int, chunk: int = 32) -> Timing:
    """Prefill prompts [B, P] at positions context.. over a zero prefix, then greedy-decode in chunks.

    The decode chunks are the engine's own jitted chunk function (`Engine._chunk`, the same step
    `generate` runs); only the prefill differs from `generate`, which always starts at position 0.
    """
    b, p = prompts.shape
    chunk, n_chunks = chunking(steps, chunk)
    cache_len = cache_length(context, p, n_chunks * chunk)

    def prefill_fn(params, cache, tokens, start):
        positions = start + jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))  # [B, P]
        logits, cache = engine.forward(params, tokens, positions, cache)  # [B, P, V]
        key = jax.random.key(0)
        first = sample(logits[:, -1], key, GREEDY)  # [B]
        return DecodeState(cache, first, positions[:, -1] + 1, jnp.zeros((b,), bool), key)

    prefill = jax.jit(prefill_fn, donate_argnums=1)
    new_cache = jax.jit(engine.new_cache, static_argnums=(0, 1))  # in one jit: no per-layer copies to stack
    tokens, done_ids, pad = jnp.asarray(prompts, jnp.int32), jnp.asarray([-2], jnp.int32), jnp.int32(-1)
    compiled = engine.__dict__.setdefault(_COMPILED_ATTR, {}).setdefault(
        (b, p, cache_len, chunk), []
    )  # [prefill, chunk]

    def compile_both(cache):
        """Prefill and the decode chunk compiled at once, in two threads (as `Engine._compile_steps`);
        with tensor parallelism the state's shardings come from running prefill, so jit compiles them."""
        if engine.tp > 1:
            compiled.extend(
                [
                    prefill,
                    lambda params, state, done_ids, pad: engine._chunk(
                        params, state, done_ids, pad, steps=chunk, sampling=GREEDY
                    ),
                ]
            )
            return
        start = jnp.int32(context)
        state = jax.eval_shape(prefill_fn, engine.params, cache, tokens, start)
        spec = jax.ShapeDtypeStruct((), jnp.int32)
        compiled.extend(
            compile_at_once(
                lambda: prefill.lower(engine.params, cache, tokens, start).compile(),
                lambda: engine._chunk.lower(
                    engine.params, state, done_ids, spec, steps=chunk, sampling=GREEDY
                ).compile(),
            )
        )

    def once(chunks: int):
        cache = jax.block_until_ready(new_cache(b, cache_len))
        start = time.perf_counter()
        if not compiled:
            compile_both(cache)
        state = compiled[0](engine.params, cache, tokens, jnp.int32(context))
        out = [np.asarray(state.tokens)[:, None]]
        mid = time.perf_counter()
        for _ in range(chunks):
            state, new = compiled[1](engine.params, state, done_ids, pad)
            out.append(np.asarray(new))
        return mid - start, time.perf_counter() - mid, np.concatenate(out, axis=1)

    start = time.perf_counter()
    once(1)
    first_call = time.perf_counter() - start
    prefill_s, decode_s, toks = once(n_chunks)
    return Timing(first_call, prefill_s, decode_s, n_chunks * chunk, toks[:, : 1 + steps])


def tokens_agree(tokens: np.ndarray, ours: np.ndarray) -> int:
    """Leading tokens equal in every sequence of tokens [B, n] and ours [B, m]."""
    n = min(tokens.shape[1], ours.shape[1])
    same = np.all(tokens[:, :n] == ours[:, :n], axis=0)  # [n]
    return int(n if same.all() else np.argmin(same))


# -- rows, estimates, the suite ------------------------------------------------------------------


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
) -> dict:
    step_s = timing.decode_s / timing.steps
    moved = decode_cost(cfg, batch=batch, context=context + prompt_len + timing.steps // 2, itemsize=itemsize).bytes
    return {
        "model": model,
        "system": system,
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
    system: str, cfg, *, batch: int, context: int, prompt_len: int, steps: int, backend: str, ceiling: float
) -> float:
    """Seconds for one row: compile + first chunk, then the timed prefill and steps (see `_EST`)."""
    compile_s, eff = _EST["gpu" if backend == "gpu" else "cpu"][system]
    itemsize = 2 if backend == "gpu" else 4
    step_s = decode_cost(cfg, batch=batch, context=context + prompt_len + steps // 2, itemsize=itemsize).bytes / (
        ceiling * 1e9 * eff
    )
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
    setup = _SETUP_S["gpu" if backend == "gpu" else "cpu"] * len(plan.models)
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
    from jaxdecode.decode import default_dtype
    from jaxdecode.memory import preflight
    from jaxdecode.model import init_random

    plan.validate()
    t0 = time.perf_counter()
    backend = jax.default_backend()
    dtype = default_dtype()
    itemsize = jnp.dtype(dtype).itemsize
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
            est = preflight(cfg, itemsize=itemsize, batch=max(plan.batches), context=max_len, looped=True)
            print(f"{name}: memory preflight {est.describe()}", file=sys.stderr)
        except ValueError as e:
            errors.append(f"{name}: {e}")
            print(errors[-1], file=sys.stderr)
            continue
        model = init_random(cfg, seed=plan.seed, dtype=dtype)
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
                        if system in HF_PEERS:
                            from jaxdecode import bench_peers

                            hf = hf or bench_peers.build_hf(model)
                            runner = bench_peers.hf_runner(hf, compiled=system == "hf_static")
                        else:
                            engine = Engine(model, **_ENGINES[system])
                            runner = _engine_runner(engine)
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
            from jaxdecode import bench_peers

            bench_peers.release_memory()
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


def _engine_runner(engine: Engine):
    mode = engine._plan.mode if engine._plan is not None else "unrolled"

    def run(prompts, *, context, steps):
        return time_engine(engine, prompts, context=context, steps=steps), {"loop_mode": mode}

    return run


# -- the command line ------------------------------------------------------------------------------


def _parse_ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(float(t[:-1]) * 1024) if t.lower().endswith("k") else int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--{what} takes comma-separated integers (1k = 1024), got {text!r}") from None
    if not vals:
        raise ValueError(f"--{what} is empty")
    return vals


def _parse_peers(text: str | None) -> tuple[list[str], dict[str, set[tuple[int, int]]]]:
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
                    (b, c) for b, c in (_parse_ints(bc.replace("x", ","), "peers") for bc in configs.split("+"))
                )
            except ValueError:
                raise ValueError(f"--peers {item!r}: restrict a peer as NAME@BxC[+BxC], e.g. hf_static@1x1k") from None
    return peers, only


def suite_plan(args) -> SuitePlan:
    base = (
        SUITES[args.suite] if args.suite else dict(models=(args.model,), batches=(args.batch or 1,), contexts=(1024,))
    )
    peers, only = _parse_peers(args.peers)
    return SuitePlan(
        models=args.models.split(",") if args.models else list(base["models"]),
        batches=_parse_ints(args.batches, "batches") if args.batches else list(base["batches"]),
        contexts=_parse_ints(args.contexts, "contexts") if args.contexts else list(base["contexts"]),
        peers=peers,
        only=only,
        prompt_len=args.prompt_len or 16,
        steps=args.steps,
        seed=args.seed,
        budget_s=args.budget_s,
        ceiling_gib=args.ceiling_gib,
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
            print_estimates(plan, backend, _CEILING_GUESS[backend], out=sys.stdout)
            return 0
        if any(p in HF_PEERS for p in plan.peers):
            # jax would otherwise take 75% of the GPU at its first allocation, leaving torch too little.
            os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        run_suite(plan, out_dir=args.out)
        return 0
    return _run_plain(args)


def _run_plain(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from jaxdecode.decode import default_dtype
    from jaxdecode.loading import load_model

    batch, prompt_len, new_tokens = args.batch or 1, args.prompt_len or 32, args.max_new_tokens
    if batch < 1 or prompt_len < 1 or new_tokens < 2:
        raise ValueError("need --batch >= 1, --prompt-len >= 1 and --max-new-tokens >= 2")
    variants = [not args.no_loop] + ([False] if args.compare_unrolled and not args.no_loop else [])
    loaded = load_model(args.model, dtype=default_dtype()) if args.tp == 1 else None
    rows = []
    for loop in variants:
        if args.tp == 1:
            engine = Engine(loaded.model, loop_layers=loop)
        else:  # random presets are made directly on the devices, split
            from jaxdecode.tp import load_engine

            engine = load_engine(args.model, args.tp, loop_layers=loop)[0]
        rows.append(
            measure_decode(engine, model_name=args.model, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens)
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

"""A/B of engine variants: each variant is data (kernel hook overrides, block sizes, loop mode, tensor
parallelism, all-reduce, environment and XLA flags), built through the engine's public arguments and
timed the way `jaxdecode bench` times (`jaxdecode.bench.time_engine`).

    python benchmarks/ab.py --variant base --variant "qkv_attend=off" --variant base
    python benchmarks/ab.py --variant "tp=2" --variant "tp=2 allreduce=psum" --profile --batches 1
    python benchmarks/ab.py --variant base --variant "xla:xla_gpu_enable_command_buffer=" --batches 1,8,32

A variant is words separated by spaces:
  base                       the default engine (a word of its own)
  unrolled                   loop_layers=False: plain JAX, XLA's dots and attention
  loop_mode=slice|inplace    how the layer scan reads the stacked weights
  tp=N                       split over N GPUs (`TPForward.from_model` of the one copy of the weights)
  allreduce=psum|kernel      under tp > 1: XLA's psum, or the engine's all-reduce kernel (the default)
  quantize=int8|int4|q4_k_m  the projections quantized (`model.quantize_weights`: groups of 128, or llama.cpp's
                             Q4_K_M mix of two-level K-quants), a copy
  scales=float32|float16|bfloat16   with quantize=: the scales' and offsets' dtype (default float16)
  HOOK=off                   turns a kernel hook off (HOOK: a `jaxdecode.model.Hook` value, e.g. qkv_attend)
  HOOK=on                    turns on a hook that is off by default (`hooks.OPTIONAL_CALLS`, e.g. mlp)
  HOOK:KW=V                  the default hook with keyword KW set, e.g. rms_norm:num_warps=8
  HOOK:KW.FIELD=V            a field of a block-size keyword, e.g. sdpa:block_sizes.num_warps=2 or
                             qkv_attend:attention_blocks.num_splits=4
  stacked_dot=off, stacked_dot:KW=V, stacked_dot:KW.FIELD=V   the same for the stacked-weight dot hook
  env:NAME=V                 an environment variable of the variant's process, e.g. env:NCCL_PROTO=LL
  xla:FLAG[=V]               appends --FLAG[=V] to XLA_FLAGS, e.g. xla:xla_gpu_enable_command_buffer=
Hooks act in the in-place loop mode only (the default on a GPU). A variant with env: or xla: words runs
in a process of its own (XLA reads its flags once per process), and so does every variant with
--isolate. The others run in this process one after the other, on one copy of the weights: name the
first variant again last to see the drift within the run.

Per variant, batch and context: --prompt-len random tokens prefilled after a zero context (the suite's
setup), a compiling call, then --repeats timed runs of --steps greedy decode steps (each after a warm
chunk). A row holds the median ms/token (all_ms: every run), tok/s, GB/s (`cost.decode_cost`'s bytes /
step time) and % of the read ceiling measured in the same process, the first call's seconds, and how
many leading greedy tokens equal the first variant's in every sequence (same weights: variants that
compute the same function agree up to rounding).
--profile: one more run under the JAX profiler, read by `gpu_trace.step_profile` (kernels per decode
step, their time, the idle time between kernels, the longest kernels), and the decode chunk's
temporary memory.
--check: each row also compares the variant's logits (the prompt's last position, one decode step) with
the unrolled model's on the same weights (XLA's own dots, an independent implementation):
check_max_rel_err and check_right (within CHECK_TOLERANCE of the largest logit). Agreement with the
first variant's greedy tokens cannot tell a wrong kernel from quantization; this can.
--hlo: the optimized HLO of one decode step: weight copies (dynamic slices of at
least one layer's smallest weight), cache copies (one layer's K or V), custom calls (kernel launches).

JSON lines on stdout and in DIR/ab.jsonl (--out, default $OUT or the current directory), the summary
last; a table on stderr. The model is `--model` (a preset: random weights; or a .gguf file or HF
directory: its weights), in the backend's default dtype (bf16 on a GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import inspect
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off, before JAX starts NCCL

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxdecode.bench import (  # noqa: E402
    cache_length,
    compiled_steps,
    loop_mode,
    read_ceiling_gb_s,
    time_engine,
    tokens_agree,
)
from jaxdecode.bench.command import parse_ints  # noqa: E402
from jaxdecode.bench.report import device_name  # noqa: E402
from jaxdecode.cost import decode_cost  # noqa: E402
from jaxdecode.decode import Engine, default_dtype  # noqa: E402
from jaxdecode.hooks import KERNEL_CALLS, OPTIONAL_CALLS, TP_CALLS, kernel_stacked_dot  # noqa: E402
from jaxdecode.kquants import QUANTIZE_CHOICES  # noqa: E402
from jaxdecode.loading import load_model  # noqa: E402
from jaxdecode.looped_model import default_loop_mode  # noqa: E402
from jaxdecode.model import Hook, quantize_weights  # noqa: E402
from jaxdecode.quantized import SCALE_DTYPE  # noqa: E402
from jaxdecode.tp import TPForward  # noqa: E402
from kernels.quant_gemm import SCALE_DTYPES  # noqa: E402

LOOP_MODES = ("slice", "inplace")
SCALE_NAMES = tuple(jnp.dtype(d).name for d in SCALE_DTYPES)
ALLREDUCE = ("psum", "kernel")
STACKED_DOT = "stacked_dot"  # the dot hook, overridden like the named hooks (`Engine(stacked_dot=)`)


def hook_table(tp: int) -> dict:
    """The hooks a variant can name: the default ones, those off by default, under tp > 1 the TP ones."""
    return {**OPTIONAL_CALLS, **KERNEL_CALLS, **(TP_CALLS if tp > 1 else {})}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One engine variant, parsed from its spec (see the module docstring)."""

    spec: str
    loop_layers: bool = True
    loop_mode: str | None = None
    tp: int = 1
    allreduce: str | None = None
    quantize: str | None = None
    scales: str | None = None  # with quantize: `quantize_weights`'s scale_dtype (None: its default)
    hooks: dict = dataclasses.field(default_factory=dict)  # hook name or STACKED_DOT -> None (off) or {kw: value}
    env: dict = dataclasses.field(default_factory=dict)

    @property
    def scale_dtype(self):  # with quantize: the scales' dtype `quantize_weights` stores
        return SCALE_DTYPE if self.scales is None else jnp.dtype(self.scales)

    @property
    def own_process(self) -> bool:
        return bool(self.env)

    def engine_hooks(self) -> dict | None:
        """The `hooks=` argument of the engine: the overrides, or None for the default table."""
        table = hook_table(self.tp)
        hooks = {
            Hook(name): None if kws is None else with_keywords(table[Hook(name)], kws)
            for name, kws in self.hooks.items()
            if name != STACKED_DOT
        }
        return hooks or None

    def engine_stacked_dot(self):
        """The `stacked_dot=` argument: None (the default), a dot that never runs a kernel (off), or the
        default dot with keywords."""
        if STACKED_DOT not in self.hooks:
            return None
        if self.hooks[STACKED_DOT] is None:
            return lambda *args, **kwargs: None  # the caller then runs the plain dot
        return with_keywords(kernel_stacked_dot, self.hooks[STACKED_DOT])


def with_keywords(fn, kws: dict):
    """fn with keywords set; a dict value replaces fields of that keyword's default (a block-size dataclass)."""
    defaults = inspect.signature(fn).parameters
    bound = {k: dataclasses.replace(defaults[k].default, **v) if isinstance(v, dict) else v for k, v in kws.items()}
    return functools.partial(fn, **bound)


def parse_value(text: str, default, what: str):
    """text as the type of `default` (bool: 1/0/true/false; None: int, float or a string)."""
    try:
        if isinstance(default, bool):
            if text.lower() not in ("1", "0", "true", "false"):
                raise ValueError
            return text.lower() in ("1", "true")
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
        if isinstance(default, str):
            return text
        if default is None:
            for cast in (int, float):
                try:
                    return cast(text)
                except ValueError:
                    pass
            return None if text.lower() == "none" else text
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not of type {type(default).__name__}") from None
    if default is inspect.Parameter.empty:
        raise ValueError(f"{what} is bound by the engine, not by a variant")
    raise ValueError(f"{what}: a {type(default).__name__} cannot be set from the command line")


def parse_keyword(fn, name: str, assignment: str, into: dict) -> None:
    """'KW=V' or 'KW.FIELD=V' for hook `name` (function fn), checked against fn's signature, into `into`."""
    target, eq, text = assignment.partition("=")
    keyword, _, field = target.partition(".")
    params = inspect.signature(fn).parameters
    if not eq or keyword not in params or params[keyword].kind is not inspect.Parameter.KEYWORD_ONLY:
        options = [p.name for p in params.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
        raise ValueError(f"{name}:{assignment}: write {name}:KW=V with KW one of {', '.join(options)}")
    default = params[keyword].default
    if not field:
        into[keyword] = parse_value(text, default, f"{name}:{keyword}")
        return
    if not dataclasses.is_dataclass(default):
        raise ValueError(f"{name}:{keyword} has no fields ({type(default).__name__}); write {name}:{keyword}=V")
    fields = [f.name for f in dataclasses.fields(default)]
    if field not in fields:
        raise ValueError(f"{name}:{keyword}.{field}: {type(default).__name__} has the fields {', '.join(fields)}")
    into.setdefault(keyword, {})[field] = parse_value(text, getattr(default, field), f"{name}:{keyword}.{field}")


def parse_variant(spec: str) -> Variant:
    """A variant from its spec; a clear ValueError naming the bad word otherwise."""
    words = spec.split()
    if words == ["base"]:
        return Variant(spec)
    if not words:
        raise ValueError("a variant is empty; the default engine is 'base'")
    if "base" in words:
        raise ValueError(f"variant {spec!r}: 'base' stands alone; other variants are words such as qkv_attend=off")
    kw: dict = dict(hooks={}, env={})
    hookable = [*(h.value for h in Hook), STACKED_DOT]
    tp = next((w.partition("=")[2] for w in words if w.startswith("tp=")), "1")
    if not tp.isdigit() or int(tp) < 1:
        raise ValueError(f"variant {spec!r}: tp takes a positive integer, got {tp!r}")
    table = hook_table(int(tp))
    for word in words:
        head, eq, value = word.partition("=")
        name, colon, rest = word.partition(":")
        if word == "unrolled":
            kw["loop_layers"] = False
        elif head == "loop_mode" and value in LOOP_MODES:
            kw["loop_mode"] = value
        elif head == "tp":
            kw["tp"] = int(value)
        elif head == "allreduce" and value in ALLREDUCE:
            kw["allreduce"] = value
        elif head == "quantize" and value in QUANTIZE_CHOICES:
            kw["quantize"] = value
        elif head == "scales" and value in SCALE_NAMES:
            kw["scales"] = value
        elif colon and name == "env" and "=" in rest:
            key, _, val = rest.partition("=")
            kw["env"][key] = val
        elif colon and name == "xla" and rest:
            kw["env"]["XLA_FLAGS"] = (kw["env"].get("XLA_FLAGS", "") + f" --{rest}").strip()
        elif head in hookable and value == "off" and not colon:
            if kw["hooks"].get(head):
                raise ValueError(f"variant {spec!r}: {head} is both off and set")
            kw["hooks"][head] = None
        elif head in (h.value for h in OPTIONAL_CALLS) and value == "on" and not colon:
            kw["hooks"].setdefault(head, {})
        elif colon and name in hookable:
            if name in kw["hooks"] and kw["hooks"][name] is None:
                raise ValueError(f"variant {spec!r}: {name} is both off and set")
            fn = kernel_stacked_dot if name == STACKED_DOT else table[Hook(name)]
            try:
                parse_keyword(fn, name, rest, kw["hooks"].setdefault(name, {}))
            except ValueError as e:
                raise ValueError(f"variant {spec!r}: {e}") from None
        else:
            raise ValueError(
                f"variant {spec!r}: cannot read {word!r}; words: base, unrolled, loop_mode={'|'.join(LOOP_MODES)}, "
                f"tp=N, allreduce={'|'.join(ALLREDUCE)}, quantize={'|'.join(QUANTIZE_CHOICES)}, "
                f"scales={'|'.join(SCALE_NAMES)}, "
                f"HOOK=off, HOOK=on, HOOK:KW=V, HOOK:KW.FIELD=V (HOOK: "
                f"{', '.join(hookable)}), env:NAME=V, xla:FLAG=V"
            )
    v = Variant(spec, **kw)
    if v.hooks and (not v.loop_layers or v.loop_mode == "slice"):
        raise ValueError(f"variant {spec!r}: kernel hooks act in the in-place loop mode only")
    if v.allreduce is not None and v.tp == 1:
        raise ValueError(f"variant {spec!r}: allreduce needs tp > 1")
    if v.scales is not None and v.quantize is None:
        raise ValueError(f"variant {spec!r}: scales= needs quantize=")
    return v


# -- measuring, in the process that runs the variant ---------------------------------------------------


def variant_model(model, v: Variant):
    """The weights the variant runs: `model`, or with quantize= a quantized copy (new arrays in new modules:
    the dense weights stay for the next variant)."""
    if not v.quantize:
        return model
    graph, state = nnx.split(model)  # new Variables over the same arrays: set_value must not reach `model`
    return quantize_weights(nnx.merge(graph, jax.tree.map(lambda a: a, state)), v.quantize, scale_dtype=v.scale_dtype)


def build_engine(model, v: Variant):
    """The variant's engine on `variant_model(...)`'s weights (split over v.tp devices by `TPForward.from_model`)."""
    kw = dict(loop_layers=v.loop_layers, hooks=v.engine_hooks(), stacked_dot=v.engine_stacked_dot())
    if v.tp == 1:
        return Engine(model, loop_mode=v.loop_mode, **kw)
    mode = v.loop_mode or default_loop_mode()
    return Engine(None, tp=TPForward.from_model(model, v.tp, loop_mode=mode, allreduce=v.allreduce or "kernel", **kw))


# --check flags a variant whose logits stray from the unrolled model's on the same weights by more than
# this fraction of their largest: rounding differences (bf16 activations, the kernels' bf16 weights and
# summation order) stay near 1e-2; a wrong kernel shows as NaN or orders of magnitude above
CHECK_TOLERANCE = 0.05


def check_logits(engine, reference, prompts: np.ndarray) -> dict:
    """The variant's logits against `reference` (the unrolled model, XLA's dots, on the same weights): the
    prompt's last position and one decode step after the reference's greedy token, both engines fed the
    same tokens. Returns check_max_rel_err (max |difference| / max |reference logit|) and check_right."""
    batch, plen = prompts.shape
    tokens = jnp.asarray(prompts, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(plen, dtype=jnp.int32), (batch, plen))
    outs, step = [], None
    for e in (reference, engine):
        cache = e.new_cache(batch, cache_length(0, plen, 1))
        first, cache = e.forward(e.params, tokens, positions, cache)
        if step is None:
            step = jnp.argmax(first[:, -1:], axis=-1).astype(jnp.int32)  # [B, 1]
        second, _ = e.forward(e.params, step, jnp.full((batch, 1), plen, jnp.int32), cache)
        outs.append([np.asarray(first[:, -1], np.float32), np.asarray(second[:, -1], np.float32)])
    err = max(float(np.abs(got - ref).max() / np.abs(ref).max()) for ref, got in zip(*outs))
    return dict(check_max_rel_err=err, check_right=bool(err < CHECK_TOLERANCE))  # NaN compares False


_DYNAMIC_SLICE = re.compile(r"= (bf16|f32|f16)\[([\d,]*)\]\{[^}]*\} (dynamic-slice|fusion)\(")


def hlo_counts(engine, batch: int, cache_len: int, weight_bytes: int, cache_bytes: int) -> dict:
    """Copies and kernel launches in the optimized HLO of one decode step (see the module docstring)."""
    cache = engine.new_cache(batch, cache_len)
    tokens = jnp.zeros((batch, 1), jnp.int32)
    hlo = jax.jit(engine.forward).lower(engine.params, tokens, tokens, cache).compile().as_text()
    weights, caches = [], []
    for line in hlo.splitlines():
        m = _DYNAMIC_SLICE.search(line)
        if not m or "dynamic-update-slice" in line or ("dynamic-slice" not in line and "dynamic_slice" not in line):
            continue
        n = int(np.prod([int(d) for d in m.group(2).split(",") if d])) * (4 if m.group(1) == "f32" else 2)
        if n >= weight_bytes:
            weights.append(f"{m.group(1)}[{m.group(2)}]")
        elif n == cache_bytes:
            caches.append(f"{m.group(1)}[{m.group(2)}]")
    return dict(
        weight_copies=len(weights),
        weight_copy_examples=weights[:4],
        cache_copies=len(caches),
        custom_calls=len(re.findall(r" custom-call\(", hlo)),
        custom_call_targets=sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo))),
    )


def measure_row(engine, v: Variant, head: dict, prompts: np.ndarray, args, ceiling: float) -> tuple[dict, np.ndarray]:
    """One row: a compiling call, --repeats timed runs, and with --hlo / --profile their counts."""
    cfg, (batch, context) = engine.cfg, (head["batch"], head["context"])
    itemsize = jnp.dtype(engine.cache_dtype).itemsize
    first = time_engine(engine, prompts, context=context, steps=args.steps)  # traces and compiles
    runs = [time_engine(engine, prompts, context=context, steps=args.steps) for _ in range(args.repeats)]
    step_s = statistics.median(t.decode_s / t.steps for t in runs)
    steps = runs[0].steps
    mean_context = context + args.prompt_len + steps // 2
    quantize = v.quantize or args.quantize
    cost = decode_cost(
        cfg, batch=batch, context=mean_context, itemsize=itemsize, quantize=quantize, scale_dtype=v.scale_dtype
    )
    moved = cost.bytes
    row = dict(
        head,
        model=args.model,
        loop_mode=loop_mode(engine),
        allreduce=(v.allreduce or "kernel") if v.tp > 1 else None,
        steps=steps,
        ms=round(step_s * 1e3, 4),
        all_ms=[round(t.decode_s / t.steps * 1e3, 4) for t in runs],
        tok_s=round(batch / step_s, 2),
        bytes_per_step=moved,  # cost.decode_cost at the mean context of the timed steps
        gb_s=round(moved / step_s / 1e9, 1),
        pct_ceiling=round(100 * moved / step_s / 1e9 / (ceiling * v.tp), 1),  # of the ceiling of the GPUs used
        read_ceiling_gb_s=round(ceiling, 1),
        first_call_s=round(first.first_call_s, 2),
        device=device_name(),
        jax=jax.__version__,
        env=v.env,
    )
    if args.hlo:
        cache_len = cache_length(context, args.prompt_len, steps)
        weight_bytes = itemsize * cfg.dim * cfg.kv_dim  # one layer's smallest weight (k or v)
        row.update(hlo_counts(engine, batch, cache_len, weight_bytes, itemsize * batch * cache_len * cfg.kv_dim))
    if args.profile:
        import gpu_trace  # beside this script

        events = gpu_trace.traced_events(
            lambda: time_engine(engine, prompts, context=context, steps=args.steps),
            os.path.join(tempfile.gettempdir(), "ab_traces"),
        )
        row.update(gpu_trace.step_profile(events, steps))
        row["temp_bytes"] = [
            c.memory_analysis().temp_size_in_bytes for c in compiled_steps(engine) if hasattr(c, "memory_analysis")
        ]
    return row, runs[0].tokens


def run_variants(variants: list[tuple[int, Variant]], args, emit) -> None:
    """Measure each (index, variant) at every batch and context in this process; `emit(row, tokens)`.
    The read ceiling first, then the weights (once), then each variant's engine, freed after its rows."""
    backend = jax.default_backend()
    if args.profile and backend != "gpu":
        raise ValueError(f"--profile reads GPU kernels from the trace; the backend here is {backend}")
    ceiling = read_ceiling_gb_s(args.ceiling_gib or (4 if backend == "gpu" else 0.25))
    print(f"read ceiling {ceiling:.1f} GB/s on {device_name()}", file=sys.stderr, flush=True)
    if args.quantize and any(v.quantize for _, v in variants):
        raise ValueError("--quantize loads the weights quantized already; drop the variants' quantize= words")
    model = load_model(args.model, dtype=default_dtype(), seed=args.seed, quantize=args.quantize).model
    for index, v in variants:
        try:
            weights = variant_model(model, v)
            engine = build_engine(weights, v)
            reference = Engine(weights, loop_layers=False) if args.check else None
        except Exception as e:  # one variant failing must not lose the others
            emit(dict(index=index, variant=v.spec, error=f"{type(e).__name__}: {str(e)[-600:]}"), None)
            continue
        for context in args.contexts:
            for batch in args.batches:
                rng = np.random.default_rng(args.seed + batch)
                prompts = rng.integers(0, model.cfg.vocab_size, (batch, args.prompt_len))
                head = dict(index=index, variant=v.spec, tp=v.tp, batch=batch, context=context)
                try:
                    row, tokens = measure_row(engine, v, head, prompts, args, ceiling)
                    if reference is not None:
                        row.update(check_logits(engine, reference, prompts))
                    emit(row, tokens)
                except Exception as e:
                    emit(dict(head, error=f"{type(e).__name__}: {str(e)[-600:]}"), None)
        engine = reference = weights = None
        gc.collect()


# -- the parent: variants in this process or in their own ---------------------------------------------


def child_command(args, spec: str) -> list[str]:
    """This script measuring one variant in a child process (it prints ROW lines)."""
    flags = [
        "--child",
        "--variant",
        spec,
        "--model",
        args.model,
        "--batches",
        ",".join(map(str, args.batches)),
        "--contexts",
        ",".join(map(str, args.contexts)),
        "--steps",
        str(args.steps),
        "--repeats",
        str(args.repeats),
        "--prompt-len",
        str(args.prompt_len),
        "--seed",
        str(args.seed),
    ]
    flags += ["--quantize", args.quantize] if args.quantize else []
    flags += ["--ceiling-gib", str(args.ceiling_gib)] if args.ceiling_gib else []
    flags += ["--profile"] * args.profile + ["--hlo"] * args.hlo + ["--check"] * args.check
    return [sys.executable, os.path.abspath(__file__), *flags]


def in_child(args, index: int, v: Variant, emit) -> None:
    """Run one variant in its own process, with its environment; its rows go to `emit`."""
    env = dict(os.environ)
    for key, value in v.env.items():
        env[key] = (env.get(key, "") + " " + value).strip() if key == "XLA_FLAGS" else value
    proc = subprocess.run(child_command(args, v.spec), env=env, stdout=subprocess.PIPE, text=True)
    rows = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    for row in rows:
        tokens = row.pop("tokens", None)
        emit(dict(row, index=index), None if tokens is None else np.asarray(tokens))
    if proc.returncode or not rows:
        emit(dict(index=index, variant=v.spec, error=f"its process ended with code {proc.returncode}"), None)


def print_table(rows: list[dict]) -> None:
    """The rows on stderr. "gap µs" (with --profile) is the median idle time between a step's kernels: on the H200 it
    takes one of two values, the larger in later variants of a process, and times the step's hundreds of kernels it
    moves a row's ms (docs/log/2026-12-05.md); compare ratios between rows of the same gap, or use --isolate."""
    print(
        f"\n{'#':>2} {'variant':40} {'B':>3} {'ctx':>6} {'ms/token':>9} {'tok/s':>9} {'GB/s':>7} {'%ceil':>6} "
        f"{'agree':>5} {'kernels':>7} {'gap µs':>6} {'right':>5}",
        file=sys.stderr,
    )
    for r in rows:
        if "error" in r:
            print(f"{r['index']:>2} {r['variant'][:40]:40} error: {r['error'][:200]}", file=sys.stderr)
            continue
        print(
            f"{r['index']:>2} {r['variant'][:40]:40} {r['batch']:>3} {r['context']:>6} {r['ms']:>9.3f} "
            f"{r['tok_s']:>9.1f} {r['gb_s']:>7.1f} {r['pct_ceiling']:>6.1f} "
            f"{r['tokens_agree_with_first'] if r['index'] else '-'!s:>5} {r.get('kernels_per_step', '-')!s:>7} "
            f"{r.get('median_inner_gap_us', '-')!s:>6} "
            f"{ {True: 'yes', False: 'NO'}.get(r.get('check_right'), '-'):>5}",
            file=sys.stderr,
        )


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--variant", action="append", default=None, help="a variant (repeat the flag); default: base")
    p.add_argument("--model", default="llama-3.1-8b", help="a preset (random weights), .gguf file or HF directory")
    p.add_argument(
        "--quantize",
        choices=QUANTIZE_CHOICES,
        default=None,
        help="load the weights quantized (a preset's are drawn quantized: a 70B at 4 bits fits where its bf16 "
        "copy would not); every variant then runs on them",
    )
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes (default 1,8)")
    p.add_argument("--contexts", default="1k", help="tokens already in the cache, e.g. 1k,4k (default 1k)")
    p.add_argument("--steps", type=int, default=64, help="greedy decode steps per timed run (default 64)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per row; the row's ms is their median")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="random weights and prompts")
    p.add_argument("--ceiling-gib", type=float, default=None, help="GiB summed for the read ceiling (4; CPU 0.25)")
    p.add_argument("--isolate", action="store_true", help="every variant in a process of its own")
    p.add_argument("--profile", action="store_true", help="kernels per step, idle time, longest kernels (GPU)")
    p.add_argument("--hlo", action="store_true", help="weight and cache copies, kernel launches in the step's HLO")
    p.add_argument(
        "--check", action="store_true", help="each row's logits against the unrolled model on the same weights"
    )
    p.add_argument("--out", default=None, help="directory for ab.jsonl (default $OUT, else the current directory)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.batches = parse_ints(args.batches, "batches")
    args.contexts = parse_ints(args.contexts, "contexts")
    if min(args.batches) < 1 or min(args.contexts) < 0 or args.steps < 1 or args.repeats < 1 or args.prompt_len < 1:
        raise ValueError("need batches >= 1, contexts >= 0, --steps >= 1, --repeats >= 1 and --prompt-len >= 1")
    args.variants = [parse_variant(spec) for spec in (args.variant or ["base"])]
    return args


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
    except ValueError as e:
        print(f"ab: error: {e}", file=sys.stderr)
        return 2
    if args.child:  # one variant, this process; the parent reads the ROW lines
        (v,) = args.variants

        def put(row, tokens):
            print("ROW " + json.dumps(dict(row, tokens=None if tokens is None else tokens.tolist())), flush=True)

        run_variants([(0, v)], args, put)
        return 0
    out_dir = args.out or os.environ.get("OUT") or "."
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "ab.jsonl")
    open(path, "w").close()
    rows, first_tokens = [], {}

    def emit(row: dict, tokens) -> None:
        if tokens is not None:
            key = (row["batch"], row["context"])
            row["tokens_agree_with_first"] = tokens_agree(first_tokens[key], tokens) if key in first_tokens else None
            first_tokens.setdefault(key, tokens)
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(path, "a") as fh:
            fh.write(json.dumps(row) + "\n")

    start = time.perf_counter()
    own = args.isolate or any(v.own_process for v in args.variants)
    try:
        if own:  # this process never touches the GPU: each child has all of it
            for index, v in enumerate(args.variants):
                in_child(args, index, v, emit)
        else:
            run_variants(list(enumerate(args.variants)), args, emit)
    except ValueError as e:  # the model or the backend refused before any row
        print(f"ab: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print_table(rows)
    ok = [r for r in rows if "error" not in r]
    summary = dict(
        summary=True,
        model=args.model,
        device=ok[0]["device"] if ok else None,
        jax=ok[0]["jax"] if ok else None,
        processes="one per variant" if own else "one",
        ms={
            f"{i}: {v.spec}": {f"B{r['batch']} ctx{r['context']}": r["ms"] for r in ok if r["index"] == i}
            for i, v in enumerate(args.variants)
        },
        errors=[f"{r['variant']}: {r['error']}" for r in rows if "error" in r],
        wall_s=round(time.perf_counter() - start, 1),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )
    print(json.dumps(summary), flush=True)
    with open(path, "a") as fh:
        fh.write(json.dumps(summary) + "\n")
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

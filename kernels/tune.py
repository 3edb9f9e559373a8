"""Offline profiler for the heuristic dataflow (FlashDecoding++ §5): inflection points per [N, K].

For each [N, K] and form ("plain": one call on W [K, N]; "looped": one layer of a stacked [L, K, N]
inside a loop over layers) it times the GEMV, the flat GEMMs (mosaic, stream, triton) and XLA's dot
over M = 1, 2, 4, ..., 128, then walks M upwards as the paper does:

  flat_impl  the flat kernel: mosaic (the supported backend) unless a later one in FLAT_IMPLS has a
             geometric-mean time over the profiled M lower by more than `margin`;
  M1         the first M where the flat kernel beats the GEMV by more than `margin` (the GEMV only
             takes M <= 1, so M1 <= 2);
  M2         the first M where XLA beats the implementation in use by more than `margin`;
             null when it never does.

An incumbent keeps its place within the margin (run-to-run noise on the H200 was a few %), so a
tie does not flip the table. XLA's dot is a contender from M = 1 on: on the H200 it beat every kernel
called once per step (docs/log/2026-11-30.md, kernel tables), which gives M1 = M2 = 1. The attention entry is the
fastest of async / sync / XLA by the same rule, over a few decode shapes.

`python -m kernels.tune --out PATH` (or `jaxdecode tune --out PATH`) writes the table for the current
GPU; `kernels/dispatch.py` reads `kernels/tables/<gpu>.json` or $KERNELS_TUNE_TABLE.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from kernels import decode_attention as da
from kernels import dispatch
from kernels import flat_gemm as fg
from kernels import flat_gemm_stream as fs
from kernels.shapes import MODELS, ModelDims

M_VALUES = (1, 2, 4, 8, 16, 32, 64, 128)
MARGIN = 0.05  # a challenger must be >5% faster to displace the incumbent (noise on the H200)
# preference order: Mosaic GPU is the supported Pallas backend (tile per CTA, then Stream-K)
FLAT_IMPLS = ("mosaic", "stream", "triton")
L2_BYTES = 60 * 2**20  # H200; weights rotate over sets > 2.5x this so every call reads HBM

Timings = dict[str, dict[int, float]]  # impl -> M -> µs per call (per layer when looped)


@dataclasses.dataclass(frozen=True)
class TuneShape:
    """y[M, n] = x[M, k] · W[k, n]; looped: W is layer l of [layers, k, n] in a loop over layers."""

    op: str
    n: int
    k: int
    form: str  # "plain" | "looped"
    layers: int = 1


def decode_gemm_shapes(
    model: ModelDims = MODELS["llama3_8b"], layers: int = 16, forms=dispatch.FORMS
) -> list[TuneShape]:
    """The paper's four decode projections [N, K]: qkv, o, gate+up (one GEMM of width 2F), down."""
    d, h = model.d_model, model.head_dim
    nk = (
        ("qkv", (model.num_heads + 2 * model.num_kv_heads) * h, d),
        ("o", d, model.num_heads * h),
        ("gate_up", 2 * model.ffn, d),
        ("down", d, model.ffn),
    )
    return [TuneShape(op, n, k, form, layers if form == "looped" else 1) for form in forms for op, n, k in nk]


def _faster(a: float, b: float, margin: float) -> bool:
    return a < (1.0 - margin) * b


def _geomean_ratio(a: dict[int, float], b: dict[int, float]) -> float:
    common = [m for m in a if m in b]
    if not common:
        return math.inf
    return math.exp(sum(math.log(a[m] / b[m]) for m in common) / len(common))


def pick_flat_impl(timings: Timings, margin: float = MARGIN) -> str:
    """The preferred flat kernel, unless a later one is faster by > margin in geometric mean."""
    have = [i for i in FLAT_IMPLS if timings.get(i)]
    if not have:  # the shape does not tile: no flat kernel ran (the walk then gives M2 = 1)
        return FLAT_IMPLS[0]
    best = have[0]
    for impl in have[1:]:
        if _geomean_ratio(timings[impl], timings[best]) < 1.0 - margin:
            best = impl
    return best


def inflection_points(timings: Timings, ms=M_VALUES, margin: float = MARGIN) -> dict:
    """{m1, m2, flat_impl} from timings[impl][M] (µs); a missing time means "cannot run"."""
    flat_impl = pick_flat_impl(timings, margin)
    t = lambda impl, m: timings.get(impl, {}).get(m, math.inf)
    m1 = m2 = None
    for m in sorted(ms):
        gemv, flat, xla = t("gemv", m), t(flat_impl, m), t("xla", m)
        if m1 is None and (m > dispatch.GEMV_MAX_M or _faster(flat, gemv, margin)):
            m1 = m
        if _faster(xla, gemv if m1 is None else flat, margin):
            m2 = m
            break
    if m1 is None:  # the gemv held every profiled M
        m1 = max(ms) + 1
    m1 = min(m1, dispatch.GEMV_MAX_M + 1)  # above that M the gemv cannot run
    if m2 is not None:
        m1 = min(m1, m2)
    return dict(m1=m1, m2=m2, flat_impl=flat_impl)


def pick_attention(timings: dict[str, dict[str, float]], margin: float = MARGIN) -> str:
    """Among dispatch.ATTENTION_IMPLS in order, a later impl wins when faster by > margin."""
    have = [i for i in dispatch.ATTENTION_IMPLS if timings.get(i)]
    best = have[0]
    for impl in have[1:]:
        if _geomean_ratio(timings[impl], timings[best]) < 1.0 - margin:
            best = impl
    return best


def build_table(
    device_kind: str,
    source: str,
    gemm: dict[TuneShape, Timings],
    ms=M_VALUES,
    attention: dict[str, dict[str, float]] | None = None,
    margin: float = MARGIN,
) -> dict:
    """The JSON table `kernels.dispatch.parse_table` reads; it keeps the timings it came from."""
    entries = []
    for s, timings in gemm.items():
        points = inflection_points(timings, ms, margin)
        entries.append(
            dict(
                op=s.op,
                form=s.form,
                n=s.n,
                k=s.k,
                layers=s.layers,
                **points,
                gemv_impl="gemv",
                timings_us={i: {str(m): round(v, 2) for m, v in sorted(t.items())} for i, t in timings.items()},
            )
        )
    table = dict(schema=1, device_kind=device_kind, source=source, margin=margin, ms=list(ms), gemm=entries)
    if attention:
        table["attention"] = dict(impl=pick_attention(attention, margin), timings_us=attention)
    dispatch.parse_table(table)  # what we write must load
    return table


def profile_gemm(
    shapes: list[TuneShape], timer: Callable[[TuneShape, str, int], float | None], ms=M_VALUES, log=print
) -> dict[TuneShape, Timings]:
    """timer(shape, impl, m) -> µs per call, or None where the impl cannot run that shape."""
    out = {}
    for s in shapes:
        timings: Timings = {}
        for m in ms:
            for impl in dispatch.GEMM_IMPLS:
                us = timer(s, impl, m)
                if us is not None:
                    timings.setdefault(impl, {})[m] = us
            log(
                f"  {s.form:6s} {s.op:8s} N={s.n:6d} K={s.k:6d} M={m:4d}  "
                + "  ".join(f"{i} {t[m]:8.1f}" for i, t in timings.items() if m in t)
                + "  µs"
            )
        out[s] = timings
    return out


# ---------------------------------------------------------------------------------------------
# Timing on the device


def _median_us(fn, args, calls: int, runs: int) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) / calls * 1e6


def runnable(impl: str, m: int, n: int, k: int, cfg: fg.BlockSizes = fg.BlockSizes()) -> bool:
    if impl == "xla":
        return True
    if n % cfg.tile_n or k % cfg.tile_k:
        return False
    if impl == "gemv":
        return m <= dispatch.GEMV_MAX_M
    return impl not in ("mosaic", "stream") or m <= dispatch.MOSAIC_MAX_M


def device_timer(
    *,
    reps: int = 16,
    runs: int = 5,
    interpret: bool = False,
    block_sizes: fg.BlockSizes = fg.BlockSizes(),
    dtype=jnp.bfloat16,
):
    """A timer for `profile_gemm`: plain = `reps` calls in one jit, each with its own x, rotating over
    weight sets larger than the L2; looped = one loop over `layers` layers (µs per layer)."""

    def gemm(impl):
        if impl == "xla":
            return lambda x, w, l=None: jnp.dot(x, w if l is None else w[l])
        if impl == "stream":
            cfg = fs.StreamBlocks(tile_n=block_sizes.tile_n, tile_k=block_sizes.tile_k)
            return lambda x, w, l=None: fs.flat_gemm_multi(x, (w,), l, block_sizes=cfg, interpret=interpret)[0]
        return lambda x, w, l=None: fg.flat_gemm(x, w, l, impl=impl, block_sizes=block_sizes, interpret=interpret)

    def step(c, y):  # a dependency from one layer to the next that fits any [N, K]
        return c + (1e-6 * y.astype(jnp.float32).sum(axis=1, keepdims=True)).astype(c.dtype)

    def timer(s: TuneShape, impl: str, m: int) -> float | None:
        if not runnable(impl, m, s.n, s.k, block_sizes):
            return None
        keys = jax.random.split(jax.random.key(m), 8)
        f = gemm(impl)
        if s.form == "plain":
            nbytes = s.k * s.n * jnp.dtype(dtype).itemsize
            nsets = min(8, max(2, math.ceil(2.5 * L2_BYTES / nbytes)))
            ws = [jax.random.normal(keys[i % 8], (s.k, s.n), dtype) * 0.02 for i in range(nsets)]
            xs = jax.random.normal(keys[0], (reps, m, s.k), dtype)
            many = jax.jit(lambda xs, ws: [f(xs[i], ws[i % len(ws)]) for i in range(reps)])
            return _median_us(many, (xs, ws), reps, runs)
        w = jax.random.normal(keys[1], (s.layers, s.k, s.n), dtype) * 0.02
        x = jax.random.normal(keys[0], (m, s.k), dtype)
        if impl == "xla":  # what a naive scan does: XLA copies W[l] out of the stack first
            loop = jax.jit(lambda x, w: lax.scan(lambda c, wl: (step(c, c @ wl), None), x, w)[0])
        else:
            loop = jax.jit(lambda x, w: lax.fori_loop(0, s.layers, lambda l, c: step(c, f(c, w, l)), x))
        return _median_us(loop, (x, w), s.layers, runs)

    return timer


def profile_attention(
    *,
    batches=(1, 8),
    cache_len: int = 8192,
    model=MODELS["llama3_8b"],
    runs: int = 5,
    interpret: bool = False,
    block_sizes=da.BlockSizes(),
    log=print,
) -> dict[str, dict[str, float]]:
    """µs per call of async / sync / XLA decode attention (T = 1) per batch size."""
    out: dict[str, dict[str, float]] = {}
    for b in batches:
        ks = jax.random.split(jax.random.key(b), 3)
        h, n, kh = model.head_dim, model.num_heads, model.num_kv_heads
        q = jax.random.normal(ks[0], (b, 1, n, h), jnp.bfloat16)  # [B, T, N, H]
        k = jax.random.normal(ks[1], (b, cache_len, kh, h), jnp.bfloat16)  # [B, S, K, H]
        v = jax.random.normal(ks[2], (b, cache_len, kh, h), jnp.bfloat16)
        lengths = jnp.full((b,), cache_len, jnp.int32)
        kw = dict(block_sizes=block_sizes, interpret=interpret)
        impls = {
            "async": jax.jit(lambda q, k, v, L: da.decode_attention_async(q, k, v, L, 0.0, **kw)[0]),
            "sync": jax.jit(lambda q, k, v, L: da.decode_attention_sync(q, k, v, L, **kw)),
            "xla": jax.jit(lambda q, k, v, L: da.decode_attention_reference(q, k, v, L)[0]),
        }
        name = f"b{b}_s{cache_len}"
        for impl, f in impls.items():
            out.setdefault(impl, {})[name] = round(_median_us(f, (q, k, v, lengths), 1, runs), 2)
        log(f"  attention {name}: " + "  ".join(f"{i} {out[i][name]:.1f}" for i in impls) + "  µs")
    return out


# ---------------------------------------------------------------------------------------------
# Command line (`jaxdecode tune` wires add_parser/run)


SMOKE_MODEL = ModelDims("smoke", 256, 4, 2, 64, 256, 2)  # tiny: every shape tiles at 64 x 128
SMOKE_BLOCKS = fg.BlockSizes(tile_n=64, tile_k=128, max_concurrent_steps=2)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "tune", help="profile GEMV / flat GEMM / XLA per [N, K] and write the dispatch table for this GPU"
    )
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out",
        required=True,
        help=f"JSON table to write (ship it as kernels/tables/<gpu>.json, or point ${dispatch.TABLE_ENV} at it)",
    )
    p.add_argument("--ms", default=",".join(map(str, M_VALUES)), help="M values, comma-separated (default %(default)s)")
    p.add_argument("--forms", default="plain,looped", help="plain and/or looped (default %(default)s)")
    p.add_argument("--layers", type=int, default=16, help="layers in the looped form (default %(default)s)")
    p.add_argument("--reps", type=int, default=16, help="calls per timed jit, plain form (default %(default)s)")
    p.add_argument("--runs", type=int, default=5, help="timed runs; the median is kept (default %(default)s)")
    p.add_argument("--margin", type=float, default=MARGIN, help="relative tie band (default %(default)s)")
    p.add_argument("--no-attention", action="store_true", help="skip the attention entry")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes in interpret mode: checks the code path on a CPU, times nothing meaningful",
    )


def run(args: argparse.Namespace, log=print) -> int:
    dev = jax.devices()[0]
    if dev.platform != "gpu" and not args.smoke:
        print(f"tune: needs a GPU (found {dev.platform}); --smoke runs the code path on the CPU", file=sys.stderr)
        return 2
    try:
        ms = tuple(sorted({int(m) for m in args.ms.split(",")}))
        forms = tuple(args.forms.split(","))
        if not ms or ms[0] < 1 or any(f not in dispatch.FORMS for f in forms):
            raise ValueError
    except ValueError:
        print(f"tune: bad --ms {args.ms!r} or --forms {args.forms!r}", file=sys.stderr)
        return 2
    if args.smoke:
        shapes = decode_gemm_shapes(SMOKE_MODEL, layers=2, forms=forms)
        timer = device_timer(reps=2, runs=1, interpret=True, block_sizes=SMOKE_BLOCKS)
    else:
        shapes = decode_gemm_shapes(layers=args.layers, forms=forms)
        timer = device_timer(reps=args.reps, runs=args.runs)
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    log(f"tune: {dev.device_kind}, jax {jax.__version__}, {date}, M = {ms}")
    gemm = profile_gemm(shapes, timer, ms, log=log)
    attention = None
    if not args.no_attention:
        attention = (
            profile_attention(
                batches=(1,),
                cache_len=64,
                runs=1,
                interpret=True,
                model=SMOKE_MODEL,
                block_sizes=da.BlockSizes(block_k=32),
                log=log,
            )
            if args.smoke
            else profile_attention(runs=args.runs, log=log)
        )
    source = f"kernels/tune.py on {dev.device_kind}, jax {jax.__version__}, {date}" + (
        " (SMOKE: interpret mode, timings meaningless)" if args.smoke else ""
    )
    table = build_table(dev.device_kind, source, gemm, ms, attention, args.margin)
    with open(args.out, "w") as fh:
        json.dump(table, fh, indent=1)
    for e in table["gemm"]:
        log(
            f"  {e['form']:6s} {e['op']:8s} [N, K]=[{e['n']}, {e['k']}]  M1={e['m1']} "
            f"M2={e['m2']} flat={e['flat_impl']}"
        )
    log(f"tune: wrote {args.out}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m kernels.tune")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))

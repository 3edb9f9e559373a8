"""Check and time the quantized GEMMs (kernels/quant_gemm.py, kernels/quant_gemm_stream.py) on one GPU
against bf16 flat GEMM, XLA and torch's tinygemm.

  JAX_PLATFORMS=cuda python benchmarks/quant_gemm_bench.py --out $OUT/quant_gemm.json [--quick]
  python benchmarks/quant_gemm_bench.py --dry-run   # the CPU: interpret mode, tiny shapes

In one process:
(a) compiled correctness of every variant (`QuantBlocks`: the tile-per-CTA kernel; `QuantStreamBlocks`:
    the Stream-K warp-specialized one) against `quant_gemm_reference` on a small
    shape (int4 G=128 f32 scales, int4 G=32 f16 scales with offsets, int8 G=128 bf16 scales); a
    variant that fails to lower prints its error's first line and the run goes on;
(b) time per call for the Llama-3.1-8B projections (N, K) = q/o (4096, 4096), k/v (1024, 4096),
    gate/up (14336, 4096), down (4096, 14336) at M = 1 and 8: int4 G=128 with scales and offsets
    (`--quantize int4`'s format, every variant), int8 G=128, scales in --scales (f16, `--quantize`'s
    default), the fused widths the decode
    hands to one stream launch (q·k·v: N = 4096 + 1024 + 1024; gate/up: 2 × 14336; stream variants
    only), bf16 `flat_gemm` (mosaic) and a
    plain XLA bf16 dot (which copies W[l] out of the stack). Each timed jit makes L = 32 calls, one per
    stacked layer, unrolled, with traced layer indices (kernels back to back as in a CUDA graph, the
    way torch's row is timed); µs per call = median over runs of the jit's wall time / L ("wall",
    launch-bound for small calls), and from one profiled run the GPU time of all the jit's kernels / L
    ("device", what a row's GB/s uses: the op's pad and epilogue kernels count) and the op's main
    kernel alone ("kernel"); every quantized row is also checked at its own shape against the reference
    (the first and last layer of the first and last run: `max_rel_err`, `right`), since a kernel right on
    the small shape of (a) can be wrong in some calls at full size;
(c) the HBM read ceiling in the same process; every row's GB/s counts its own bytes (codes + scales
    + x + y, or the bf16 weight + x + y) and its % of the ceiling;
(d) if torch imports: tinygemm int4 (`_convert_weight_to_int4pack` + `_weight_int4pack_mm`, group
    128, bf16) on the same shapes, 32 distinct layers per CUDA graph;
(e) the 8B's whole quantized MLP (shape "mlp"), int4 and int8, M = 1 and 8: the engine's launches (gate + up,
    SwiGLU, down, combines) against `kernels.quant_mlp_owned`'s one launch, GB/s in the three weights' bytes.
Ends with a table and one JSON line; --out writes the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import statistics
import sys
import time

# torch and JAX share the GPU here: JAX must not take 75% of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from kernels import flat_gemm as fg  # noqa: E402
from kernels import quant_gemm as qg  # noqa: E402
from kernels import quant_gemm_stream as qs  # noqa: E402

LAYERS = 32
SHAPES = {"q_o": (4096, 4096), "k_v": (1024, 4096), "gate_up": (14336, 4096), "down": (4096, 14336)}  # (N, K)
MS = (1, 8)
GROUP = 128
FUSED = {"qkv": ((4096, 1024, 1024), 4096), "gate+up": ((14336, 14336), 4096)}  # (N_i, K): one launch each
MLP = {"mlp": (4096, 14336)}  # (D, F): the whole quantized MLP, as launches or as one (`kernels.quant_mlp_owned`)
VARIANTS = {  # name: QuantBlocks (tile per CTA) or QuantStreamBlocks (Stream-K); the first is the engine's
    "stream": qs.QuantStreamBlocks(),  # the engine's: resolved per shape and format (`QuantStreamBlocks.resolved`)
    "stream_biased_4wg": qs.QuantStreamBlocks(tile_n=256, int4_feed="biased"),  # int4: biased codes, "acc"
    "stream_biased_2wg": qs.QuantStreamBlocks(tile_n=128, int4_feed="biased"),
    # 16-bit x: int4 codes relabelled in registers, int8 codes converted
    "stream_relabel": qs.QuantStreamBlocks(int4_feed="relabel", int8_feed="convert"),
    "stream_shuffle": qs.QuantStreamBlocks(int4_feed="shuffle"),  # Mosaic GPU's conversion and relayout
    "stream_w_2wg": qs.QuantStreamBlocks(tile_n=128, scale_in="w"),
    "stream_acc_4wg": qs.QuantStreamBlocks(tile_n=256, scale_in="acc"),
    # four compute warpgroups on units half as deep: a unit's compute per warpgroup halves (int8 with 16-bit x and
    # int4 relabelled are compute-bound at 256 deep), with the stages the engine asks (4) or 8 (int4's units are 18 KB)
    "stream_tk128": qs.QuantStreamBlocks(tile_n=256, tile_k=128),
    "stream_tk128_st8": qs.QuantStreamBlocks(tile_n=256, tile_k=128, stages=8),
    # units twice as deep: each weight row's part of a unit is 256 bytes of int4 codes (128 at tile_k=256), against
    # 16-bit x with 8 stages at 256 deep (as many code bytes in flight): does the row segment's length bound the read?
    "stream_tk512": qs.QuantStreamBlocks(tile_k=512),
    "stream_tk512_n128": qs.QuantStreamBlocks(tile_n=128, tile_k=512),
    "stream_relabel_tk512": qs.QuantStreamBlocks(int4_feed="relabel", tile_k=512),
    "stream_relabel_st8": qs.QuantStreamBlocks(int4_feed="relabel", stages=8),
    # a launch's first burst held short: at most 1-3 units' copies outstanding per CTA past the last landed one, so
    # a CTA's units land spread out rather than all four at the end of one burst
    "stream_inflight1": qs.QuantStreamBlocks(in_flight=1),
    "stream_inflight2": qs.QuantStreamBlocks(in_flight=2),
    "stream_inflight3": qs.QuantStreamBlocks(in_flight=3),
    "stream_st3": qs.QuantStreamBlocks(stages=3),
    "stream_st2": qs.QuantStreamBlocks(stages=2),
    "tile": qg.QuantBlocks(),  # "w" for int4 with offsets, "acc" for int8
}
INT8_VARIANTS = (
    "stream",
    "stream_inflight1",
    "stream_inflight2",
    "stream_inflight3",
    "stream_st3",
    "stream_relabel",
    "stream_w_2wg",
    "stream_acc_4wg",
    "stream_tk128",
    "stream_tk128_st8",
    "tile",
)
RUN = dict(
    layers=LAYERS,
    shapes=SHAPES,
    fused=FUSED,
    mlp=MLP,
    runs=20,
    warmup=3,
    interpret=False,
    fg_blocks=fg.BlockSizes(),
    dry=False,
    bf16=True,  # time the bf16 rows
    scales=jnp.dtype(jnp.float16),  # the timed rows' scales and offsets (--scales; `--quantize`'s default)
    deadline=float("inf"),  # perf_counter time after which timing rows are skipped (--budget-s)
    save=lambda: None,  # writes the JSON so far (--out), after every row
)
ROWS: list[dict] = []


def log(*a):
    print(*a, flush=True)


def first_line(e: Exception) -> str:
    lines = [s for s in str(e).strip().splitlines() if s.strip()]
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def dry_mode():
    """Tiny shapes through Mosaic GPU's interpreter on the CPU: checks the script, not the speed."""

    def small(c):
        if isinstance(c, qs.QuantStreamBlocks):
            return dataclasses.replace(
                c, tile_k=min(c.tile_k, 128), ctas=8
            )  # tiny widths: tile_n resolves to 256 or less
        return dataclasses.replace(c, tile_n=64, tile_k=min(c.tile_k, 128))

    VARIANTS.update({name: small(c) for name, c in VARIANTS.items()})
    RUN.update(
        layers=2,
        shapes={"tiny": (256, 256)},
        fused={"tiny2": ((256, 256), 256)},
        mlp={"tiny_mlp": (256, 256)},
        runs=1,
        warmup=0,
        interpret=True,
        fg_blocks=fg.BlockSizes(tile_n=64, tile_k=128, max_concurrent_steps=2),
        dry=True,
    )


# ---------------------------------------------------------------------------------------------
# Inputs and bytes


def quant_inputs(key, layers: int, n: int, k: int, cdt, group: int, sdt, offsets: bool = False):
    """codes [L, N, K], scales [L, K/G, N] (y ~ N(0, 1) for x ~ N(0, 1)), offsets or None."""
    hi = 8 if cdt == jnp.int4 else 128
    k1, k2, k3 = jax.random.split(key, 3)
    codes = jax.random.randint(k1, (layers, n, k), -hi, hi, jnp.int8).astype(cdt)
    unit = 1.0 / (hi / np.sqrt(3) * np.sqrt(k))
    scales = (jax.random.uniform(k2, (layers, k // group, n), jnp.float32, 0.5, 1.5) * unit).astype(sdt)
    off = (jax.random.normal(k3, (layers, k // group, n), jnp.float32) / np.sqrt(k)).astype(sdt) if offsets else None
    return codes, scales, off


def quant_bytes(m: int, n: int, k: int, bits: int, group: int, scale_bytes: int) -> int:
    """One call's bytes: codes + scales of one layer, x [M, K] bf16 read, y [M, N] bf16 written."""
    return n * k * bits // 8 + (k // group) * n * scale_bytes + 2 * m * k + 2 * m * n


def group_bytes(offsets: bool) -> int:
    """Bytes per group and weight row of the timed rows' scales (and offsets), in --scales' dtype."""
    return (1 + offsets) * RUN["scales"].itemsize


def bf16_bytes(m: int, n: int, k: int) -> int:
    return 2 * n * k + 2 * m * k + 2 * m * n


def log_bytes() -> None:
    """Bytes per call of the Llama-3.1-8B shapes (whatever the run times), for checking by hand."""
    log(f"bytes per call (MiB) at M = 1 / 8: int4 G=128 {RUN['scales'].name} scales + offsets, int8 G=128, bf16")
    for shape, (n, k) in SHAPES.items():
        row = [
            [f(m) / 2**20 for m in MS]
            for f in (
                lambda m: quant_bytes(m, n, k, 4, GROUP, group_bytes(True)),
                lambda m: quant_bytes(m, n, k, 8, GROUP, group_bytes(False)),
                lambda m: bf16_bytes(m, n, k),
            )
        ]
        log(f"  {shape:8s} N={n:<6d} K={k:<6d} " + "   ".join(" / ".join(f"{v:.4f}" for v in r) for r in row))


# ---------------------------------------------------------------------------------------------
# (c) the read ceiling


def read_ceiling() -> float:
    """GB/s of an f32 sum over a 4 GiB bf16 array (jaxdecode.bench.timing's measure where it imports)."""
    gib = 0.01 if RUN["dry"] else 4
    try:
        from jaxdecode.bench.timing import read_ceiling_gb_s

        return read_ceiling_gb_s(gib=gib)
    except Exception as e:  # noqa: BLE001  (the engine package may be mid-edit; the measure is small)
        log(f"  jaxdecode.bench.timing unavailable ({first_line(e)}); measuring here")
    x = jnp.ones((int(gib * 2**30) // 2,), jnp.bfloat16)
    total = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    jax.block_until_ready(total(x))
    ts = []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(total(x))
        ts.append(time.perf_counter() - t0)
    return x.nbytes / statistics.median(ts) / 1e9


def quant_op(cfg, group: int = GROUP, interpret: bool = False):
    """gemm(x, layer, codes, scales, *offsets) -> [M, N] with one weight, for either kernel family."""
    if isinstance(cfg, qs.QuantStreamBlocks):
        return lambda x, l, c, s, *o: qs.quant_gemm_multi(
            x, ((c, s, o[0] if o else None),), l, group=group, block_sizes=cfg, interpret=interpret
        )[0]
    return lambda x, l, c, s, *o: qg.quant_gemm(
        x, c, s, o[0] if o else None, l, group=group, block_sizes=cfg, interpret=interpret
    )


def feed(cfg, m: int, k: int, weight) -> str | None:
    """The feed a stream variant runs at M for the weight's codes (int8 activations, "s8", are checked against
    their own reference); None for the tile-per-CTA kernel."""
    if not isinstance(cfg, qs.QuantStreamBlocks):
        return None
    cfg = qs.resolve_blocks(cfg, jax.ShapeDtypeStruct((m, k), jnp.bfloat16), (weight,), GROUP)
    return cfg.feed_for(qg.code_bits(weight[0].dtype))


# ---------------------------------------------------------------------------------------------
# (a) correctness of every variant


def check_variants(variants: dict) -> list[dict]:
    out = []
    m, n, k, layers = 5, 256, 1024, 2
    if RUN["dry"]:
        n, k = 128, 256
    x = jax.random.normal(jax.random.key(0), (m, k), jnp.float32).astype(jnp.bfloat16)
    cases = {
        "int4_g128_f32": (jnp.int4, 128, jnp.float32, False),
        "int4_g32_f16_offsets": (jnp.int4, 32, jnp.float16, True),
        "int8_g128_bf16": (jnp.int8, 128, jnp.bfloat16, False),
    }
    for cname, (cdt, group, sdt, off) in cases.items():
        codes, scales, offsets = quant_inputs(jax.random.key(1), layers, n, k, cdt, group, sdt, off)
        ref = np.asarray(qg.quant_gemm_reference(x, codes, scales, offsets, layers - 1, group=group), np.float32)
        for vname, cfg in variants.items():
            row = dict(case=cname, variant=vname)
            try:
                arrays = (codes, scales) + (() if offsets is None else (offsets,))
                y = quant_op(cfg, group, RUN["interpret"])(x, jnp.int32(layers - 1), *arrays)
                err = np.abs(np.asarray(y, np.float32) - ref)
                # bf16 rounding of ~N(0, 1) outputs, plus the "w" variant's bf16 weights (see the tests)
                row.update(max_abs_err=float(err.max()), ok=bool(np.isfinite(err).all() and err.max() < 0.06))
            except Exception as e:  # noqa: BLE001  (a variant that fails to lower must not end the run)
                row.update(ok=False, error=first_line(e))
            out.append(row)
            log(
                f"  {cname:22s} {vname:16s} "
                + (f"max |err| {row['max_abs_err']:.4f} " if "max_abs_err" in row else "")
                + ("ok" if row["ok"] else f"FAILED {row.get('error', '')}")
            )
    return out


# ---------------------------------------------------------------------------------------------
# (b) timing: L calls over the stacked layers per jit


def time_loop(gemm, weights: tuple, m: int, n: int, k: int, reference=None) -> tuple:
    """(median µs per call, compile + first run s, GPU µs per call, main kernel µs, error) of
    gemm(x, l, *weights) [M, N] over l = 0..L-1 unrolled in one jit. The stacks are the jit's arguments:
    closed over, they would be baked into the executable as constants (GBs). error: with `reference(x, l)`
    given, the largest |y - reference| / max |reference| over the first and last layers of the first and
    the last timed run (a kernel can be wrong in some calls only), else NaN."""
    layers = RUN["layers"]
    x = jax.random.normal(jax.random.key(7), (m, k), jnp.float32).astype(jnp.bfloat16)

    @jax.jit
    def loop(x, weights, index):  # index [L] int32: traced, so no call sees a constant layer
        # unrolled (an XLA while loop adds a host round trip per call); every output returned, so every
        # call stays live with no kernel of the harness's own between them
        return tuple(gemm(x, index[l], *weights) for l in range(layers))

    index = jnp.arange(layers, dtype=jnp.int32)
    t0 = time.perf_counter()
    first_outs = jax.block_until_ready(loop(x, weights, index))
    first = time.perf_counter() - t0
    for _ in range(RUN["warmup"]):
        jax.block_until_ready(loop(x, weights, index))
    ts = []
    for _ in range(RUN["runs"]):
        t0 = time.perf_counter()
        last_outs = jax.block_until_ready(loop(x, weights, index))
        ts.append(time.perf_counter() - t0)
    device_us, kernel_us = profiled(lambda: jax.block_until_ready(loop(x, weights, index)))
    error = float("nan")
    if reference is not None:
        errs = []
        for l in (0, layers - 1):
            ref = np.asarray(reference(x, l), np.float32)
            for outs in (first_outs, last_outs):
                errs.append(np.abs(np.asarray(outs[l], np.float32) - ref).max() / np.abs(ref).max())
        error = float(max(errs))  # NaN outputs propagate: a NaN error is a wrong kernel too
    return statistics.median(ts) / layers * 1e6, first, device_us / layers, kernel_us, error


def profiled(run) -> tuple[float, float]:
    """(GPU µs of all kernels of one run(), median µs of its most time-consuming kernel name) from a
    profiler trace (benchmarks/gpu_trace.py); NaNs where no trace is written (the CPU)."""
    if RUN["dry"]:
        return float("nan"), float("nan")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gpu_trace

    kernels = gpu_trace.run_kernels(run)
    top = gpu_trace.top_by_name(kernels, 1)[0][0]
    main = [e["dur"] for e in kernels if e["name"][:60] == top]
    return sum(e["dur"] for e in kernels), statistics.median(main)


def record(
    shape: str, m: int, impl: str, variant: str, us, nbytes: int, ceiling: float, error=None, first_s=None, extra=None
):
    """One row; `us` is the time its GB/s uses (device time where profiled), `extra` more timings."""
    gbps = nbytes / us / 1e3 if us else float("nan")
    row = dict(shape=shape, m=m, impl=impl, variant=variant, bytes=nbytes, us=None if us is None else round(us, 2))
    row.update(gb_s=round(gbps, 1), pct_ceiling=round(100 * gbps / ceiling, 1), **(extra or {}))
    if first_s is not None:
        row["compile_s"] = round(first_s, 1)
    if error:
        row["error"] = error
    ROWS.append(row)
    RUN["save"]()
    shown = f"{us:9.2f} us {gbps:7.0f} GB/s {row['pct_ceiling']:5.1f}%" if us else f"FAILED {error}"
    took = f"  (compile+1st {first_s:.1f} s)" if first_s is not None else ""
    log(f"  {shape:8s} M={m:<3d} {impl:10s} {variant:16s} {nbytes / 2**20:8.2f} MiB  {shown}{took}")


# outputs ~N(0, 1): bf16 rounding of the output and, under "w", of each scaled weight stay under 1e-2 of the
# largest; a register or synchronization fault shows orders of magnitude above (or as NaN)
WRONG = 0.02


def attempt_time(shape, m, impl, variant, nbytes, ceiling, gemm, weights, n, k, reference=None):
    if time.perf_counter() > RUN["deadline"]:
        record(shape, m, impl, variant, None, nbytes, ceiling, error="skipped: past --budget-s")
        return
    try:
        wall, first, device, kernel, error = time_loop(gemm, weights, m, n, k, reference)
        extra = dict(wall_us=round(wall, 2), kernel_us=round(kernel, 2))
        if reference is not None:
            extra.update(max_rel_err=error, right=bool(error < WRONG))  # NaN compares False: wrong
            if not extra["right"]:
                log(f"  WRONG: {shape} M={m} {impl} {variant}: max |err| {error:.3g} of max |y|")
        record(shape, m, impl, variant, wall if np.isnan(device) else device, nbytes, ceiling, None, first, extra)
    except Exception as e:  # noqa: BLE001  (one failing variant must not end the run)
        record(shape, m, impl, variant, None, nbytes, ceiling, error=first_line(e))


def time_shapes(ceiling: float, variants: dict, int8_variants) -> None:
    layers, interp = RUN["layers"], RUN["interpret"]
    for i, (shape, (n, k)) in enumerate(RUN["shapes"].items()):
        key = jax.random.key(100 + i)
        for cdt, names in ((jnp.int4, list(variants)), (jnp.int8, list(int8_variants))):
            with_offsets = cdt == jnp.int4  # --quantize int4 is asymmetric: offsets beside the scales
            codes, scales, offsets = quant_inputs(key, layers, n, k, cdt, GROUP, RUN["scales"], with_offsets)
            bits = jnp.iinfo(cdt).bits
            for m in MS:
                nbytes = quant_bytes(m, n, k, bits, GROUP, group_bytes(with_offsets))
                for name in names:
                    gemm = quant_op(VARIANTS[name], GROUP, interp)
                    arrays = (codes, scales) + ((offsets,) if with_offsets else ())
                    s8 = feed(VARIANTS[name], m, k, (codes, scales, offsets if with_offsets else None)) == "s8"
                    ref_op = qs.quant_gemm_s8_reference if s8 else qg.quant_gemm_reference
                    ref = lambda x, l, c=codes, s=scales, o=offsets, f=ref_op: f(x, c, s, o, l, group=GROUP)
                    attempt_time(shape, m, f"int{bits}", name, nbytes, ceiling, gemm, arrays, n, k, ref)
            del codes, scales, offsets
            gc.collect()
        if not RUN["bf16"]:
            continue
        w = jax.random.normal(key, (layers, k, n), jnp.float32).astype(jnp.bfloat16)  # [L, K, N]
        flat = lambda x, l, w: fg.flat_gemm(x, w, l, impl="mosaic", block_sizes=RUN["fg_blocks"], interpret=interp)
        dot = lambda x, l, w: jnp.dot(x, lax.dynamic_index_in_dim(w, l, 0, False), preferred_element_type=jnp.float32)
        for m in MS:
            nbytes = bf16_bytes(m, n, k)
            attempt_time(shape, m, "bf16", "flat_gemm", nbytes, ceiling, flat, (w,), n, k)
            xla = lambda x, l, w: dot(x, l, w).astype(x.dtype)
            attempt_time(shape, m, "bf16", "xla_dot", nbytes, ceiling, xla, (w,), n, k)
        del w
        gc.collect()
    time_fused(ceiling, variants)


def time_fused(ceiling: float, variants: dict) -> None:
    """The stream variants on the fused widths: one launch for several weights sharing x."""
    layers, interp = RUN["layers"], RUN["interpret"]
    for i, (shape, (ns, k)) in enumerate(RUN["fused"].items()):
        for cdt in (jnp.int4, jnp.int8):
            with_offsets = cdt == jnp.int4
            keys = jax.random.split(jax.random.key(200 + i), len(ns))
            sdt = RUN["scales"]
            weights = [quant_inputs(kk, layers, n, k, cdt, GROUP, sdt, with_offsets) for kk, n in zip(keys, ns)]
            bits = jnp.iinfo(cdt).bits
            for m in MS:
                nbytes = sum(quant_bytes(m, n, k, bits, GROUP, group_bytes(with_offsets)) for n in ns) - 2 * m * k * (
                    len(ns) - 1
                )  # x is read once
                for name, cfg in variants.items():
                    if not isinstance(cfg, qs.QuantStreamBlocks) or (cdt == jnp.int8 and name not in INT8_VARIANTS):
                        continue

                    def gemm(x, l, *ws, cfg=cfg):
                        return qs.quant_gemm_multi(x, ws, l, group=GROUP, block_sizes=cfg, interpret=interp)

                    attempt_time(shape, m, f"int{bits}", name, nbytes, ceiling, gemm, tuple(weights), sum(ns), k)
            del weights
            gc.collect()
    time_mlp(ceiling)


def time_mlp(ceiling: float) -> None:
    """The quantized MLP of one layer, x [M, D] -> y [M, D] f32: as the engine's default hooks run it (gate + up in
    one stream launch, its combine with SwiGLU, down in another and its combine: "launches") against one launch of
    `kernels.quant_mlp_owned` ("owned"), on the same stacks, their codes taken as stored (int4 in `permute_k` order);
    "owned" checked against its reference at its own shape. GB/s count the three weights, x and y."""
    from kernels import quant_mlp_owned as qo

    layers, interp = RUN["layers"], RUN["interpret"]
    for i, (shape, (d, f)) in enumerate(RUN["mlp"].items()):
        for cdt in (jnp.int4, jnp.int8):
            with_offsets = cdt == jnp.int4
            keys = jax.random.split(jax.random.key(300 + i), 3)
            gate, up, down = (
                quant_inputs(kk, layers, n, k, cdt, GROUP, RUN["scales"], with_offsets)
                for kk, (n, k) in zip(keys, ((f, d), (f, d), (d, f)))
            )
            bits = jnp.iinfo(cdt).bits
            # the codes' own order, for the reference (int4's are taken as stored: `permute_k` is its own inverse)
            natural = tuple((qg.permute_k(c) if bits == 4 else c, s_, o) for c, s_, o in (gate, up, down))
            blocks = qo.OwnedMLPBlocks(ctas=8) if RUN["dry"] else qo.OwnedMLPBlocks()
            multi = functools.partial(  # the engine's stream launch, its combine, y in f32
                qs.quant_gemm_multi, group=GROUP, out_dtype=jnp.float32, permuted_codes=bits == 4, interpret=interp
            )

            def launches(x, l, g, u, dw):
                gv, uv = multi(x, (g, u), l)
                return multi((gv / (1.0 + jnp.exp(-gv)) * uv).astype(x.dtype), (dw,), l)[0]

            def owned(x, l, g, u, dw):
                return qo.quant_mlp_owned(x, g, u, dw, l, group=GROUP, block_sizes=blocks, interpret=interp)

            def reference(x, l, natural=natural):
                return qo.quant_mlp_owned_reference(x, *natural, l, group=GROUP)

            shapes = ((f, d), (f, d), (d, f))
            weight_bytes = sum(quant_bytes(0, n, k, bits, GROUP, group_bytes(with_offsets)) for n, k in shapes)
            for m in MS:
                nbytes = weight_bytes + 2 * m * d + 2 * m * d  # the weights, x and y (as bf16, like the GEMM rows)
                weights = (gate, up, down)
                attempt_time(shape, m, f"int{bits}", "launches", nbytes, ceiling, launches, weights, d, d)
                attempt_time(shape, m, f"int{bits}", "owned", nbytes, ceiling, owned, weights, d, d, reference)
            del gate, up, down, natural
            gc.collect()


# ---------------------------------------------------------------------------------------------
# (d) torch tinygemm int4


def time_torch_tinygemm(ceiling: float) -> None:
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device for torch")
    except Exception as e:  # noqa: BLE001
        log(f"  torch tinygemm skipped: {first_line(e)}")
        return
    layers = RUN["layers"]
    for shape, (n, k) in RUN["shapes"].items():
        if time.perf_counter() > RUN["deadline"]:
            log(f"  torch tinygemm {shape}: skipped, past --budget-s")
            continue
        try:
            packs = []
            for _ in range(layers):  # distinct layers, so the graph reads HBM as the JAX loop does
                q = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda")
                packed = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # [N, K/2]
                packs.append(torch.ops.aten._convert_weight_to_int4pack(packed, 8))
            sz = torch.rand(k // GROUP, n, 2, dtype=torch.bfloat16, device="cuda")  # scales and zeros
        except Exception as e:  # noqa: BLE001
            log(f"  torch tinygemm {shape}: packing failed: {first_line(e)}")
            continue
        for m in MS:
            nbytes = quant_bytes(m, n, k, 4, GROUP, 4)  # bf16 scale + bf16 zero per group and column
            try:
                x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
                run = lambda x=x, packs=packs: [torch.ops.aten._weight_int4pack_mm(x, p, GROUP, sz) for p in packs]
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    run()
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    run()
                graph.replay()
                torch.cuda.synchronize()
                ts = []
                for _ in range(RUN["runs"]):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    graph.replay()
                    b.record()
                    torch.cuda.synchronize()
                    ts.append(a.elapsed_time(b) * 1e3 / layers)
                record(shape, m, "int4", "torch_tinygemm", statistics.median(ts), nbytes, ceiling)
            except Exception as e:  # noqa: BLE001
                record(shape, m, "int4", "torch_tinygemm", None, nbytes, ceiling, error=first_line(e))
        del packs
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the JSON here")
    ap.add_argument("--quick", action="store_true", help="time the first two variants and int8's default only")
    ap.add_argument("--variants", default=None, help="comma-separated names of VARIANTS to time (default: all)")
    ap.add_argument("--dry-run", action="store_true", help="interpret mode on tiny shapes (the CPU works)")
    ap.add_argument("--skip-timing", action="store_true", help="the ceiling and the correctness check only")
    ap.add_argument("--budget-s", type=float, default=210, help="start no timing row after this many seconds")
    ap.add_argument(
        "--shapes", default=None, help="comma-separated names of SHAPES, FUSED and MLP to time (default: all)"
    )
    ap.add_argument("--no-bf16", action="store_true", help="skip the bf16 rows (flat GEMM and XLA's dot)")
    ap.add_argument(
        "--scales", default="float16", choices=("float16", "bfloat16", "float32"), help="the timed rows' scales dtype"
    )
    args = ap.parse_args(argv)
    RUN["scales"] = jnp.dtype(args.scales)
    if args.shapes:
        names = args.shapes.split(",")
        RUN["shapes"] = {k: v for k, v in SHAPES.items() if k in names}
        RUN["fused"] = {k: v for k, v in FUSED.items() if k in names}
        RUN["mlp"] = {k: v for k, v in MLP.items() if k in names}
    RUN["bf16"] = not args.no_bf16
    if args.dry_run:
        dry_mode()
    t_start = time.perf_counter()
    RUN["deadline"] = t_start + args.budget_s
    dev = jax.devices()[0]
    summary = dict(
        bench="quant_gemm",
        device=dev.device_kind,
        jax=jax.__version__,
        layers=RUN["layers"],
        group=GROUP,
        scales=RUN["scales"].name,
        dry_run=RUN["dry"],
        variants={name: dict(kernel=type(c).__name__, **dataclasses.asdict(c)) for name, c in VARIANTS.items()},
        rows=ROWS,
    )

    def save():
        summary["seconds"] = round(time.perf_counter() - t_start, 1)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(summary, f, indent=1)

    RUN["save"] = save
    log(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, layers {RUN['layers']}")
    log_bytes()
    ceiling = read_ceiling()
    summary["read_ceiling_gb_s"] = round(ceiling, 1)
    log(f"read ceiling: {ceiling:.0f} GB/s")
    log(f"(a) correctness of each variant against quant_gemm_reference  [{time.perf_counter() - t_start:.0f} s]")
    variants = dict(list(VARIANTS.items())[:2]) if args.quick else VARIANTS
    int8 = INT8_VARIANTS[:1] if args.quick else INT8_VARIANTS
    if args.variants:
        variants = {name: VARIANTS[name] for name in args.variants.split(",")}
        int8 = tuple(name for name in variants if name in INT8_VARIANTS)
    summary["correctness"] = check_variants(variants)
    save()
    if not args.skip_timing:
        since = time.perf_counter() - t_start
        if not RUN["dry"]:  # the peer first, so that --budget-s never cuts it
            log(f"(d) torch tinygemm int4  [{since:.0f} s]")
            time_torch_tinygemm(ceiling)
        log(f"(b) µs per call, L calls over stacked layers in one jit, GB/s in each row's bytes  [{since:.0f} s]")
        time_shapes(ceiling, variants, int8)
    save()
    log("\nshape    M   impl       variant          device µs  kernel µs   wall µs    GB/s  %ceil")
    for r in ROWS:
        if r["us"] is not None:
            name = f"{r['shape']:8s} {r['m']:<3d} {r['impl']:10s} {r['variant']:16s}"
            times = f"{r['us']:9.2f} {r.get('kernel_us', float('nan')):10.2f} {r.get('wall_us', r['us']):9.2f}"
            log(f"{name} {times} {r['gb_s']:7.0f} {r['pct_ceiling']:6.1f}")
    print(json.dumps(summary, separators=(",", ":")))
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)

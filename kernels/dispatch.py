"""Heuristic dataflow (FlashDecoding++ §5): pick the implementation per (M, N, K) and GPU.

FlashDecoding++ profiles each [N, K] offline and stores two inflection points per shape: below M1
a CUDA-core GEMV wins, between M1 and M2 the flat GEMM, from M2 on the conventional GEMM (here XLA's
dot, i.e. cuBLAS). `kernels/tune.py` measures them and writes one JSON table per GPU; the tables
that ship live in `kernels/tables/<normalized device_kind>.json` (`NVIDIA H200` -> `h200.json`).
The environment variable KERNELS_TUNE_TABLE=PATH replaces the shipped table (e.g. with the output
of `jaxdecode tune --out PATH`). The run-time rule is a lookup; every choice carries its reason.

Each entry has a form: "plain" (one call on a [K, N] weight) or "looped" (one layer of a stacked
[L, K, N] weight inside a loop over layers, where XLA would copy W[l] out first, so the in-place
kernel wins longer). An [N, K] not in the table takes the entry of the nearest profiled shape of the
same form (distance in log N, log K). A device without a table (the CPU, other GPUs) gets the safe
default: XLA for everything.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import re

import jax

from kernels import flat_gemm

TABLES_DIR = pathlib.Path(__file__).parent / "tables"
TABLE_ENV = "KERNELS_TUNE_TABLE"
FORMS = ("plain", "looped")
GEMM_IMPLS = ("gemv", "mosaic", "stream", "triton", "xla")
ATTENTION_IMPLS = ("async", "sync", "xla")
GEMV_MAX_M = 1  # the gemv kernel takes one row (flat_gemm impl="gemv")
PALLAS_TRITON = ("gemv", "triton")  # deprecated in jax 0.11: kept for the plain form, never chosen in the loop
MOSAIC_MAX_M = 256  # wgmma N side of the Mosaic kernel


@dataclasses.dataclass(frozen=True)
class Choice:
    impl: str  # "mosaic" | "stream" | "triton" | "gemv" | "xla" for GEMMs; "async" | "sync" | "xla" for attention
    reason: str


@dataclasses.dataclass(frozen=True)
class GemmEntry:
    """Inflection points of one [N, K] and form: M < m1 → gemv_impl; m1 <= M < m2 → flat_impl;
    M >= m2 → XLA. m2=None: XLA never won up to the largest profiled M."""

    op: str
    form: str  # "plain" | "looped"
    n: int
    k: int
    m1: int
    m2: int | None
    flat_impl: str
    gemv_impl: str = "gemv"


@dataclasses.dataclass(frozen=True)
class Table:
    device_kind: str
    source: str
    gemm: tuple[GemmEntry, ...]
    attention_impl: str
    path: str

    def lookup(self, n: int, k: int, form: str) -> tuple[GemmEntry, bool] | None:
        """(entry, exact) for [N, K] of `form`: the exact entry or the nearest one in log space."""
        entries = [e for e in self.gemm if e.form == form]
        if not entries:
            return None
        dist = lambda e: math.hypot(math.log(e.n / n), math.log(e.k / k))
        best = min(entries, key=dist)
        return best, dist(best) == 0.0


def normalize_gpu_name(device_kind: str) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100_80gb_hbm3': the table file stem."""
    name = re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_")
    return re.sub(r"^nvidia_", "", name)


def _int_or_none(x, what):
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise ValueError(f"{what} must be a positive integer or null, got {x!r}")
    return x


def parse_table(data: dict, path: str = "<dict>") -> Table:
    """Validate the JSON written by `kernels.tune` (ValueError names the bad field)."""
    try:
        entries = []
        for i, e in enumerate(data["gemm"]):
            where = f"{path}: gemm[{i}]"
            if e["form"] not in FORMS:
                raise ValueError(f"{where}: form {e['form']!r} not in {FORMS}")
            if e["flat_impl"] not in ("mosaic", "stream", "triton") or e.get("gemv_impl", "gemv") != "gemv":
                raise ValueError(f"{where}: unknown impl in {e}")
            m1, m2 = _int_or_none(e["m1"], f"{where}.m1"), _int_or_none(e["m2"], f"{where}.m2")
            if m1 is None or (m2 is not None and m2 < m1):
                raise ValueError(f"{where}: need 1 <= m1 <= m2, got {m1=}, {m2=}")
            entries.append(GemmEntry(str(e["op"]), e["form"], int(e["n"]), int(e["k"]), m1, m2, e["flat_impl"]))
        attention = data.get("attention", {}).get("impl", "xla")
        if attention not in ATTENTION_IMPLS:
            raise ValueError(f"{path}: attention impl {attention!r} not in {ATTENTION_IMPLS}")
        return Table(str(data["device_kind"]), str(data["source"]), tuple(entries), attention, path)
    except (KeyError, TypeError) as err:
        raise ValueError(f"{path}: malformed tune table ({type(err).__name__}: {err})") from err


@functools.cache
def load_table(path: str) -> Table:
    with open(path) as fh:
        return parse_table(json.load(fh), path)


def table_for(device: jax.Device | None = None) -> tuple[Table | None, str]:
    """(table, where it came from) for the device; (None, why not) when there is none."""
    device = device or jax.devices()[0]
    if device.platform != "gpu":
        return None, f"{device.platform}: no GPU kernels"
    override = os.environ.get(TABLE_ENV)
    if override:
        return load_table(override), f"${TABLE_ENV}={override}"
    path = TABLES_DIR / f"{normalize_gpu_name(device.device_kind)}.json"
    if not path.exists():
        return None, (f"no tuned table for {device.device_kind!r} (kernels/tables/{path.name}; run `jaxdecode tune`)")
    return load_table(str(path)), f"kernels/tables/{path.name}"


def gpu_kind(device: jax.Device | None = None) -> str | None:
    """'H200' / 'H100' / other device_kind string for CUDA GPUs; None for anything else."""
    device = device or jax.devices()[0]
    if device.platform != "gpu":
        return None
    kind = device.device_kind
    return next((name for name in ("H200", "H100") if name in kind), kind)


def choose_gemm(
    m: int,
    n: int,
    k: int,
    *,
    looped: bool = False,
    device: jax.Device | None = None,
    block_sizes: flat_gemm.BlockSizes = flat_gemm.BlockSizes(),
    table: Table | None = None,
) -> Choice:
    """Implementation for y[m, n] = x[m, k]·W[k, n]; `looped`: W is one layer of a stacked array
    indexed inside a loop (XLA would copy the slice first). `table` overrides the device's table."""
    where = "the given table"
    if table is None:
        table, where = table_for(device)
        if table is None:
            return Choice("xla", f"{where}: XLA dot")
    form = "looped" if looped else "plain"
    found = table.lookup(n, k, form)
    if found is None:
        return Choice("xla", f"{where} has no {form} entries: XLA dot")
    e, exact = found
    if n % block_sizes.tile_n or k % block_sizes.tile_k:
        return Choice("xla", f"{n=}, {k=} not multiples of tile_n={block_sizes.tile_n}, tile_k={block_sizes.tile_k}")
    shape = f"[N, K]=[{n}, {k}]" if exact else f"nearest profiled [N, K]=[{e.n}, {e.k}] ({e.op})"
    points = f"M1={e.m1}, M2={e.m2 if e.m2 is not None else 'none'}"
    tail = f"{form} {shape}, {points} on {table.device_kind} ({where})"
    if looped and (m < e.m1 and m <= GEMV_MAX_M or e.flat_impl in PALLAS_TRITON):
        # The decode path takes no Pallas-Triton kernel (deprecated): the entry's Mosaic GPU flat kernel
        # (Stream-K for a Triton one), which measured equal to the GEMV end to end at batch 1.
        impl = "stream" if e.flat_impl in PALLAS_TRITON else e.flat_impl
        return Choice(impl, f"M={m}: the loop takes no Pallas-Triton kernel, {impl} instead: {tail}")
    if m < e.m1 and m <= GEMV_MAX_M:
        if exact:
            return Choice(e.gemv_impl, f"M={m} < M1: {tail}")
        # The GEMV kernel loops over K on CUDA cores, so its speed does not carry over from another
        # shape: taken from the nearest entries it made Qwen2.5-7B's looped decode far slower on the
        # H200 (see docs/log/).
        return Choice(e.flat_impl, f"M={m} < M1, but GEMV is not extrapolated to an unprofiled shape: {tail}")
    if e.m2 is not None and m >= e.m2:
        return Choice("xla", f"M={m} >= M2: XLA dot; {tail}")
    if e.flat_impl in ("mosaic", "stream") and m > MOSAIC_MAX_M:
        return Choice("xla", f"M={m} > {MOSAIC_MAX_M}, the Mosaic kernel's limit: XLA dot; {tail}")
    why = f"M1 <= M={m} < M2" if e.m2 is not None else f"M={m} >= M1 and XLA never won"
    return Choice(e.flat_impl, f"{why}: {tail}")


def choose_attention(device: jax.Device | None = None, table: Table | None = None) -> Choice:
    """Decode attention implementation for the device: the table's choice, else XLA."""
    where = "the given table"
    if table is None:
        table, where = table_for(device)
        if table is None:
            return Choice("xla", f"{where}: XLA einsum")
    return Choice(table.attention_impl, f"fastest profiled on {table.device_kind} ({where})")

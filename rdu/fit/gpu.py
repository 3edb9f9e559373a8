"""The GPU modes xla, eager, scan_copy and fixed of `rdu.gpu.simulate_gpu` as a `jnp` function of
their free constants (`gpu_time`), their fixed inputs (`gpu_features`) and the fit to our H200 rows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.config import get_preset
from rdu.anchors import H200_ROWS, GPURow
from rdu.fit.common import fit_constants, msle
from rdu.gpu import gpu_kernel_terms
from rdu.hardware import GPU_FREE, H100, H200, GPUSpec
from rdu.mapping import Kernel, fuse
from rdu.trace import trace_decode_step

GPU_KEYS = GPU_FREE


ASSUMED_GPU = frozenset({"kernel_overhead_s", "eager_op_s"})  # no measurement behind them: weaker prior


def gpu_constants(g: GPUSpec) -> dict[str, float]:
    return {k: getattr(g, k) for k in GPU_KEYS}


@dataclass(frozen=True)
class GPUFeatures:
    """Fixed inputs of `simulate_gpu` for one traced step and mode, one entry per kernel."""

    n: np.ndarray  # calls * iterations per token
    count: np.ndarray  # GPU kernels launched per call
    fixed_s: np.ndarray  # mode "fixed": the kernels' own fixed costs per call (spec constants, not fitted)
    weight_bytes: np.ndarray  # per GPU
    kv_bytes: np.ndarray  # KV cache read per GPU
    other_bytes: np.ndarray  # KV write + activations, at the read ceiling
    copy_bytes: np.ndarray  # bytes (read + written) of the scan's weight copies, at the copy bandwidth
    compute_s: np.ndarray
    comm_s: np.ndarray
    eager: float  # 1.0: host-dispatched (eager_op_s per kernel), 0.0: queued (kernel_overhead_s)
    fixed: float  # 1.0: mode "fixed" (fixed_s per call, weights at the read ceiling)
    gemv: float  # 1.0: M = batch = 1 (weights at gemv_efficiency), 0.0: M >= 2 (gemm_efficiency)
    read_bw: float
    copy_bw: float
    model_bytes: float
    step_s: float = 0.0  # per token, outside the kernels


jax.tree_util.register_dataclass(
    GPUFeatures,
    data_fields=[
        "n",
        "count",
        "fixed_s",
        "weight_bytes",
        "kv_bytes",
        "other_bytes",
        "copy_bytes",
        "compute_s",
        "comm_s",
        "eager",
        "fixed",
        "gemv",
        "read_bw",
        "copy_bw",
        "model_bytes",
        "step_s",
    ],
    meta_fields=[],
)


def gpu_features(
    kernels: list[Kernel],
    gpu: GPUSpec,
    *,
    batch: int = 1,
    mode: str = "xla",
    n_gpus: int = 1,
    kv_heads: int = 8,
    activation_bytes: int = 0,
    logits_bytes: int = 0,
    kernels_per_layer: int | None = None,
    step_s: float = 0.0,
) -> GPUFeatures:
    """Read the fixed inputs of `simulate_gpu` (same arguments, same `gpu_kernel_terms`)."""
    rows = []
    for k in kernels:
        t = gpu_kernel_terms(
            k,
            gpu,
            mode=mode,
            n_gpus=n_gpus,
            kv_heads=kv_heads,
            activation_bytes=activation_bytes,
            logits_bytes=logits_bytes,
            kernels_per_layer=kernels_per_layer,
        )
        rows.append(
            (
                k.calls * k.iterations,
                t.count,
                t.fixed_s,
                t.weight_bytes,
                t.kv_bytes,
                t.other_bytes,
                t.copy_bytes,
                t.compute_s,
                t.comm_s,
            )
        )
    cols = [np.asarray(c, dtype=np.float64) for c in zip(*rows)]
    return GPUFeatures(
        *cols,
        eager=float(mode == "eager"),
        fixed=float(mode == "fixed"),
        gemv=float(batch == 1),
        read_bw=gpu.read_bw,
        copy_bw=gpu.copy_bw,
        model_bytes=float(sum(k.calls * k.iterations * k.bytes for k in kernels)),
        step_s=step_s,
    )


def gpu_time(c: dict, f: GPUFeatures):
    """Per-token time (s) of `simulate_gpu` as a `jnp` function of the constants `c`."""
    overhead = jnp.where(f.eager > 0, c["eager_op_s"], c["kernel_overhead_s"])
    eff = jnp.where(f.fixed > 0, 1.0, jnp.where(f.gemv > 0, c["gemv_efficiency"], c["gemm_efficiency"]))
    mem = (
        f.weight_bytes / (eff * f.read_bw)
        + f.kv_bytes / (c["attention_efficiency"] * f.read_bw)
        + f.other_bytes / f.read_bw
    )
    mem = mem + f.copy_bytes / f.copy_bw
    fixed = jnp.where(f.fixed > 0, f.fixed_s, f.count * overhead)
    it = fixed + jnp.maximum(mem, f.compute_s) + f.comm_s
    return jnp.sum(f.n * it) + f.step_s


def gpu_row_features(row: GPURow, step_s: float = 0.0) -> GPUFeatures:
    cfg = get_preset(row.model)
    g = trace_decode_step(cfg, row.batch, row.context, looped=False)
    all_kernels = fuse(g)
    kernels = [k for k in all_kernels if k.role != "sampling"]
    spec = H100 if row.gpu == "h100" else H200
    return gpu_features(
        kernels,
        spec,
        batch=row.batch,
        mode=row.mode,
        n_gpus=row.n_gpus,
        kv_heads=cfg.n_kv_heads,
        activation_bytes=row.batch * cfg.dim * 2,
        kernels_per_layer=row.kernels_per_layer,
        logits_bytes=sum(k.other_bytes for k in all_kernels if k.role == "sampling"),
        step_s=step_s,
    )


def _tied(c: dict) -> dict:
    """The model without a batch term: every matmul at the M = 1 efficiency."""
    return dict(c, gemm_efficiency=c["gemv_efficiency"])


def fit_gpu(
    feats: list[GPUFeatures], rows=H200_ROWS, steps: int = 600, lr: float = 0.05, batch_dependent: bool = True
) -> tuple[dict, float]:
    """Fit the GPU constants on the train rows; `batch_dependent=False` ties gemm to gemv efficiency."""
    train = [(f, r) for f, r in zip(feats, rows) if r.split == "train"]
    view: Callable[[dict], dict] = (lambda c: c) if batch_dependent else _tied

    def loss(c):
        return msle([1e3 * gpu_time(view(c), f) for f, _ in train], [r.measured_ms for _, r in train])

    c, v = fit_constants(loss, gpu_constants(H200), steps, lr, weak=ASSUMED_GPU)
    return view(c), v

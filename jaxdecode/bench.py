"""Decode benchmark harness: first-call time, prefill ms, decode tok/s and % of the memory roofline.

Each measurement is one JSON line. The first call of a fresh engine includes tracing and
compilation; the timed run after it reuses the compiled steps.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import asdict, dataclass

import jax
import numpy as np

from jaxdecode.cost import decode_cost
from jaxdecode.decode import Engine


@dataclass
class DecodeMeasurement:
    model: str
    variant: str  # "looped" or "unrolled"
    backend: str
    device: str
    batch: int
    prompt_len: int
    new_tokens: int
    first_call_s: float  # trace + compile + prefill + decode of the first run
    prefill_ms: float
    decode_ms_per_step: float
    decode_tok_s: float  # tokens per second summed over the batch
    weight_gb_s: float  # bytes the step must move (cost.py) / step time
    date: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def measure_decode(engine: Engine, *, model_name: str, batch: int = 1, prompt_len: int = 32,
                   new_tokens: int = 128, chunk: int = 32, seed: int = 0) -> DecodeMeasurement:
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
    device = jax.devices()[0]
    return DecodeMeasurement(
        model=model_name, variant="looped" if engine.loop_layers else "unrolled", backend=jax.default_backend(),
        device=getattr(device, "device_kind", str(device)) + (f" ({platform.processor() or platform.machine()})"
                                                             if device.platform == "cpu" else ""),
        batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, first_call_s=round(first_call, 3),
        prefill_ms=round(gen.prefill_s * 1e3, 2), decode_ms_per_step=round(step_s * 1e3, 3),
        decode_tok_s=round(batch / step_s, 2), weight_gb_s=round(moved / step_s / 1e9, 2),
        date=time.strftime("%Y-%m-%d"),
    )


def run_cli_bench(args) -> int:
    """`jaxdecode bench`: time the looped engine (and optionally the unrolled one) on this machine."""
    from rich.console import Console
    from rich.table import Table

    from jaxdecode.decode import default_dtype
    from jaxdecode.loading import load_model

    if args.batch < 1 or args.prompt_len < 1 or args.max_new_tokens < 2:
        raise ValueError("need --batch >= 1, --prompt-len >= 1 and --max-new-tokens >= 2")
    loaded = load_model(args.model, dtype=default_dtype())
    variants = [not args.no_loop] + ([False] if args.compare_unrolled and not args.no_loop else [])
    rows = []
    for loop in variants:
        engine = Engine(loaded.model, loop_layers=loop)
        rows.append(measure_decode(engine, model_name=args.model, batch=args.batch, prompt_len=args.prompt_len,
                                   new_tokens=args.max_new_tokens))
    table = Table(title=f"decode, {rows[0].device}, {rows[0].date}")
    for col in ("variant", "batch", "first call s", "prefill ms", "ms/step", "tok/s", "GB/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r.variant, str(r.batch), f"{r.first_call_s:.2f}", f"{r.prefill_ms:.1f}",
                      f"{r.decode_ms_per_step:.2f}", f"{r.decode_tok_s:.1f}", f"{r.weight_gb_s:.1f}")
    Console(file=sys.stderr).print(table)
    for r in rows:
        print(r.to_json())
    return 0

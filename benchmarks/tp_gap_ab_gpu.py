"""Why kernels sit ~0.45 µs apart in a TP2 decode step and ~0 apart on one GPU: XLA command-buffer A/B.

    python benchmarks/tp_gap_ab_gpu.py [--variants tp2,tp2:SERIALIZE,tp1@8:CONCURRENT,...] [--hlo]
        # 2 Hopper GPUs; one JSON line per variant on stdout and in $OUT/tp_gap_ab_gpu.jsonl

Llama-3.1-8B, random bf16 weights, batch 1 (or "@B"), 1k context (or "#S"), the default looped in-place engine on
one GPU (tp1) or split over 2 (tp2, the all-reduce kernel). XLA reads its flags once per process, so
each variant runs in its own process. Variants, by their parts:
- "tp2:MODE": XLA's `--xla_gpu_command_buffer_scheduling_mode=MODE` (SERIALIZE, CONCURRENT or LHS, the default);
- "-qkv_attend": the q·k·v epilogue kernel off; "-residual_norm": the all-reduce kernel's residual add and
  norm off (`looped_model.kernel_residual_norm`); "-psum": XLA's psum instead of the all-reduce kernel;
- "~N": the attention kernel's splits chosen for N programs ("~old": the rule before 2026-12-01);
  "^N": the all-reduce kernel for up to N elements;
- "tp1+peers": one GPU's engine after a psum over both GPUs in the same process (NCCL set up, peer access
  on); "tp1+after_tp2": after three decode chunks of the 2-GPU engine; "tp1+loop_psum": after a small
  2-GPU program with a psum inside a loop (which leaves every later kernel boundary of the process
  slower, see device_gap_gpu.py);
- timing only, wrong values: "-nocomm" leaves the layers' all-reduces out, "-nocoll" every collective
  (also the embedding's psum and the LM head's all-gather), "-nogather" the LM head's all-gather only;
- "+embed_kernel": the embedding's all-reduce by the kernel too (`tp.EMBED_KERNEL`; right values, and no
  NCCL call left in the step loop but the LM head's gather);
- "tp1u": one GPU, the unrolled engine (plain JAX: XLA's dots and attention; `jaxdecode bench`'s "unrolled");
- "tpx1": one GPU through the tensor-parallel program (`TPForward` over a 1-device mesh, psum);
  "tp1half": one GPU running one TP2 shard's shapes (half the heads, FFN and vocab; no all-reduce);
- "VARIANT|N": a one-GPU variant in N processes at once, one per GPU (CUDA_VISIBLE_DEVICES), timed and
  traced together (a file barrier): do two GPUs busy with the same decode, with no program in common,
  show TP2's gaps?
TP_GAP_PRESET names another model preset (a tiny one runs the harness up to the trace on the CPU).

Per variant: the untraced ms/token (best of three 64-step runs), then one more 64-step run under the
profiler (the same cache length, so the same attention splits; until 2026-12-01 a 32-step one, whose
shorter cache could change them), from which, on GPU 0: the kernels per stream (a command buffer whose
DAG has parallel branches runs them on several streams), and on the busiest stream the kernel time per
step against the untraced step and the median idle time between two kernels inside a layer; on one GPU
also the decode chunk's temporary memory (XLA's `memory_analysis`). `--hlo`: the optimized HLO of each
variant without a mode goes to $OUT (`--xla_dump_to`), to name the fusions. With TP_GAP_DUMP=DIR set,
every traced event of the process (both GPUs, host threads) within about one layer of the middle of the
step goes to DIR/events_<variant>.json.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import defaultdict

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off

STEPS = 64  # per timed and traced chunk: one cache length (so one attention split count) for both
PRESET = os.environ.get("TP_GAP_PRESET", "llama-3.1-8b")  # a tiny-* preset runs the harness on the CPU (smoke)


def measure(variant: str) -> dict:
    """Runs in the variant's own process (XLA_FLAGS already set by the parent)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxdecode.bench import time_engine
    from jaxdecode.config import get_preset
    from jaxdecode.decode import Engine
    from jaxdecode.model import init_random
    from jaxdecode.tp import TPForward

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_trace import gpu_pids, kernel_events, traced_events, track_names

    tp = 2 if variant.startswith("tp2") else 1

    def tp_engine(model, devices, allreduce):  # the looped in-place engine over `devices` GPUs
        return Engine(None, tp=TPForward.from_model(model, devices, loop_mode="inplace", allreduce=allreduce))

    via_tp = variant.startswith("tpx1")  # one GPU through the tensor-parallel program (shard_map over 1 device, psum)
    if "+peers" in variant:  # one GPU's engine in a process that first ran a psum over both GPUs
        from jax.sharding import Mesh, PartitionSpec

        mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
        total = jax.jit(
            jax.shard_map(
                lambda a: jax.lax.psum(a, "x"), mesh=mesh, in_specs=PartitionSpec("x"), out_specs=PartitionSpec()
            )
        )(jnp.ones((2, 128), jnp.bfloat16))
        jax.block_until_ready(total)
    if "+loop_psum" in variant:  # first a small 2-GPU program with a psum inside a loop (benchmarks/device_gap_gpu.py)
        from device_gap_gpu import build

        run, block = build("shard2_psum")
        block(run())
    if "+after_tp2" in variant:  # one GPU's engine in a process that first ran the 2-GPU engine's decode
        tp2 = tp_engine(init_random(get_preset(PRESET), seed=0, dtype=jnp.bfloat16), 2, "kernel")
        for _ in range(3):
            time_engine(tp2, np.ones((1, 16), np.int32), context=1024, steps=STEPS)
        del tp2
    from jaxdecode import looped_model

    if "-qkv_attend" in variant:  # the q·k·v epilogue as XLA's fusions (the hook off)
        looped_model.KERNEL_CALLS.pop("qkv_attend")
    if "~" in variant:  # "~N": the attention kernel picks its splits for N programs (BlockSizes.target_programs)
        import functools

        from kernels.decode_attention import BlockSizes

        if "~old" in variant:  # the rule before 2026-12-01: ~264 programs, no cap on programs or splits
            blocks = BlockSizes(target_programs=264, max_programs=None, max_splits=None)
        else:
            blocks = BlockSizes(target_programs=int(re.search(r"~(\d+)", variant).group(1)))
        looped_model.KERNEL_CALLS["qkv_attend"] = functools.partial(
            looped_model.kernel_qkv_attend, attention_blocks=blocks
        )
    if "^" in variant:  # "^N": the all-reduce kernel takes activations of up to N elements (batch 8: 32768)
        from kernels import allreduce

        allreduce.PERSISTENT_MAX_ELEMENTS = int(re.search(r"\^(\d+)", variant).group(1))
    if "-nocomm" in variant or "-nocoll" in variant:  # timing only: the layers' all-reduces left out
        from jaxdecode import model as model_module

        model_module.tp_residual_add = lambda x, block_out, cfg: x + block_out
    if "-nocoll" in variant:  # timing only: no collective anywhere (also the embedding's psum, the LM head's gather)
        jax.lax.psum = lambda x, axis_name, **kw: x
    if "-nocoll" in variant or "-nogather" in variant:  # timing only: the LM head's all-gather left out
        jax.lax.all_gather = lambda x, axis_name, *, axis=0, tiled=False, **kw: (
            jnp.concatenate([x, x], axis=axis) if tiled else jnp.stack([x, x], axis=axis)
        )
    if "+embed_kernel" in variant:  # the embedding's all-reduce by the kernel too: no NCCL psum in the step loop
        from jaxdecode import tp as tp_module

        tp_module.EMBED_KERNEL = True
    if "-residual_norm" in variant:  # the MLP's norm as its own kernel after the all-reduce (the hook off)
        looped_model.CONFIG_CALLS.pop("residual_norm")
    batch = int(re.search(r"@(\d+)", variant).group(1)) if "@" in variant else 1
    context = int(re.search(r"#(\d+)", variant).group(1)) if "#" in variant else 1024
    preset = get_preset(PRESET)
    if variant.startswith("tp1half"):  # one GPU, one TP2 shard's shapes (half the heads, FFN and vocab), no all-reduce
        import dataclasses

        preset = dataclasses.replace(
            preset,
            name=preset.name + "-tp2-shard",
            n_heads=preset.n_heads // 2,
            n_kv_heads=preset.n_kv_heads // 2,
            ffn_dim=preset.ffn_dim // 2,
            head_dim=preset.dim // preset.n_heads,
            vocab_size=preset.vocab_size // 2,
        )
    model = init_random(preset, seed=0, dtype=jnp.bfloat16)
    allreduce = "psum" if "-psum" in variant else "kernel"  # "tp2-psum": XLA's all-reduce (NCCL), no Mosaic kernel
    if via_tp:
        engine = tp_engine(model, 1, "psum")
    else:
        unrolled = variant.startswith("tp1u")  # plain JAX: no looping pass, XLA's dots and attention
        engine = Engine(model, loop_layers=not unrolled) if tp == 1 else tp_engine(model, 2, allreduce)
    prompts = np.ones((batch, 16), np.int32)
    time_engine(engine, prompts, context=context, steps=STEPS)  # compiles
    _barrier("timed")
    runs = [time_engine(engine, prompts, context=context, steps=STEPS) for _ in range(3)]
    _barrier("traced")
    step_us = min(t.decode_s / t.steps for t in runs) * 1e6
    temp = [
        c.memory_analysis().temp_size_in_bytes
        for steps in getattr(engine, "_bench_compiled", {}).values()
        for c in steps
        if hasattr(c, "memory_analysis")
    ]
    out_dir = os.path.join("/tmp/traces", variant.replace(":", "_"))
    events = traced_events(lambda: time_engine(engine, prompts, context=context, steps=STEPS), out_dir)
    gpu0 = min(gpu_pids(track_names(events)))
    streams = defaultdict(list)
    for e in kernel_events(events, {gpu0}):
        streams[e["tid"]].append(e)
    evs = sorted(max(streams.values(), key=len), key=lambda e: e["ts"])
    names = [e["name"][:60] for e in evs]
    # one decode step: between the last two launches of the LM head (the longest kernel run once a step)
    durations = defaultdict(list)
    for e in evs:
        durations[e["name"][:60]].append(e["dur"])
    head = max(
        durations, key=lambda n: float(np.median(durations[n])) if STEPS <= len(durations[n]) <= 2 * STEPS + 4 else 0.0
    )
    starts = [i for i, n in enumerate(names) if n == head]
    step = evs[starts[-2] + 1 : starts[-1] + 1]
    gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(step, step[1:])]
    inner = [g for g in gaps if g < 2.0]  # leave out the per-layer CUDA-graph boundaries (~4 µs)
    row = dict(
        variant=variant,
        tp=tp,
        batch=batch,
        temp_bytes=temp,
        jax=jax.__version__,
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        untraced_step_us=round(step_us, 1),
        all_step_us=[round(t.decode_s / t.steps * 1e6, 1) for t in runs],
        step_kernel_us=round(sum(e["dur"] for e in step), 1),
        kernels_per_step=len(step),
        step_top_kernels=_top_by_name(step),
        median_inner_gap_us=round(float(np.median(inner)), 3),
        mean_inner_gap_us=round(float(np.mean(inner)), 3),
        boundary_gaps=len(gaps) - len(inner),
        boundary_gap_us=round(float(np.median([g for g in gaps if g >= 2.0] or [0.0])), 2),
        layer=[
            [e["name"][:40], round(e["dur"], 2), round(g, 2)]
            for e, g in zip(step[len(step) // 2 : len(step) // 2 + 20], gaps[len(step) // 2 - 1 :])
        ],
        streams={str(tid): len(v) for tid, v in sorted(streams.items(), key=lambda kv: -len(kv[1]))},
        other_stream_kernels=sorted(
            {e["name"][:50] for tid, v in streams.items() if v is not max(streams.values(), key=len) for e in v}
        )[:12],
    )
    if os.environ.get("TP_GAP_DUMP"):  # every event of the process around one middle layer, for reading by eye
        mid = step[len(step) // 2]["ts"]
        window = [e for e in events if e.get("ph") == "X" and mid - 20 <= e.get("ts", 0) <= mid + 120]
        labels = track_names(events)
        dump = [
            dict(
                track=labels.get((e["pid"], None), str(e["pid"]))
                + " / "
                + labels.get((e["pid"], e.get("tid")), str(e.get("tid"))),
                name=e["name"][:80],
                ts=round(e["ts"] - mid, 3),
                dur=round(e.get("dur", 0), 3),
                args={k: str(v)[:80] for k, v in (e.get("args") or {}).items()},
            )
            for e in sorted(window, key=lambda e: e["ts"])
        ]
        with open(os.path.join(os.environ["TP_GAP_DUMP"], f"events_{variant.replace(':', '_')}.json"), "w") as fh:
            json.dump(dump, fh, indent=0)
    return row


def _top_by_name(step: list, n: int = 16) -> list:
    """[name, kernels, total µs] of a step's kernels grouped by name, the n longest in total."""
    totals = defaultdict(lambda: [0, 0.0])
    for e in step:
        totals[e["name"][:60]][0] += 1
        totals[e["name"][:60]][1] += e["dur"]
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:n]
    return [[name, count, round(total, 1)] for name, (count, total) in ranked]


def _barrier(name: str) -> None:
    """Wait until every process of a "VARIANT|N" run reaches this point (files in $TP_GAP_BARRIER)."""
    folder = os.environ.get("TP_GAP_BARRIER")
    if not folder:
        return
    import glob
    import time

    open(os.path.join(folder, f"{name}.{os.getpid()}"), "w").close()
    deadline = time.time() + 600
    while len(glob.glob(os.path.join(folder, f"{name}.*"))) < int(os.environ["TP_GAP_PARTIES"]):
        if time.time() > deadline:
            raise TimeoutError(f"barrier {name}: the other processes did not arrive")
        time.sleep(0.005)


def _concurrent_rows(variant: str, env: dict) -> list[dict]:
    """ "BASE|N": BASE in N processes at once, process i on GPU i only; their rows, tagged /gpuI."""
    import tempfile

    base, parties = variant.split("|")
    folder = tempfile.mkdtemp(prefix="tp_gap_barrier_")
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", base],
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(env, CUDA_VISIBLE_DEVICES=str(i), TP_GAP_BARRIER=folder, TP_GAP_PARTIES=parties),
        )
        for i in range(int(parties))
    ]
    rows = []
    for i, proc in enumerate(procs):
        row = _child_row(f"{variant} on GPU {i}", *proc.communicate(), proc.returncode)
        if row is not None:
            rows.append(dict(row, variant=f"{variant}/gpu{i}"))
    return rows


def _child_row(label: str, stdout: str, stderr: str, returncode: int) -> dict | None:
    """The row a child process printed ("ROW {json}"), or None after saying why it has none."""
    rows = [line[4:] for line in stdout.splitlines() if line.startswith("ROW ")]
    if returncode or not rows:
        print(f"{label}: failed (rc {returncode})\n{stderr[-3000:]}", flush=True)
        return None
    return json.loads(rows[0])


def _emit(row: dict, out: str) -> None:
    """Print a row and append it to the JSON lines file `out`."""
    print(json.dumps(row), flush=True)
    with open(out, "a") as fh:
        fh.write(json.dumps(row) + "\n")


def main() -> int:
    if "--child" in sys.argv:
        print("ROW " + json.dumps(measure(sys.argv[sys.argv.index("--child") + 1])), flush=True)
        return 0
    variants = (
        sys.argv[sys.argv.index("--variants") + 1].split(",")
        if "--variants" in sys.argv
        else ["tp2", "tp2:SERIALIZE", "tp2:CONCURRENT", "tp1", "tp1:SERIALIZE"]
    )
    out = os.path.join(os.environ.get("OUT", "."), "tp_gap_ab_gpu.jsonl")
    for variant in variants:
        env = dict(os.environ)
        if "--hlo" in sys.argv and ":" not in variant:
            dump = os.path.join("/tmp/hlo", variant.replace("@", "_"))
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_as_text").strip()
        if ":" in variant:
            env["XLA_FLAGS"] = (
                env.get("XLA_FLAGS", "") + f" --xla_gpu_command_buffer_scheduling_mode={variant.split(':')[1]}"
            ).strip()
        if "|" in variant:
            for row in _concurrent_rows(variant, env):
                _emit(row, out)
            continue
        proc = subprocess.run([sys.executable, __file__, "--child", variant], env=env, capture_output=True, text=True)
        row = _child_row(variant, proc.stdout, proc.stderr, proc.returncode)
        if row is None:
            continue
        _emit(row, out)
        if "--hlo" in sys.argv and ":" not in variant:  # the decode chunk: the largest optimized module
            import glob
            import shutil

            files = glob.glob(os.path.join(dump, "*chunk*after_optimizations.txt"))
            if files:
                shutil.copy(
                    max(files, key=os.path.getsize),
                    os.path.join(os.environ.get("OUT", "."), f"hlo_{variant.replace('@', '_')}.txt"),
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())

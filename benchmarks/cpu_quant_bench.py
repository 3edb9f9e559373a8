"""The shipped model's decode speed on the CPU: its Q4_1 weights dequantized to float32 against the same
weights kept quantized (`jaxdecode.quantized.quant_dot`'s CPU path), each looped and unrolled, in one run.

    python benchmarks/cpu_quant_bench.py [--out DIR] [--rounds 3] [--repeats 3] [--steps 64]

Each variant runs in a process of its own (its own weights, caches and thread pools), in --rounds
interleaved rounds. A process loads the model, then times --repeats runs of --steps greedy decode steps
after a --prompt-len-token random prompt (`jaxdecode.bench.time_engine`, each run after a compiling or
warm one). The machine may be shared: each process records the load average before and after, and the
variants are compared within the run (ratios to the float32 rows of the same loop mode), not with
other runs. A row: tok/s (median over the process's runs), the weight bytes a step reads
(`cost.step_weight_bytes`, the weights as stored), GB/s and % of the read ceiling measured in the
parent, and whether its greedy tokens equal the float32 reference's.
JSON lines to DIR/cpu_quant_bench.jsonl (--out, default $OUT or the current directory), the summary
last; a table on stderr; the summary JSON last on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

VARIANTS = {"float32": dict(dequantize=True), "Q4_1 kept": {}}
LOOPS = ("looped", "unrolled")


def child(variant: str, loop: str, args) -> dict:
    """One variant timed in this process."""
    import jax
    import numpy as np

    from jaxdecode.bench import loop_mode, time_engine
    from jaxdecode.cost import step_weight_bytes
    from jaxdecode.decode import Engine
    from jaxdecode.loading import load_model

    load_before = os.getloadavg()[0]
    model = load_model(**VARIANTS[variant]).model
    engine = Engine(model, loop_layers=loop == "looped")
    prompts = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (1, args.prompt_len))
    runs = [time_engine(engine, prompts, context=0, steps=args.steps)]  # the first compiles
    cpu, wall = time.process_time(), time.perf_counter()
    runs += [time_engine(engine, prompts, context=0, steps=args.steps) for _ in range(args.repeats - 1)]
    cpu_share = (time.process_time() - cpu) / (time.perf_counter() - wall)
    return dict(
        variant=variant,
        loop_mode=loop_mode(engine),
        tok_s=[round(r.steps / r.decode_s, 2) for r in runs],
        first_call_s=round(runs[0].first_call_s, 2),
        weight_bytes=step_weight_bytes(model),
        tokens=runs[-1].tokens[0].tolist(),
        cpu_share=round(cpu_share, 2),
        load_before=load_before,
        load_after=os.getloadavg()[0],
        backend=jax.default_backend(),
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of one process per variant")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per process")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--child", nargs=2, metavar=("VARIANT", "LOOP"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, args)))
        return 0

    from jaxdecode.bench import read_ceiling_gb_s

    ceiling = read_ceiling_gb_s(gib=1)
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            for loop in LOOPS:
                cmd = [sys.executable, __file__, "--child", variant, loop, "--repeats", str(args.repeats)]
                cmd += ["--steps", str(args.steps), "--prompt-len", str(args.prompt_len)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                runs.setdefault((variant, loop), []).append(json.loads(out.strip().splitlines()[-1]))
    reference = runs[("float32", "looped")][0]["tokens"]
    rows = []
    for (variant, loop), rs in runs.items():
        tok_s = statistics.median(t for r in rs for t in r["tok_s"])
        f32 = statistics.median(t for r in runs[("float32", loop)] for t in r["tok_s"])
        gb_s = rs[0]["weight_bytes"] * tok_s / 1e9
        rows.append(
            dict(
                variant=variant,
                loop_mode=rs[0]["loop_mode"],
                tok_s=round(tok_s, 1),
                tok_s_max=max(t for r in rs for t in r["tok_s"]),
                vs_float32=round(tok_s / f32, 2),
                weight_mb=round(rs[0]["weight_bytes"] / 1e6, 1),
                gb_s=round(gb_s, 2),
                pct_ceiling=round(100 * gb_s / ceiling, 1),
                greedy_equal=all(r["tokens"] == reference for r in rs),
                runs=[r["tok_s"] for r in rs],
                load=[(r["load_before"], r["load_after"]) for r in rs],
                cpu_share=[r["cpu_share"] for r in rs],
            )
        )
    hardware = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    print(f"\n{hardware}, read ceiling {ceiling:.1f} GB/s, {args.steps} steps", file=sys.stderr)
    print(
        f"{'weights':10} {'loop':9} {'tok/s':>6} {'max':>6} {'vs f32':>6} {'MB':>6} {'GB/s':>6} {'%ceil':>6} "
        f"{'cores':>9} greedy=",
        file=sys.stderr,
    )
    for r in rows:
        print(
            f"{r['variant']:10} {r['loop_mode']:9} {r['tok_s']:6.1f} {r['tok_s_max']:6.1f} {r['vs_float32']:6.2f} "
            f"{r['weight_mb']:6.0f} {r['gb_s']:6.2f} {r['pct_ceiling']:6.1f} "
            f"{min(r['cpu_share']):4.2f}-{max(r['cpu_share']):4.2f} {r['greedy_equal']}",
            file=sys.stderr,
        )
    load = [x for r in rows for pair in r["load"] for x in pair]
    summary = dict(
        hardware=hardware,
        read_ceiling_gb_s=round(ceiling, 2),
        load_min_max=[min(load), max(load)],
        best={r["variant"]: max(q["tok_s"] for q in rows if q["variant"] == r["variant"]) for r in rows},
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cpu_quant_bench.jsonl"), "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in [*rows, summary])
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

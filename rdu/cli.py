"""`jaxdecode rdu`: decode time of a preset on modeled SN40L sockets (looped and not) and on a GPU.

    jaxdecode rdu --model llama-3.1-8b --batch 1 --context 4096 --sockets 1,2,4,8,16 --hbm-tb-s 1.8 --gpu h200
    jaxdecode rdu --model llama-3.1-8b --batch 8 --context 1024 --gpus 2 --constants fitted
    jaxdecode rdu --validate --json   # issue #27's targets (value, band, pass), sensitivity, GPU rows
    jaxdecode rdu --model llama-3.1-70b --html report.html --png report.png

The lead wires `add_parser` and `run` into jaxdecode/cli.py. With --json the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys

from rdu.hardware import CONSTANTS, SN40L_HBM_CHOICES


def add_parser(subparsers) -> argparse.ArgumentParser:
    from jaxdecode.config import PRESETS

    p = subparsers.add_parser("rdu", help="model decode on SN40L sockets and a GPU from the traced graph")
    p.add_argument(
        "--model", default="llama-3.1-8b", help=f"preset name, one of {', '.join(PRESETS)} (default %(default)s)"
    )
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (default %(default)s)")
    p.add_argument("--context", type=int, default=4096, help="cached tokens read per step (default %(default)s)")
    p.add_argument("--sockets", default="1,2,4,8,16", help="comma-separated socket counts, 1..16 (default %(default)s)")
    p.add_argument(
        "--hbm-tb-s",
        type=float,
        default=1.8,
        choices=sorted(SN40L_HBM_CHOICES),
        help="SN40L HBM bandwidth per socket in TB/s (published: 1.6, 1.8, 2.0; default %(default)s)",
    )
    p.add_argument(
        "--gpu", default="h200", choices=("h100", "h200"), help="the GPU modeled beside the SN40L (default %(default)s)"
    )
    p.add_argument(
        "--quantize",
        choices=("int8", "int4", "q4_k_m"),  # jaxdecode.kquants.QUANTIZE_CHOICES
        default=None,
        help="weights quantized as `jaxdecode --quantize` stores them (default: dense)",
    )
    p.add_argument("--gpus", type=int, default=1, help="GPUs of one node, tensor parallel, 1..8 (default %(default)s)")
    p.add_argument(
        "--constants",
        default="published",
        choices=CONSTANTS,
        help="free constants: published/assumed (rdu/hardware.py) or fitted (rdu/fitted.json) (default %(default)s)",
    )
    p.add_argument("--validate", action="store_true", help="print the validation table and exit")
    p.add_argument("--json", action="store_true", help="end with one JSON object holding the results")
    p.add_argument("--html", metavar="PATH", help="write a self-contained HTML report (graph, mapping, timeline)")
    p.add_argument("--png", metavar="PATH", help="write a PNG of the timeline and tok/s vs sockets")
    return p


def _fail(msg: str) -> int:
    print(f"jaxdecode rdu: {msg}", file=sys.stderr)
    return 2


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {path} ({len(text.encode()) / 1e6:.2f} MB)")


def run(args) -> int:
    from jaxdecode.config import get_preset
    from rdu.analysis import analyze

    if args.validate:
        from rdu.hardware import load_fitted
        from rdu.targets import evaluate, sensitivity
        from rdu.targets import table as target_table
        from rdu.validate import comparison_table

        constants = "fitted" if args.constants == "published" else args.constants  # the targets: one fitted set
        targets = evaluate(constants)
        sweep = sensitivity(constants)
        text, data = comparison_table()
        print(f"targets of issue #27, {constants} constants (one set for every row):")
        print(target_table(targets))
        print("SN40L-16 Llama-3.1-8B bs1 4K, tok/s as one constant moves (the others held):")
        for r in sweep:
            print(f"  {r['constant']:16s} {r['value']:10.4g}  {r['tok_s']:8.1f} tok/s  {r['vs_dgx']:5.2f}x DGX")
        print(text)
        from rdu.fit.quant import quant_table

        rec = load_fitted()
        print(quant_table(rec))
        if args.json:
            required = [r for r in targets if not r["soft"]]
            print(
                json.dumps(
                    {
                        "constants": constants,
                        "targets": targets,
                        "all_required_pass": all(r["pass"] for r in required),
                        "failing": [r["key"] for r in required if not r["pass"]],
                        "sn40l_fit": {
                            k: rec["sn40l"][k] for k in ("fitted", "fit_rows", "held_out_rows", "leave_one_out")
                        },
                        "sensitivity": sweep,
                        "gpu": data,
                        "gpu_fit_summary": rec["summary"],
                    }
                )
            )
        return 0
    try:
        cfg = get_preset(args.model)
        sockets = [int(s) for s in args.sockets.split(",") if s.strip()]
    except ValueError as e:
        return _fail(str(e))
    if args.batch < 1 or args.context < 1 or not sockets or any(not 1 <= s <= 16 for s in sockets):
        return _fail("need --batch >= 1, --context >= 1 and socket counts in 1..16")
    n_gpus = getattr(args, "gpus", 1)
    if not 1 <= n_gpus <= 8:
        return _fail(f"--gpus must be in 1..8 (one node), got {n_gpus}")
    a = analyze(
        cfg,
        args.batch,
        args.context,
        sockets,
        hbm_tb_s=args.hbm_tb_s,
        gpu_name=args.gpu,
        constants=getattr(args, "constants", "published"),
        n_gpus=n_gpus,
        quantize=getattr(args, "quantize", None),
    )
    if not a.fitting:  # no socket count asked for holds the model: say why (the first reason), exit 2
        return _fail(a.runs[0].reason)
    for line in a.lines:
        print(line)
    if getattr(args, "html", None):
        from rdu.viz import render_html

        _write(args.html, render_html(a))
    if getattr(args, "png", None):
        from rdu.plots import report_png

        report_png(a, args.png)
        print(f"wrote {args.png}")
    result = a.result
    if args.json:
        print(json.dumps(result))
    return 0

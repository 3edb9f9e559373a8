"""`jaxdecode rdu`: decode time of a preset on modeled SN40L sockets (looped and not) and on a GPU.

    jaxdecode rdu --model llama-3.1-8b --batch 1 --context 4096 --sockets 1,2,4,8,16 --hbm-tb-s 1.8 --gpu h200
    jaxdecode rdu --validate          # the published / measured numbers vs the model

The lead wires `add_parser` and `run` into jaxdecode/cli.py. With --json the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys

from rdu.hardware import SN40L_HBM_CHOICES


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("rdu", help="model decode on SN40L sockets and a GPU from the traced graph")
    p.add_argument("--model", default="llama-3.1-8b", help="preset name")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=4096, help="cached tokens read per step")
    p.add_argument("--sockets", default="1,2,4,8,16", help="comma-separated socket counts (1..16)")
    p.add_argument("--hbm-tb-s", type=float, default=1.8, choices=sorted(SN40L_HBM_CHOICES),
                   help="SN40L HBM bandwidth per socket (published: 1.6, 1.8, 2.0)")
    p.add_argument("--gpu", default="h200", choices=("h100", "h200"))
    p.add_argument("--validate", action="store_true", help="print the validation table and exit")
    p.add_argument("--json", action="store_true")
    return p


def _fail(msg: str) -> int:
    print(f"jaxdecode rdu: {msg}", file=sys.stderr)
    return 2


def run(args) -> int:
    from jaxdecode.config import get_preset
    from rdu.hardware import gpu, sn40l
    from rdu.mapping import ModelDoesNotFit, map_decode
    from rdu.simulate import gpu_estimate, simulate_rdu
    from rdu.trace import trace_decode_step

    if args.validate:
        from rdu.validate import mape, rows, table

        rs = rows()
        print(table(rs))
        if args.json:
            print(json.dumps({"rows": [dict(vars(r), delta_pct=r.delta_pct, within=r.within) for r in rs],
                              "mape": mape(rs)}))
        return 0
    try:
        cfg = get_preset(args.model)
        sockets = [int(s) for s in args.sockets.split(",") if s.strip()]
    except ValueError as e:
        return _fail(str(e))
    if args.batch < 1 or args.context < 1 or not sockets or any(not 1 <= s <= 16 for s in sockets):
        return _fail("need --batch >= 1, --context >= 1 and socket counts in 1..16")
    hw = sn40l(args.hbm_tb_s)
    graph = trace_decode_step(cfg, args.batch, args.context)
    result = {"model": cfg.name, "batch": args.batch, "context": args.context, "hardware": hw.name,
              "gflop_per_step": graph.total_flops() / 1e9, "gb_per_step": graph.fused_bytes / 1e9, "sn40l": []}
    print(f"{cfg.name} B={args.batch} S={args.context}: {graph.total_flops() / 1e9:.2f} GFLOP, "
          f"{graph.fused_bytes / 1e9:.2f} GB per step; {hw.name}")
    for p in sockets:
        try:
            m = map_decode(graph, hw, p, batch=args.batch, kv_heads=cfg.n_kv_heads, dim=cfg.dim)
        except ModelDoesNotFit as e:
            print(f"  {p:2d} sockets: does not fit: {e}")
            result["sn40l"].append({"sockets": p, "fits": False, "reason": str(e)})
            continue
        on, off = simulate_rdu(m, looped=True), simulate_rdu(m, looped=False)
        print(f"  {p:2d} sockets: looped {on.ms_per_token:8.3f} ms ({on.tok_s:8.1f} tok/s, "
              f"{100 * on.fraction_of_roofline:4.1f}% of roofline, {on.calls_per_token} calls)  "
              f"unlooped {off.ms_per_token:8.3f} ms ({off.calls_per_token} calls)  "
              f"KL {off.per_token_s / on.per_token_s:.2f}x")
        result["sn40l"].append({"sockets": p, "fits": True, "looped": on.as_dict(), "unlooped": off.as_dict(),
                                "kl_speedup": off.per_token_s / on.per_token_s})
    spec = gpu(args.gpu)
    unrolled = trace_decode_step(cfg, args.batch, args.context, looped=False)
    result["gpu"] = {}
    for mode in ("xla", "scan_copy", "eager"):
        e = gpu_estimate(unrolled, spec, batch=args.batch, dim=cfg.dim, kv_heads=cfg.n_kv_heads, mode=mode)
        note = "" if graph.fused_bytes <= spec.hbm_bytes else f"  (does not fit {spec.hbm_bytes / 1e9:.0f} GB HBM)"
        print(f"  {spec.name} {mode:9s}: {e.ms_per_token:8.3f} ms ({e.tok_s:8.1f} tok/s, {e.calls_per_token} "
              f"kernels){note}")
        result["gpu"][mode] = e.as_dict()
    if args.json:
        print(json.dumps(result))
    return 0

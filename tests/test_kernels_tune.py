"""kernels/tune.py: inflection points from synthetic timings (computed by hand), the table it
writes, dispatch following that table, and the command line's refusals."""

import argparse
import math

from kernels import dispatch, tune

MS = (1, 2, 4, 8, 16, 32, 64, 128)
MOSAIC = {1: 12.0, 2: 12.0, 4: 12.0, 8: 12.0, 16: 13.0, 32: 16.0, 64: 24.0, 128: 40.0}
XLA = {1: 20.0, 2: 20.0, 4: 19.0, 8: 18.0, 16: 17.0, 32: 16.5, 64: 22.0, 128: 30.0}


def _timings(**over):
    t = dict(gemv={1: 10.0}, mosaic=dict(MOSAIC), triton={m: 1.02 * v for m, v in MOSAIC.items()}, xla=dict(XLA))
    t.update(over)
    return t


def test_three_ranges():
    # M=1: gemv 10 < mosaic 12, XLA 20: gemv. M=2: no gemv above M=1 → M1 = 2. XLA first beats
    # mosaic by > 5% at M=64 (22 < 0.95·24 = 22.8; at M=32, 16.5 > 16): M2 = 64.
    assert tune.inflection_points(_timings(), MS) == dict(m1=2, m2=64, flat_impl="mosaic")


def test_margin_decides_near_ties():
    xla = {**XLA, 32: 15.5}  # 15.5 vs mosaic 16: 3% faster, inside the 5% band
    assert tune.inflection_points(_timings(xla=xla), MS)["m2"] == 64
    assert tune.inflection_points(_timings(xla=xla), MS, margin=0.0)["m2"] == 32


def test_flat_beats_gemv_at_m1():
    # mosaic 9 < 0.95·10 at M=1 → M1 = 1.
    got = tune.inflection_points(_timings(mosaic={**MOSAIC, 1: 9.0}), MS)
    assert got == dict(m1=1, m2=64, flat_impl="mosaic")


def test_xla_wins_from_m1_as_on_the_h200():
    # XLA 8 beats gemv 10 at M=1 (as measured on the H200 for single calls): M1 = M2 = 1.
    assert tune.inflection_points(_timings(xla={**XLA, 1: 8.0}), MS) == dict(m1=1, m2=1, flat_impl="mosaic")


def test_xla_never_wins():
    got = tune.inflection_points(_timings(xla={m: 100.0 for m in MS}), MS)
    assert got == dict(m1=2, m2=None, flat_impl="mosaic")


def test_flat_impl_needs_a_clear_win():
    # triton 10% faster at every M (geomean ratio 0.9 < 0.95) → triton; 3% faster → mosaic stays.
    fast = {m: 0.9 * v for m, v in MOSAIC.items()}
    assert tune.pick_flat_impl(_timings(triton=fast)) == "triton"
    assert tune.pick_flat_impl(_timings(triton={m: 0.97 * v for m, v in MOSAIC.items()})) == "mosaic"
    assert tune.pick_flat_impl(dict(xla=XLA)) == "mosaic"  # nothing tiled: the walk gives XLA
    assert tune.inflection_points(dict(xla=XLA), MS)["m2"] == 1


def test_attention_pick():
    t = {"async": {"a": 10.0, "b": 20.0}, "sync": {"a": 9.8, "b": 19.6}, "xla": {"a": 30.0, "b": 40.0}}
    assert tune.pick_attention(t) == "async"  # sync only 2% faster
    t["sync"] = {"a": 8.0, "b": 16.0}
    assert tune.pick_attention(t) == "sync"


def test_profile_then_dispatch_uses_the_table():
    """A fake timer: profile_gemm asks only for runnable (impl, M); dispatch follows the table."""
    shapes = [tune.TuneShape("o", 4096, 4096, "plain"), tune.TuneShape("o", 4096, 4096, "looped", 4)]
    asked = []

    def timer(s, impl, m):
        asked.append((s.form, impl, m))
        if not tune.runnable(impl, m, s.n, s.k):
            return None
        t = _timings(xla={mm: 100.0 for mm in MS}) if s.form == "looped" else _timings()
        return t.get(impl, {}).get(m)

    gemm = tune.profile_gemm(shapes, timer, MS, log=lambda *a: None)
    assert "gemv" in gemm[shapes[0]] and list(gemm[shapes[0]]["gemv"]) == [1]
    assert len(asked) == 2 * len(MS) * len(dispatch.GEMM_IMPLS)
    table = dispatch.parse_table(tune.build_table("NVIDIA H200", "test", gemm, MS))
    plain = [dispatch.choose_gemm(m, 4096, 4096, table=table).impl for m in (1, 2, 63, 64, 128)]
    assert plain == ["gemv", "mosaic", "mosaic", "xla", "xla"]
    looped = [dispatch.choose_gemm(m, 4096, 4096, looped=True, table=table).impl for m in (1, 2, 128, 256, 257)]
    assert looped == ["mosaic", "mosaic", "mosaic", "mosaic", "xla"]  # the loop takes no (Pallas-Triton) GEMV
    reason = dispatch.choose_gemm(64, 4096, 4096, table=table).reason
    assert "M2=64" in reason and "[N, K]=[4096, 4096]" in reason


def test_decode_shapes_are_the_papers_four():
    shapes = tune.decode_gemm_shapes()
    assert [(s.n, s.k) for s in shapes if s.form == "plain"] == [
        (6144, 4096),
        (4096, 4096),
        (28672, 4096),
        (4096, 14336),
    ]
    assert {s.form for s in shapes} == {"plain", "looped"}
    assert all(s.layers > 1 for s in shapes if s.form == "looped")


def _args(**kw):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd")
    tune.add_parser(sub)
    return parser.parse_args(["tune", *[a for k, v in kw.items() for a in (f"--{k}", str(v))]])


def test_cli_refuses_cpu_and_bad_values(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert tune.run(_args(out=out), log=lambda *a: None) == 2
    assert "needs a GPU" in capsys.readouterr().err
    args = _args(out=out, ms="1,x")
    args.smoke = True
    assert tune.run(args, log=lambda *a: None) == 2
    assert "bad --ms" in capsys.readouterr().err
    assert not out.exists()
    assert math.isclose(tune.MARGIN, 0.05)

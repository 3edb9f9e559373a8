"""benchmarks/kernel_timeline's reading of Mosaic GPU's in-kernel trace, on a trace written by hand in the
profiler's format: per warpgroup track (tid = 1 + warpgroup + warpgroups · CTA), "B"/"E" events whose ts is
(the CTA's global-timer start in ns + SM cycles since its first event) / 1e3."""

from __future__ import annotations

import json

import pytest

from benchmarks import kernel_timeline as kt

GHZ = 2.0  # cycles per ns: 1000 cycles are 500 ns
COMPUTE_WGS = 2  # and one memory warpgroup: 3 tracks a CTA


def _track(cta: int, wg: int, start_ns: float, regions) -> list[dict]:
    """regions: (name, begin cycle, end cycle), nested ones listed after their parent, in time order."""
    marks = []  # at one cycle: exits first (the inner one first), then entries (the outer one first)
    for i, (name, b, e) in enumerate(regions):
        marks += [(b, (1, i), "B", name), (e, (0, -i), "E", name)]
    marks.sort(key=lambda m: (m[0], m[1]))
    tid = 1 + wg + (COMPUTE_WGS + 1) * cta
    return [{"name": n, "ph": ph, "ts": (start_ns + c) / 1e3, "pid": 1 + cta, "tid": tid} for c, _, ph, n in marks]


COMPUTE = [  # two units: the first waits 1000 cycles for its stage, the second 200; then the tile's flush
    ("unit", 0, 2000),
    ("wait_stage", 0, 1000),
    ("unit", 2000, 3000),
    ("wait_stage", 2000, 2200),
    ("flush", 3000, 3400),
]
MEMORY = [("issue_first", 0, 200), ("wait_free", 200, 1200)]


@pytest.fixture
def trace(tmp_path):
    events = []
    for cta, start in ((0, 1_000_000.0), (1, 1_000_500.0)):  # CTA 1 starts 500 ns later
        for wg in range(COMPUTE_WGS):
            events += _track(cta, wg, start, COMPUTE)
        events += _track(cta, COMPUTE_WGS, start, MEMORY)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"displayTimeUnit": "ns", "traceEvents": events}))
    return str(path)


def test_regions_in_ns_from_each_ctas_start(trace):
    ctas = kt.read_trace(trace, COMPUTE_WGS, GHZ)
    assert [c["cta"] for c in ctas] == [0, 1]
    assert ctas[1]["start"] - ctas[0]["start"] == pytest.approx(500.0)
    regions = dict(((n, a), b) for n, a, b in ctas[1]["wgs"][0])  # (name, entry ns) -> exit ns
    assert regions[("wait_stage", 0.0)] == pytest.approx(500.0)
    assert regions[("unit", 1000.0)] == pytest.approx(1500.0)
    assert regions[("flush", 1500.0)] == pytest.approx(1700.0)
    assert sorted(ctas[1]["wgs"][COMPUTE_WGS]) == [("issue_first", 0.0, 100.0), ("wait_free", 100.0, 600.0)]


def test_summary_by_hand(trace):
    s = kt.summarize(kt.read_trace(trace, COMPUTE_WGS, GHZ), COMPUTE_WGS)
    med, top = s["median"], s["max"]
    assert s["ctas"] == 2 and top["start"] == pytest.approx(500.0) and s["last_end"] == pytest.approx(2200.0)
    assert med["span"] == pytest.approx(1700.0)  # flush ends at 3400 cycles
    assert med["first_stage"] == pytest.approx(500.0)  # the first wait_stage's exit
    assert med["units"] == 2
    assert med["unit"] == pytest.approx(1500.0 - 600.0)  # units' time less all their stage waits
    assert med["wait_stage"] == pytest.approx(100.0)  # the waits after the first stage landed
    assert med["flush"] == pytest.approx(200.0) and med["drain"] == 0.0 and med["round_x"] == 0.0
    assert med["issue_first"] == pytest.approx(100.0) and med["wait_free"] == pytest.approx(500.0)

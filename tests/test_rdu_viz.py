"""rdu.viz / rdu.plots / rdu.analysis: the report's numbers are the CLI's numbers, its size stays small
for 80 layers, the drawings account for every unit and every second, and the PNGs are real images."""

import argparse
import io
import json
import re
from contextlib import redirect_stdout
from html.parser import HTMLParser

import numpy as np
import pytest

from jaxdecode.config import get_preset
from rdu.analysis import analyze, mean_hbm, timeline
from rdu.cli import add_parser, run
from rdu.viz import render_html, report_html
from rdu.viz_chip import CELL, grid_svg

ARGS_70B = ["--model", "llama-3.1-70b", "--batch", "1", "--context", "4096", "--sockets", "1,2,4,8,16"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_cli(argv: list[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd"))
    out = io.StringIO()
    with redirect_stdout(out):
        rc = run(parser.parse_args(["rdu", *argv]))
    return rc, out.getvalue()


class Cells(HTMLParser):
    """Elements carrying data-key: (key, data-value, visible text); and the rdu-data JSON block."""

    def __init__(self):
        super().__init__()
        self.cells, self.data, self._open, self._in_data = [], None, None, False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "data-key" in a:
            self._open = [a["data-key"], a["data-value"], ""]
        if tag == "script" and a.get("id") == "rdu-data":
            self._in_data = True

    def handle_data(self, data):
        if self._open is not None:
            self._open[2] += data
        if self._in_data:
            self.data = (self.data or "") + data

    def handle_endtag(self, tag):
        if self._open is not None and tag in ("td", "span"):
            self.cells.append(tuple(self._open))
            self._open = None
        if tag == "script":
            self._in_data = False


def lookup(obj, key: str):
    for part in key.split("."):
        obj = obj[int(part)] if isinstance(obj, list) else obj[part]
    return obj


@pytest.fixture(scope="module")
def cli_70b(tmp_path_factory):
    d = tmp_path_factory.mktemp("rdu70b")
    html_path, png_path = d / "report.html", d / "report.png"
    rc, out = run_cli([*ARGS_70B, "--json", "--html", str(html_path), "--png", str(png_path)])
    assert rc == 0
    return json.loads(out.strip().splitlines()[-1]), html_path.read_text(encoding="utf-8"), png_path


def test_page_numbers_equal_cli_json(cli_70b):
    result, page, _ = cli_70b
    p = Cells()
    p.feed(page)
    assert json.loads(p.data) == result  # the embedded block is the --json object, exactly
    keys = {k for k, _, _ in p.cells}
    fitting = [i for i, r in enumerate(result["sn40l"]) if r["fits"]]
    assert [r["sockets"] for r in result["sn40l"] if r["fits"]] == [4, 8, 16]  # 70B needs 4 x 64 GiB
    for i in fitting:
        for mode in ("looped", "unlooped"):
            assert f"sn40l.{i}.{mode}.tok_s" in keys and f"sn40l.{i}.{mode}.fraction_of_roofline" in keys
        assert f"sn40l.{i}.kl_speedup" in keys
    assert {"gpu.xla.tok_s", "gpu.eager.tok_s", "gpu.scan_copy.tok_s", "gflop_per_step"} <= keys
    for key, value, text in p.cells:
        want = lookup(result, key)
        assert float(value) == want, key  # exact value carried by the cell
        shown = float(re.sub(r"[^0-9.eE+-]", "", text))
        if key.endswith("fraction_of_roofline"):
            shown /= 100
        # the visible text is the value rounded to its display precision
        assert shown == pytest.approx(want, rel=1e-2, abs=6e-4), (key, text, want)
    # rows that do not fit say so, with the reason
    assert page.count('class="nofit"') == 2 and "exceeds HBM" in page


def test_python_api_gives_the_same_numbers(cli_70b):
    result, _, _ = cli_70b
    page = report_html("llama-3.1-70b", 1, 4096, (1, 2, 4, 8, 16))
    p = Cells()
    p.feed(page)
    assert json.loads(p.data) == result


def test_70b_page_is_small_and_layers_are_folded(cli_70b):
    result, page, _ = cli_70b
    assert len(page.encode()) < 5e6
    assert "<script src" not in page and "<link" not in page and "http://" not in page and "https://" not in page
    # one layer body per trace (looped + unrolled), not 80 of them
    n_ops = page.count('<g class="op')
    layer = get_preset("llama-3.1-70b")
    assert 150 < n_ops < 400, n_ops
    assert "scan ×80" in page and "decoder_layer_call ×80" in page and layer.n_layers == 80
    assert page.count('<details class="loop"') == 1 and page.count('<details class="repeat"') == 1


def test_png_is_a_real_image(cli_70b):
    import matplotlib.image as mpimg

    _, _, png = cli_70b
    raw = png.read_bytes()
    assert raw[:8] == PNG_MAGIC and len(raw) > 20_000
    img = mpimg.imread(png)
    assert img.shape[0] > 400 and img.shape[1] > 600
    colors = np.unique((img[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colors) > 50  # bars, lines, text: not a blank canvas


def test_plots_api_writes_pngs(tmp_path):
    from rdu.plots import scaling_png, timeline_png

    a = analyze(get_preset("tiny-gqa"), 2, 32, [1, 2])
    timeline_png(a, tmp_path / "t.png", sockets=1)
    scaling_png(a, tmp_path / "s.png")
    for f in ("t.png", "s.png"):
        raw = (tmp_path / f).read_bytes()
        assert raw[:8] == PNG_MAGIC and len(raw) > 10_000
    with pytest.raises(ValueError, match="no fitting run on 4 sockets"):
        timeline_png(a, tmp_path / "x.png", sockets=4)


@pytest.fixture(scope="module")
def tiny():
    return analyze(get_preset("tiny-gqa"), 2, 32, [1, 2])


def test_timeline_accounts_for_every_second(tiny):
    for r in tiny.fitting:
        for est in (r.looped, r.unlooped):
            segs = timeline(r.mapping, est)
            assert segs[0].start_s == 0 and segs[-1].end_s == pytest.approx(est.per_token_s, rel=1e-12)
            assert all(a.end_s == b.start_s for a, b in zip(segs, segs[1:]))
            assert all(0 <= s.hbm <= r.mapping.hw.hbm_efficiency + 1e-9 for s in segs)
        on, off = timeline(r.mapping, r.looped), timeline(r.mapping, r.unlooped)
        layers = tiny.cfg.n_layers
        dips = lambda segs: sum(1 for s in segs if s.role == "decoder" and s.phase == "boundary")  # noqa: E731
        assert dips(on) == 1 and dips(off) == layers  # looping removes the dips at layer boundaries
        assert mean_hbm(on) >= mean_hbm(off)


def test_grid_colors_exactly_the_allocated_units(tiny):
    r = tiny.fitting[0]
    for name, alloc in r.mapping.allocations.items():
        svg = grid_svg(alloc, r.mapping, "t")
        pcu = pmu = 0
        for g in re.findall(r'<g class="stage">(.*?)</g>', svg):
            for y, w in re.findall(r'<rect x="\d+" y="(\d+)" width="(\d+)"', g):
                if int(y) // CELL % 2:
                    pmu += int(w) // CELL
                else:
                    pcu += int(w) // CELL
        assert (pcu, pmu) == (alloc.pcus, alloc.pmus), name
        assert pcu <= r.mapping.hw.pcus and pmu <= r.mapping.hw.pmus


def test_report_when_nothing_fits():
    a = analyze(get_preset("llama-3.1-70b"), 1, 4096, [1])
    page = render_html(a)
    assert "does not fit" in page and "no mapping to draw" in page and "Nothing fits" in page

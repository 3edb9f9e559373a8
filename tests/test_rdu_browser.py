"""The HTML report in a real browser (Debian's Chromium driven by Playwright): the graph, the tile and
the timeline render, no console errors, expanding the looped layer shows its ops, switching the overlay
recolors the nodes, and the 70B page loads in under 2 s."""

import os
import re
import time

import pytest

from jaxdecode.config import get_preset
from rdu.analysis import analyze
from rdu.viz import render_html

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

pytestmark = pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} missing: run .ci/install-browser.sh (apt-get install chromium)"
)

VISIBLE_OPS = "Array.from(document.querySelectorAll('g.op')).filter(e => e.checkVisibility()).length"


@pytest.fixture(scope="module")
def page_70b(tmp_path_factory):
    a = analyze(get_preset("llama-3.1-70b"), 1, 4096, [1, 2, 4, 8, 16])
    path = tmp_path_factory.mktemp("browser") / "report.html"
    path.write_text(render_html(a), encoding="utf-8")
    return path, a


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def open_page(browser, path):
    page = browser.new_page(viewport={"width": 1300, "height": 1000})
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    t0 = time.perf_counter()
    page.goto(path.as_uri(), wait_until="load")
    return page, errors, time.perf_counter() - t0


def test_70b_report_renders_and_expands(browser, page_70b, tmp_path):
    path, a = page_70b
    page, errors, wall_s = open_page(browser, path)
    load_ms = page.evaluate("performance.getEntriesByType('navigation')[0].loadEventEnd")
    assert load_ms < 2000 and wall_s < 2.0, (load_ms, wall_s)

    # graph: the top-level ops are drawn; the looped kernel is collapsed
    assert page.locator("#graph svg.strip").count() > 10
    before = page.evaluate(VISIBLE_OPS)
    assert 10 < before < 60
    loop = page.locator("details.loop").first
    assert "scan ×80" in loop.locator(":scope > summary").inner_text() and not loop.evaluate("d => d.open")
    loop.locator(":scope > summary").click()
    loop.locator("details.call > summary").first.click()  # the decoder_layer_call body
    visible = "els => els.filter(e => e.checkVisibility()).length"
    # a call's summary reads "<op> <name> <n> ops ...": match the name as a whole word
    call = lambda name: loop.locator("details.call > summary").filter(has_text=re.compile(rf"\b{name}\s"))  # noqa: E731
    call("residual_norm").first.click()  # the attention's residual add and the MLP's norm: a nested call
    reductions = loop.locator("g.op.k-reduction").evaluate_all(visible)
    norms = loop.locator("details.call > summary").filter(has_text="rms_norm")
    assert norms.count() == 2  # the layer's two norms, nested calls, collapsed
    for i in range(2):
        norms.nth(i).click()
    assert loop.locator("g.op.k-reduction").evaluate_all(visible) == reductions + 2  # one mean of squares each
    call("qkv_attend").first.click()  # projections, RoPE and attend: a nested call, collapsed
    after = page.evaluate(VISIBLE_OPS)
    assert after > before + 50  # one layer body: matmuls, attention, mlp, RoPE, the norms' ops
    assert loop.locator("g.op.k-matmul").evaluate_all(visible) == 1  # o; q, k, v in qkv; gate, up, down in mlp
    call("qkv").first.click()  # inside qkv_attend, collapsed
    assert loop.locator("g.op.k-matmul").evaluate_all(visible) == 4  # + q, k, v
    call("mlp").first.click()  # the MLP block: a nested call, collapsed
    assert loop.locator("g.op.k-matmul").evaluate_all(visible) == 5  # + down; gate and up in its swiglu
    loop.locator("details.call > summary").filter(has_text="swiglu").first.click()
    assert loop.locator("g.op.k-matmul").evaluate_all(visible) == 7  # + gate and up

    # tooltips carry shapes and dtypes
    tip = loop.locator("g.op.k-matmul title").first.text_content()
    assert "bfloat16[" in tip and "runs per token: 80" in tip

    # overlay selector recolors nodes
    node = loop.locator("g.op.k-matmul rect").first
    by_time = node.evaluate("r => getComputedStyle(r).fill")
    page.select_option("#overlay", "kind")
    by_kind = node.evaluate("r => getComputedStyle(r).fill")
    assert by_time != by_kind

    # mapping: the default view (decoder kernel on 4 sockets) is visible and colors the allocated units
    view = page.locator(".gridview:not([hidden])")
    assert view.count() == 1 and view.get_attribute("data-s") == "4"
    assert view.locator("svg.tile g.stage rect").count() > 50
    page.select_option("#grid-sockets", "16")
    assert page.locator(".gridview:not([hidden])").get_attribute("data-s") == "16"

    # timeline: one panel per fitting socket count, the unlooped lane has a boundary per layer
    panels = page.locator("svg.timeline")
    assert panels.count() == len(a.fitting) == 3
    assert panels.first.locator("rect.seg").count() > 2 * 80
    assert panels.first.locator("path.bw").count() == 4

    # summary table
    assert page.locator("#summary-sn40l td[data-key$='.looped.tok_s']").count() == 3

    shot = tmp_path / "report.png"
    page.screenshot(path=str(shot), full_page=False)
    assert shot.stat().st_size > 20_000
    assert errors == []
    page.close()

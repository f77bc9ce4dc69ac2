"""memra-obs report pages in a real headless Chromium (Debian's ``chromium``, driven through
Playwright's DevTools connection, none of its own browser builds): no console error, no
request leaving the page, every section present and non-empty, every figure decoded, and a
screenshot that is not blank. Skipped without chromium or playwright, unless
``MEMRA_OBS_REQUIRE_PEERS=1`` (CI), which makes their absence a failure."""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from test_report import demo, report

from memra_obs.report.page import SECTIONS

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip


def _missing(why: str) -> None:
    if os.environ.get("MEMRA_OBS_REQUIRE_PEERS") == "1":
        pytest.fail(f"{why} (MEMRA_OBS_REQUIRE_PEERS=1: the browser tests must run)")
    pytest.skip(why)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory):
    """One Chromium for the module, with its own empty profile."""
    if not os.access(CHROMIUM, os.X_OK):
        _missing("chromium not found (Debian: apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright not installed (pip install -e .[dev])")
    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, args=FLAGS, headless=True,
            viewport={"width": 1280, "height": 900},
        )  # fmt: skip
        yield ctx
        ctx.close()


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Reports of a demo's log, of its span file, and A/B of two demo logs."""
    tmp = tmp_path_factory.mktemp("pages")
    log, spans = demo(tmp, "a", "--requests", "6", "--seed", "21", "--speed", "5")
    log2, _ = demo(tmp, "b", "--requests", "6", "--seed", "22", "--speed", "5")
    out = {"log": tmp / "log.html", "spans": tmp / "spans.html", "ab": tmp / "ab.html"}
    report(log, out=out["log"])
    report(spans, out=out["spans"])
    report(log, log2, out=out["ab"])
    return out


def _open(browser, path: Path) -> tuple[dict, list[str], list[str], bytes]:
    page = browser.new_page()
    errors: list[str] = []
    requests: list[str] = []
    page.on(
        "console", lambda m: errors.append(f"{m.type}: {m.text}") if m.type == "error" else None
    )
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.on("request", lambda r: requests.append(r.url))
    url = path.resolve().as_uri()
    page.goto(url, wait_until="load")
    facts = page.evaluate(
        """() => ({
        sections: Object.fromEntries([...document.querySelectorAll('section')].map(s => [s.id,
            {text: s.innerText.trim().length, figures: s.querySelectorAll('img, table').length}])),
        broken: [...document.images].filter(i => !i.complete || i.naturalWidth === 0).map(i => i.alt),
        images: document.images.length,
    })"""
    )
    shot = page.screenshot(full_page=True)
    page.close()
    return facts, errors, [u for u in requests if u != url], shot


def _not_blank(png: bytes) -> None:
    import matplotlib.image as mpimg

    px = mpimg.imread(io.BytesIO(png))[..., :3]
    assert px.shape[0] > 1500 and px.shape[1] >= 1200
    assert px.std() > 0.05  # not one flat colour
    assert (px.min(axis=2) < 0.9).mean() > 0.02  # ink on more than 2% of the page


@pytest.mark.parametrize("which", ["log", "spans", "ab"])
def test_report_renders_in_headless_chromium(browser, pages, which):
    """No console error, no request but the page itself, every section there with content,
    every figure decoded, a non-blank screenshot."""
    facts, errors, requests, shot = _open(browser, pages[which])
    assert errors == []
    assert requests == []
    want = [s for s in SECTIONS if s != "ab" or which == "ab"]
    assert list(facts["sections"]) == want
    for sid, s in facts["sections"].items():  # the last two are prose when all went well
        assert s["text"] > 40 and (s["figures"] > 0 or sid in ("refused", "notes")), sid
    assert facts["broken"] == [] and facts["images"] >= 11
    assert facts["sections"]["acceptance"]["figures"] >= 5  # 3 figures, the estimates' tables
    _not_blank(shot)
    (pages[which].parent / f"{which}.png").write_bytes(shot)


def test_a_printed_page_keeps_every_column_and_its_colours(browser, pages):
    """Printed (A4's 720 CSS px), no table is cut at the page's edge (the summaries' 18 columns
    scrolled: on paper, the slow-round columns were gone), and the red and green marks print
    (browsers leave backgrounds out unless the page asks)."""
    page = browser.new_page()
    page.goto(pages["ab"].resolve().as_uri(), wait_until="load")
    page.emulate_media(media="print")
    page.set_viewport_size({"width": 720, "height": 1000})
    cut = page.evaluate("""() => [...document.querySelectorAll('table')].map(t => [
        t.closest('section').id, t.getBoundingClientRect().right]).filter(x => x[1] > 721)""")
    adjust = page.evaluate("getComputedStyle(document.querySelector('td')).printColorAdjust")
    page.close()
    assert cut == [] and adjust == "exact"


def test_a_screen_reader_hears_each_numbers_row_and_column(browser, pages):
    """Each number of the totals and the A/B tables has a row header (a screen reader read
    "A: a.log, 467", not which quantity), and the A/B's differences say their unit."""
    page = browser.new_page()
    page.goto(pages["ab"].resolve().as_uri(), wait_until="load")
    assert page.locator("#totals").get_by_role("rowheader", name="rounds", exact=True).count() == 1
    assert page.locator("#ab").get_by_role("rowheader", name="verify", exact=True).count() == 1
    assert page.locator("#ab").get_by_role("columnheader", name="B - A, ms").count() == 1
    page.close()

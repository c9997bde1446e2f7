"""The built site in headless Chromium at 1440x900: a click on any figure (a page's file or a
notebook's inline image) shows it at full size, and a code block or table wider than its column
scrolls (its overflow is auto, so the rest is reachable, never cut off)."""
from __future__ import annotations

import functools
import http.server
import os
import threading
from pathlib import Path

import pytest

CHROMIUM = Path(os.environ.get("QSA_LAB_CHROMIUM", "/usr/bin/chromium"))
PAGES = ["", "tutorial/01_e4m3_and_the_null_block/", "tutorial/07_scribble_an_engine/", "canary/", "performance/"]

#: every element of the article wider inside than its box, and how its overflow is handled
OVERFLOWING = """() => [...document.querySelectorAll(`article pre, article pre > code, article table,
    article .md-typeset__scrollwrap, article .highlight-ipynb, article .jp-OutputArea-output`)]
  .filter(e => e.scrollWidth > e.clientWidth + 2 && e.clientWidth > 0)
  .map(e => ({what: e.tagName + ' ' + e.className, overflow: getComputedStyle(e).overflowX,
              clipped_by: (() => { for (let p = e; p; p = p.parentElement)
                                     if (p !== e && p.scrollWidth > p.clientWidth + 2 &&
                                         /(auto|scroll)/.test(getComputedStyle(p).overflowX)) return 'scroll';
                                   return 'none'; })()}))"""


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def browser_page(built_site):
    assert built_site["returncode"] == 0, built_site["stderr"]
    sync_api = pytest.importorskip("playwright.sync_api", reason="the e2e dependency group is not installed")
    if not CHROMIUM.exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (scripts/setup_e2e.sh installs it)")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(_Quiet, directory=built_site["site"]))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox", "--headless"])
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            yield page, f"http://127.0.0.1:{server.server_address[1]}/"
        finally:
            browser.close()
            server.shutdown()
            server.server_close()


@pytest.mark.docs
@pytest.mark.e2e
def test_a_figure_enlarges_and_wide_code_scrolls(browser_page):
    page, base = browser_page
    figures = 0
    for url in PAGES:
        page.goto(base + url, wait_until="load")
        name = url or "the home page"
        page.wait_for_function("() => [...document.querySelectorAll('article img')].every(i => i.complete)")
        images = page.locator("article img")
        for i in range(images.count()):
            img = images.nth(i)
            natural, shown = img.evaluate("i => [i.naturalWidth, i.getBoundingClientRect().width]")
            if natural < 100:
                continue                                 # an icon, not a figure
            figures += 1
            img.scroll_into_view_if_needed()
            img.click()
            box = page.locator(".qsa-lightbox img")
            assert box.count() == 1, f"{name}: a click on figure {i} opens nothing"
            width = box.evaluate("i => i.getBoundingClientRect().width")
            assert abs(width - natural) <= 1, f"{name}: figure {i} opens {width:.0f} px wide, its full size is {natural}"
            page.keyboard.press("Escape")
            assert page.locator(".qsa-lightbox").count() == 0, f"{name}: Escape leaves the figure open"
        cut = [e for e in page.evaluate(OVERFLOWING) if e["overflow"] not in ("auto", "scroll") and e["clipped_by"] != "scroll"]
        assert not cut, f"{name}: wider than the column and not scrolling: {cut}"
    assert figures >= 5, f"only {figures} figures on {PAGES}"

"""The poison playground as a user sees it: JupyterLab in headless Chromium.

Headless execution (nbclient) cannot see a widget front-end that fails to
render, a figure that never appears or an Export button that does nothing.
This test opens notebooks/03_poison_playground.ipynb in a real JupyterLab,
runs all cells from the Run menu, and then works the controls by hand:

  1. every code cell ran, no traceback and no widget error is shown, and the
     playground's controls, NaN-map image and route table are on screen;
  2. site -> none: the image changes and the grouped route shows 0 NaN
     (screenshot playground-before-poison.png);
  3. site -> targeted, then new dims typed: the image changes again and the
     route table's grouped row lists exactly the new dims
     (playground-after-poison.png);
  4. unticking the pad_fix toggle redraws and drops its route from the table
     (playground-after-fix.png);
  5. while a redraw runs the playground shows it (the figure dimmed,
     "computing..." in the message line; the controls stay live), and all of
     it clears once the new figure is there;
  6. a redraw with the notebook scrolled to the figure leaves the scroll
     position and the figure where they were (the image is replaced in place);
  7. dims "999" shows a visible "⚠ dims" message and keeps the figure;
  8. stale-tail is reachable from the controls: a geometry marked "partial
     tail", then site stale-tail, draws NaN on the grouped route;
  9. Export writes PNG, SVG and PDF into $QSA_LAB_FIGURES (the PNG carrying
     the case, backend, dims, git commit and csrc hash in its metadata, and no
     poison seed for a site that ignores it) and names the files in the message
     line;
 10. attended-k: the plane control shows k (the plane applied) and is
     disabled, the route table shows the grouped route finite where the
     reference is NaN (no None anywhere), screenshot playground-attended-k.png;
 11. clicks during a redraw coalesce: five clicks on a fix toggle while a
     slow redraw (a context-8192 preset) runs end with the toggle and the
     route table in the state of the last click, after at most two redraws.
 12. at 1440x900, every fix on, every control, the figure, the status and the
     route table are on screen together (playground-1440x900.png): the table's
     content, a row for every route, fits its box (nothing cut or scrolled
     away), every dropdown option's label fits its dropdown whole, and toggling
     a fix changes neither the table's height nor the figure's place.
 (9 also: the export message is at most two lines at 1600 px: the file stem and
     the folder once each.)

After every step the page is searched for tracebacks and widget errors.
Screenshots go to results/e2e/ (failure-<step>.png too when a step fails).
Fixtures: tests/e2e/conftest.py.
"""

from __future__ import annotations

import hashlib
import re
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from qsa_lab.routes.labels import ROUTES

pytestmark = pytest.mark.e2e

NOTEBOOK = "03_poison_playground.ipynb"

# How the playground's controls are found: by the description a user reads.
# (qsa_lab/widgets.py, class Playground, promises these descriptions.)
SITE_LABEL = re.compile(r"\bsite\b")
DIMS_LABEL = re.compile(r"\bdims\b")
FIX_LABEL = re.compile(r"\bpad_fix\b")
KFIX_LABEL = re.compile(r"\bkernel_fix\b")
KFIX_ROUTE = "grouped+kernel_fix"
PLANE_LABEL = re.compile(r"\bplane\b")
SLOW_PRESET = re.compile(r"19\srows,\sctx\s8192")   # the report's decode-like case: a slow first draw
FIX_ROUTE = "grouped+pad_fix"   # the route table row that the pad_fix toggle adds
UNFIXED_ROUTE = "grouped"       # the route whose NaN dims follow the poisoned dims
EXPORT_LABEL = re.compile(r"\bExport\b")
GEOMETRY_LABEL = re.compile(r"\bgeometry\b")
SEED_LABEL = re.compile(r"\bseed\b")
TAIL_PRESET = re.compile(r"partial\stail")  # ipywidgets shows spaces as no-break spaces  # presets whose geometry has a partial microblock
FIGURE = "img.qsa-figure"      # the playground's figure: an Image widget replaced in place
TABLE = ".qsa-table table"     # the route table (an HTML widget)
MESSAGE = ".qsa-message"       # computing... / ⚠ errors / exported: paths
STATUS = ".qsa-status"         # the case on screen
NEW_DIMS = "5,21,44"  # small enough for every geometry preset's head_dim

RUN_ALL_TIMEOUT_S = 180
WIDGET_TIMEOUT_S = 30
REDRAW_TIMEOUT_S = 30
EXPORT_TIMEOUT_S = 30

# What a broken widget set-up shows in JupyterLab: a model the front-end cannot
# load (e.g. an ipywidgets 7 front-end for an ipywidgets 8 kernel), a view that
# failed, or a Python exception rendered in an output.
ERROR_PATTERNS = [
    re.compile(p) for p in (
        r"Error displaying widget",
        r"Failed to load model",
        r"Failed to create view",
        r"Could not (?:find|create) (?:model|view)",
        r"Traceback \(most recent call last\)",
        r"(?m)^\w*(?:Error|Exception)\s+Traceback",   # IPython's error header
        r"(?m)^(?:\w+\.)*\w*(?:Error|Exception): ",  # the last line of a traceback
    )
]
# What a notebook shows instead of a widget when no widget front-end is loaded.
UNRENDERED_WIDGET = re.compile(r"^(?:VBox|HBox|Tab|Box|GridBox|AppLayout|Output)\(|Loading widget\.\.\.", re.M)


class Failure(AssertionError):
    pass


@contextmanager
def step(name: str, page, results_dir: Path, console: list[str]):
    """Run one step; on failure save a screenshot and say what the page showed."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - re-raised with context
        shot = results_dir / f"failure-{name}.png"
        try:
            page.screenshot(path=str(shot))
        except Exception:  # noqa: BLE001 - a dead page must not hide the real error
            shot = None
        outputs = output_texts(page, limit=3000)
        raise Failure(
            f"e2e step '{name}' failed: {exc}\n"
            f"--- notebook outputs (text) ---\n{outputs or '(none)'}\n"
            f"--- browser console errors ---\n" + ("\n".join(console[-15:]) or "(none)") +
            (f"\n--- screenshot: {shot}" if shot else "")
        ) from None


TOP_OUTPUTS = ".jp-Cell-outputArea > .jp-OutputArea-child > .jp-OutputArea-output"
ALL_OUTPUTS = ".jp-OutputArea-output"  # nested ones too (inside Output widgets)


def outputs(page, selector: str = TOP_OUTPUTS) -> list[str]:
    try:
        texts = page.eval_on_selector_all(selector, "els => els.map(e => e.innerText)")
    except Exception:  # noqa: BLE001 - a dead page must not hide the real error
        return ["(page unavailable)"]
    return [t.strip() for t in texts if t.strip()]


def output_texts(page, limit: int = 100_000) -> str:
    return "\n".join(outputs(page))[:limit]


def assert_no_widget_error(page) -> None:
    """Raise with the offending output if any shows an error; else None."""
    for text in outputs(page, ALL_OUTPUTS):
        for pattern in ERROR_PATTERNS:
            if pattern.search(text):
                lines = text.splitlines()
                last = next((ln for ln in reversed(lines) if ERROR_PATTERNS[-1].search(ln)), "")
                raise AssertionError(
                    f"the notebook shows an error ({pattern.pattern!r})"
                    + (f": {last.strip()}" if last else "") + "\n  output ends:\n    "
                    + "\n    ".join(lines[-12:]))
    broken = page.locator(".jupyter-widgets.jp-mod-error, .widget-error, .jupyter-widgets-error-widget")
    if broken.count():
        raise AssertionError(f"{broken.count()} widget(s) in the error state: "
                             f"{broken.first.inner_text()[:500]!r}")


def wait_until(what: str, predicate, timeout_s: float, interval_s: float = 0.25):
    """Poll predicate() until truthy; raise with `what` and the last value otherwise."""
    deadline = time.monotonic() + timeout_s
    value = None
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"{what}: not within {timeout_s:.0f} s (last seen: {value!r})")


def no_dialog(page) -> bool:
    """False when no dialog is open; raises with its text when one is (fail fast:
    nobody will click it)."""
    dialog = page.locator(".jp-Dialog")
    if dialog.count():
        raise AssertionError(f"JupyterLab opened a dialog: {dialog.first.inner_text()[:500]!r}")
    return False


def kernel_state(server, notebook: str) -> str | None:
    for session in server.api("sessions"):
        if session.get("path", "").endswith(notebook) and session.get("kernel"):
            return session["kernel"].get("execution_state")
    return None


def code_prompts(page) -> list[str]:
    return page.eval_on_selector_all(
        ".jp-CodeCell .jp-InputPrompt", "els => els.map(e => e.textContent.trim())")


def image_signature(root) -> str:
    """A digest of the playground figure's source (a new object URL on every redraw)."""
    srcs = root.locator(FIGURE).evaluate_all("els => els.map(e => e.src)")
    return hashlib.sha256("\n".join(srcs).encode()).hexdigest() if srcs else ""


def route_rows(root) -> dict[str, list[str]]:
    """The route table as {route: [cells...]} (first cell of each body row is the route)."""
    rows = root.locator(TABLE).evaluate_all(
        "ts => ts.flatMap(t => Array.from(t.querySelectorAll('tbody tr')).map("
        "r => Array.from(r.children).map(c => c.innerText.trim())))")
    return {r[0]: r[1:] for r in rows if r}


def labelled(scope, widget_class: str, label: re.Pattern):
    """The ipywidget of class `widget_class` inside `scope` (a page or a locator)
    whose description matches `label`."""
    page = scope if not hasattr(scope, "page") else scope.page
    return scope.locator(f".{widget_class}").filter(
        has=page.locator(".widget-label", has_text=label))


def wait_redraw(root, what: str, previous: str, check) -> tuple[str, dict]:
    """Wait until the figure differs from `previous` and check(route_rows) holds."""
    state = {}

    def done():
        sig, rows = image_signature(root), route_rows(root)
        state.update(sig=sig, rows=rows)
        return bool(sig) and sig != previous and check(rows)

    try:
        wait_until(what, done, REDRAW_TIMEOUT_S)
    except TimeoutError as exc:
        same = "the figure did not change" if state.get("sig") == previous else "the figure changed"
        raise TimeoutError(f"{exc}; {same}; route table: {state.get('rows')}") from None
    return state["sig"], state["rows"]


def nan_dims(rows: dict, route: str) -> str | None:
    """The route's nan_dims cell ('' when none), by the table's column order."""
    row = rows.get(route)
    return None if row is None else row[1].replace(" ", "")


def busy_now(root) -> dict:
    return root.evaluate(BUSY_NOW)


def output_area(root):
    """The playground cell's outputs (controls, figure, table), without its source."""
    area = root.locator(".jp-Cell-outputArea")
    area.scroll_into_view_if_needed()
    return area


def nan_map_shot(root) -> bytes:
    return root.locator(FIGURE).first.screenshot()


# Records, from the moment it is installed, whether the playground ever showed its busy state.
WATCH_BUSY = """root => {
  const pg = root.querySelector('.qsa-playground');
  const seen = {dimmed: false, disabled: false, computing: false};
  const look = () => {
    if (pg.classList.contains('qsa-busy')) seen.dimmed = true;
    if (pg.querySelector('select:disabled, input:disabled')) seen.disabled = true;
    const m = pg.querySelector('.qsa-message');
    if (m && /computing/.test(m.innerText)) seen.computing = true;
  };
  const obs = new MutationObserver(look);
  obs.observe(pg, {subtree: true, attributes: true, childList: true, characterData: true});
  window.__qsaBusy = {seen, stop: () => obs.disconnect()};
}"""
BUSY_NOW = """root => {
  const pg = root.querySelector('.qsa-playground');
  const m = pg.querySelector('.qsa-message');
  return {dimmed: pg.classList.contains('qsa-busy'),
          disabled: pg.querySelectorAll('select:disabled, input:disabled').length,
          computing: !!(m && /computing/.test(m.innerText))};
}"""
# The notebook's scrolling element, and where the figure sits in the window.
SCROLL_STATE = """img => {
  let s = img.parentElement;
  while (s && !(s.scrollHeight > s.clientHeight + 1 && /(auto|scroll)/.test(getComputedStyle(s).overflowY)))
    s = s.parentElement;
  return {scrollTop: s ? s.scrollTop : null, figureTop: img.getBoundingClientRect().top,
          scroller: s ? s.className : null};
}"""
# Scrolls the playground's top to the notebook's top, then measures the notebook's visible part
# and the playground's parts (every control, the figure, the status and the route table).
FITS = """root => {
  const pg = root.querySelector('.qsa-playground');
  let s = pg.parentElement;
  while (s && !(s.scrollHeight > s.clientHeight + 1 && /(auto|scroll)/.test(getComputedStyle(s).overflowY)))
    s = s.parentElement;
  if (!s) return null;
  s.scrollTop += pg.getBoundingClientRect().top - s.getBoundingClientRect().top;
  const box = el => { const r = el.getBoundingClientRect(); return {top: r.top, bottom: r.bottom, height: r.height, width: r.width}; };
  const table = pg.querySelector('.qsa-table');
  const boxes = {figure: box(pg.querySelector('img.qsa-figure')), status: box(pg.querySelector('.qsa-status')),
                 table: box(table)};
  pg.querySelectorAll('select, input, button').forEach((el, i) => { boxes[`control ${i} ${el.closest('.widget-inline-hbox, .widget-checkbox, button')?.innerText?.trim() || el.tagName}`] = box(el); });
  // the table's content: every row (header too) by its first cell, and whether anything overflows the box
  const rows = [...table.querySelectorAll('tr')].map(r => ({name: r.children[0]?.innerText.trim(), ...box(r)}));
  const overflow = {scroll: table.scrollHeight, client: table.clientHeight};
  // every option of every dropdown, measured in the dropdown's own font against the room its box leaves
  const ctx = document.createElement('canvas').getContext('2d');
  const labels = [];
  pg.querySelectorAll('select').forEach(sel => {
    const cs = getComputedStyle(sel);
    ctx.font = `${cs.fontStyle} ${cs.fontWeight} ${cs.fontSize} ${cs.fontFamily}`;
    const room = sel.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight) - 16;   // 16: the arrow
    // (ipywidgets writes an option's spaces as no-break spaces: the label is read back with plain ones)
    [...sel.options].forEach(o => labels.push({label: o.text.replace(/\u00a0/g, ' '), width: ctx.measureText(o.text).width, room}));
  });
  const v = s.getBoundingClientRect();
  return {view: {top: v.top, bottom: Math.min(v.bottom, window.innerHeight)}, boxes, rows, overflow, labels};
}"""
SCROLL_TO_FIGURE = """img => {
  let s = img.parentElement;
  while (s && !(s.scrollHeight > s.clientHeight + 1 && /(auto|scroll)/.test(getComputedStyle(s).overflowY)))
    s = s.parentElement;
  s.scrollTop += img.getBoundingClientRect().top - s.getBoundingClientRect().top - 120;
  return s.scrollTop;
}"""


def test_playground_in_jupyterlab(lab_server, browser_context, results_dir):
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    page = browser_context.new_page()
    console: list[str] = []
    page.on("console", lambda m: console.append(f"{m.type}: {m.text[:300]}")
            if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
    page.set_default_timeout(30_000)

    def mark(name):
        timings[name] = round(time.monotonic() - t0, 1)

    assert (lab_server.root_dir / NOTEBOOK).is_file(), f"{NOTEBOOK} is not in notebooks/"

    with step("open", page, results_dir, console):
        page.goto(lab_server.url(f"lab/tree/{NOTEBOOK}?reset"))
        page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=60_000)
        # Run All only once the server reports the notebook's kernel started and idle.
        wait_until("the notebook's kernel started and idle (GET /api/sessions)",
                   lambda: no_dialog(page) or kernel_state(lab_server, NOTEBOOK) == "idle", 60)
        mark("opened")

    with step("run-all", page, results_dir, console):
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
        n_code = len(code_prompts(page))
        assert n_code, "the notebook shows no code cell"
        # Fail fast on an error output: Run All stops at it and the rest never runs.
        wait_until(f"all {n_code} code cells executed (prompts [n]:)",
                   lambda: no_dialog(page) or assert_no_widget_error(page) or
                   all(re.fullmatch(r"\[\d+\]:", p) for p in code_prompts(page)),
                   RUN_ALL_TIMEOUT_S)
        mark("ran all cells")

    with step("widgets-render", page, results_dir, console):
        assert_no_widget_error(page)
        dims_input = labelled(page, "widget-text", DIMS_LABEL).locator("input")

        def rendered():
            if dims_input.count() and dims_input.first.is_visible():
                return True
            # A widget repr printed as text never turns into a widget: fail now.
            if UNRENDERED_WIDGET.search(output_texts(page)):
                raise AssertionError(
                    "the outputs hold widget reprs (text), not widgets: is the ipywidgets "
                    "front-end (jupyterlab_widgets) installed, enabled and matching ipywidgets?")
            assert_no_widget_error(page)
            return False

        wait_until(f"a text control labelled {DIMS_LABEL.pattern!r} rendered", rendered,
                   WIDGET_TIMEOUT_S)
        assert dims_input.count() == 1, f"{dims_input.count()} dims controls, expected 1"
        # The playground: the cell whose output holds the dims control.
        root = page.locator(".jp-CodeCell").filter(has=dims_input)
        site = labelled(root, "widget-dropdown", SITE_LABEL).locator("select")
        assert site.count() == 1, f"{site.count()} site dropdowns, expected 1"
        wait_until("the NaN-map image drawn in the playground's figure (Image widget)",
                   lambda: image_signature(root), WIDGET_TIMEOUT_S)
        rows = wait_until("a route table shown", lambda: route_rows(root), WIDGET_TIMEOUT_S)
        for route in (UNFIXED_ROUTE, FIX_ROUTE):
            assert route in rows, f"route table lacks {route!r}: {list(rows)}"
        assert_no_widget_error(page)
        sig, shot0 = image_signature(root), nan_map_shot(root)
        mark("widgets rendered")

    with step("unpoison", page, results_dir, console):
        site.select_option("none")
        sig, rows = wait_redraw(root, "the figure redrawn for site 'none' with 0 NaN on grouped",
                                sig, lambda r: r.get(UNFIXED_ROUTE, ["?"])[0] == "0")
        assert_no_widget_error(page)
        output_area(root).screenshot(path=str(results_dir / "playground-before-poison.png"))
        shot_clean = nan_map_shot(root)
        mark("unpoisoned")

    with step("poison", page, results_dir, console):
        site.select_option("targeted")
        old = dims_input.input_value().replace(" ", "")
        sig, rows = wait_redraw(root, f"the figure redrawn for site 'targeted', dims {old}",
                                sig, lambda r: nan_dims(r, UNFIXED_ROUTE) == old)
        new = NEW_DIMS if old != NEW_DIMS else "9,30"
        dims_input.fill(new)
        dims_input.press("Enter")  # commits a continuous_update=False Text
        sig, rows = wait_redraw(root, f"the figure redrawn after dims {old} -> {new}, "
                                f"{UNFIXED_ROUTE!r} NaN on exactly those dims",
                                sig, lambda r: nan_dims(r, UNFIXED_ROUTE) == new)
        assert int(rows[UNFIXED_ROUTE][0]) > 0, rows[UNFIXED_ROUTE]
        assert_no_widget_error(page)
        output_area(root).screenshot(path=str(results_dir / "playground-after-poison.png"))
        shot_poisoned = nan_map_shot(root)
        assert shot_poisoned not in (shot0, shot_clean), "the rendered NaN map did not change"
        mark("poisoned")

    with step("toggle-fix", page, results_dir, console):
        # A Checkbox's description sits beside its input, not in a .widget-label.
        toggle = root.locator(".widget-checkbox", has_text=FIX_LABEL).locator("input[type=checkbox]")
        assert toggle.count() == 1, f"{toggle.count()} toggles labelled {FIX_LABEL.pattern!r}"
        was_on = toggle.is_checked()
        toggle.click()
        sig, rows = wait_redraw(
            root, f"the figure redrawn after {'un' if was_on else ''}ticking the fix, "
            f"{FIX_ROUTE!r} {'gone from' if was_on else 'added to'} the route table",
            sig, lambda r: (FIX_ROUTE in r) != was_on)
        assert toggle.is_checked() != was_on
        assert_no_widget_error(page)
        output_area(root).screenshot(path=str(results_dir / "playground-after-fix.png"))
        mark("fix toggled")

    with step("busy-state", page, results_dir, console):
        assert busy_now(root) == {"dimmed": False, "disabled": 0, "computing": False}, busy_now(root)
        root.evaluate(WATCH_BUSY)
        dims_input.fill("3,4")
        dims_input.press("Enter")
        sig, rows = wait_redraw(root, "the figure redrawn after dims 3,4", sig,
                                lambda r: nan_dims(r, UNFIXED_ROUTE) == "3,4")
        wait_until("the busy state cleared (figure not dimmed, controls enabled, no 'computing')",
                   lambda: busy_now(root) == {"dimmed": False, "disabled": 0, "computing": False}, WIDGET_TIMEOUT_S)
        seen = page.evaluate("() => { window.__qsaBusy.stop(); return window.__qsaBusy.seen; }")
        assert seen == {"dimmed": True, "disabled": False, "computing": True}, \
            f"the redraw did not show its busy state, or disabled the controls (seen: {seen})"
        assert "dims 3,4" in root.locator(STATUS).inner_text(), root.locator(STATUS).inner_text()
        mark("busy state")

    with step("scroll", page, results_dir, console):
        figure = root.locator(FIGURE).first
        figure.evaluate(SCROLL_TO_FIGURE)
        dims_input.fill("5,6")   # Playwright scrolls the input into view here, before `before`
        time.sleep(0.5)
        before = figure.evaluate(SCROLL_STATE)
        assert before["scroller"] and before["scrollTop"] > 0, f"the notebook did not scroll: {before}"
        dims_input.press("Enter")
        sig, rows = wait_redraw(root, "the figure redrawn after dims 5,6", sig,
                                lambda r: nan_dims(r, UNFIXED_ROUTE) == "5,6")
        wait_until("the busy state cleared", lambda: not busy_now(root)["computing"], WIDGET_TIMEOUT_S)
        after = figure.evaluate(SCROLL_STATE)
        assert abs(after["scrollTop"] - before["scrollTop"]) <= 2, f"the notebook scrolled: {before} -> {after}"
        assert abs(after["figureTop"] - before["figureTop"]) <= 2, f"the figure moved: {before} -> {after}"
        mark("scroll kept")

    with step("bad-input", page, results_dir, console):
        # A bad value shows a message (not a traceback) and keeps the figure.
        message = root.locator(MESSAGE)
        status_before = root.locator(STATUS).inner_text()
        dims_input.fill("999")
        dims_input.press("Enter")
        wait_until("a visible '⚠ dims' message after typing dims 999",
                   lambda: "⚠" in (t := " ".join(message.all_inner_texts())) and "dims" in t,
                   REDRAW_TIMEOUT_S)
        assert image_signature(root) == sig, "the figure changed after a bad dims value"
        assert root.locator(STATUS).inner_text() == status_before, "the status changed after a bad dims value"
        assert_no_widget_error(page)
        mark("bad input")

    with step("stale-tail", page, results_dir, console):
        # site stale-tail needs a request that ends inside a microblock: a preset offers one
        geometry = labelled(root, "widget-dropdown", GEOMETRY_LABEL).locator("select")
        options = geometry.locator("option").evaluate_all("els => els.map(e => e.textContent.trim())")
        tails = [o for o in options if TAIL_PRESET.search(o)]
        assert tails, f"no geometry preset marked {TAIL_PRESET.pattern!r} among {options}"
        dims_input.fill(NEW_DIMS)
        dims_input.press("Enter")   # valid dims again
        geometry.select_option(index=options.index(tails[0]))   # waits while a redraw disables the controls
        site.select_option("stale-tail")

        def stale_tail_drawn():
            status, rows = root.locator(STATUS).inner_text(), route_rows(root)
            return ("stale-tail" in status and f"dims {NEW_DIMS}" in status and not busy_now(root)["computing"]
                    and rows.get(UNFIXED_ROUTE, ["0"])[0] not in ("0", "?")) and rows

        rows = wait_until(f"geometry {tails[0]!r}, site stale-tail drawn with NaN on the grouped route",
                          stale_tail_drawn, 3 * REDRAW_TIMEOUT_S)
        sig = image_signature(root)
        assert "stale-tail" in root.locator(STATUS).inner_text()
        assert "⚠" not in root.locator(MESSAGE).inner_text()
        output_area(root).screenshot(path=str(results_dir / "playground-stale-tail.png"))
        seed_input = labelled(root, "widget-text", SEED_LABEL).locator("input")
        seed_input.fill("7")
        seed_input.press("Enter")   # a poison seed stale-tail ignores: the export must not record it
        assert_no_widget_error(page)
        mark("stale-tail")

    with step("export", page, results_dir, console):
        figures = lab_server.figures_dir
        before = {p.name for p in figures.rglob("*") if p.is_file()}
        root.locator("button", has_text=EXPORT_LABEL).first.click()
        # The message names the files once all three are written.
        shown = wait_until("an 'exported: ...' message after clicking Export",
                           lambda: "exported" in (t := " ".join(message.all_inner_texts())) and t,
                           EXPORT_TIMEOUT_S)
        new_files = [p for p in figures.rglob("*") if p.is_file() and p.name not in before]
        files = {p.suffix.lower(): p for p in new_files}
        assert {".png", ".svg", ".pdf"} <= files.keys(), \
            f"Export wrote {sorted(p.name for p in new_files)} to QSA_LAB_FIGURES={figures}; " \
            f"expected a PNG, an SVG and a PDF (message: {shown!r})"
        assert f"{files['.png'].name}, .svg, .pdf" in shown and shown.count(files[".png"].stem) == 1, shown
        assert files[".png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", files[".png"]
        assert files[".pdf"].read_bytes()[:5] == b"%PDF-", files[".pdf"]
        assert b"<svg" in files[".svg"].read_bytes()[:4000], files[".svg"]
        from qsa_lab.plotting.export import read_png_meta

        meta = read_png_meta(files[".png"])
        assert meta.get("backend") in ("emulate", "cuda") and "stale-tail" in meta.get("case", ""), meta
        # stale-tail's bytes do not depend on the poison seed: neither the metadata nor the name claims one
        assert meta.get("dims") == NEW_DIMS and meta.get("poison_seed") == "" and "_ps" not in files[".png"].name, meta
        assert meta.get("git_commit") and meta.get("csrc_sha256"), meta
        assert meta.get("site") == "stale-tail" and TAIL_PRESET.search(meta.get("preset", "")), meta
        assert str(figures.resolve()) not in shown.split(" in ")[0], f"a path before the names in {shown!r}"
        lines = message.first.evaluate("m => { const cs = getComputedStyle(m); const lh = parseFloat(cs.lineHeight) || "
                                       "1.3 * parseFloat(cs.fontSize); return m.getBoundingClientRect().height / lh; }")
        assert lines <= 2.5, f"the export message takes {lines:.1f} lines: {shown!r}"
        root.locator("button", has_text=EXPORT_LABEL).first.click()      # again: nothing new to write
        wait_until("'already exported, unchanged' after a second click",
                   lambda: "already exported, unchanged" in " ".join(message.all_inner_texts()), EXPORT_TIMEOUT_S)
        assert_no_widget_error(page)
        mark("exported")

    with step("attended-k", page, results_dir, console):
        plane = labelled(root, "widget-dropdown", PLANE_LABEL).locator("select")
        plane.select_option("v")
        wait_until("plane v applied", lambda: not busy_now(root)["computing"] and "/v" in
                   root.locator(STATUS).inner_text(), REDRAW_TIMEOUT_S)
        site.select_option("attended-k")

        def attended_drawn():
            status, rows = root.locator(STATUS).inner_text(), route_rows(root)
            return ("attended-k/k" in status and not busy_now(root)["computing"] and rows) and rows

        rows = wait_until("site attended-k drawn", attended_drawn, 2 * REDRAW_TIMEOUT_S)
        assert plane.input_value() == "k" and plane.is_disabled(), "the plane control does not show the plane applied"
        ref, grouped = rows["reference"], rows[UNFIXED_ROUTE]
        assert int(ref[0]) > 0 and int(grouped[2]) > 0 and int(grouped[0]) < int(ref[0]), rows
        assert "None" not in root.locator(TABLE).inner_text()
        output_area(root).screenshot(path=str(results_dir / "playground-attended-k.png"))
        site.select_option("targeted")
        wait_until("site targeted again, plane control live", lambda: not plane.is_disabled()
                   and "targeted" in root.locator(STATUS).inner_text() and not busy_now(root)["computing"],
                   2 * REDRAW_TIMEOUT_S)
        assert_no_widget_error(page)
        mark("attended-k")

    with step("coalesced-clicks", page, results_dir, console):
        toggle = root.locator(".widget-checkbox", has_text=KFIX_LABEL).locator("input[type=checkbox]")
        assert toggle.count() == 1, f"{toggle.count()} toggles labelled {KFIX_LABEL.pattern!r}"
        was_on = toggle.is_checked()
        root.locator(FIGURE).first.evaluate(
            "img => { window.__qsaSrcs = new Set(); new MutationObserver(() => window.__qsaSrcs.add(img.src))"
            ".observe(img, {attributes: true, attributeFilter: ['src']}); }")
        geometry = labelled(root, "widget-dropdown", GEOMETRY_LABEL).locator("select")
        options = geometry.locator("option").evaluate_all("els => els.map(e => e.textContent.trim())")
        slow = next(o for o in options if SLOW_PRESET.search(o))
        geometry.select_option(index=options.index(slow))
        wait_until("the slow redraw running", lambda: busy_now(root)["computing"], REDRAW_TIMEOUT_S, 0.05)
        for _ in range(5):                      # all five land while that redraw runs
            toggle.click()
        assert busy_now(root)["computing"], "the redraw ended before the clicks: nothing to coalesce"
        want_on = not was_on                    # five toggles: the opposite of where it started

        def settled():
            rows = route_rows(root)
            return (not busy_now(root)["computing"] and "ctx 8192" in root.locator(STATUS).inner_text()
                    and (KFIX_ROUTE in rows) == want_on and rows)

        wait_until("the playground settled on the last click", settled, 6 * REDRAW_TIMEOUT_S)
        time.sleep(1.0)                          # a late extra redraw would show up here
        assert toggle.is_checked() == want_on, "a click was dropped"
        redraws = page.evaluate("() => window.__qsaSrcs.size")
        assert 1 <= redraws <= 2, f"{redraws} redraws for one geometry change and five clicks: not coalesced"
        assert (KFIX_ROUTE in route_rows(root)) == want_on
        assert_no_widget_error(page)
        mark("coalesced clicks")

    with step("fits-1440x900", page, results_dir, console):
        # At 1440x900 (file browser open) the controls and the figure are on screen together, and
        # the route table keeps its height when a fix toggle drops a row: the figure never jumps.
        page.set_viewport_size({"width": 1440, "height": 900})
        for toggle in root.locator(".widget-checkbox input[type=checkbox]").all():   # every fix on: every route
            if not toggle.is_checked():
                toggle.click()
                sig, _ = wait_redraw(root, "the figure redrawn with one more fix", sig, lambda r: True)
        wait_until("every route in the table", lambda: set(route_rows(root)) == set(ROUTES), REDRAW_TIMEOUT_S)
        wait_until("the busy state cleared", lambda: not busy_now(root)["computing"], WIDGET_TIMEOUT_S)
        time.sleep(0.5)
        layout = wait_until("the playground's boxes measured", lambda: root.evaluate(FITS), WIDGET_TIMEOUT_S)
        page.screenshot(path=str(results_dir / "playground-1440x900.png"))
        view, boxes = layout["view"], layout["boxes"]
        off = {k: b for k, b in boxes.items() if b["top"] < view["top"] - 1 or b["bottom"] > view["bottom"] + 1}
        assert not off, f"off screen at 1440x900 (notebook view {view}): {off}"
        assert boxes["figure"]["height"] > 300 and boxes["figure"]["width"] > 600, boxes["figure"]
        # the content, not the box: the header and a row per route, each inside the box and on screen
        table, rows = boxes["table"], layout["rows"]
        assert sorted(r["name"] for r in rows[1:]) == sorted(ROUTES), rows
        cut = [r for r in rows if r["top"] < table["top"] - 1 or r["bottom"] > table["bottom"] + 1
               or r["bottom"] > view["bottom"] + 1]
        assert not cut, f"route table rows cut off (box {table}, view {view}): {cut}"
        assert layout["overflow"]["scroll"] <= layout["overflow"]["client"] + 1, layout["overflow"]
        # every dropdown's labels whole ("(partial tail)", the marker notebook 03 points at, included)
        clipped = [(x["label"], round(x["width"]), round(x["room"])) for x in layout["labels"] if x["width"] > x["room"]]
        assert not clipped, f"dropdown labels wider than their dropdown (label, px, room): {clipped}"
        assert any("partial tail" in x["label"] for x in layout["labels"]), " | ".join(x["label"] for x in layout["labels"])
        toggle = root.locator(".widget-checkbox", has_text=FIX_LABEL).locator("input[type=checkbox]")
        was_on = toggle.is_checked()
        toggle.click()
        sig, rows = wait_redraw(root, "the figure redrawn after toggling pad_fix at 1440x900", sig,
                                lambda r: (FIX_ROUTE in r) != was_on)
        wait_until("the busy state cleared", lambda: not busy_now(root)["computing"], WIDGET_TIMEOUT_S)
        after = root.evaluate(FITS)["boxes"]
        for name in ("table", "figure", "status"):
            assert abs(after[name]["height"] - boxes[name]["height"]) <= 1, f"{name}: {boxes[name]} -> {after[name]}"
        assert abs(after["figure"]["top"] - boxes["figure"]["top"]) <= 1, "the figure moved"
        mark("fits 1440x900")

    print(f"\ne2e timings (s since test start): {timings}; "
          f"exported: {sorted(p.name for p in files.values())}")

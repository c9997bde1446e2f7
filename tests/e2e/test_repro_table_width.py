"""Notebook 04's differential table fits a notebook cell: rendered by Chromium in a 1000-px
column (a JupyterLab cell on a 1440-px screen with the file browser open), the table needs no
horizontal scroll, and every column is there."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e

CELL_PX = 1000


def test_repro_table_fits_the_cell(browser_context, results_dir):
    from qsa_lab.analysis import figure_data as figdata
    from qsa_lab.report.repro import run_repro

    table, _ = run_repro(backend="emulate", progress=False, repeat=True, geometry_overrides=dict(context=256, topk=16))
    html = figdata.repro_display(table).to_html()
    page = browser_context.new_page()
    page.set_content(f"<html><body style='font-family:sans-serif;margin:0'><div id='cell' style='width:{CELL_PX}px'>"
                     f"{html}</div></body></html>")
    width = page.evaluate("() => document.querySelector('#cell table').scrollWidth")
    headers = page.eval_on_selector_all("#cell th.col_heading", "els => els.map(e => e.innerText.replace(/\\s+/g, ' '))")
    page.screenshot(path=str(results_dir / "repro-table-1000px.png"), full_page=True)
    page.close()
    assert width <= CELL_PX, f"the table is {width} px wide in a {CELL_PX}-px cell"
    assert {"ref", "A", "B", "A+B", "C", "expected ≠ ref", "as expected", "repeat identical"} <= set(headers)

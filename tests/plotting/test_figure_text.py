"""Every figure the project exports keeps every text inside its canvas and apart from every other
text, at the size and dpi it is exported at: `qsa-lab repro --figures` / `make demo` (01-05), the
canary's leak matrix (its report's leak_matrix.png, notebook 06) and leak maps, the scribble's
verdict grid (notebook 07), the cross-request map (04), the complete fixes' cost (05) and the
playground's figure (03).

A text is what matplotlib drew: titles, suptitles, axis labels, tick labels, legend texts, table
cells, annotations. Its window extent comes from the renderer that drew it.

QSA_LAB_FIGURE_TEXT_DIR=<folder>: also write each figure's PNG there, to look at.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

import matplotlib

matplotlib.use("Agg")
import pytest  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from qsa_lab.support.package_data import locate  # noqa: E402

SLACK_PX = 1.0   # extents are rounded to the pixel: touching is not overlapping


def drawn_texts(fig, dpi: float) -> list:
    """[(text, extent)] of every non-empty text drawn when `fig` is drawn at `dpi`."""
    if not isinstance(fig.canvas, FigureCanvasAgg):
        FigureCanvasAgg(fig)      # a bare Figure draws on the Agg canvas, as savefig's PNG does
    fig.set_dpi(dpi)
    drawn, draw = [], Text.draw

    def spy(self, renderer):
        draw(self, renderer)
        if self.get_visible() and self.get_text().strip():
            drawn.append(self)

    with mock.patch.object(Text, "draw", spy):
        fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    return [(t, t.get_window_extent(renderer)) for t in dict.fromkeys(drawn)]


def text_problems(fig, dpi: float = 150, cropped: bool = False) -> list[str]:
    """What is wrong with the texts of `fig` drawn at `dpi`: a text outside the figure (unless
    `cropped`: saved with bbox_inches='tight', the file grows to hold it), two texts overlapping."""
    texts = drawn_texts(fig, dpi)
    W, H = fig.bbox.width, fig.bbox.height
    out = []
    for t, b in texts:
        if not cropped and (b.x0 < -SLACK_PX or b.y0 < -SLACK_PX or b.x1 > W + SLACK_PX or b.y1 > H + SLACK_PX):
            out.append(f"outside the {W:.0f}x{H:.0f} px figure: {t.get_text()!r} at "
                       f"({b.x0:.0f}, {b.y0:.0f})-({b.x1:.0f}, {b.y1:.0f})")
    for i, (t, b) in enumerate(texts):
        for u, c in texts[i + 1:]:
            w = min(b.x1, c.x1) - max(b.x0, c.x0)
            h = min(b.y1, c.y1) - max(b.y0, c.y0)
            if w > SLACK_PX and h > SLACK_PX:
                out.append(f"overlap ({w:.0f}x{h:.0f} px): {t.get_text()!r} and {u.get_text()!r}")
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        for tab in ax.tables:             # a cell's text inside its cell: the next cell paints over the rest
            for cell in tab.get_celld().values():
                t = cell.get_text()
                if t.get_text().strip() and not _inside(t.get_window_extent(renderer), cell.get_window_extent(renderer)):
                    out.append(f"outside its table cell: {t.get_text()!r}")
        for legend in [ax.get_legend()] if ax.get_legend() else []:   # a legend hides no bar or whisker
            box = legend.get_window_extent(renderer)
            for a in ax.patches + [x for x in ax.lines if x.get_transform() == ax.transData]:
                if a.get_visible() and box.overlaps(a.get_window_extent(renderer)):
                    out.append(f"legend {[x.get_text() for x in legend.get_texts()]} over a {type(a).__name__}")
                    break
    return out


def _inside(inner, outer) -> bool:
    return (inner.x0 >= outer.x0 - SLACK_PX and inner.x1 <= outer.x1 + SLACK_PX and inner.y0 >= outer.y0 - SLACK_PX
            and inner.y1 <= outer.y1 + SLACK_PX)


def check(fig, name: str, dpi: float = 150, cropped: bool = False):
    where = os.environ.get("QSA_LAB_FIGURE_TEXT_DIR")
    problems = text_problems(fig, dpi, cropped)
    if where:
        fig.savefig(Path(where) / f"{name}.png", dpi=dpi, **({"bbox_inches": "tight"} if cropped else {}))
    assert not problems, f"{name}: " + "\n  ".join(problems)


# -- the checker itself ----------------------------------------------------------------------------

def test_checker_finds_a_cut_and_an_overlap_and_passes_a_clean_figure():
    fig = Figure(figsize=(4, 3))
    ax = fig.add_subplot()
    ax.set_title("fits")
    assert text_problems(fig) == []
    ax.text(1.2, 0.5, "far past the right edge of the figure", transform=ax.transAxes)
    assert any(p.startswith("outside") and "far past" in p for p in text_problems(fig))
    fig = Figure(figsize=(4, 3))
    ax = fig.add_subplot()
    ax.text(0.5, 0.5, "one text")
    ax.text(0.52, 0.5, "another text")
    assert any(p.startswith("overlap") for p in text_problems(fig))
    fig = Figure(figsize=(4, 3))
    tab = fig.add_subplot().table(cellText=[["a long cell text", "next"]], bbox=[0.35, 0.4, 0.3, 0.2])
    tab.auto_set_font_size(False)
    tab.set_fontsize(12)
    assert "outside its table cell: 'a long cell text'" in text_problems(fig)
    fig = Figure(figsize=(4, 3))
    ax = fig.add_subplot()
    ax.barh([0, 1], [1, 4], label="bars")
    ax.legend(loc="upper right")
    assert any(p.startswith("legend ['bars'] over a Rectangle") for p in text_problems(fig))


# -- `qsa-lab repro --figures` / `make demo` (notebooks 01-05) -------------------------------------

@pytest.fixture(scope="module")
def repro():
    from qsa_lab.report.repro import run_repro

    return run_repro(backend="emulate", geometry_overrides=dict(context=2048, topk=128), progress=False,
                     parallel=False)


@pytest.fixture(scope="module")
def specs(repro):
    from qsa_lab.report.figures import figure_specs

    table, results = repro
    return {s.name: s for s in figure_specs(results, table, "emulate")}


REPRO_FIGURES = ("01_e4m3_code_table", "01_fp16_byte_nan_rates", "01_page0_byte_maps", "02_plan", "02_nan_maps",
                 "02_attribution", "02_routes", "03_playground_default", "04_repro_table", "04_stale_tail_routes",
                 "05_fix_cost")


@pytest.mark.parametrize("name", REPRO_FIGURES)
def test_repro_figure_text(specs, name):
    fig, _ = specs[name].draw()
    check(fig, name)    # export_figure's dpi, not cropped


# -- the canary (its report's leak_matrix.png, notebook 06) ----------------------------------------

def _canary_report(**kw):
    from qsa_lab.canary import run_canary

    return run_canary(["qsa:grouped", "qsa:grouped+kernel_fix", "torch:sdpa-math"], backend="emulate", **kw)


@pytest.mark.parametrize("payloads", [None, ["nan"]], ids=["every-payload", "one-payload"])
def test_canary_report_leak_matrix_text(tmp_path, payloads):
    """The report folder's leak_matrix.png as write_report draws it (cropped to what it draws)."""
    from qsa_lab.canary.figures import leak_matrix, plot_leak_matrix

    report = _canary_report(payloads=payloads)
    check(plot_leak_matrix(leak_matrix(report)).figure, f"canary_leak_matrix_{len(payloads or 'all')}", dpi=120,
          cropped=True)


def test_canary_h200_leak_matrix_text():
    from qsa_lab.canary.figures import leak_matrix, plot_leak_matrix

    doc = json.loads((locate("data") / "canary_h200.json").read_text())
    check(plot_leak_matrix(leak_matrix(doc)).figure, "canary_h200_leak_matrix")


def test_canary_leak_maps_text():
    from qsa_lab.canary import figures as cf
    from qsa_lab.plotting.plots import small_multiples

    report = _canary_report(regions=["null-block"], payloads=["nan"], dims=[5])
    maps = cf.leak_maps(report)
    assert maps
    check(small_multiples(cf.plot_leak_map, maps, ncols=2, panel=(6.5, 2.8)), "canary_leak_maps")


# -- the scribble's verdict grid (notebook 07) ------------------------------------------------------

def _scribble_report(name: str, regions=None):
    from qsa_lab.scribble.check import Cell, ScribbleReport

    doc = json.loads((Path(__file__).parents[2] / "evidence" / "scribble_h200" / name).read_text())
    cells = [Cell(**c) for c in doc["results"] if regions is None or c["region"] in regions]
    return ScribbleReport(doc["engine"], doc["reads_pool"], doc["graphs"], doc["model"], doc["workload"], cells)


@pytest.mark.parametrize("regions", [None, ("other-requests", "free-blocks")], ids=["every-region", "two-regions"])
def test_scribble_verdict_grid_text(regions):
    """As notebook 07 draws it: on plotting.verdicts.verdict_axes."""
    from qsa_lab.plotting.verdicts import verdict_axes
    from qsa_lab.scribble import verdict_grid

    ax = verdict_grid(_scribble_report("scribble_eager_graphs.json", regions), ax=verdict_axes(len(regions or "1234567")))
    check(ax.figure, f"scribble_grid_{len(regions or 'all')}")


# -- notebook 04: the cross-request map; notebook 05: the complete fixes' cost -----------------------

def test_cross_request_map_text():
    from qsa_lab.analysis.cross_request import cross_request, row_map
    from qsa_lab.model.geometry import MIXES
    from qsa_lab.plotting.plots import plot_cross_request

    mix = MIXES["upstream-mix"].replace(context=120, head_dim=32, topk=32)
    records = cross_request(mix, payloads=("nan",), requests=[0], backend="emulate")
    check(plot_cross_request(row_map(records, mix, "nan", 0)).figure, "cross_request")


def test_complete_fix_cost_text():
    from qsa_lab.analysis import bench_data
    from qsa_lab.plotting.plots import plot_complete_fix_cost

    data = bench_data.complete_fix_data(bench_data.load_complete_fix())
    assert data is not None
    check(plot_complete_fix_cost(data).figure, "complete_fix_cost")

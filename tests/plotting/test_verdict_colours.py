"""The canary's leak matrix and the scribble's verdict grid draw a verdict alike: one colour, one
mark and one legend per verdict (qsa_lab.plotting.verdicts)."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402

from qsa_lab.analysis.leaks import VERDICTS  # noqa: E402
from qsa_lab.plotting import verdicts as style  # noqa: E402

SHARED = ["clean", "nan-leak", "inf-leak", "finite-leak", "error", "unstable-control", "n/a"]


def _drawn(ax, verdicts) -> dict:
    """verdict -> the set of (mark, rgb) its cells of a drawn grid show (rgb: the image's pixel)."""
    image = ax.get_images()[0].get_array()
    marks = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in ax.texts}
    out = {}
    for i, row in enumerate(verdicts):
        for j, v in enumerate(row):
            rgb = tuple(np.round(np.asarray(image[i, j][:3], dtype=float), 4))
            out.setdefault(v, set()).add((marks[i, j], rgb))
    return out


def _legend(ax) -> dict:
    return {t.get_text(): tuple(np.round(p.get_facecolor()[:3], 4))
            for t, p in zip(ax.get_legend().get_texts(), ax.get_legend().get_patches())}


def test_every_verdict_has_one_distinct_colour_and_mark_in_the_verdicts_order():
    assert tuple(style.STYLE) == VERDICTS
    assert len(set(style.COLOURS.values())) == len(VERDICTS) and len(set(style.MARKS.values())) == len(VERDICTS)
    assert style.legend_line(["clean", "nan-leak"]) == "# . clean   N NaN leak"


def test_the_canary_grid_and_the_scribble_grid_give_a_verdict_the_same_colour_mark_and_legend():
    pytest.importorskip("torch")
    from qsa_lab.canary.figures import leak_matrix, plot_leak_matrix
    from qsa_lab.scribble.figures import verdict_grid
    from qsa_lab.scribble.regions import REGIONS as regions
    from qsa_lab.scribble.report import Cell, ScribbleReport

    doc = {"kernels": ["k"], "backend": None, "results": [
        {"kernel": "k", "region": f"r{i}", "plane": "v", "payload": "nan", "verdict": v} for i, v in enumerate(SHARED)]}
    canary = plot_leak_matrix(leak_matrix(doc), ax=plt.figure().add_subplot())
    report = ScribbleReport("e", "gather", False, "m", {}, [Cell("read", r, "nan", v) for r, v in zip(regions, SHARED)]
                            + [Cell("write", "read-trash", "-", "stray-write")])
    scribble = verdict_grid(report, ax=plt.figure().add_subplot())

    drawn_canary = _drawn(canary, [SHARED])
    drawn_scribble = _drawn(scribble, [[v, "stray-write" if r == "read-trash" else "not-run"]
                                       for r, v in zip(regions, SHARED)])
    expected = {v: {(style.MARKS[v], tuple(np.round(to_rgb(style.COLOURS[v]), 4)))} for v in VERDICTS}
    assert set(drawn_canary) == set(SHARED) and set(drawn_scribble) == set(SHARED) | {"stray-write", "not-run"}
    for v in SHARED:
        assert drawn_canary[v] == drawn_scribble[v] == expected[v], v
    assert drawn_scribble["stray-write"] == expected["stray-write"]
    canary_legend, scribble_legend = _legend(canary), _legend(scribble)
    assert all(canary_legend[k] == scribble_legend[k] for k in canary_legend.keys() & scribble_legend.keys())
    assert set(canary_legend) == {f"{style.MARKS[v]}  {v}" for v in SHARED}
    assert set(scribble_legend) == {f"{style.MARKS[v]}  {v}" for v in SHARED + ["stray-write", "not-run"]}
    plt.close("all")

"""One colour and one mark per verdict, and one legend: the canary's leak matrix, the scribble's
verdict grid and the canary's text matrix all draw a verdict from here, so it looks the same in each.

    verdict_cells(verdicts, ax)       a grid of verdicts (rows x columns of names): colour and mark
    verdict_legend(ax, seen)          the legend of the verdicts drawn, in the verdicts' order
    legend_line(shown)                the same legend as one text line (the command line's matrix)

Plain Python at import (the command line imports it for the marks); matplotlib only when drawing.
"""
from __future__ import annotations

from qsa_lab.analysis.leaks import (CLEAN, ERROR, FINITE_LEAK, INF_LEAK, INPUT_MODIFIED, NA, NAN_LEAK, NOT_RUN,
                                    STRAY_WRITE, UNSTABLE, VERDICTS)
from qsa_lab.plotting.plots import CLEAN_COLOR, NAN_COLOR

#: verdict -> (colour, mark, words for a legend)
STYLE = {
    CLEAN: (CLEAN_COLOR, ".", CLEAN),
    NAN_LEAK: (NAN_COLOR, "N", "NaN leak"),
    INF_LEAK: ("#f59f00", "I", "Inf leak"),
    FINITE_LEAK: ("#7048e8", "F", "finite leak (bits changed)"),
    STRAY_WRITE: ("#0c8599", "W", "stray write"),
    ERROR: ("#343a40", "E", ERROR),
    UNSTABLE: ("#868e96", "U", "unstable control"),
    INPUT_MODIFIED: ("#e64980", "M", "input modified"),
    NA: ("#a5d8ff", "/", "n/a (nothing references the region)"),
    NOT_RUN: ("#d9d9d9", "-", "not run"),
}
COLOURS = {v: s[0] for v, s in STYLE.items()}
MARKS = {v: s[1] for v, s in STYLE.items()}
#: the marks' colour: white on every verdict's colour but the pale not-run
MARK_COLOUR = {v: "#666666" if v == NOT_RUN else "white" for v in VERDICTS}


def legend_line(shown=VERDICTS) -> str:
    """'# . clean   N NaN leak   ...': the legend of `shown` (in the verdicts' order) as one line."""
    return "# " + "   ".join(f"{MARKS[v]} {STYLE[v][2]}" for v in VERDICTS if v in shown)


def verdict_cells(verdicts, ax, fontsize: float = 7):
    """verdicts: rows x columns of verdict names (NOT_RUN for a cell without one). Draws each cell
    in its verdict's colour with its mark; -> ax."""
    from matplotlib.colors import to_rgb

    ax.imshow([[to_rgb(COLOURS[v]) for v in row] for row in verdicts], aspect="auto", interpolation="nearest")
    for i, row in enumerate(verdicts):
        for j, v in enumerate(row):
            ax.text(j, i, MARKS[v], ha="center", va="center", fontsize=fontsize, fontweight="bold",
                    color=MARK_COLOUR[v])
    return ax


def verdict_legend(ax, seen, **kwargs):
    """The legend of the verdicts `seen` (and clean, always), in the verdicts' order, beside the
    axes unless kwargs place it. -> the Legend."""
    from matplotlib.patches import Patch

    handles = [Patch(color=COLOURS[v], label=f"{MARKS[v]}  {v}") for v in VERDICTS if v in set(seen) | {CLEAN}]
    return ax.legend(handles=handles, **{"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "fontsize": 8,
                                         **kwargs})


def verdict_axes(rows: int = 8, width: float = 9.5):
    """A pyplot Axes for a verdict grid of `rows` rows (the scribble's verdict_grid(report, ax=...)):
    laid out constrained and wide enough that the row names, the legend beside it and the verdict
    line under it stay inside the figure."""
    import matplotlib.pyplot as plt

    return plt.figure(figsize=(width, 0.42 * rows + 1.6), layout="constrained").add_subplot()

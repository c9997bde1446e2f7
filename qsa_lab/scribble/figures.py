"""fn(report, ax=None) -> ax: the scribble's verdicts as a region x payload grid."""
from __future__ import annotations

from .verdicts import PAYLOADS, REGIONS, STRAY

COLOURS = {"clean": "#cfe8cf", "n/a": "#eeeeee", "nan-leak": "#d73027", "inf-leak": "#fc8d59",
           "finite-leak": "#fee090", STRAY: "#7b3294", "error": "#555555", "unstable-control": "#999999"}


def verdict_grid(report, ax=None):
    """Rows: regions; columns: the read check's payloads, then the write guard; the report's summary under it."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    cells = {(c.region, c.payload if c.check == "read" else "write"): c.verdict for c in report.cells}
    regions = [r for r in REGIONS if any(k[0] == r for k in cells)]
    columns = [p for p in PAYLOADS if any(k[1] == p for k in cells)] + ["write"]
    grid = [[to_rgb(COLOURS.get(cells.get((r, c), "n/a"), "#ffffff")) for c in columns] for r in regions]
    ax.imshow(grid, aspect="auto")
    for i, r in enumerate(regions):
        for j, c in enumerate(columns):
            ax.text(j, i, cells.get((r, c), ""), ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(columns)), columns)
    ax.set_yticks(range(len(regions)), regions)
    ax.set_title(f"{report.engine} ({report.reads_pool})", fontsize=9)
    ax.set_xlabel(report.summary(), fontsize=7)
    return ax

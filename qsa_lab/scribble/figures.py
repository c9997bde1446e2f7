"""fn(report, ax=None) -> ax: the scribble's verdicts as a region x payload grid, in the canary
leak matrix's colours, marks and legend (qsa_lab.plotting.verdicts)."""
from __future__ import annotations

from qsa_lab.analysis.leaks import NOT_RUN
from qsa_lab.plotting.verdicts import verdict_cells, verdict_legend

from .regions import PAYLOADS, REGIONS


def verdict_grid(report, ax=None):
    """Rows: regions; columns: the read check's payloads, then the write guard; a cell no check
    filled is not-run; the report's verdict line under it."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    cells = {(c.region, c.payload if c.check == "read" else "write"): c.verdict for c in report.cells}
    regions = [r for r in REGIONS if any(k[0] == r for k in cells)]
    columns = [p for p in PAYLOADS if any(k[1] == p for k in cells)] + ["write"]
    verdicts = [[cells.get((r, c), NOT_RUN) for c in columns] for r in regions]
    verdict_cells(verdicts, ax)
    verdict_legend(ax, {v for row in verdicts for v in row})
    ax.set_xticks(range(len(columns)), columns)
    ax.set_yticks(range(len(regions)), regions)
    ax.set_title(f"{report.engine} ({report.reads_pool})", fontsize=9)
    ax.set_xlabel(report.verdict_line(), fontsize=7)
    return ax

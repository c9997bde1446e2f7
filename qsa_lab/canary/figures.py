"""Canary figures: data functions (a report or its JSON in, plain dicts out) and drawing
functions `fn(data, ax=None) -> ax` in the style of qsa_lab.plotting.plots (NaN in its NAN_COLOR)."""
from __future__ import annotations

import numpy as np

from qsa_lab.analysis.leaks import NOT_RUN
from qsa_lab.plotting.plots import _ax, _cmap, _dim_axis, _nan_legend
from qsa_lab.plotting.verdicts import verdict_cells, verdict_legend


# -- data -------------------------------------------------------------------------------------------

def _doc(source) -> dict:
    return source if isinstance(source, dict) else source.to_json()


def leak_matrix(source) -> dict:
    """source: a CanaryReport or a qsa_lab.canary/1 document. -> kernels x columns of verdicts,
    columns (region, plane, payload) in run order; kernels that did not run keep a grey row."""
    doc = _doc(source)
    columns = list(dict.fromkeys((r["region"], r["plane"], r["payload"]) for r in doc["results"]))
    kernels = list(doc.get("kernels") or dict.fromkeys(r["kernel"] for r in doc["results"]))
    verdicts = [[NOT_RUN] * len(columns) for _ in kernels]
    for r in doc["results"]:
        verdicts[kernels.index(r["kernel"])][columns.index((r["region"], r["plane"], r["payload"]))] = r["verdict"]
    reasons = {s["kernel"]: s["reason"] for s in doc.get("skipped", []) if "kernel" in s and "region" not in s}
    return {"kernels": kernels, "columns": columns, "verdicts": verdicts, "skipped": reasons,
            "title": _title(doc)}


def _title(doc: dict) -> str:
    """What ran where; the qsa routes' backend only when some ran (never 'backend None')."""
    parts = [f"qsa routes on {doc['backend']}" if doc.get("backend") else None,
             f"device {doc.get('device')}", f"GPU {doc.get('gpu')}" if doc.get("gpu") else None,
             f"{doc.get('kv_dtype')} pool", f"torch {doc.get('torch')}"]
    return "canary: " + ", ".join(p for p in parts if p)


def leak_map(result, title: str = "") -> dict:
    """One LeakResult -> its poisoned output as [rows * q_heads, head_dim] float (NaN kept) and
    the changed outputs, rows in (row, head) order."""
    out, leak = result.output, result.leak
    rows, hq, d = out.shape
    return {"values": out.reshape(rows * hq, d).numpy(), "changed": leak.reshape(rows * hq, d).numpy(),
            "q_heads": hq, "verdict": result.verdict,
            "title": title or f"{result.kernel}  {result.region}/{result.plane}/{result.payload}: {result.verdict}"}


def leak_maps(report, plane: str | None = None, payload: str | None = None) -> list:
    """leak_map of every leaking result (optionally one plane / payload only)."""
    return [leak_map(r) for r in report.leaks()
            if (plane is None or r.plane == plane) and (payload is None or r.payload == payload)]


# -- drawing ----------------------------------------------------------------------------------------

TICK_PT = 9.5
CHAR_IN = 0.085   # a character of a region name at TICK_PT, in inches (a little more than DejaVu Sans's widest)


def _band_name(region: str, columns: int) -> str:
    """A region's name for a band `columns` wide: on one line when it fits 0.32 in per column, else
    broken after each hyphen ('stale-\nmicroblock')."""
    return region if len(region) * CHAR_IN + 0.15 <= 0.32 * columns else region.replace("-", "-\n")


def plot_leak_matrix(data: dict, ax=None):
    """data: leak_matrix. Kernels down, region / plane / payload across; a cell per verdict, in the
    colours and marks of qsa_lab.plotting.verdicts (the scribble's grid uses the same)."""
    kernels, columns = data["kernels"], data["columns"]
    # one labelled band per region on the top axis: a name wider than its band breaks at its
    # hyphens, and the columns widen until the widest line fits its band (no name runs into the next)
    regions = [c[0] for c in columns]
    starts = [j for j in range(len(columns)) if j == 0 or regions[j] != regions[j - 1]]
    ends = starts[1:] + [len(columns)]
    names = [_band_name(regions[s], e - s) for s, e in zip(starts, ends)]
    column_in = max([0.32] + [(max(map(len, n.split("\n"))) * CHAR_IN + 0.15) / (e - s)
                              for n, s, e in zip(names, starts, ends)])
    ax = _ax(ax, (max(6.0, column_in * len(columns) + 3.5), 0.34 * len(kernels) + 2.2))
    verdict_cells(data["verdicts"], ax)
    # tick labels at TICK_PT: the committed H200 matrix, scaled to a notebook's width, drew 7 pt as ~7 px
    ax.set_yticks(range(len(kernels)), [k + ("  (skipped)" if k in data["skipped"] else "") for k in kernels],
                  fontsize=TICK_PT)
    ax.set_xticks(range(len(columns)), [f"{p}/{pl}" for _, p, pl in columns], rotation=90, fontsize=TICK_PT)
    for j in starts[1:]:
        ax.axvline(j - 0.5, color="black", lw=1.4)
    top = ax.secondary_xaxis("top")
    top.set_xticks([(s + e - 1) / 2 for s, e in zip(starts, ends)], names, fontsize=TICK_PT)
    top.tick_params(length=0)
    for y in range(len(kernels) - 1):
        ax.axhline(y + 0.5, color="white", lw=0.8)
    ax.set_xlabel("plane / payload")
    verdict_legend(ax, {v for row in data["verdicts"] for v in row})
    ax.set_title(data["title"], fontsize=9)
    return ax


def plot_leak_map(data: dict, ax=None):
    """data: leak_map. |output| in grey, NaN in NAN_COLOR, Inf and changed finite outputs outlined."""
    vals, changed = data["values"], data["changed"]
    ax = _ax(ax, (8, max(2.5, 0.05 * vals.shape[0] + 1.2)))
    finite = np.abs(vals[np.isfinite(vals)])
    vmax = float(np.percentile(finite, 99)) if finite.size else 1.0
    ax.imshow(np.where(np.isinf(vals), vmax, np.abs(vals)), cmap=_cmap("Greys"), vmin=0, vmax=vmax or 1.0,
              aspect="auto", interpolation="nearest")
    odd = changed & ~np.isnan(vals)                       # Inf and changed finite values: outlined
    if odd.any():
        ys, xs = np.nonzero(odd)
        ax.scatter(xs, ys, marker="s", s=12, facecolors="none", edgecolors="#7048e8", linewidths=0.8)
    hq = data["q_heads"]
    rows = vals.shape[0] // hq
    step = max(1, rows // 12)
    ax.set_yticks(np.arange(0, rows, step) * hq, [f"row {r}" for r in range(0, rows, step)], fontsize=7)
    ax.set_ylabel(f"query row x {hq} heads")
    dims = sorted(set(np.nonzero(np.isnan(vals).any(axis=0))[0].tolist()))
    _dim_axis(ax, vals.shape[1], dims)
    ax.set_title(f"{data['title']}\n{int(np.isnan(vals).sum())} NaN, {int(odd.sum())} Inf / changed finite",
                 fontsize=8)
    _nan_legend(ax)
    return ax

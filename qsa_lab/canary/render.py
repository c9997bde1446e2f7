"""The canary's report rendered: a leak report's blocks as Markdown and HTML (the data:
qsa_lab.canary.report), and a run's matrix and notes for the terminal (`qsa-lab canary`).

Blocks are (kind, ...) tuples: ("h1" | "h2" | "h3", text), ("p", text), ("code", text),
("img", file name), ("table", header, rows). Plain Python; the marks and
the legend are the verdict grids' own (qsa_lab.plotting.verdicts).
"""
from __future__ import annotations

from html import escape

from qsa_lab.analysis.leaks import FAILURES, LEAKS, NOT_RUN, STRAY_WRITE, VERDICTS
from qsa_lab.plotting.verdicts import MARKS, legend_line


# -- a leak report's blocks ---------------------------------------------------------------------------

def markdown(blocks) -> str:
    """The blocks as Markdown."""
    out = []
    for kind, *rest in blocks:
        if kind in ("h1", "h2", "h3"):
            out.append("#" * int(kind[1]) + " " + rest[0])
        elif kind == "p":
            out.append(rest[0])
        elif kind == "code":
            out.append("```\n" + rest[0] + "\n```")
        elif kind == "img":
            out.append(f"<img src=\"{rest[0]}\" alt=\"leak matrix\" style=\"max-width:100%\">")
        elif kind == "table":
            head, rows = rest
            cell = lambda s: str(s).replace("|", "\\|")  # noqa: E731
            out.append("\n".join(["| " + " | ".join(map(cell, head)) + " |", "|" + " --- |" * len(head)]
                                 + ["| " + " | ".join(map(cell, r)) + " |" for r in rows]))
    return "\n\n".join(out) + "\n"


def html(blocks) -> str:
    """The blocks as one HTML page (every text escaped)."""
    e = escape
    out = ["<!doctype html><html><head><meta charset='utf-8'><title>qsa_lab canary leak report</title>",
           "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}img{max-width:100%;height:auto}"
           "table{border-collapse:collapse}"
           "td,th{border:1px solid #bbb;padding:2px 8px;text-align:left}pre{background:#f4f4f4;padding:6px}"
           "</style></head><body>"]
    for kind, *rest in blocks:
        if kind in ("h1", "h2", "h3"):
            out.append(f"<{kind}>{e(rest[0])}</{kind}>")
        elif kind == "p":
            out.append(f"<p>{e(rest[0])}</p>")
        elif kind == "code":
            out.append(f"<pre>{e(rest[0])}</pre>")
        elif kind == "img":
            out.append(f"<img src='{e(rest[0])}' alt='leak matrix' style='max-width:100%;height:auto'>")
        elif kind == "table":
            head, rows = rest
            out.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>"
                       + "".join("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in r) + "</tr>" for r in rows)
                       + "</table>")
    return "\n".join(out) + "\n</body></html>\n"


# -- the terminal ----------------------------------------------------------------------------------

#: the width the terminal matrix is wrapped to (a region never splits across two blocks)
WIDTH = 120
#: the longest kernel name shown whole in the matrix (a longer one keeps its end)
LABEL_MAX = 48


def terminal(report, doc: dict) -> list[str]:
    """What `qsa-lab canary` prints without `--json -`: the case, the matrix, its legend, one
    note per group of non-clean cells, what was skipped and the counts (doc: report.to_json())."""
    ran = f"qsa routes on {report.backend}, " if report.backend else ""   # only the qsa routes have a backend
    lines = [f"# canary: {report.case.describe()}; {doc['pool_pages']} pool pages; {ran}device {report.device}",
             f"# regions (slots): {doc['regions']}; payload bits: {doc['payload_bits']}",
             matrix(report), legend_line([v for v in VERDICTS if v != STRAY_WRITE]),   # a kernel call writes no pool
             *notes(report)]
    for s in report.skipped:
        what = "/".join(s[k] for k in ("kernel", "region", "plane", "payload") if k in s)
        lines.append(f"# skipped {what}: {s['reason']}")
    return [w for line in lines + [f"# {report.summary()}"] for w in wrap(line)]


def wrap(text: str, width: int = WIDTH) -> list[str]:
    """A `# ...` line folded to `width` at its item breaks (three spaces, as the legend parts its
    marks) or at word breaks, continued with `#   `; other lines (the matrix) as they are."""
    import textwrap

    if not text.startswith("# ") or len(text) <= width:
        return text.splitlines() or [text]
    out = []
    for part in text[2:].split("   "):
        if out and len(out[-1]) + 3 + len(part) <= width:
            out[-1] += "   " + part
        else:
            out += textwrap.wrap(part, width, initial_indent="# " if not out else "#   ",
                                 subsequent_indent="#   ", break_on_hyphens=False)
    return out


def _group_cells(cells) -> str:
    regions = list(dict.fromkeys(r.region for r in cells))
    planes = list(dict.fromkeys(r.plane for r in cells))
    payloads = list(dict.fromkeys(r.payload for r in cells))
    if len(regions) * len(planes) * len(payloads) == len(cells):
        return f"{','.join(regions)} / {','.join(planes)} / {','.join(payloads)}"
    return ", ".join(f"{r.region}/{r.plane}/{r.payload}" for r in cells)


def notes(report) -> list[str]:
    """One line per group of non-clean cells: same verdict, detail and cells; kernels merged."""
    groups = {}
    for r in report.non_clean():
        detail = r.error or (f"changed {', '.join(r.modified)}" if r.modified else "") or r.note
        # a failure's detail differs cell by cell (counts, differences): its first one stands for all
        key = (r.kernel, r.verdict, "" if r.verdict in FAILURES else detail)
        groups.setdefault(key, [detail, []])[1].append(r)
    groups = {(k, v, d): cells for (k, v, _), (d, cells) in groups.items()}
    merged = {}
    for (kernel, verdict, detail), cells in groups.items():
        counts = ""
        if verdict in LEAKS:
            counts = f" ({sum(c.nan for c in cells)} NaN, {sum(c.inf for c in cells)} Inf, " \
                     f"{sum(c.finite_changed for c in cells)} finite changed)"
        merged.setdefault((verdict, _group_cells(cells), counts, detail), []).append(kernel)
    out = []
    for (verdict, where, counts, detail), kernels in merged.items():
        who = "every kernel" if len(kernels) > 1 and len(kernels) == len(report.kernels) else ", ".join(kernels)
        out.append(f"# {who}: {verdict} at {where}{counts}" + (f": {detail}" if detail else ""))
    return out


def matrix(report, width: int = WIDTH) -> str:
    """Kernels down; region, plane and payload across, one mark per verdict
    (qsa_lab.plotting.verdicts), wrapped by region into blocks no wider than `width`."""
    results = report.results      # read directly: no pandas import for a terminal table
    if not results:
        return "(no results)"
    kernels = list(dict.fromkeys(r.kernel for r in results))
    regions = list(dict.fromkeys(r.region for r in results))
    planes = list(dict.fromkeys(r.plane for r in results))
    payloads = list(dict.fromkeys(r.payload for r in results))
    mark = {(r.kernel, r.region, r.plane, r.payload): MARKS[r.verdict] for r in results}
    label = lambda k: k if len(k) <= LABEL_MAX else "..." + k[-(LABEL_MAX - 3):]   # noqa: E731
    left = max(len("payload"), *(len(label(k)) for k in kernels)) + 2

    def group(region):   # one region's columns: a header per line, then one string per kernel
        cells = [(p, x) for p in planes for x in payloads]
        w = max(len(region), 2 * len(cells) - 1)
        plane_row = "".join(f"{p.upper():<{2 * len(payloads)}}" for p in planes).rstrip()
        payload_row = " ".join(x[0] for _, x in cells)
        rows = [" ".join(mark.get((k, region, p, x), MARKS[NOT_RUN]) for p, x in cells) for k in kernels]
        return w, [region, plane_row, payload_row, *rows]

    groups = [group(r) for r in regions]
    blocks, block, used = [], [], left
    for g in groups:
        if block and used + g[0] > width:
            blocks.append(block)
            block, used = [], left
        block.append(g)
        used += g[0] + 2
    blocks.append(block)
    heads = ["region", "plane", "payload", *(label(k) for k in kernels)]
    out = []
    for block in blocks:
        for i, head in enumerate(heads):
            out.append((f"{head:<{left}}" + "  ".join(f"{g[1][i]:<{g[0]}}" for g in block)).rstrip())
        out.append("")
    keys = ", ".join(f"{x[0]} {x}" for x in payloads)
    return "\n".join(out[:-1] + [f"# payloads: {keys}; planes K and V"])

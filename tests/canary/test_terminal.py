"""What `qsa-lab canary` prints: the matrix wrapped by region to 120 columns, every mark the
verdict of its cell, and no `None` where a value is missing (a user kernel has no backend)."""
from __future__ import annotations

import re

from qsa_lab.canary import run_canary
from qsa_lab.canary.render import WIDTH, matrix, terminal, wrap
from qsa_lab.plotting.verdicts import MARKS

import canary_kernels

#: a long user-kernel name, as a `file.py:function` path gives one
LONG = "some/where/deep/in/a/checkout/kernels/attention_variants.py:paged_decode"


def _report():
    kernels = {LONG: canary_kernels.zero_times_v, "qsa:grouped": "qsa:grouped"}
    return run_canary(kernels, payloads=["nan", "max"], backend="emulate")


def _parse(text: str) -> dict:
    """The matrix text back into {(kernel, region, plane, payload): mark}."""
    cells, payload_key = {}, {}
    key = re.search(r"# payloads: (.*?);", text).group(1)
    payload_key = dict(part.split(" ") for part in key.split(", "))
    for block in text.split("\n\n"):
        lines = [line for line in block.splitlines() if not line.startswith("#")]
        region_line, plane_line, payload_line, *rows = lines
        starts = [m.start() for m in re.finditer(r"\S+", region_line)][1:]
        for i, start in enumerate(starts):
            end = starts[i + 1] if i + 1 < len(starts) else None
            region = region_line[start:end].strip()
            marks = payload_line[start:end].split()
            planes = plane_line[start:end].split()
            per_plane = len(marks) // len(planes)
            for row in rows:
                kernel = row[:starts[0]].strip()
                for j, m in enumerate(row[start:end].split()):
                    cells[(kernel, region, planes[j // per_plane].lower(), payload_key[marks[j]])] = m
    return cells


def test_the_matrix_fits_120_columns_and_every_mark_is_its_cells_verdict():
    report = _report()
    lines = terminal(report, report.to_json())
    assert all(len(line) <= WIDTH for line in lines), max(lines, key=len)
    text = "\n".join(lines)
    assert "None" not in text and "qsa routes on emulate, device cpu" in " ".join(lines)
    shown = _parse(matrix(report))
    short = "..." + LONG[-(48 - 3):]
    want = {(short if r.kernel == LONG else r.kernel, r.region, r.plane, r.payload): MARKS[r.verdict]
            for r in report.results}
    assert shown == want


def test_a_narrow_terminal_wraps_every_region_into_its_own_block():
    report = _report()
    text = matrix(report, width=30)
    assert len(text.split("\n\n")) == len({r.region for r in report.results})


def test_a_long_note_folds_at_its_item_breaks():
    line = "# " + "   ".join(f"{i} item number {i}" for i in range(40))
    out = wrap(line)
    assert all(len(x) <= WIDTH for x in out) and out[0].startswith("# 0 item") and out[1].startswith("#   ")
    assert " ".join(x.lstrip("# ") for x in out).split() == line[2:].split()


def test_a_run_of_user_kernels_names_no_backend():
    report = run_canary({LONG: canary_kernels.zero_times_v}, regions=["null-block"], payloads=["nan"])
    head = " ".join(terminal(report, report.to_json())[:2])
    assert "backend" not in head and "qsa routes" not in head and "None" not in head and "device cpu" in head

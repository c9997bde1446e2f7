"""What the CLI prints and the docs say agree with the figures: the repro table fits 120
columns with its reference and expected columns, the diff table states pass/fail against the
tolerance and explains the reference row, `bench --help` describes itself, the README's
first-command numbers are the ones printed, and notebooks/README.md lists every notebook."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from qsa_lab.app.cli import main

REPO = Path(__file__).resolve().parents[2]
TINY = ["--rows", "19", "--context", "256", "--topk", "16", "--backend", "emulate"]


@pytest.fixture(scope="module")
def table():
    from qsa_lab.report.repro import REPRO_CASES, run_repro

    cases = [c for c in REPRO_CASES if c.report_key == "rows19-targeted" or c.poison.get("site") == "attended-k"]
    return run_repro(backend="emulate", cases=cases, progress=False, repeat=False,
                     geometry_overrides=dict(context=256, topk=16))[0]


def test_repro_stdout_fits_120_columns_with_reference_and_expectations(table):
    from qsa_lab.report.repro import format_table

    text = format_table(table)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 120, max(lines, key=len)
    head = lines[0].split()
    assert head[2:9] == ["ref", "xqa", "grp", "A", "B", "A+B", "C"] and head[-1] == "ok"
    rows = {l.split()[0]: l for l in lines[1:] if l[:2].strip().isdigit()}   # a long case name goes on below its row
    assert "480*" in rows["1"] and rows["1"].rstrip().endswith("yes") and " grp " in rows["1"]
    assert rows["2"].rstrip().endswith("yes") and "grp,A,B,A+B,C" in rows["2"]   # attended-k: as predicted
    assert any(l.startswith("#  1: unfixed grouped NaN") and l.endswith("[grp]") for l in lines)
    assert all(bool(v) for v in table["as_expected"])
    narrow = format_table(table, width=100)
    assert max(map(len, narrow.splitlines())) <= 100
    for text in (text, narrow):   # every case name whole, its words in order on its row and the lines under it
        lines = text.splitlines()
        case_w = lines[0].index("   ref") - 3                  # the case column: from 3 up to the first route
        shown = " ".join(line[3:3 + case_w].strip() for line in lines[1:] if not line.startswith("#"))
        for case in table["case"]:
            assert case in shown, (case, text)


def test_diff_table_passes_or_fails_against_the_tolerance_and_explains_the_reference(capsys):
    assert main(["diff", "--poison", "targeted"] + TINY) == 0
    out = capsys.readouterr().out
    rows = {l.split()[0]: l.split() for l in out.splitlines() if l and not l.startswith("#")}
    assert rows["grouped"][-1] == "FAIL" and rows["grouped+kernel_fix"][-1] == "pass"
    assert rows["reference"][-1] == "pass" and "within_tol" in rows["nan_count"]
    assert "0.002 + 0.02 * |reference|" in out and "rounded to fp16" in out


def test_help_texts():
    import argparse

    from qsa_lab.app.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bench = sub.choices["bench"]
    assert bench.description and "GPU" in bench.description and "data/bench_h200.json" in bench.description
    assert {"--json", "--quick", "--reps", "--force"} <= {o for a in bench._actions for o in a.option_strings}
    dims = next(a for a in sub.choices["diff"]._actions if "--dims" in a.option_strings)
    assert "attended-k" in dims.help and "attended-v" in dims.help


def test_bench_reps_is_checked_before_the_gpu(capsys):
    assert main(["bench", "--reps", "0"]) == 2
    assert capsys.readouterr().err.strip() == "qsa-lab: error: --reps: must be >= 1, got 0"


def test_readme_first_command_numbers_are_what_it_prints(capsys):
    readme = (REPO / "README.md").read_text()
    first = readme[readme.index("## See the bug in one command"):readme.index("## The bug")]
    assert main(["diff", "decode", "--poison", "targeted", "--context", "256", "--topk", "16"]) == 0
    out = capsys.readouterr().out
    nan_bytes = int(re.search(r"# poison: (\d+) NaN bytes", out).group(1))
    assert nan_bytes == 20 and "20 NaN bytes" in first and "five NaN" not in first


def test_notebooks_readme_lists_every_notebook():
    text = (REPO / "notebooks" / "README.md").read_text()
    for nb in sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        assert f"`{nb.stem}`" in text, nb.stem


def test_bench_playground_writes_results_and_warns_on_a_miss(tmp_path, monkeypatch, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_playground", REPO / "benchmarks" / "bench_playground.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.OUT == REPO / "results" / "bench_playground_cpu.json"     # never the committed evidence/ file
    slow = {"geometry": {}, "backend": "emulate", "first_draw_s": 9.0, "first_draw_cpu_s": 1.0, "changes": {},
            "median_redraw_s": 5.0, "worst_median_s": 5.0, "limit_s": 0.3, "first_draw_limit_s": 2.0}
    monkeypatch.setattr(bench, "bench_preset", lambda preset, repeat: dict(slow))
    preset = next(iter(__import__("qsa_lab.analysis.playground", fromlist=["PRESETS"]).PRESETS))
    out = tmp_path / "r" / "b.json"
    assert bench.main(["--preset", preset, "--json", str(out)]) == 0       # a miss on a loaded machine: a warning
    err = capsys.readouterr().err
    assert err.startswith(f"warning: {preset}: median redraw 5.000 s (target 0.3 s)") and out.exists()
    assert bench.main(["--preset", preset, "--json", str(out), "--strict"]) == 1

"""One vocabulary: every surface names a route or fix as routes.labels does (the letters only
beside a name), and an earlier spelling on the command line is refused with the name it has now."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from qsa_lab.routes import labels
from qsa_lab.routes.labels import FIXES, GROUPED, ROUTES, SHORT, fix_label, label

REPO = Path(__file__).resolve().parents[2]


def test_names_and_letters():
    assert ROUTES == ("reference", "xqa", "grouped", "grouped+kernel_fix", "grouped+pad_fix", "grouped+both_fixes",
                      "grouped+masked_load", "grouped+request_groups", "grouped+finite_pv")
    assert [label(r) for r in ROUTES[2:]] == ["grouped", "grouped+kernel_fix (A)", "grouped+pad_fix (B)",
                                              "grouped+both_fixes (A+B)", "grouped+masked_load (C)",
                                              "grouped+request_groups (R)", "grouped+finite_pv (F)"]
    assert [fix_label(f) for f in ("unfixed", *FIXES)] == ["unfixed", "kernel_fix (A)", "pad_fix (B)",
                                                           "both_fixes (A+B)", "masked_load (C)", "request_groups (R)",
                                                           "finite_pv (F)"]
    assert labels.COMPLETE_FIXES == ("grouped+request_groups", "grouped+finite_pv")
    assert labels.GROUPING == {"grouped+request_groups": "request"}
    assert labels.heading("grouped+pad_fix") == "pad_fix (B)" and labels.heading("xqa") == "xqa"
    assert labels.slug(["kernel_fix", "grouped+masked_load"]) == "kernel_fix+masked_load" and labels.slug([]) == "none"
    assert labels.short_key(ROUTES[2:4]) == "grp = grouped, A = grouped+kernel_fix"


@pytest.mark.parametrize("old, route", [("fixA", "grouped+kernel_fix"), ("A", "grouped+kernel_fix"),
                                        ("fix A", "grouped+kernel_fix"), ("grouped+fixA", "grouped+kernel_fix"),
                                        ("kernel_fix", "grouped+kernel_fix"), ("fixB", "grouped+pad_fix"),
                                        ("pad-fix", "grouped+pad_fix"), ("both", "grouped+both_fixes"),
                                        ("A+B", "grouped+both_fixes"), ("grouped+both", "grouped+both_fixes"),
                                        ("fixC", "grouped+masked_load"), ("C", "grouped+masked_load"),
                                        ("request-groups", "grouped+request_groups"),
                                        ("grouped+finitepv", "grouped+finite_pv")])
def test_earlier_spellings_name_the_route_now(old, route):
    assert labels.renamed_route(old) == route


def test_no_name_of_now_is_an_earlier_spelling():
    assert all(labels.renamed_route(r) is None for r in ROUTES)
    assert all(labels.renamed_fix(f) is None for f in (*FIXES, *labels.KERNEL_VARIANTS))
    assert set(labels.OLD_FIX_NAMES.values()) == set(FIXES)


def test_kernel_variants_and_bench_variants_come_from_labels():
    from qsa_lab.routes import bench, compiled, emulate, run

    assert emulate.VARIANTS == run.VARIANTS == labels.KERNEL_VARIANTS == ("unfixed", "kernel_fix", "masked_load",
                                                                          "finite_pv")
    assert set(labels.KERNEL_VARIANTS) <= set(compiled.VARIANTS)
    assert set(compiled.VARIANTS) == set(compiled.BARRIERS_PER_TILE)
    assert bench.VARIANTS[:len(FIXES) + 1] == ("unfixed", *FIXES)
    assert bench.PLAN_GROUPING == {"request_groups": "request"}
    # each fix variant runs the kernel and plan of its route
    assert all(bench.GROUPED_VARIANTS[labels.fix_of(r) or "unfixed"] == how for r, how in GROUPED.items())
    with pytest.raises(ValueError, match="^variants: 'both' is now called 'both_fixes'$"):
        bench.time_point(None, variants=("unfixed", "both"))


def _as_written_before(doc):
    """A document as an earlier version wrote it: the bench's variant `both`, the fix_a keys."""
    old_keys = {new: old for old, new in labels.OLD_KEYS.items()}
    if isinstance(doc, dict):
        return {("both" if k == "both_fixes" else old_keys.get(k, k)): _as_written_before(v) for k, v in doc.items()}
    return [_as_written_before(v) for v in doc] if isinstance(doc, list) else doc


def test_a_bench_json_of_an_earlier_version_is_read_by_the_names_of_now(tmp_path):
    from qsa_lab.analysis import bench_data

    now = json.loads(bench_data.BENCH_JSON.read_text())
    assert "both_fixes" in now["report_geometry"]["ms"] and "kernel_fix_vs_report" in now
    old = _as_written_before(now)
    assert "both" in old["report_geometry"]["ms"] and "fix_a_vs_report" in old and "kernel_fix_vs_report" not in old
    assert bench_data.current_names(old) == now
    cost = bench_data.fix_cost(old)
    measured = [v for v in ("unfixed", *FIXES) if v in now["report_geometry"]["us_per_tile"]]
    assert list(cost["variants"]) == measured and len(measured) >= 5   # a fix measured later joins the list
    assert cost == bench_data.fix_cost(now)
    assert cost["variants"]["both_fixes"]["us_per_tile"] == old["report_geometry"]["us_per_tile"]["both"]
    assert cost["report_v100_ratio"] == old["fix_a_vs_report"]["report_v100_ratio"] == 1.246
    (tmp_path / "old.json").write_text(json.dumps(old))
    df, _ = bench_data.load_bench(tmp_path / "old.json")
    assert "both_fixes" in set(df.route) and "both" not in set(df.route)


def test_an_upstream_fix_cost_json_of_an_earlier_version_loads(tmp_path):
    from qsa_lab.analysis import bench_data

    now = bench_data.load_upstream()
    assert now == json.loads(bench_data.UPSTREAM_JSON.read_text())          # committed in today's keys
    old = _as_written_before(now)
    assert "upstream_fix_a_ratio" in old["rows"][0] and "fix_a_commit" in old["upstream"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert bench_data.load_upstream(tmp_path / "old.json") == now
    bench = bench_data.bench_doc(False)
    assert bench_data.fix_cost(bench, old) == bench_data.fix_cost(bench, now)
    assert bench_data.fix_cost_table(old).equals(bench_data.fix_cost_table(now))


def _table():
    import pandas as pd

    row = {"case": "a case", **{f"nan[{r}]": 0 for r in ROUTES}, "differs_from_reference": "grouped",
           "expected_to_differ": "grouped,grouped+pad_fix", "as_expected": False, "expect": "what it predicts",
           **{f"max|{r}-xqa|": 1e-3 for r in labels.FIXED_ROUTES}, "max|xqa-reference|": 1e-4,
           "poisoned_dims": [1, 2], "report_grouped_nan": None}
    return pd.DataFrame([row])


def test_repro_text_table_heads_and_keys_from_labels():
    from qsa_lab.report.repro import format_table

    lines = format_table(_table()).splitlines()
    assert lines[0].split()[2:2 + len(ROUTES)] == [SHORT[r] for r in ROUTES]
    key = " ".join(line for line in lines if line.startswith("# "))
    assert all(f"{SHORT[r]} = {r}" in key for r in ROUTES if SHORT[r] != r)
    assert lines[-1].endswith("[grp,B]")


def test_repro_notebook_table_and_figure_headings_from_labels():
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from qsa_lab.analysis.figure_data import repro_display
    from qsa_lab.plotting.plots import plot_repro_table

    html = repro_display(_table()).to_html()
    heads = re.findall(r'class="col_heading[^"]*" >([^<]*)</th>', html)
    assert heads[2:2 + len(ROUTES)] == [SHORT[r] for r in ROUTES]
    assert labels.short_key() in html                         # the caption spells the abbreviations out
    ax = plot_repro_table(_table(), ax=Figure().add_subplot())
    cells = ax.tables[0].get_celld()
    header = [cells[0, j].get_text().get_text().replace("\n", " ") for j in range(2, 2 + len(ROUTES))]
    assert header == [labels.heading(r) for r in ROUTES]
    assert labels.short_key() in " ".join(ax.get_title().split())   # wrapped to the figure's width


def test_fix_cost_figure_labels_from_labels():
    import matplotlib
    matplotlib.use("Agg")

    from qsa_lab.report.figures import fix_cost_figure

    from qsa_lab.plotting.plots import FIX_COLORS

    assert list(FIX_COLORS) == ["unfixed", *FIXES]
    fig, _ = fix_cost_figure()
    ticks = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert ticks == [fix_label(v) for v in ("unfixed", *FIXES) if v in ticks_measured()]
    legend = [t.get_text() for t in fig.axes[2].get_legend().get_texts()]
    assert f"qsa_lab {fix_label('kernel_fix')}" in legend


def ticks_measured():
    """The fixes the committed bench JSON measured (by their names now)."""
    from qsa_lab.analysis import bench_data

    return bench_data.current_names(json.loads(bench_data.BENCH_JSON.read_text()))["report_geometry"]["us_per_tile"]


def test_canary_qsa_kernels_are_the_routes():
    from qsa_lab.canary.kernels import builtin_kernels, resolve_kernel

    assert [k for k in builtin_kernels() if k.startswith("qsa:")] == [f"qsa:{r}" for r in ROUTES]
    with pytest.raises(ValueError, match=r"^kernels: 'qsa:both' is now called 'qsa:grouped\+both_fixes'$"):
        resolve_kernel("qsa:both", "emulate")


@pytest.mark.parametrize("given, now", [("qsa:fixA", "qsa:grouped+kernel_fix"), ("qsa:A", "qsa:grouped+kernel_fix"),
                                        ("qsa:both", "qsa:grouped+both_fixes"),
                                        ("torch:sdpa-math,qsa:grouped+fixC", "qsa:grouped+masked_load")])
def test_an_earlier_spelling_on_the_command_line_names_the_new_one(given, now, capsys):
    from qsa_lab.app.cli import main

    assert main(["canary", "--kernels", given]) == 2
    old = given.split(",")[-1]
    assert capsys.readouterr().err == f"qsa-lab: error: --kernels: {old!r} is now called {now!r}\n"


def test_no_other_module_spells_a_fix_by_its_letter():
    """The letters and the old spellings live in labels.py alone (the playground's export names too:
    labels.slug; the JSON keys too: labels.OLD_KEYS)."""
    old = re.compile(r"fix [ABC]\b|fix[ABC]\b|(?<![a-z])fix_[abc](?![a-z])|\"both\"|'both'", re.IGNORECASE)
    found = [f"{p.relative_to(REPO)}:{i}" for p in sorted((REPO / "qsa_lab").rglob("*.py"))
             if p.name != "labels.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if old.search(line)]
    found += [p.name for p in sorted((REPO / "notebooks").glob("*.ipynb")) if old.search(p.read_text())]
    # and every other surface: the committed data (its JSON keys), docs, benchmarks, the READMEs
    others = [REPO / "README.md", *(REPO / "data").iterdir(), *(REPO / "docs").rglob("*.md"),
              *(REPO / "docs" / "hooks").glob("*.py"), *(REPO / "benchmarks").glob("*.*"),
              *(REPO / "notebooks").glob("*.md")]
    found += [f"{p.relative_to(REPO)}:{i}" for p in sorted(others) if p.suffix in (".md", ".py", ".sh", ".json", ".csv")
              for i, line in enumerate(p.read_text().splitlines(), 1) if old.search(line)]
    assert found == []

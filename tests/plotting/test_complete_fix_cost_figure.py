"""The complete fixes' cost as notebook 05 and the docs show it, from a qsa_lab.complete_fix_cost/1
document (benchmarks/complete_fix_cost.py), and the note drawn while none is committed."""
from __future__ import annotations

import json

import matplotlib
import pytest

matplotlib.use("Agg")

from qsa_lab.analysis import bench_data  # noqa: E402
from qsa_lab.plotting.plots import plot_complete_fix_cost  # noqa: E402


def doc():
    def route(us, groups, xqa):
        return {"median_us": us, "p10_us": us * 0.95, "p90_us": us * 1.1, "groups": groups, "xqa_rows": xqa,
                "tiles": 10 * groups, "tiles_longest_group": 12}
    routes = {"grouped": route(90, 6, 1), "grouped+kernel_fix": route(100, 6, 1), "grouped+masked_load": route(92, 6, 1),
              "grouped+request_groups": route(76, 5, 9), "grouped+finite_pv": route(91, 6, 1),
              "grouped+finite_pv, NaN in V": route(120, 6, 1), "xqa": route(300, 0, 49)}
    return {"schema": "qsa_lab.complete_fix_cost/1", "gpu": "a GPU",
            "shapes": [{"name": "upstream-mix", "routes": routes}, {"name": "aligned: 19 / 1", "routes": routes}]}


def test_table_and_figure_data(tmp_path):
    d = doc()
    table = bench_data.complete_fix_table(d)
    assert list(table.index) == ["upstream-mix", "aligned: 19 / 1"]
    assert table.loc["upstream-mix", "kernel_fix (A) µs"] == 100.0
    assert table.loc["upstream-mix", "grouped+request_groups (R) ×A"] == "0.76 (0.72–0.84)"
    assert table.loc["upstream-mix", "groups + XQA rows: A | R"] == "6 + 1 | 5 + 9"
    data = bench_data.complete_fix_data(d)
    assert "grouped+kernel_fix" not in data["routes"] and data["shapes"][0]["ratios"]["xqa"] == (3.0, 2.85, 3.3)
    ax = plot_complete_fix_cost(data)
    assert len(ax.patches) == 2 * len(data["routes"]) and ax.get_yticklabels()[0].get_text() == "upstream-mix"
    path = tmp_path / "c.json"
    path.write_text(json.dumps(d))
    assert bench_data.load_complete_fix(path) == d
    path.write_text(json.dumps({**d, "schema": "other"}))
    with pytest.raises(ValueError, match="complete_fix_cost/1"):
        bench_data.load_complete_fix(path)


def test_nothing_committed_draws_a_note(tmp_path):
    assert bench_data.load_complete_fix(tmp_path / "absent.json") is None
    assert bench_data.complete_fix_data(None) is None
    ax = plot_complete_fix_cost(None)
    assert "not measured yet" in ax.texts[0].get_text() and not ax.axison

"""benchmarks/complete_fix_cost.py without a GPU: its shapes mix requests where they say so, each
route's plan and what it walks, the spread and the goals read from a run."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from qsa_lab.model.case import build_case
from qsa_lab.model.plan import form_groups

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("complete_fix_cost", ROOT / "benchmarks" / "complete_fix_cost.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shapes_mix_requests_where_they_say(bench):
    for name, g in bench.SHAPES.items():
        small = build_case(g.replace(context=max(64, max(g.rows_of_requests()) + g.requests + 3), head_dim=16, topk=8))
        rows, _ = form_groups(small, "consecutive")
        mixed = any(len(set(small.token_to_req[r].tolist())) > 1 for r in rows)
        assert mixed == (not name.startswith(("aligned", "report"))), name
    assert set(bench.QUICK) <= set(bench.SHAPES)


def test_plans_and_what_a_route_walks(bench):
    g = bench.SHAPES["upstream-mix: 49 / 4 (46+1+1+1), ctx 8192"].replace(context=400, head_dim=16, topk=128)
    case = build_case(g)
    plans = bench.plans(case)
    assert set(plans) == set(bench.ROUTES)
    grouped, aligned = bench.plan_stats(plans["grouped"], g.rows), bench.plan_stats(plans["grouped+request_groups"],
                                                                                    g.rows)
    assert (grouped["groups"], grouped["xqa_rows"]) == (6, 1)                # 48 rows grouped, row 48 to XQA
    assert (aligned["groups"], aligned["xqa_rows"]) == (5, 9)                # 40 rows of request 0; 6 + 3 to XQA
    assert grouped["tiles_longest_group"] > aligned["tiles_longest_group"]   # the mixed group walks 3 requests
    assert bench.plan_stats(None, 49) == {"groups": 0, "tiles": 0, "tiles_longest_group": 0, "xqa_rows": 49}


def test_spread_and_goals(bench):
    s = bench.spread([float(x) for x in range(1, 101)])
    assert (s["median_us"], s["min_us"], s["max_us"], s["n"]) == (50.5, 1.0, 100.0, 100)
    assert s["p10_us"] < s["median_us"] < s["p90_us"]

    def shape(name, fix, r, f):
        mk = lambda m, p10: {"median_us": m, "p10_us": p10, "ratio_to_kernel_fix": m / fix}  # noqa: E731
        return {"name": name, "routes": {"grouped+kernel_fix": mk(fix, fix), "grouped+request_groups": mk(r, r * 0.99),
                                         "grouped+finite_pv": mk(f, f * 0.99)}}
    goals = bench.goals([shape("upstream-mix", 10, 7, 9.5), shape("aligned: 19 / 1", 10, 10, 10.5)])
    assert goals["grouped+request_groups"] == {"slower_than_kernel_fix_beyond_spread": [],
                                               "faster_on_mixed": ["upstream-mix"], "mixed_shapes": 1,
                                               "never_slower": True}
    assert goals["grouped+finite_pv"]["slower_than_kernel_fix_beyond_spread"] == ["aligned: 19 / 1"]

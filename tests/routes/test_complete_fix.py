"""Issue 37 on the emulation: one request's non-finite V reaches the other requests' rows of a mixed
group under every upstream fix, never under the complete fixes (request_groups, finite_pv); a
finite payload leaks nowhere; the reference is clean; finite_pv gives a row exactly the non-finite
result of the values it attends; request-aligned groups with padded remainders."""
from __future__ import annotations

import pytest
import torch

from qsa_lab.analysis.cross_request import (CrossRequestReport, cross_request, judge, leak_records, nonfinite_rows,
                                            pivot_frame, pivot_text, row_map)
from qsa_lab.model.case import build_case
from qsa_lab.model.geometry import MIXES, Geometry
from qsa_lab.model.plan import EMPTY_ROW, REMAINDER_GROUP_MIN, form_groups, plan_groups
from qsa_lab.model.poison import poison_request
from qsa_lab.routes import emulate
from qsa_lab.routes.labels import COMPLETE_FIXES
from qsa_lab.routes.run import grouped_output, run_routes

SMALL = dict(head_dim=64, context=400, topk=128)   # upstream's rows and groups; every block selected
UPSTREAM = MIXES["upstream-mix"].replace(**SMALL)


@pytest.fixture(scope="module")
def upstream_nan_in_request_0():
    return run_routes(poison_request(build_case(UPSTREAM), 0, "nan"), backend="emulate")


def test_upstream_shape_mixes_requests_in_one_group():
    case = build_case(UPSTREAM)
    rows, rest = form_groups(case, "consecutive")
    assert rows.shape == (6, 8) and rest.tolist() == [48]
    assert sorted(set(case.token_to_req[rows[5]].tolist())) == [0, 1, 2]       # rows 40-47: requests 0, 1, 2


def test_acceptance_nan_in_request_0(upstream_nan_in_request_0):
    res = upstream_nan_in_request_0
    req = res.case.token_to_req
    assert not nonfinite_rows(res.reference64)[req != 0].any()                  # the reference: others clean
    assert nonfinite_rows(res.reference64)[req == 0].all()
    for route in ("grouped", "grouped+kernel_fix", "grouped+both_fixes", "grouped+pad_fix", "grouped+masked_load"):
        bad = torch.nonzero(nonfinite_rows(res.outputs[route]) & (req != 0)).flatten().tolist()
        assert bad == [46, 47], route                                           # requests 1 and 2 in the mixed group
    for route in ("xqa", *COMPLETE_FIXES):
        assert not nonfinite_rows(res.outputs[route])[req != 0].any(), route
        out, ref = res.outputs[route], res.reference64
        assert torch.equal(torch.isnan(out), torch.isnan(ref)) and torch.equal(torch.isinf(out), torch.isinf(ref))


@pytest.mark.parametrize("q_heads,reached", [(2, {1: [40, 41, 42, 43, 44, 45, 47]}), (6, {1: [45, 47]}),
                                             (8, {1: [47], 2: [46]})])
def test_reach_follows_the_m_tiles(q_heads, reached):
    """Which rows a request's NaN reaches under kernel_fix depends on who shares its 16-row M-tiles:
    at 2 heads the whole group, at 6 the adjacent rows, at 8 the neighbour of the same M-tile."""
    base = build_case(UPSTREAM.replace(q_heads=q_heads))
    for r, rows in reached.items():
        res = run_routes(poison_request(base, r, "nan"), ["reference", "grouped+kernel_fix", *COMPLETE_FIXES],
                         backend="emulate")
        req = res.case.token_to_req
        assert torch.nonzero(nonfinite_rows(res.outputs["grouped+kernel_fix"]) & (req != r)).flatten().tolist() == rows
        for route in COMPLETE_FIXES:
            assert not nonfinite_rows(res.outputs[route])[req != r].any(), (q_heads, r, route)


def test_finite_control_leaks_nowhere():
    records = cross_request(UPSTREAM, payloads=("max",), requests=[0, 1], backend="emulate")
    assert records and not leak_records(records) and all(x["verdict"] in ("n/a", "clean") for x in records)
    report = CrossRequestReport("emulate", "upstream-mix", [], records)
    assert report.exit_code() == 0 and report.counts()["leaking"] == 0 and not report.nothing_checked()


def test_inf_own_rows_as_the_reference_only_with_finite_pv():
    """An Inf in request 0's V: its own rows are Inf in the reference; kernel_fix multiplies that Inf by
    the zero P of a token a row does not attend but its neighbour does (0 * Inf = NaN), finite_pv does not."""
    records = cross_request(UPSTREAM.replace(kv_dtype="fp16"), payloads=("inf",), requests=[0], backend="emulate",
                            routes=["grouped+kernel_fix", "grouped+finite_pv", "xqa"])
    own = {x["route"]: x["as_reference"] for x in records if x["request"] == x["poisoned_request"]}
    assert own == {"reference": True, "grouped+kernel_fix": False, "grouped+finite_pv": True, "xqa": True}
    assert {x["verdict"] for x in records if x["request"] == 0} == {"n/a"}
    assert {x["route"] for x in leak_records(records)} == {"grouped+kernel_fix"}
    assert {x["verdict"] for x in leak_records(records)} == {"nan-leak"}       # 0 * Inf = NaN in the other rows
    report = CrossRequestReport("emulate", "upstream-mix", [], records)
    assert report.exit_code() == 0                                              # kernel_fix need not stay clean
    assert CrossRequestReport("emulate", "upstream-mix", [], [dict(x, route="xqa") for x in records]).exit_code() == 1


def test_e4m3_has_no_inf_payload():
    records = cross_request(UPSTREAM, payloads=("inf",), requests=[0], backend="emulate")
    assert [x["verdict"] for x in records] == ["n/a"] and "no inf code" in records[0]["note"]
    report = CrossRequestReport("emulate", "upstream-mix", [], records)
    assert report.nothing_checked() and report.exit_code() == 3 and report.unavailable() == ["e4m3 has no inf code"]


def test_tables_and_figure_data(upstream_nan_in_request_0):
    records = [{"q_heads": 6, "kv_dtype": "e4m3", **x} for x in judge(upstream_nan_in_request_0, 0, "nan")]
    table = pivot_frame(records, 6)
    assert table.loc["grouped+kernel_fix", "nan in r0"] == "r1:46 r2:47"
    assert table.loc["grouped+finite_pv", "nan in r0"] == "-"
    assert pivot_text(records, 6) == table.to_string()          # the command's table, without pandas
    records[0]["as_reference"] = False                          # a '*' cell: wider than its column's others
    assert pivot_text(records, 6) == pivot_frame(records, 6).to_string()
    assert "*" in pivot_text(records, 6)
    data = row_map(records, UPSTREAM, "nan", 0)
    assert data["nonfinite"]["grouped+kernel_fix"] == list(range(48))            # 0-45 own, 46-47 the leak
    assert data["request_of_row"][44:] == [0, 0, 1, 2, 3] and data["grouped_rows"] == 48
    with pytest.raises(ValueError, match="poisoned_request"):
        row_map(records, UPSTREAM, "nan", 3)


def test_padded_remainder_groups():
    case = poison_request(build_case(MIXES["prefill-mix"].replace(**SMALL)), 1, "nan")
    rows, rest = form_groups(case, "request", remainder_group_min=5)    # remainders 4, 5, 7: the last two padded
    assert rest.tolist() == [16, 17, 18, 19]
    assert rows.shape == (5, 8) and rows[-1].tolist() == [33, 34, 35, 36, 37, 38, 39, EMPTY_ROW]
    assert rows[3].tolist() == [28, 29, 30, 31, 32, EMPTY_ROW, EMPTY_ROW, EMPTY_ROW]
    assert REMAINDER_GROUP_MIN == 8 and form_groups(case, "request")[1].numel() == 16   # the default: XQA
    plan = plan_groups(case, "request", remainder_group_min=1)
    ref = run_routes(case, ["reference"], backend="emulate").reference64
    for variant in ("kernel_fix", "finite_pv"):
        out = grouped_output(case, plan, variant, emulate, checked=True)
        assert torch.equal(torch.isnan(out), torch.isnan(ref)), variant     # request 1's rows only, as the reference
        g = emulate.grouped_forward(case.q, case.kv_cache, case.k_scale, case.v_scale, plan.members,
                                    plan.microblocks, plan.masks, plan.seq_len, kv_dtype=case.kv_dtype,
                                    sm_scale=case.sm_scale, variant=variant)
        empty = plan.members == EMPTY_ROW
        assert torch.equal(g[empty], torch.zeros_like(g[empty]))           # an empty slot's output is 0
    with pytest.raises(ValueError, match="remainder_group_min"):
        form_groups(case, "request", remainder_group_min=0)


def test_request_rows_geometry():
    g = Geometry(rows=5, requests=2, request_rows=[3, 2], context=40)
    assert g.request_rows == (3, 2) and g.rows_of_requests() == [3, 2]
    assert Geometry(rows=5, requests=2).rows_of_requests() == [3, 2]
    case = build_case(g.replace(head_dim=16, topk=8))
    assert case.token_to_req.tolist() == [0, 0, 0, 1, 1]
    for bad in ((3, 3), (5,), (5, 0), (2.5, 2.5)):
        with pytest.raises(ValueError, match="^request_rows: "):
            Geometry(rows=5, requests=2, request_rows=bad, context=40)
    assert [MIXES[m].rows_of_requests()[:2] for m in MIXES] == [[46, 1], [20, 13], [4, 3]]


def test_poison_request_checks_its_arguments():
    case = build_case(UPSTREAM)
    for kw, arg in ((dict(request=4), "request"), (dict(request=True), "request"), (dict(request=0, payload="inf"),
                    "payload"), (dict(request=0, dims=[64]), "dims"), (dict(request=0, plane="kv"), "plane")):
        with pytest.raises(ValueError, match=f"^{arg}"):
            poison_request(case, **kw)
    p = poison_request(case, 2, "nan", dims=[3])
    assert p.poison["site"] == "request" and p.poison["request"] == 2 and p.poison["poisoned_dims"] == [3]
    assert p.poison["nan_bytes"] == p.poison["slots"] == int(case.seq_lens[2])     # every written token of request 2

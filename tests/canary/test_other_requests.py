"""The other-requests region (issue 33, item 3): a row that reads another request's page (past
its own last page, or through a wrong block-table row) is flagged under every layout, with or
without free pages; a correct kernel stays clean there, because only the rows of the request
under test are judged."""
import itertools
from pathlib import Path

import pytest
import torch

import canary_kernels as ck
from qsa_lab.app.cli import main
from qsa_lab.canary import run_canary
from qsa_lab.canary.case import canary_case
from qsa_lab.model.regions import _request_splits, region_parts, region_slots, request_pages

LAYOUTS = [dict(layout=lay, free_pages=fp) for lay in ("contiguous", "scatter") for fp in (0, 2)]
KERNELS = {"past": ck.reads_past_last_page, "other": ck.reads_other_request_page, "reference": ck.reference,
           "zero_times_v": ck.zero_times_v}


@pytest.mark.parametrize("geometry", LAYOUTS, ids=lambda g: f"{g['layout']}-free{g['free_pages']}")
def test_cross_request_reads_are_flagged_and_correct_kernels_clean(geometry):
    rep = run_canary(KERNELS, regions=["other-requests"], payloads=["nan", "inf"], backend="emulate", **geometry)
    v = {(r.kernel, r.plane, r.payload): r for r in rep.results}
    rows = rep.case.token_to_req
    for plane, payload in itertools.product("kv", ("nan", "inf")):
        assert v["past", plane, payload].verdict == "nan-leak"    # 0 * Inf is NaN too
        assert v["other", plane, payload].verdict == "nan-leak"
        # the last request has no next page in the packed list: only the first two requests' rows leak
        assert v["past", plane, payload].where()["rows"] == torch.nonzero(rows < 2).flatten().tolist()
        assert v["other", plane, payload].where()["rows"] == list(range(rep.case.rows))
        # their own pages are poisoned for the OTHER requests' rows, which are not judged: clean
        assert v["reference", plane, payload].verdict == "clean"
        assert v["zero_times_v", plane, payload].verdict == "clean"


def test_the_default_matrix_flags_a_cross_request_read_with_no_free_pages(capsys):
    kernel = f"{Path(ck.__file__)}:reads_past_last_page"
    code = main(["canary", "--kernel", kernel, "--layout", "scatter", "--free-pages", "0", "--payloads", "nan",
                 "--planes", "v"])
    out = capsys.readouterr().out
    assert code == 1
    assert "nan-leak at other-requests" in out


def test_parts_pages_of_other_requests_judged_on_the_request_rows():
    case = canary_case(layout="scatter", free_pages=0)
    maps = request_pages(case)
    parts = region_parts(case, "other-requests")
    assert len(parts) == case.requests
    for r, (slots, rows) in enumerate(parts):
        assert torch.equal(rows, case.token_to_req == r)
        want = maps[[s for s in range(case.requests) if s != r]].any(0) & ~maps[r]
        assert torch.equal(slots.any(1), want) and bool(slots[want].all())
        assert not slots[0].any()   # the null block is its own region
    assert torch.equal(region_slots(case, "other-requests"), parts[0][0] | parts[1][0] | parts[2][0])
    assert region_parts(canary_case(requests=1, rows=3), "other-requests") == []


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 33])
def test_splits_cover_every_ordered_pair_of_requests(n):
    splits = _request_splits(n)
    for r, s in itertools.permutations(range(n), 2):
        assert any(r in judged and s in poisoned for judged, poisoned in splits), (r, s)
    assert all(not (judged & poisoned) for judged, poisoned in splits)
    assert len(splits) <= max(n, 2 * (n - 1).bit_length())


def test_a_report_writes_no_call_file_for_a_cross_request_leak(tmp_path):
    """A call file is judged on every row, and the poisoned requests' own rows attend those pages:
    a replay of it would blame a correct kernel. The report shows where the leak lands, no call."""
    from qsa_lab.canary.report import write_report

    rep = run_canary({"other": ck.reads_other_request_page}, regions=["other-requests", "stale-tail"],
                     payloads=["nan"], planes=["v"], backend="emulate")
    assert {r.region: r.verdict for r in rep.results} == {"other-requests": "nan-leak", "stale-tail": "clean"}
    text = write_report(rep, tmp_path / "r", minimize=False).read_text()
    assert not list((tmp_path / "r" / "calls").glob("*other-requests*"))
    assert "other-requests / V plane" in text and "No call file: this region is judged one request at a time" in text


@pytest.mark.parametrize("requests", [3, 4, 5, 8, 16])
def test_one_requests_read_of_anothers_page_is_caught_at_any_request_count(requests):
    """Request 0's rows read request 1's first page. From 5 requests each row is judged by several
    parts (one per bit of the request id); the parts that do not poison request 1 must not hide
    the one that does (it used to: exit 0 at 5, 8 and 16 requests)."""
    rep = run_canary({"r0": ck.request0_reads_request1, "reference": ck.reference}, regions=["other-requests"],
                     payloads=["nan"], planes=["v"], backend="emulate", requests=requests, rows=2 * requests,
                     context=40, free_pages=0)
    leak, clean = rep.find("r0", "other-requests", "v", "nan"), rep.find("reference", "other-requests", "v", "nan")
    assert leak.verdict == "nan-leak", leak.describe()
    assert leak.where()["rows"] == torch.nonzero(rep.case.token_to_req == 0).flatten().tolist()
    assert clean.verdict == "clean"
    assert rep.exit_code() == 1

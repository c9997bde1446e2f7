"""The per-row rule (issue 37, item 6): the opt-in region other-rows poisons, for each row, the slots
OTHER rows attend and it does not, and judges that row alone. It finds the spread within one request
(row p multiplying a V that only later rows attend) as well as across requests; a correct kernel
stays clean; the default regions do not include it."""
import torch

import canary_kernels as ck
from qsa_lab.app.cli import main
from qsa_lab.canary import run_canary
from qsa_lab.canary.case import canary_case
from qsa_lab.model.regions import OPT_IN, attended_slots, check_region, region_parts, region_slots, regions_of


def test_parts_one_row_each_with_what_others_attend():
    case = canary_case()
    assert "other-rows" in OPT_IN and "other-rows" not in regions_of(case.spec)
    check_region("other-rows", case.spec)                                    # allowed when named
    parts = region_parts(case, "other-rows")
    everyone = attended_slots(case)
    union = torch.zeros_like(everyone)
    for slots, rows in parts:
        assert int(rows.sum()) == 1
        mine = attended_slots(case, rows)
        assert torch.equal(slots, everyone & ~mine)                          # others' slots, never its own
        union |= slots
    assert len(parts) == case.rows and torch.equal(region_slots(case, "other-rows"), union)


def test_a_correct_kernel_is_clean_and_zero_times_v_leaks():
    rep = run_canary({"reference": ck.reference, "zero_times_v": ck.zero_times_v}, regions=["other-rows"],
                     payloads=["nan"], planes=["v"], backend="emulate")
    verdicts = {r.kernel: r.verdict for r in rep.results}
    assert verdicts == {"reference": "clean", "zero_times_v": "nan-leak"}


def test_within_one_request_request_groups_leaks_finite_pv_does_not():
    """16 rows of one request (two groups): no group spans requests, so other-requests has nothing to
    find; the per-row rule sees kernel_fix's kernel multiply a row by the NaN its neighbours attend."""
    routes = ["qsa:grouped+kernel_fix", "qsa:grouped+request_groups", "qsa:grouped+finite_pv", "qsa:xqa"]
    rep = run_canary(routes, regions=["other-rows"], payloads=["nan", "inf"], planes=["v"], backend="emulate",
                     requests=1, rows=16, context=40)
    v = {(r.kernel, r.payload): r.verdict for r in rep.results}
    for payload in ("nan", "inf"):
        assert v["qsa:grouped+kernel_fix", payload] == v["qsa:grouped+request_groups", payload] == "nan-leak"
        assert v["qsa:grouped+finite_pv", payload] == v["qsa:xqa", payload] == "clean"


def test_cli_runs_it_when_named(capsys):
    code = main(["canary", "--kernels", "qsa:grouped+finite_pv,qsa:grouped+kernel_fix", "--regions", "other-rows",
                 "--payloads", "nan", "--planes", "v", "--backend", "emulate"])
    out = capsys.readouterr().out
    assert code == 1 and "qsa:grouped+kernel_fix: nan-leak at other-rows" in out
    assert "qsa:grouped+finite_pv" not in out.split("# . clean")[1]           # no leak line for finite_pv

"""`qsa-lab cross-request` (the mixed-request case) and the mixed presets on the command line."""
from __future__ import annotations

import json

import pytest

from qsa_lab.analysis.leaks import LEAKS
from qsa_lab.app.cli import main

SMALL = ["--head-dim", "32", "--context", "120", "--topk", "32", "--backend", "emulate"]


def test_cross_request_table_and_exit(capsys):
    assert main(["cross-request", "--q-heads", "6", "--requests", "1", "--payloads", "nan,max", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "groups of 8 consecutive rows that mix requests: 40-47 (requests 0,1,2)" in out
    line = next(x for x in out.splitlines() if x.startswith("grouped+kernel_fix "))
    assert line.split()[1:] == ["r0:45", "r2:47", "-"]          # nan in r1 reaches rows 45 and 47; max: nothing
    assert next(x for x in out.splitlines() if x.startswith("grouped+finite_pv ")).split()[1:] == ["-", "-"]
    assert "# must stay clean (reference, xqa, the complete fixes): none leaks" in out


def test_cross_request_json(capsys, tmp_path):
    assert main(["cross-request", "prefill-mix", "--q-heads", "2", "--requests", "0", "--payloads", "nan",
                 "--routes", "grouped+both_fixes,grouped+request_groups", "--json", "-", *SMALL]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "qsa_lab.cross_request/2" and doc["mix"] == "prefill-mix" and doc["must_be_clean_leaks"] == 0
    assert doc["exit_code"] == 0 and doc["qsa_lab_version"] and doc["gpu"]       # the report base's header
    assert doc["runs"][0]["geometry"]["request_rows"] == [20, 13, 7]
    assert [g["requests"] for g in doc["runs"][0]["groups"] if g["mixed"]] == [[0, 1], [1, 2]]
    leak = [r for r in doc["records"] if r["verdict"] in LEAKS]
    assert {r["route"] for r in leak} == {"grouped+both_fixes"} and {r["request"] for r in leak} == {1}
    assert {r["verdict"] for r in leak} == {"nan-leak"} and all(r["nan"] > 0 and r["inf"] == 0 for r in leak)
    own = [r for r in doc["records"] if r["request"] == r["poisoned_request"]]
    assert own and {r["verdict"] for r in own} == {"n/a"}                     # the poisoned request's own rows
    assert doc["counts"] == {"cells": len(doc["records"]), "checks": len(doc["records"]) - len(own),
                             "leaking": len(leak)}



def _cores(monkeypatch, idle: bool):
    """Whether a core is free for cross-request's second process."""
    from qsa_lab.support import processes

    monkeypatch.setattr(processes, "idle_core", lambda: idle)


def test_cross_request_progress_counts_runs_on_stderr(capsys, monkeypatch):
    """One line a poisoned run on stderr, counted of the total (q-heads x requests x payloads with a code:
    e4m3 has no inf); none under --json -."""
    _cores(monkeypatch, False)
    assert main(["cross-request", "--q-heads", "2,6", "--requests", "0,2", "--payloads", "nan,inf", *SMALL]) == 0
    out, err = capsys.readouterr()
    lines = [x for x in err.splitlines() if x.startswith("# [")]
    assert "# cross-request: 4 poisoned runs" in err and "# [" not in out
    assert [x.split("]")[0] for x in lines] == [f"# [{i}/4" for i in range(1, 5)]
    assert lines[0] == "# [1/4] q_heads 2, nan in request 0" and lines[-1].startswith("# [4/4] q_heads 6, nan in request 2 (about ")
    assert main(["cross-request", "--q-heads", "6", "--requests", "1", "--payloads", "nan", "--json", "-", *SMALL]) == 0
    assert capsys.readouterr().err == ""

def _undated(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k != "date"}


@pytest.mark.parametrize("fate", ["runs", "dies"])
@pytest.mark.parametrize("heads, requests, told, last_here, last_there", [
    ("6,2", "0,1", "# q_heads 6: in a second process", "# [4/4] q_heads 2, max in request 1",
     "# [8/8] q_heads 6, max in request 1"),
    # three counts: q_heads 6 there, and the max runs of q_heads 2 (the fewest heads) too, which evens the ends out
    ("6,2,4", "0,1,2", "# q_heads 6 and q_heads 2 (max): in a second process", "# [9/9] q_heads 4, max in request 2",
     "# [18/18] q_heads 2, max in request 2")])
def test_a_second_process_takes_part_of_the_runs_and_the_report_is_the_same(capsys, monkeypatch, fate, heads,
                                                                            requests, told, last_here, last_there):
    """With a core to spare the geometry with the most query heads (and, with three, part of the one with
    the fewest) runs in a second process (and if that process dies, here): the report is the one a single
    process gives, record for record."""
    import os
    import signal

    from qsa_lab.app import cross_request as app
    from qsa_lab.support.executor import SecondProcess

    argv = ["cross-request", "--q-heads", heads, "--requests", requests, "--payloads", "nan,max", *SMALL]
    _cores(monkeypatch, False)
    assert main([*argv, "--json", "-"]) == 0
    alone = json.loads(capsys.readouterr().out)
    _cores(monkeypatch, True)
    started, start, submit = [], app._second, SecondProcess.submit
    monkeypatch.setattr(app, "_second", lambda g: started.append(start(g)) or started[-1])
    if fate == "dies":
        monkeypatch.setattr(SecondProcess, "submit", lambda self, *a: os.kill(self.pid, signal.SIGKILL) or submit(self, *a))
    assert main([*argv, "--json", "-"]) == 0
    beside = json.loads(capsys.readouterr().out)
    assert len(started) == 1 and isinstance(started[0], SecondProcess) and started[0]._pool is None   # ended
    assert _undated(beside) == _undated(alone)
    assert {r["q_heads"] for r in alone["records"]} == set(map(int, heads.split(","))) and alone["counts"]["leaking"] > 0
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"{told}, beside these" in err
    assert last_here in err
    assert (last_there in err) == (fate == "dies")     # run here after all


def test_the_second_process_takes_part_of_a_geometry_only_where_the_ends_come_closer():
    """_jobs: the geometry with the most heads goes there; of three equal geometries, the second half of the
    checked payloads of the one with the fewest heads goes too (records in order: its first part here);
    with two geometries, or one checked payload, nothing more moves."""
    from types import SimpleNamespace

    from qsa_lab.app import cross_request as app

    def jobs(heads, payloads, apart, requests=None):
        args = SimpleNamespace(mix="upstream-mix", q_heads=heads, kv_dtype="e4m3", payloads=payloads,
                               requests=requests, routes=None, dims=None, context=None, head_dim=None, topk=None,
                               seed=None, json=None, force=False)
        return app._jobs(app.check_args(args), apart)

    assert jobs([2, 6, 8], "nan,inf,max", 2) == ([(0, ("nan", "inf")), (1, ("nan", "inf", "max"))],
                                                 [(2, ("nan", "inf", "max")), (0, ("max",))])
    assert jobs([8, 6, 2], "nan,zero,max", 0) == ([(1, ("nan", "zero", "max")), (2, ("nan", "zero"))],
                                                  [(0, ("nan", "zero", "max")), (2, ("max",))])
    assert jobs([2, 6, 8], "nan,inf,max", None) == ([(i, ("nan", "inf", "max")) for i in range(3)], [])
    assert jobs([2, 6], "nan,max", 1) == ([(0, ("nan", "max"))], [(1, ("nan", "max"))])
    assert jobs([2, 6, 8], "nan,inf", 2) == ([(0, ("nan", "inf")), (1, ("nan", "inf"))], [(2, ("nan", "inf"))])
    # one request a geometry: moving one run costs about two here and there, so nothing moves
    assert jobs([2, 6, 8], "nan,max", 2, [0]) == ([(0, ("nan", "max")), (1, ("nan", "max"))], [(2, ("nan", "max"))])


def test_cross_request_leak_in_a_route_that_must_stay_clean_exits_1(capsys, monkeypatch):
    """Exit 1 comes from the routes that must stay clean only: here xqa is made to read as leaking."""
    from qsa_lab.analysis import cross_request as xr

    monkeypatch.setattr(xr, "MUST_BE_CLEAN", ("grouped+kernel_fix",))
    assert main(["cross-request", "--q-heads", "6", "--requests", "1", "--payloads", "nan", *SMALL]) == 1
    assert "# must stay clean (reference, xqa, the complete fixes): LEAK in grouped+kernel_fix" in capsys.readouterr().out


def test_cross_request_that_checks_nothing_exits_3(capsys):
    """e4m3 has no Inf code: every record n/a, no check ran, and that is never a pass."""
    assert main(["cross-request", "--q-heads", "6", "--payloads", "inf", *SMALL]) == 3
    out, err = capsys.readouterr()
    assert "# n/a: e4m3 has no inf code" in out
    assert err.strip().splitlines()[-1] == ("qsa-lab: cross-request: no check ran: the cache's dtype has a code "
                                            "for none of the payloads")


@pytest.mark.parametrize("argv, flag", [(["--payloads", "nan,zap"], "--payloads"), (["--requests", "4"], "--requests"),
                                        (["--q-heads", "0"], "--q-heads"), (["--routes", "fixA"], "--routes"),
                                        (["--dims", "999"], "--dims"), (["--head-dim", "20"], "--head-dim")])
def test_cross_request_bad_input_names_the_argument(argv, flag, capsys):
    assert main(["cross-request", *argv, "--backend", "emulate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"qsa-lab: error: {flag}: "), err


def test_diff_mixed_preset_and_request_rows(capsys):
    assert main(["diff", "upstream-mix", "--head-dim", "32", "--context", "120", "--topk", "32", "--poison",
                 "attended-v", "--backend", "emulate", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["geometry"]["request_rows"] == [46, 1, 1, 1] and doc["geometry"]["rows"] == 49
    assert main(["diff", "--rows", "5", "--requests", "2", "--request-rows", "4,2", "--backend", "emulate"]) == 2
    assert capsys.readouterr().err.startswith("qsa-lab: error: --request-rows: ")

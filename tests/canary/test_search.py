"""The canary's search (issue 46): cases drawn inside a kernel's declared limits, replayed
bit for bit from a seed and a case budget, every leak shrunk to a small case that still leaks
through the plain canary, correct kernels clean, failures kept apart from leaks (exit 3), bad
budgets named. Case budgets keep each test to seconds."""
import json
from pathlib import Path

import pytest

import canary_kernels as ck
from qsa_lab.app.cli import main
from qsa_lab.canary import run_canary, search
from qsa_lab.canary.case import load_case
from qsa_lab.canary.leak_search import Limits, limits_of, parse_budget, write_search_report

pytest_plugins = ["pytester"]
EMULATE = dict(backend="emulate")


@pytest.fixture(scope="module")
def kernel_fix():
    """One search of the grouped route's merged fix: it leaks across requests."""
    return search("qsa:grouped+kernel_fix", budget=12, seed=0, **EMULATE)


def test_the_same_seed_and_case_budget_draw_the_same_cases():
    one = search("qsa:grouped+finite_pv", budget=6, seed=5, **EMULATE)
    two = search("qsa:grouped+finite_pv", budget=6, seed=5, **EMULATE)
    other = search("qsa:grouped+finite_pv", budget=6, seed=6, **EMULATE)
    assert len(one.cases) == 6
    assert [o.params for o in one.cases] == [o.params for o in two.cases]
    assert [o.params for o in one.cases] != [o.params for o in other.cases]


def test_cases_stay_inside_the_declared_limits():
    found = search("qsa:grouped+finite_pv", budget=15, seed=1, **EMULATE)
    lim = limits_of("qsa:grouped+finite_pv")
    assert lim.gqa is False and lim.attends == ("sparse",)
    for o in found.cases:
        p = o.params
        assert p.kv_heads == 1 and p.q_heads in lim.q_heads and p.attend == "sparse"
        assert p.head_dim in lim.head_dims and p.page_size in lim.page_sizes
        assert 1 <= p.requests <= lim.max_requests and max(p.request_rows) <= lim.max_query_len
    assert "attend sparse" in found.searched() and "KV heads 1" in found.searched()


def test_a_cross_request_leak_is_found_shrunk_and_leaks_again_through_the_plain_canary(kernel_fix):
    assert kernel_fix.exit_code() == 1
    cross = [f for f in kernel_fix.findings if ("other-requests", "v") in f.cells]
    assert len(cross) == 1
    f = cross[0]
    p = f.params
    assert p.requests <= 2 and p.size() <= f.from_params.size()
    assert p.payloads == ("nan",) and p.q_heads == 1 and p.head_dim == 16
    assert f.reproduced()
    again = run_canary(["qsa:grouped+kernel_fix"], case=p.case(), regions=["other-requests"], planes=["v"],
                       payloads=["nan"], **EMULATE)
    assert [r.verdict for r in again.results] == ["nan-leak"]


def test_findings_are_one_per_shrunk_case():
    found = search("qsa:grouped", budget=8, seed=0, **EMULATE)
    shrunk = [f.params for f in found.findings]
    assert len(shrunk) == len(set(shrunk))
    cells = [c for f in found.findings for c in f.cells]
    assert len(cells) == len(set(cells))
    assert any(("null-block", "v") in f.cells for f in found.findings)
    # the null block and the unselected blocks of one row of 8 leak through the same case: one finding
    assert any(set(f.cells) == {("null-block", "v"), ("unselected", "v")} for f in found.findings)
    assert all(f.params.requests == 1 for f in found.findings if ("null-block", "v") in f.cells)


def test_a_finding_replays_from_its_case_file(kernel_fix, tmp_path):
    lines = write_search_report(kernel_fix, tmp_path / "r")
    i = next(n for n, f in enumerate(kernel_fix.findings, 1) if ("other-requests", "v") in f.cells)
    case = load_case(tmp_path / "r" / "cases" / f"finding-{i}.safetensors", attend="sparse")
    again = run_canary(["qsa:grouped+kernel_fix"], case=case, regions=["other-requests"], planes=["v"],
                       payloads=["nan"], **EMULATE)
    assert [r.verdict for r in again.results] == ["nan-leak"]
    assert (tmp_path / "r" / f"finding-{i}" / "report.md").is_file()
    assert f"--case cases/finding-{i}.safetensors" in lines[i - 1]
    doc = json.loads((tmp_path / "r" / "search.json").read_text())
    assert doc["schema"] == "qsa_lab.canary-search/1" and doc["searches"][0]["findings"]


def test_a_correct_kernel_searches_clean_and_exits_0(capsys):
    code = main(["canary", "--search", "--kernels", "qsa:xqa", "--budget", "8", "--backend", "emulate"])
    out, err = capsys.readouterr()
    assert code == 0
    assert "no leak found" in out and "limits searched:" in out
    assert "search qsa:xqa:" in err        # progress on stderr


def test_an_erroring_kernel_exits_3_and_is_no_leak():
    found = search(ck.raises, budget=3, seed=0)
    assert found.exit_code() == 3 and not found.findings
    assert len(found.failed()) == 3 and all(o.failures[0][0] == "error" for o in found.failed())


def test_an_unstable_kernel_exits_3_and_is_no_leak():
    found = search(ck.noisy, budget=3, seed=0, attend="dense")
    assert found.exit_code() == 3 and not found.findings
    assert {o.failures[0][0] for o in found.failed()} == {"unstable-control"}


def test_a_user_file_kernel_runs_in_one_worker_and_exits_3_on_errors(capsys):
    kernel = f"{Path(ck.__file__)}:raises"
    code = main(["canary", "--search", "--kernel", kernel, "--budget", "2", "--attend", "dense"])
    err = capsys.readouterr().err
    assert code == 3
    assert "search found no leak, and 2 case(s) failed" in err


def test_json_to_stdout_is_quiet_on_stderr(capsys):
    code = main(["canary", "--search", "--kernels", "qsa:xqa", "--budget", "3", "--backend", "emulate",
                 "--json", "-"])
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert code == 0 and doc["exit_code"] == 0 and len(doc["searches"][0]["cases"]) == 3
    assert "search qsa:xqa" not in err


@pytest.mark.parametrize("argv, flag", [
    (["--search", "--kernels", "qsa:xqa", "--budget", "soon"], "--budget"),
    (["--search", "--kernels", "qsa:xqa", "--budget", "0"], "--budget"),
    (["--kernels", "qsa:xqa", "--budget", "10"], "--budget"),
    (["--search", "--kernels", "qsa:xqa", "--attend", "dense"], "--attend"),
    (["--search", "--kernels", "qsa:xqa", "--rows", "8"], "--rows"),
    (["--search"], "--search"),
])
def test_bad_search_options_name_the_option(capsys, argv, flag):
    assert main(["canary", *argv]) == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err


def test_budget_grammar():
    assert parse_budget("120s").seconds == 120 and parse_budget("2m").seconds == 120
    assert parse_budget("500").cases == 500 and parse_budget("500 cases").cases == 500 and parse_budget(7).cases == 7
    for bad in ("0", "-3", "1h", "", "3.5", True):
        with pytest.raises((ValueError, TypeError), match="budget"):
            parse_budget(bad)


def test_a_kernel_declares_its_limits():
    def mine(call):
        raise AssertionError("not called")
    mine.canary_limits = {"kv_dtypes": ("fp16",), "attends": ("dense",)}
    assert limits_of(mine) == Limits(kv_dtypes=("fp16",), attends=("dense",))
    mine.canary_limits = {"colour": "red"}
    with pytest.raises(ValueError, match="limits: unknown field"):
        limits_of(mine)


def test_the_pytest_plugin_fails_on_a_finding(pytester):
    pytester.makepyfile(test_s='''
import pytest

@pytest.mark.qsa_canary_search("qsa:grouped+kernel_fix", budget=6, backend="emulate", shrink_runs=20)
def test_leaks(qsa_canary_search):
    qsa_canary_search.check()

@pytest.mark.qsa_canary_search("qsa:xqa", budget=3, backend="emulate")
def test_clean(qsa_canary_search):
    qsa_canary_search.check()
''')
    result = pytester.runpytest("-p", "qsa_lab.canary.pytest_plugin", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    assert "finding 1: other-requests/v" in result.stdout.str()


def test_a_finding_is_printed_with_its_shrunk_case(kernel_fix):
    text = "\n".join(kernel_fix.lines())
    f = kernel_fix.findings[0]
    assert f"shrunk from {f.from_params.requests} req, {f.from_params.rows} rows" in text
    assert f.params.describe() in text and "re-check other-requests/v/nan: nan-leak" in text


def test_a_pin_the_canary_refuses_is_refused_before_any_case(capsys):
    assert main(["canary", "--search", "--kernels", "torch:sdpa-math", "--head-dim", "24", "--budget", "2"]) == 2
    assert "--head-dim" in capsys.readouterr().err
    with pytest.raises(ValueError, match="q_heads"):
        search("qsa:xqa", budget=2, q_heads=32)


def test_a_search_writes_nothing_where_it_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    found = search("qsa:grouped+finite_pv", budget=3, seed=0, **EMULATE)
    assert len(found.cases) == 3
    assert list(tmp_path.iterdir()) == []     # no .hypothesis/ (example database, constants cache)


def test_a_group_limit_holds_in_every_drawn_case_and_every_shrink_candidate():
    """FlashInfer's CUDA-core decode serves at most 8 query heads per KV head: the search never
    draws, nor shrinks to, a wider group, and a pin past it is refused naming the option."""
    from hypothesis import given, settings

    from qsa_lab.canary.leak_search import candidates, strategy

    lim = limits_of("flashinfer:decode")
    assert lim.max_group == 8 and lim.head_dims == (64, 128, 256) and lim.max_query_len == 1
    assert limits_of("flashinfer:prefill").head_dims == (64, 128, 256)
    assert "at most 8 query heads each" in lim.describe()
    seen = []

    @settings(max_examples=60, database=None, deadline=None)
    @given(strategy(lim, {}))
    def draw(p):
        seen.append(p)
        assert p.q_heads // p.kv_heads <= 8 and p.head_dim in (64, 128, 256)
        for q in candidates(p, lim, {}):
            assert q.q_heads // q.kv_heads <= 8
    draw()
    assert any(p.q_heads >= 16 for p in seen)     # wide query heads were drawn, with enough KV heads
    wide = [p for p in seen if p.q_heads >= 16]
    assert all(p.kv_heads >= p.q_heads // 8 for p in wide)
    with pytest.raises(ValueError, match="q_heads: .*at most 8 query heads per KV head"):
        search("flashinfer:decode", budget=1, q_heads=32, kv_heads=1, backend="emulate")
    with pytest.raises(ValueError, match="limits: max_group must be an int in 0..4096"):
        Limits(max_group=-1)

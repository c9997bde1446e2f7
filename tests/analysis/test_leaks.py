"""The one leak check (qsa_lab.analysis.leaks): one verdict table under the canary and the scribble,
and one rule for what "changed" means, for every output dtype and for an engine's generation."""
import math
from pathlib import Path

import pytest
import torch

from qsa_lab.analysis import leaks
from qsa_lab.analysis.leaks import compare, compare_generation, control_problem

PACKAGE = Path(leaks.__file__).resolve().parents[1]


# -- one table ----------------------------------------------------------------------------------------

def test_canary_and_scribble_use_the_one_table_and_the_one_comparison():
    from qsa_lab import canary
    from qsa_lab.canary import pytest_plugin, results
    from qsa_lab.scribble import check, compare, report

    assert canary.VERDICTS is leaks.VERDICTS and canary.LEAKS is results.LEAKS is leaks.LEAKS
    assert canary.compare is results.compare is leaks.compare and results.control_problem is leaks.control_problem
    assert check.verdict_of is leaks.verdict_of and compare.compare_generation is leaks.compare_generation
    assert report.LEAKS is pytest_plugin.LEAKS is leaks.LEAKS and report.STRAY is leaks.STRAY_WRITE
    assert issubclass(results.CanaryReport, leaks.LeakReport) and issubclass(report.ScribbleReport, leaks.LeakReport)
    assert results.CanaryReport.summary is report.ScribbleReport.summary is leaks.LeakReport.summary


def test_no_second_vocabulary_module():
    """The verdict names are written once (tests/analysis/test_vocabulary.py scans the package)."""
    assert not (PACKAGE / "canary" / "verdicts.py").exists()
    assert not hasattr(__import__("qsa_lab.scribble.regions", fromlist=["x"]), "CHECKS")


def test_order_category_and_exit_code():
    assert leaks.VERDICTS == ("clean", "nan-leak", "inf-leak", "finite-leak", "stray-write", "error",
                              "unstable-control", "input-modified", "n/a", "not-run")
    assert [leaks.category(v) for v in leaks.VERDICTS] == ["clean"] + ["leak"] * 4 + ["failure"] * 3 + \
        ["no-check"] * 2
    assert leaks.exit_code([]) == 0 and leaks.exit_code(["clean", "n/a", "not-run"]) == 0
    assert leaks.exit_code(["clean", "stray-write"]) == 1 and leaks.exit_code(["nan-leak", "input-modified"]) == 3
    with pytest.raises(ValueError, match="verdict: unknown 'leak'"):
        leaks.category("leak")


def test_counts_and_their_line():
    c = leaks.counts(["clean", "nan-leak", "stray-write", "n/a", "error", "not-run"])
    assert c == {"cells": 6, "checks": 3, "leaking": 2}
    assert leaks.summary(c) == "2 leaking of 3 checks (6 cells)"



class _Report(leaks.LeakReport):
    def __init__(self, verdicts, exit_verdicts=None):
        self._v, self._e = verdicts, exit_verdicts

    def verdicts(self):
        return self._v

    def exit_verdicts(self):
        return self._v if self._e is None else self._e


@pytest.mark.parametrize("verdicts, exit_verdicts, nothing, code", [
    (["clean", "n/a"], None, False, 0),
    (["n/a", "not-run"], None, True, 3),          # nothing checked: never a pass
    ([], None, True, 3),
    (["error", "n/a"], None, True, 3),
    (["nan-leak", "n/a"], None, False, 1),
    (["nan-leak", "clean"], ["clean"], False, 0),  # the exit code answers for exit_verdicts() only
    (["n/a"], [], True, 3),
])
def test_the_report_base_exit_code_and_nothing_checked(verdicts, exit_verdicts, nothing, code):
    r = _Report(verdicts, exit_verdicts)
    assert r.nothing_checked() is nothing and r.exit_code() == code
    assert leaks.NO_CHECKS == "no-checks" and leaks.NO_CHECKS_EXIT == 3 and leaks.NO_CHECKS not in leaks.VERDICTS

# -- what "changed" means -----------------------------------------------------------------------------

def _nan_pair(dtype):
    """Two NaNs of `dtype` with different bits."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[torch.empty(0, dtype=dtype).element_size()]
    codes = {torch.float32: (0x7FC00000, 0x7FC00001), torch.float16: (0x7E00, 0x7FFF),
             torch.bfloat16: (0x7FC0, 0x7FC1), torch.float8_e4m3fn: (0x7F, 0xFF),
             torch.float8_e5m2: (0x7E, 0xFF)}[dtype]
    a, b = (torch.tensor([c]).to(ints).view(dtype) for c in codes)
    return a, b


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_nan_whose_payload_bits_change_is_no_change(dtype):
    a, b = _nan_pair(dtype)
    assert torch.isnan(a.float()).all() and torch.isnan(b.float()).all()
    assert not torch.equal(leaks.bits(a), leaks.bits(b))
    control = torch.cat([torch.tensor([1.0, 2.0]).to(dtype), a])
    output = torch.cat([torch.tensor([1.0, 2.0]).to(dtype), b])
    verdict, counts, changed = compare(control, output)
    assert verdict == "clean" and counts == {"nan": 0, "inf": 0, "finite_changed": 0}
    assert changed.tolist() == [False, False, False]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_outputs_that_become_nan_inf_or_another_finite_value(dtype):
    control = torch.tensor([1.0, 2.0, 4.0, 0.5]).to(dtype)
    nan = _nan_pair(dtype)[0]
    out = control.clone()
    out[0:1] = nan
    out[1] = 3.0
    cases = [(out, "nan-leak", {"nan": 1, "inf": 0, "finite_changed": 1}, [True, True, False, False])]
    if dtype != torch.float8_e4m3fn:                      # e4m3fn has no Inf
        inf = control.clone()
        inf[2] = -math.inf
        cases.append((inf, "inf-leak", {"nan": 0, "inf": 1, "finite_changed": 0}, [False, False, True, False]))
    zero = torch.tensor([0.0, 2.0, 4.0, 0.5]).to(dtype)
    negative_zero = zero.clone()
    negative_zero[0] = -0.0                               # same value, other bits: a change
    cases.append((negative_zero, "finite-leak", {"nan": 0, "inf": 0, "finite_changed": 1},
                  [True, False, False, False]))
    for output, verdict, counts, mask in cases:
        base = zero if output is negative_zero else control
        got = compare(base, output)
        assert (got.verdict, got.counts, got.changed.tolist()) == (verdict, counts, mask), dtype


def test_inf_of_the_other_sign_is_an_inf_change_and_nan_to_finite_a_finite_one():
    control = torch.tensor([math.inf, math.nan, 1.0])
    got = compare(control, torch.tensor([-math.inf, 7.0, 1.0]))
    assert got.counts == {"nan": 0, "inf": 1, "finite_changed": 1} and got.verdict == "inf-leak"


def test_compare_refuses_outputs_that_do_not_match():
    with pytest.raises(ValueError, match="does not match the control"):
        compare(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="does not match the control"):
        compare(torch.zeros(2), torch.zeros(2, dtype=torch.float16))
    with pytest.raises(TypeError, match="floating-point"):
        compare(torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))


def test_a_generation_by_the_same_rule_plus_its_tokens():
    tokens = [[5, 6, 7], [8, 9]]
    lp = torch.tensor([-0.5, -1.0, math.nan, -2.0])
    other_nan = lp.clone()
    other_nan.view(torch.int32)[2] = 0x7FC00123
    assert compare_generation(tokens, [[5, 6, 7], [8, 9]], lp, other_nan).verdict == "clean"
    moved = compare_generation(tokens, [[5, 6, 1], [8, 9]], lp, lp.clone())
    assert moved.verdict == "finite-leak" and moved.counts == {"nan": 0, "inf": 0, "finite_changed": 0,
                                                               "tokens_changed": 1}
    went_nan = lp.clone()
    went_nan[0] = math.nan
    got = compare_generation(tokens, tokens, lp, went_nan)
    assert got.verdict == "nan-leak" and got.counts["nan"] == 1 and got.changed.tolist() == [True, False, False,
                                                                                            False]
    shorter = compare_generation(tokens, [[5, 6], [8, 9]], lp, torch.tensor([-0.5, math.nan, -2.0]))
    assert shorter.counts == {"nan": 1, "inf": 0, "finite_changed": 3, "tokens_changed": 1}
    assert shorter.verdict == "nan-leak" and shorter.changed is None


def test_control_problems():
    ok = torch.tensor([1.0, 2.0], dtype=torch.float16)
    assert control_problem(ok) == "" and control_problem(ok, ok.clone()) == ""
    assert "holds 1 NaN and 0 Inf of 2" in control_problem(torch.tensor([math.nan, 1.0]))
    drift = ok.clone()
    drift[1] = 2.001953125
    assert control_problem(ok, drift).startswith("two control runs differ in 1 outputs")
    assert control_problem(ok, ok.float()).startswith("two control runs returned")


# -- the report base ----------------------------------------------------------------------------------

def test_the_report_base_gives_counts_exit_code_and_a_stable_header():
    class Report(leaks.LeakReport):
        SCHEMA = "test/1"

        def verdicts(self):
            return ["clean", "finite-leak", "n/a"]

    r = Report()
    assert r.counts() == {"cells": 3, "checks": 2, "leaking": 1} and r.exit_code() == 1
    assert r.summary() == "1 leaking of 2 checks (3 cells)"
    head = r.header()
    assert list(head)[0] == "schema" and head["schema"] == "test/1"
    assert {"qsa_lab_version", "python", "torch", "cuda", "gpu", "date"} <= set(head)
    assert head["torch"] == torch.__version__ and r.header() == head      # read once per report

"""support.progress.Steps: one counted line a step, the time left from the steps done so far."""
from __future__ import annotations

import io

import pytest

from qsa_lab.support.progress import Steps, seconds


def test_steps_count_and_estimate():
    now = [100.0]
    out = io.StringIO()
    steps = Steps(3, out=out, clock=lambda: now[0])
    steps.step("a")
    now[0] += 10                   # the first step took 10 s: two left, 20 s
    steps.step("b")
    steps.add(1)                   # a confirming run found on the way
    now[0] += 30                   # mean 20 s a step, two steps left
    steps.step("c")
    now[0] += 20
    steps.step("d")
    assert out.getvalue().splitlines() == ["# [1/3] a", "# [2/3] b (about 20 s left)", "# [3/4] c (about 40 s left)",
                                           "# [4/4] d (about 20 s left)"]


def test_steps_never_count_past_the_total_and_refuse_a_bad_total():
    out = io.StringIO()
    steps = Steps(0, out=out)
    steps.step("x")
    assert out.getvalue().startswith("# [1/1] x")
    with pytest.raises(ValueError, match="total"):
        Steps(-1)


def test_seconds():
    assert [seconds(x) for x in (0.4, 8.6, 125)] == ["0 s", "9 s", "2 min 05 s"]

"""run_repro's repeats in a second process (support.executor): the same table as in one process,
the repeat's outputs bit for bit the first run's across processes, a repeat that differs is
reported as one, and a second process that dies or is never started leaves the caller to run the
repeats itself; it is gone when run_repro returns."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pandas as pd
import pytest
import torch

from qsa_lab.report import repro
from qsa_lab.support import executor

TINY = dict(context=256, topk=16, head_dim=32)
CASES = [c for c in repro.REPRO_CASES if c.poison.get("site") in ("targeted", "stale-tail", "attended-k")]


@pytest.fixture(scope="module")
def one_process():
    return repro.run_repro(backend="emulate", cases=CASES, progress=False, geometry_overrides=TINY,
                           parallel=False)


@pytest.fixture
def spawned(monkeypatch):
    """The second processes run_repro starts, by pid, as they are closed."""
    seen = []
    close = executor.SecondProcess.close

    def record(self):
        seen.append(self.pid)
        close(self)

    monkeypatch.setattr(executor.SecondProcess, "close", record)
    return seen


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


def test_two_processes_give_the_one_process_table(one_process, spawned):
    table, results = repro.run_repro(backend="emulate", cases=CASES, progress=False, geometry_overrides=TINY,
                                     parallel=True)
    pd.testing.assert_frame_equal(table, one_process[0])
    assert table["bit_identical_repeat"].all() and len(results) == len(CASES)
    for a, b in zip(results, one_process[1]):
        assert all(torch.equal(a.outputs[r].view(torch.int16), b.outputs[r].view(torch.int16)) for r in a.outputs)
    assert len(spawned) == 1 and not _alive(spawned[0])     # ended with the call


def test_the_second_process_repeats_bit_for_bit_and_never_a_case_taken_back():
    """It runs from the last case back what the caller has not taken back; each repeat it sends
    is the in-process run of that case, bit for bit."""
    got = []
    with executor.SecondProcess("qsa_lab.report.repro") as second:
        relay = executor.Relay(second, answered=got.append)
        for i in reversed(range(len(CASES))):
            relay.add(i, repro.repeat_outputs, CASES[i], "emulate", TINY, 1)
        assert relay.take(0)                        # the caller takes the first case back
        last = len(CASES) - 1
        out = relay.result(last)
        mine = repro.run_case(CASES[last], "emulate", TINY).outputs
        assert out is not None and set(out) == set(mine)
        assert all(torch.equal(out[r].view(torch.int16), mine[r].view(torch.int16)) for r in mine)
        assert all(relay.result(i) is not None for i in range(last, 0, -1))
        assert relay.result(0) is None and not relay.take(last)   # never sent; sent, so not taken back
    assert sorted(got) == list(range(1, len(CASES)))


def test_a_repeat_that_differs_is_reported(monkeypatch, one_process):
    """The caller compares what the second process sends: a flipped bit there is a repeat that
    is not bit-identical (the check is not skipped for repeats run elsewhere)."""
    real, take = executor.Relay.result, executor.Relay.take

    def tampered(self, i, timeout=None):
        out = real(self, i, timeout)
        if out is not None and i == len(CASES) - 1:
            x = out["xqa"].clone()
            x.view(torch.int16).view(-1)[0] ^= 1
            out = dict(out, xqa=x)
        return out

    monkeypatch.setattr(executor.Relay, "result", tampered)
    monkeypatch.setattr(executor.Relay, "take", lambda self, i: i == 0 and take(self, i))   # it runs the rest
    table, _ = repro.run_repro(backend="emulate", cases=CASES, progress=False, geometry_overrides=TINY,
                               parallel=True)
    assert list(table["bit_identical_repeat"]) == [True] * (len(CASES) - 1) + [False]


class _Dies(executor.SecondProcess):
    """A second process killed as soon as it started."""

    def __init__(self, *warm):
        super().__init__(*warm)
        os.kill(self.pid, signal.SIGKILL)


class _Unstartable:
    def __init__(self, *warm):
        raise OSError("no process")


@pytest.mark.parametrize("second", [_Dies, _Unstartable], ids=["dies", "unstartable"])
def test_without_a_working_second_process_the_repeats_run_here(monkeypatch, one_process, second):
    monkeypatch.setattr(executor, "SecondProcess", second)
    table, _ = repro.run_repro(backend="emulate", cases=CASES, progress=False, geometry_overrides=TINY,
                               parallel=True)
    pd.testing.assert_frame_equal(table, one_process[0])


def test_the_thread_counts_share_the_free_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(repro.procs, "cores", lambda: 8)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert repro._threads(2, 2) == (3, 3) and repro._threads(1, 2) == (6, None)
    assert repro._threads(2, float("inf")) == (1, 1) and repro._threads(1, float("inf")) == (1, None)   # unknown load
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert repro._threads(2, 0) == (None, None)


def test_beside_the_figure_process_the_repeats_stay_here(monkeypatch, spawned):
    """`qsa-lab repro`'s figure process (beside=1) holds the idle core: no second repro process."""
    monkeypatch.setattr(repro.procs, "others_running", lambda: 0)
    monkeypatch.setattr(repro.procs, "cores", lambda: 2)
    repro.run_repro(backend="emulate", cases=CASES[:2], progress=False, geometry_overrides=TINY, beside=1)
    assert spawned == []
    repro.run_repro(backend="emulate", cases=CASES[:2], progress=False, geometry_overrides=TINY)
    assert len(spawned) == 1


CHILD = r'''
from qsa_lab.report import repro
from qsa_lab.support import executor
init = executor.SecondProcess.__init__
def told(self, *a, **kw):
    init(self, *a, **kw)
    print(self.pid, flush=True)
executor.SecondProcess.__init__ = told
repro.run_repro(backend="emulate", progress=False, parallel=True)   # full size: seconds to be signalled in
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the second process dies with its caller on Linux")
def test_a_signal_to_the_caller_ends_the_second_process():
    import signal
    import time

    p = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(p.stdout.readline())
        assert _alive(pid)
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid)
    finally:
        p.kill()
        p.wait()

"""run_repro's repeats in a second process (qsa_lab.report.repeat_worker): the same table as in one
process, the repeat's outputs bit for bit the first run's across processes, a repeat that differs
is reported as one, and a second process that fails or is never started leaves the caller to run
the repeats itself; it is gone when run_repro returns."""
from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest
import torch

from qsa_lab.report import repro, repeat_worker as reproworker

TINY = dict(context=256, topk=16, head_dim=32)
CASES = [c for c in repro.REPRO_CASES if c.poison.get("site") in ("targeted", "stale-tail", "attended-k")]


@pytest.fixture(scope="module")
def one_process():
    return repro.run_repro(backend="emulate", cases=CASES, progress=False, geometry_overrides=TINY,
                           parallel=False)


@pytest.fixture
def spawned(monkeypatch):
    """The second processes run_repro starts, as they are closed."""
    seen = []
    close = reproworker.Repeats.close

    def record(self):
        seen.append(self.proc)
        close(self)

    monkeypatch.setattr(reproworker.Repeats, "close", record)
    return seen


def test_two_processes_give_the_one_process_table(one_process, spawned):
    table, results = repro.run_repro(backend="emulate", cases=CASES, progress=False, geometry_overrides=TINY,
                                     parallel=True)
    pd.testing.assert_frame_equal(table, one_process[0])
    assert table["bit_identical_repeat"].all() and len(results) == len(CASES)
    for a, b in zip(results, one_process[1]):
        assert all(torch.equal(a.outputs[r].view(torch.int16), b.outputs[r].view(torch.int16)) for r in a.outputs)
    assert len(spawned) == 1 and spawned[0].poll() is not None     # ended with the call


def test_the_second_process_repeats_bit_for_bit_and_stops_at_a_claimed_case():
    """It runs from the last case back and stops at a case the caller claimed; each repeat it
    sends is the in-process run of that case, bit for bit."""
    got = []
    second = reproworker.Repeats(CASES, "emulate", TINY, 1, on_repeat=lambda: got.append(1))
    try:
        last = len(CASES) - 1
        assert second.claim(0)                       # the caller takes the first case
        out = second.wait(last)
        assert out is not None and second.ok
        mine = repro.run_case(CASES[last], "emulate", TINY).outputs
        assert set(out) == set(mine)
        assert all(torch.equal(out[r].view(torch.int16), mine[r].view(torch.int16)) for r in mine)
        for i in range(last, 0, -1):
            assert second.wait(i) is not None
        while second.ok and not second.done:
            second._take(block=True)
        assert second.ok and 0 not in second.started    # nothing of what the caller claimed
    finally:
        second.close()
    assert len(got) == len(CASES) - 1


def test_a_repeat_that_differs_is_reported(monkeypatch, one_process):
    """The caller compares what the second process sends: a flipped bit there is a repeat that
    is not bit-identical (the check is not skipped for repeats run elsewhere)."""
    real = reproworker.Repeats.wait

    def tampered(self, i):
        out = real(self, i)
        if out is not None and i == len(CASES) - 1:
            x = out["xqa"].clone()
            x.view(torch.int16).view(-1)[0] ^= 1
            out = dict(out, xqa=x)
        return out

    monkeypatch.setattr(reproworker.Repeats, "wait", tampered)
    monkeypatch.setattr(reproworker.Repeats, "claim", lambda self, i: i == 0 and self.ok)  # it runs the rest
    table, _ = repro.run_repro(backend="emulate", cases=CASES, progress=False, geometry_overrides=TINY,
                               parallel=True)
    assert list(table["bit_identical_repeat"]) == [True] * (len(CASES) - 1) + [False]


@pytest.mark.parametrize("how", ["exits", "unstartable"])
def test_without_a_working_second_process_the_repeats_run_here(monkeypatch, one_process, how):
    def spawn(module, *args, stderr=None):
        if how == "unstartable":
            raise OSError("no process")
        return subprocess.Popen([sys.executable, "-c", "pass"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    monkeypatch.setattr(reproworker.procs, "spawn", spawn)
    table, _ = repro.run_repro(backend="emulate", cases=CASES, progress=False, geometry_overrides=TINY,
                               parallel=True)
    pd.testing.assert_frame_equal(table, one_process[0])


def test_the_thread_counts_share_the_free_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(repro.procs, "_cores", lambda: 8)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert repro._threads(2, 2) == (3, 3) and repro._threads(1, 2) == (6, None)
    assert repro._threads(2, float("inf")) == (1, 1) and repro._threads(1, float("inf")) == (1, None)   # unknown load
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert repro._threads(2, 0) == (None, None)


def test_beside_the_figure_process_the_repeats_stay_here(monkeypatch, spawned):
    """`qsa-lab repro`'s figure process (figworker) holds the idle core: no second repro process."""
    from qsa_lab.report import figure_worker as figworker

    monkeypatch.setattr(repro.procs, "others_running", lambda: 0)
    monkeypatch.setattr(repro.procs, "_cores", lambda: 2)
    monkeypatch.setattr(figworker, "running", lambda: 1)
    repro.run_repro(backend="emulate", cases=CASES[:2], progress=False, geometry_overrides=TINY)
    assert spawned == []
    monkeypatch.setattr(figworker, "running", lambda: 0)
    repro.run_repro(backend="emulate", cases=CASES[:2], progress=False, geometry_overrides=TINY)
    assert len(spawned) == 1


CHILD = r'''
from qsa_lab.report import repro, repeat_worker as reproworker
init = reproworker.Repeats.__init__
def told(self, *a, **kw):
    init(self, *a, **kw)
    print(self.proc.pid, flush=True)
reproworker.Repeats.__init__ = told
repro.run_repro(backend="emulate", progress=False, parallel=True)   # full size: seconds to be signalled in
'''


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


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

"""The second process of `qsa-lab canary` (qsa_lab.canary.overlap, on support.executor):
FlexAttention's kernels run there while this one runs the others. Whatever happens to it, the report is the one the run
gives without it, bit for bit: verdicts, counts, NaN masks, outputs, skipped reasons, order."""
import json

import pytest
import torch

from proc_state import alive
from qsa_lab.canary import overlap, run_canary
from qsa_lab.canary.execution import same_bits
from qsa_lab.canary.names import parse_kernel
from qsa_lab.support import processes as procs

# qsa routes and SDPA around both FlexAttention kernels, on poisoned cells of every kind they give:
# NaN leaks (flex V null block, paged flex V free pages), clean (K), n/a (flex, free pages)
KERNELS = ["qsa:grouped", "torch:flex", "torch:sdpa-math", "torch:flex-paged"]
MATRIX = dict(regions=["null-block", "free-pages"], backend="emulate")


def _same_report(a, b):
    undated = [{k: v for k, v in r.to_json().items() if k != "date"} for r in (a, b)]   # when each ran
    assert a.kernels == b.kernels and a.skipped == b.skipped and undated[0] == undated[1]
    assert len(a.results) == len(b.results)
    for x, y in zip(a.results, b.results):
        assert x.to_dict() == y.to_dict() and x.traceback == y.traceback
        for t, u in ((x.leak, y.leak), (x.output, y.output)):
            assert (t is None) == (u is None)
            if t is not None:
                assert same_bits(t, u), f"{x.kernel} {x.region}/{x.plane}/{x.payload}"
                assert torch.equal(torch.isnan(t), torch.isnan(u))


@pytest.fixture(scope="module")
def in_process():
    return run_canary(KERNELS, **MATRIX)


def _taken(monkeypatch) -> list:
    """The Overlaps run_canary makes, as it takes them."""
    seen, take = [], overlap.take
    monkeypatch.setattr("qsa_lab.canary.runner.take_overlap",
                        lambda *a: seen.append(take(*a)) or seen[-1])
    return seen


def test_the_second_process_gives_the_same_report(in_process, monkeypatch):
    seen = _taken(monkeypatch)
    second = overlap.start()
    report = run_canary(KERNELS, **MATRIX, second=second)
    assert seen[0].answered and seen[0].names == ["torch:flex", "torch:flex-paged"]   # it ran them
    assert second._pool is None and not alive(second.pid)                             # and it is ended
    _same_report(report, in_process)
    for kernel in ("torch:flex", "torch:flex-paged"):
        assert {r.verdict for r in report.results if r.kernel == kernel} == {"nan-leak", "clean", "n/a"}


def test_a_second_process_that_dies_leaves_the_run_to_this_one(in_process, monkeypatch):
    import os
    import signal

    seen = _taken(monkeypatch)
    second = overlap.start()
    os.kill(second.pid, signal.SIGKILL)
    report = run_canary(KERNELS, **MATRIX, second=second)
    assert seen[0] is not None and not seen[0].answered
    _same_report(report, in_process)


class _Second:
    closed = False

    def close(self):
        self.closed = True


def _named(*items):
    """run_canary's (name, kernel) pairs: a name parsed (canary.names), a callable as it is."""
    return [(n, parse_kernel(k) if isinstance(k, str) else k) for n, k in items]


@pytest.mark.parametrize("named,device", [
    (_named(("torch:flex", "torch:flex"), ("qsa:xqa", "qsa:xqa")), "mps"),           # a device it does not use
    (_named(("torch:flex", "torch:flex"), ("torch:flex-paged", "torch:flex-paged")), "cpu"),  # nothing beside them
    (_named(("torch:flex", lambda call: call.q), ("qsa:xqa", "qsa:xqa")), "cpu"),    # a callable of that name
    (_named(("qsa:xqa", "qsa:xqa")), "cpu"),
])
def test_a_run_it_cannot_help_ends_it(named, device):
    second = _Second()
    assert overlap.take(second, named, torch.device(device)) is None
    assert second.closed


def test_a_run_takes_it_for_its_flex_kernels():
    second = _Second()
    got = overlap.take(second, _named(("qsa:xqa", "qsa:xqa"), ("torch:flex-paged", "torch:flex-paged")),
                       torch.device("cpu"))
    assert got.second is second and got.names == ["torch:flex-paged"] and not second.closed
    assert got.device == "cpu"
    on_gpu = overlap.take(_Second(), _named(("torch:flex", "torch:flex"), ("qsa:xqa", "qsa:xqa")),
                          torch.device("cuda"))                          # compiled flex there, on the same GPU
    assert on_gpu.names == ["torch:flex"] and on_gpu.device == "cuda"
    assert overlap.take(None, _named(("qsa:xqa", "qsa:xqa"), ("torch:flex", "torch:flex")), "cpu") is None


@pytest.mark.parametrize("others,started", [(0, True), (1, False)])
def test_the_cli_starts_it_only_with_a_core_to_spare(monkeypatch, capsys, others, started):
    from qsa_lab.app.cli import main

    monkeypatch.setattr(procs, "others_running", lambda: others)      # besides the CLI itself, on 2 cores
    monkeypatch.setattr(procs.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    seen = []
    start = overlap.start
    monkeypatch.setattr(overlap, "start", lambda: seen.append(start()) or seen[-1])
    taken = _taken(monkeypatch)
    argv = ["canary", "--kernels", "qsa:xqa,torch:flex-paged", "--regions", "null-block", "--planes", "v",
            "--payloads", "nan", "--backend", "emulate", "--json", "-"]
    assert main(argv) == 1
    doc = capsys.readouterr().out
    assert len(seen) == int(started) and [o.answered for o in taken if o] == [True] * started
    assert all(s._pool is None for s in seen)                             # ended with the command
    assert '"verdict": "nan-leak"' in doc and '"kernel": "torch:flex-paged"' in doc
    if started:
        monkeypatch.setattr(procs, "others_running", lambda: 3)
        assert main(argv) == 1 and _undated(capsys.readouterr().out) == _undated(doc) and len(seen) == 1


def _undated(text: str) -> dict:
    """A canary JSON document without the date it ran."""
    return {k: v for k, v in json.loads(text).items() if k != "date"}


def test_others_running_reads_this_machine():
    assert procs.others_running() >= 0


def test_flex_untraced_gives_every_default_cell_the_same_bits_without_tracing(monkeypatch):
    """FlexAttention on the CPU skips dynamo's per-call trace (kernels.flex_untraced): every cell of
    the default matrix is the same report, bit for bit, as the traced call gives, and no trace runs."""
    from contextlib import nullcontext

    from qsa_lab.canary import kernels

    names = ["torch:flex", "torch:flex-paged"]
    with monkeypatch.context() as m:
        m.setattr(kernels, "flex_untraced", nullcontext)          # torch's own path: traced every call
        traced = run_canary(names, backend="emulate")
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda *a, **k: compiled.append(a) or (_ for _ in ()).throw(
        AssertionError("traced")))
    untraced = run_canary(names, backend="emulate")
    assert compiled == []
    assert {r.verdict for r in untraced.results} >= {"nan-leak", "clean"}
    _same_report(untraced, traced)

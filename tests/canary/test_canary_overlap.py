"""The second process of `qsa-lab canary` (qsa_lab.canary.overlap): FlexAttention's kernels run
there while this one runs the others. Whatever happens to it, the report is the one the run
gives without it, bit for bit: verdicts, counts, NaN masks, outputs, skipped reasons, order."""
import pytest
import torch

from qsa_lab.canary import overlap, run_canary
from qsa_lab.canary.execution import same_bits

# qsa routes and SDPA around both FlexAttention kernels, on poisoned cells of every kind they give:
# NaN leaks (flex V null block, paged flex V free pages), clean (K), n/a (flex, free pages)
KERNELS = ["qsa:grouped", "torch:flex", "torch:sdpa-math", "torch:flex-paged"]
MATRIX = dict(regions=["null-block", "free-pages"], backend="emulate")


def _same_report(a, b):
    assert a.kernels == b.kernels and a.skipped == b.skipped and a.to_json() == b.to_json()
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
    overlap.close_overlap()
    return run_canary(KERNELS, **MATRIX)


def test_the_second_process_gives_the_same_report(in_process):
    spare = overlap.start_overlap()
    report = run_canary(KERNELS, **MATRIX)
    assert spare.answered and spare.proc is None and overlap._SPARE is None   # it ran them, and it is ended
    _same_report(report, in_process)
    for kernel in ("torch:flex", "torch:flex-paged"):
        assert {r.verdict for r in report.results if r.kernel == kernel} == {"nan-leak", "clean", "n/a"}


def test_a_second_process_that_dies_leaves_the_run_to_this_one(in_process):
    spare = overlap.start_overlap()
    spare.proc.kill()
    report = run_canary(KERNELS, **MATRIX)
    assert not spare.answered
    _same_report(report, in_process)


class _Spare:
    closed = False

    def close(self):
        self.closed = True


@pytest.mark.parametrize("named,device", [
    ([("torch:flex", "torch:flex"), ("qsa:xqa", "qsa:xqa")], "cuda"),            # a GPU run: compiled flex here
    ([("torch:flex", "torch:flex"), ("torch:flex-paged", "torch:flex-paged")], "cpu"),   # nothing beside them
    ([("torch:flex", lambda call: call.q), ("qsa:xqa", "qsa:xqa")], "cpu"),      # a callable of that name
    ([("qsa:xqa", "qsa:xqa")], "cpu"),
])
def test_a_run_it_cannot_help_ends_it(monkeypatch, named, device):
    spare = _Spare()
    monkeypatch.setattr(overlap, "_SPARE", spare)
    assert overlap.take_overlap(named, torch.device(device)) is None
    assert spare.closed and overlap._SPARE is None


def test_one_run_takes_it():
    spare = _Spare()
    overlap._SPARE = spare
    try:
        got = overlap.take_overlap([("qsa:xqa", "qsa:xqa"), ("torch:flex-paged", "torch:flex-paged")],
                                   torch.device("cpu"))
        assert got is spare and got.names == ["torch:flex-paged"] and not spare.closed
        assert overlap.take_overlap([("qsa:xqa", "qsa:xqa"), ("torch:flex", "torch:flex")], "cpu") is None
    finally:
        overlap._SPARE = None


@pytest.mark.parametrize("others,started", [(0, True), (1, False)])
def test_the_cli_starts_it_only_with_a_core_to_spare(monkeypatch, capsys, others, started):
    from qsa_lab.app.cli import main

    monkeypatch.setattr(overlap, "_others_running", lambda: others)      # besides the CLI itself, on 2 cores
    monkeypatch.setattr(overlap.procs.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    seen = []
    start = overlap.start_overlap
    monkeypatch.setattr(overlap, "start_overlap", lambda: seen.append(start()) or seen[-1])
    argv = ["canary", "--kernels", "qsa:xqa,torch:flex-paged", "--regions", "null-block", "--planes", "v",
            "--payloads", "nan", "--backend", "emulate", "--json", "-"]
    assert main(argv) == 1
    doc = capsys.readouterr().out
    assert [s.answered for s in seen] == ([True] if started else []) and overlap._SPARE is None
    assert '"verdict": "nan-leak"' in doc and '"kernel": "torch:flex-paged"' in doc
    if started:
        monkeypatch.setattr(overlap, "_others_running", lambda: 3)
        assert main(argv) == 1 and capsys.readouterr().out == doc and len(seen) == 1


def test_others_running_reads_this_machine():
    assert overlap._others_running() >= 0

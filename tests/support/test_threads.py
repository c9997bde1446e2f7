"""Torch's CPU threads fit the free cores when qsa-lab runs as the program (procs.fit_torch_threads)."""
import pytest
import torch

from qsa_lab.app import cli
from qsa_lab.support import processes as procs


@pytest.fixture
def two_cores(monkeypatch):
    threads = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(procs.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    torch.set_num_threads(2)
    yield monkeypatch
    torch.set_num_threads(threads)


@pytest.mark.parametrize("others, started, want", [(0, 0, 2), (0.0, 1, 1), (1, 0, 1), (5, 0, 1), (1, 1, 1),
                                                  (float("inf"), 0, 1)])   # inf: no load figure on this system
def test_threads_fit_the_cores_no_other_process_holds(two_cores, others, started, want):
    two_cores.setattr(procs, "others_running", lambda: others)
    assert procs.fit_torch_threads(started) == want
    assert torch.get_num_threads() == want


def test_never_more_than_torchs_own_count(two_cores):
    two_cores.setattr(procs, "others_running", lambda: 0)
    torch.set_num_threads(1)
    assert procs.fit_torch_threads() == 1


@pytest.mark.parametrize("var", ["OMP_NUM_THREADS", "MKL_NUM_THREADS"])
def test_a_count_the_user_set_is_kept(two_cores, var):
    two_cores.setattr(procs, "others_running", lambda: 5)
    two_cores.setenv(var, "2")
    assert procs.fit_torch_threads() == 2 == torch.get_num_threads()


def test_one_command_in_a_callers_process_keeps_its_threads(two_cores, capsys):
    two_cores.setattr(procs, "others_running", lambda: 5)
    assert cli.main(["diff", "--rows", "4", "--requests", "1", "--context", "64", "--topk", "8", "--head-dim", "16",
                     "--q-heads", "2", "--backend", "emulate"]) == 0
    assert torch.get_num_threads() == 2
    two_cores.setattr(cli, "_PROGRAM", True)     # as the program, the same command fits them
    assert cli.main(["diff", "--rows", "4", "--requests", "1", "--context", "64", "--topk", "8", "--head-dim", "16",
                     "--q-heads", "2", "--backend", "emulate"]) == 0
    assert torch.get_num_threads() == 1

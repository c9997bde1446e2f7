"""The scribble's progress: each generation told before it runs, counted of the generations planned so
far (a leak's confirming re-runs join the plan as they start): the last one is N of N."""
import sys

import pytest

transformers = pytest.importorskip("transformers")

from qsa_lab.app.cli import main  # noqa: E402
from qsa_lab.scribble.check import scribble  # noqa: E402
from qsa_lab.scribble.engines.transformers import TransformersEngine  # noqa: E402
from qsa_lab.scribble.models import tiny_model, workload  # noqa: E402


def test_every_generation_is_told_and_the_last_is_n_of_n():
    eng = TransformersEngine(tiny_model(), workload("chunked-prefill"), pad=True)   # read-trash nan leaks
    generate, runs, told = eng.generate, [], []

    def counted(*a, **k):
        runs.append(len(told))
        return generate(*a, **k)

    eng.generate = counted
    report = scribble(eng, regions=("read-trash", "other-requests"), payloads=("nan",),
                      progress=lambda what, total: told.append((what, total)))
    assert runs == list(range(1, len(told) + 1))          # told before each generation, once each
    assert [w for w, _ in told[:3]] == ["clean run", "second clean run", "read-trash / nan"]
    assert "confirming: read-trash / nan" in [w for w, _ in told]                  # the leak's re-runs
    assert [c.verdict for c in report.cells if c.check == "read"][0] == "nan-leak"
    totals = [t for _, t in told]
    assert totals == sorted(totals) and totals[-1] == len(told)
    assert all(t >= i for i, t in enumerate(totals, 1))


def test_cli_progress_on_a_terminal_only_and_never_under_json_stdout(capsys, monkeypatch):
    argv = ["scribble", "--regions", "read-trash", "--payloads", "nan", "--device", "cpu"]
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(argv) == 0
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("# [")]
    assert lines[0] == "# [1/3] clean run" and lines[-1].startswith("# [3/3] read-trash / nan (about ")
    assert main([*argv, "--json", "-"]) == 0
    assert "# [" not in capsys.readouterr().err

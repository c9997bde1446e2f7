"""Reliability IV (issue 40): the API's errors name their argument in one line; a signal while
`diff --save --json` publishes leaves both outputs or neither; a killed `--report` leaves no hidden
partial folder behind; a case file's shape errors are bad input; a float8 output from a worker
kernel is judged."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import qsa_lab
from qsa_lab.app.cli import main
from qsa_lab.canary import register_kernel, run_canary
from qsa_lab.canary.case import canary_case, load_case
from qsa_lab.model.case import build_case
from qsa_lab.model.memory import MemoryBudgetError

ROOT = Path(__file__).parents[2]
TINY = ["--rows", "8", "--context", "64", "--topk", "8", "--head-dim", "16", "--backend", "emulate"]


def _no_allocation(monkeypatch):
    """canary_case must refuse before it builds anything."""
    import qsa_lab.canary.case as cc

    def built(*a, **k):
        raise AssertionError("allocated before the budget refused the case")
    monkeypatch.setattr(cc, "build_case", built)
    monkeypatch.setattr(cc, "with_free_pages", built)


API = [("plan_groups(None)", lambda: qsa_lab.plan_groups(None), TypeError, "case"),
       ("pad_fix(None)", lambda: qsa_lab.pad_fix(None), TypeError, "plan"),
       ("run_canary(timeout=inf)", lambda: run_canary(["torch:sdpa-math"], timeout=float("inf")), ValueError,
        "timeout"),
       ("run_canary(timeout=1e300)", lambda: run_canary(["torch:sdpa-math"], timeout=1e300), ValueError, "timeout"),
       ("canary_case(free_pages=10**9)", lambda: canary_case(free_pages=10 ** 9), MemoryBudgetError, "free_pages"),
       ("canary_case(free_pages=-1)", lambda: canary_case(free_pages=-1), ValueError, "free_pages"),
       ("register_kernel of a non-callable", lambda: register_kernel("mylib:attn", 42), TypeError, "fn"),
       ("build_case(max_memory='1M')", lambda: build_case(max_memory="1M"), MemoryBudgetError, "max_memory"),
       ("build_case(max_memory=nan)", lambda: build_case(max_memory=float("nan")), ValueError, "max_memory"),
       ("build_case(max_memory=-1)", lambda: build_case(max_memory=-1), ValueError, "max_memory"),
       ("load_case(None)", lambda: load_case(None), TypeError, "path"),
       ("load_case('')", lambda: load_case(""), ValueError, "path")]


@pytest.mark.parametrize("name,call,kind,arg", API, ids=[a[0] for a in API])
def test_api_errors_are_one_line_naming_the_argument(name, call, kind, arg, monkeypatch):
    _no_allocation(monkeypatch)
    with pytest.raises(kind) as e:
        call()
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and msg.startswith(f"{arg}: "), msg
    from qsa_lab.canary.names import REGISTERED

    assert "mylib:attn" not in REGISTERED


# -- diff --save --json: both published or neither ------------------------------------------------

SIGNAL_AT = textwrap.dedent('''
    import os, signal, sys
    # as at a terminal: a test run started in the background (`make test &`) hands its children
    # SIGINT ignored, and qsa-lab rightly keeps an ignored signal ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from qsa_lab.app import case_file
    from qsa_lab.support import outputs

    where, argv = sys.argv[1], sys.argv[2:]
    publish, encode, seen = outputs._publish, case_file.encode, []

    def interrupt():
        os.kill(os.getpid(), signal.SIGINT)

    def encoding(*a, **k):
        blob = encode(*a, **k)
        if where == "temporaries":
            interrupt()
        return blob

    def publishing(tmp, path, force, arg):
        seen.append(arg)
        if where == f"before {len(seen)}":
            interrupt()
        publish(tmp, path, force, arg)
        if where == f"after {len(seen)}":
            interrupt()

    case_file.encode, outputs._publish = encoding, publishing
    sys.argv = ["qsa-lab", *argv]
    from qsa_lab.app.cli import main
    main()
''')


@pytest.mark.parametrize("where", ["temporaries", "before 1", "after 1", "before 2", "after 2"])
def test_a_signal_while_diff_publishes_leaves_both_outputs_or_neither(where, tmp_path):
    out, saved = tmp_path / "d.json", tmp_path / "d.safetensors"
    p = subprocess.run([sys.executable, "-c", SIGNAL_AT, where, "diff", *TINY, "--poison", "targeted",
                        "--json", str(out), "--save", str(saved)], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    left = sorted(x.name for x in tmp_path.iterdir())
    if where == "temporaries":
        assert (p.returncode, left) == (130, []), (p.returncode, left, p.stderr)
        assert p.stderr.strip().endswith("qsa-lab: interrupted")
    else:
        assert (p.returncode, left) == (0, ["d.json", "d.safetensors"]), (p.returncode, left, p.stderr)
        assert "interrupted while publishing the outputs: every one was written whole" in p.stderr
        assert out.read_text().startswith("{") and saved.stat().st_size > 1000


def test_a_failure_publishing_the_second_output_removes_the_first(tmp_path, monkeypatch, capsys):
    """--json is published first; --save then finds a file that appeared meanwhile: neither stays."""
    from qsa_lab.support import outputs

    out, saved = tmp_path / "d.json", tmp_path / "d.safetensors"
    publish = outputs._publish

    def publishing(tmp, path, force, arg):
        if arg == "--save":
            saved.write_text("someone else's")
        publish(tmp, path, force, arg)
    monkeypatch.setattr(outputs, "_publish", publishing)
    code = main(["diff", *TINY, "--json", str(out), "--save", str(saved)])
    err = capsys.readouterr().err
    assert code == 2 and "--save: " in err and "appeared during the run" in err
    assert not out.exists() and saved.read_text() == "someone else's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.safetensors"]


# -- a killed --report -------------------------------------------------------------------------------

KILLED_REPORT = textwrap.dedent('''
    import os, signal, sys
    from qsa_lab.support.outputs import writing_folder
    with writing_folder(sys.argv[1], "--report") as tmp:
        (tmp / "report.md").write_text("half")
        os.kill(os.getpid(), signal.SIGKILL)
''')


def test_a_killed_report_leaves_a_partial_folder_the_next_run_removes(tmp_path, capsys):
    folder = tmp_path / "rep"
    p = subprocess.run([sys.executable, "-c", KILLED_REPORT, str(folder)], capture_output=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == -9
    (partial,) = [x for x in tmp_path.iterdir()]
    assert partial.name.startswith(".rep.partial-") and not folder.exists()
    code = main(["canary", "--kernels", "torch:sdpa-math", "--regions", "null-block", "--payloads", "nan",
                 "--planes", "v", "--backend", "emulate", "--report", str(folder)])
    err = capsys.readouterr().err
    assert code == 1 and sorted(x.name for x in tmp_path.iterdir()) == ["rep"]
    assert f"qsa-lab: warning: report: removed {partial}, a partial folder left by a run that was killed" in err


def test_a_folder_another_run_is_writing_is_left_alone(tmp_path):
    from qsa_lab.support.outputs import clean_leftovers

    mine = tmp_path / f".rep.partial-{os.getppid()}-0123abcd"     # a live process: a run writing it now
    mine.mkdir()
    assert clean_leftovers(tmp_path / "rep", "--report") == [] and mine.is_dir()


# -- case files and worker outputs ---------------------------------------------------------------------

@pytest.mark.parametrize("name,tensor,needle", [
    ("seq_lens", torch.tensor(33, dtype=torch.int32), "seq_lens"),
    ("seq_lens", torch.zeros(0, dtype=torch.int32), "seq_lens"),
    ("seq_lens", torch.tensor([33, 32], dtype=torch.int32), "block_table"),
    ("q", torch.zeros((), dtype=torch.float16), "q"),
    ("query_lens", torch.tensor([5, 5], dtype=torch.int32), "query_lens"),
    ("query_lens", torch.tensor([-1, 6, 5], dtype=torch.int32), "query_lens"),
    ("token_to_req", torch.full((10,), 7, dtype=torch.int32), "token_to_req"),
    ("token_to_req", torch.zeros(10, 2, dtype=torch.int32), "token_to_req")])
def test_a_case_file_of_the_wrong_shape_is_bad_input(name, tensor, needle, tmp_path, capsys):
    from safetensors.torch import save_file

    c = canary_case()
    t = {"kv_cache": c.kv_cache, "block_table": c.block_table, "seq_lens": c.seq_lens, "q": c.q,
         "selected": c.selected, name: tensor}
    path = tmp_path / "case.safetensors"
    save_file({k: v.contiguous() for k, v in t.items()}, str(path))
    with pytest.raises(ValueError, match=f"^{needle}: "):
        load_case(path)
    code = main(["canary", "--case", str(path), "--kernels", "torch:sdpa-math"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"qsa-lab: error: --case: {needle}: ") and len(err.splitlines()) == 1, err


def test_a_float8_output_from_a_worker_kernel_is_judged(tmp_path):
    kernel = tmp_path / "f8.py"
    kernel.write_text("import torch\nimport canary_kernels as ck\n\n"
                      "def attn(call):\n    return ck.zero_times_v(call).float().to(torch.float8_e4m3fn)\n")
    rep = run_canary([f"{kernel}:attn"], regions=["stale-tail"], payloads=["nan"], planes=["v"], backend="emulate")
    (r,) = rep.results
    assert r.verdict == "nan-leak" and r.nan > 0 and rep.exit_code() == 1

"""A call file is data: replay runs a kernel only when the user names it (issue 33, item 1).

Each forged file records a kernel that would create a marker file on import or on call; replay
without --kernel must create no marker, print no verdict, name the recorded kernel with the
command that would run it, and exit 2."""
import os
import sys

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from qsa_lab.canary.case import canary_case
from qsa_lab.canary.replay import KernelNotNamed, main, replay
from qsa_lab.canary.calls import save_call
from qsa_lab.model.regions import region_slots

EVIL = """\
import pathlib
pathlib.Path({marker!r}).write_text("imported")
def boom(call):
    pathlib.Path({marker!r}).write_text("called")
    return call.q
"""


@pytest.fixture
def call_file(tmp_path):
    case = canary_case()
    path = tmp_path / "report" / "calls" / "cell.safetensors"
    save_call(path, case, "torch:sdpa-math", "null-block", "v", "nan", region_slots(case, "null-block"), None,
              "clean", {"nan": 0, "inf": 0, "finite_changed": 0}, {})
    return path


def forge(path, kernel: str):
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(path), metadata={**meta, "kernel": kernel})
    return path


@pytest.fixture
def evil(tmp_path, monkeypatch):
    """An importable evil module beside the report (also shipped inside it) -> the marker path."""
    marker = tmp_path / "MARKER"
    for where in (tmp_path / "evil.py", tmp_path / "report" / "evil.py", tmp_path / "evil_mod.py"):
        where.parent.mkdir(exist_ok=True)
        where.write_text(EVIL.format(marker=str(marker)))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    return marker


FORGED = ["evil.py:boom",                  # relative path
          "{tmp}/evil.py:boom",            # absolute path
          "evil_mod:boom",                 # module:function on the path
          "report/evil.py:boom",           # a .py shipped inside the report folder
          "builtins:print"]                # any callable of the standard library


@pytest.mark.parametrize("kernel", FORGED)
def test_forged_call_files_run_nothing(call_file, evil, tmp_path, kernel, capsys):
    kernel = kernel.format(tmp=tmp_path)
    forge(call_file, kernel)
    with pytest.raises(KernelNotNamed):
        replay(call_file)
    code = main([str(call_file)])
    out, err = capsys.readouterr()
    assert code == 2
    assert not evil.exists(), f"replay ran code the file named: {evil.read_text()}"
    assert "verdict" not in out and "clean" not in out
    assert kernel in err and "--kernel" in err and len(err.strip().splitlines()) == 1


def test_a_kernel_the_user_names_runs(call_file, evil, capsys):
    """The marker mechanism works: the same kernel named on the command line does run."""
    forge(call_file, "evil_mod:boom")
    main([str(call_file), "--kernel", "evil_mod:boom"])
    assert evil.read_text() == "called"


def test_a_builtin_recorded_kernel_runs_unnamed(call_file, capsys):
    assert main([str(call_file), "--backend", "emulate"]) == 1   # sdpa-math reads the null block: it leaks
    assert "verdict nan-leak" in capsys.readouterr().out


@pytest.mark.parametrize("kernel", ["qsa:no-such-route", "torch:../../evil.py:boom", "flashinfer:evil.py:boom"])
def test_a_forged_builtin_name_is_looked_up_never_imported(call_file, evil, kernel, capsys):
    forge(call_file, kernel)
    assert main([str(call_file), "--backend", "emulate"]) in (2, 3)   # unknown built-in: cannot run here
    assert not evil.exists()
    assert "verdict" not in capsys.readouterr().out


@pytest.mark.parametrize("kernel,code,problem", [
    ("qsa:no-such-route", 2, "unknown qsa route 'no-such-route'"),     # not a name: bad input
    ("no kernel at all", 2, "'no kernel at all' is not a known kernel"),
    ("torch:nope", 3, "unknown torch kernel 'torch:nope'"),            # a name this qsa_lab cannot run
    ("flashinfer:evil.py:boom", 3, "unknown flashinfer kernel 'flashinfer:evil.py:boom'")])
def test_a_bad_recorded_name_is_an_error_naming_the_call_file(call_file, evil, kernel, code, problem, capsys):
    forge(call_file, kernel)
    assert main([str(call_file), "--backend", "emulate"]) == code
    err = capsys.readouterr().err
    assert f"call file: {problem}" in err and len(err.strip().splitlines()) == 1
    assert err.startswith("replay: error: call file: " if code == 2 else "replay: CannotRun: ")
    assert not evil.exists()


@pytest.mark.parametrize("kernel,code,problem", [("", 2, "an empty kernel name"),
                                                 ("my-mod:fn", 2, "'my-mod:fn': 'my-mod' is neither a module"),
                                                 ("torch:nope", 3, "unknown torch kernel 'torch:nope'")])
def test_a_bad_kernel_option_is_an_error_naming_it(call_file, kernel, code, problem, capsys):
    assert main([str(call_file), "--kernel", kernel, "--backend", "emulate"]) == code
    err = capsys.readouterr().err
    assert f"--kernel: {problem}" in err and len(err.strip().splitlines()) == 1


def test_replay_of_a_fifo_does_not_hang(tmp_path, capsys):
    fifo = tmp_path / "call.safetensors"
    os.mkfifo(fifo)
    assert main([str(fifo)]) == 2
    assert "not a regular file" in capsys.readouterr().err


def test_ctrl_c_during_replay_is_one_line(call_file, monkeypatch, capsys):
    import qsa_lab.canary.replay as mod

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(mod, "replay", interrupted)
    assert main([str(call_file)]) == 130
    assert capsys.readouterr().err.strip() == "replay: interrupted"


@pytest.mark.parametrize("key, value", [("mla", "[1]"), ("mla", "-1"), ("v_head_dim", "\"16\""), ("mla", "{")])
def test_a_call_file_with_a_corrupt_header_is_bad_input(call_file, key, value, capsys):
    """A header value of the wrong kind is exit 2 (bad input) in one line naming the file, never a
    kernel run that fails (exit 3: cannot tell)."""
    with safe_open(str(call_file), framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(call_file), metadata={**meta, key: value})
    assert main([str(call_file), "--backend", "emulate"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("replay: error: path:") and str(call_file) in err

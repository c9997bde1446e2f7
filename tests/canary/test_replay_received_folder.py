"""Replay inside a folder someone sent (issue 40, Reliability IV): nothing lying in the current folder
is imported. `python -m` puts the current folder first on the import path, so a report folder
holding `shlex.py`, `torch.py`, `safetensors/` or `qsa_lab/` would run them; the documented command,
`qsa-lab replay`, never has the current folder on its path, `python -m qsa_lab ...` and `python -m
qsa_lab.canary.replay` take it off before importing anything else, and the user-kernel worker finds
a kernel module in the current folder only after every installed module."""
import subprocess
import sys
from pathlib import Path

import pytest

from qsa_lab.canary.calls import save_call
from qsa_lab.canary.case import canary_case
from qsa_lab.model.regions import region_slots

ROOT = Path(__file__).parents[2]
QSA_LAB = Path(sys.executable).parent / "qsa-lab"
#: modules a replay imports (directly or through torch / safetensors), planted in the folder
PLANTED = ("shlex", "torch", "argparse", "json", "numpy", "__future__", "signal", "threading", "safetensors")
MARK = "import pathlib\npathlib.Path({path!r}).write_text('imported from the folder')\n"


def plant(folder: Path, names=PLANTED, package=False) -> Path:
    """Modules that leave a marker in folder/MARKERS when imported -> the markers' folder."""
    marks = folder.parent / "MARKERS"
    marks.mkdir(exist_ok=True)
    for name in names:
        code = MARK.format(path=str(marks / name))
        if name == "safetensors":
            (folder / name).mkdir()
            (folder / name / "__init__.py").write_text(code)
        else:
            (folder / f"{name}.py").write_text(code)
    if package:
        (folder / "qsa_lab").mkdir()
        (folder / "qsa_lab" / "__init__.py").write_text(MARK.format(path=str(marks / "qsa_lab")))
    return marks


@pytest.fixture
def report(tmp_path):
    """A received report folder: one call file of a built-in kernel, and a kernel file of its own."""
    folder = tmp_path / "report"
    case = canary_case()
    save_call(folder / "calls" / "cell.safetensors", case, "torch:sdpa-math", "stale-tail", "v", "nan",
              region_slots(case, "stale-tail"), None, "nan-leak", {"nan": 1, "inf": 0, "finite_changed": 0}, {})
    (folder / "kernels").mkdir()
    (folder / "kernels" / "mine.py").write_text(
        "import canary_kernels\n\ndef attn(call):\n    return canary_kernels.reference(call)\n")
    return folder


def run(argv, cwd):
    env = {"PATH": str(Path(sys.executable).parent), "HOME": str(cwd),
           "PYTHONPATH": str(ROOT / "tests")}         # canary_kernels, for the user's kernel file
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_qsa_lab_replay_imports_nothing_from_the_folder(report):
    marks = plant(report, package=True)
    p = run([str(QSA_LAB), "replay", "calls/cell.safetensors", "--backend", "emulate"], report)
    assert sorted(x.name for x in marks.iterdir()) == [], p.stderr
    assert p.returncode == 1 and "verdict nan-leak" in p.stdout, p.stdout + p.stderr    # torch:sdpa-math reads 0 * NaN
    # and a user kernel named from the folder runs in its worker without the folder's modules
    p = run([str(QSA_LAB), "replay", "calls/cell.safetensors", "--kernel", "kernels/mine.py:attn",
             "--backend", "emulate"], report)
    assert sorted(x.name for x in marks.iterdir()) == [], p.stderr
    assert p.returncode == 0 and "replay kernels/mine.py:attn" in p.stdout, p.stdout + p.stderr   # masked: clean


@pytest.mark.parametrize("module", [["qsa_lab", "replay"], ["qsa_lab.canary.replay"]])
def test_python_m_takes_the_current_folder_off_the_path_first(report, module):
    """Without -P, `python -m` cannot stop a `qsa_lab/` lying there (it is the package being run):
    that is why the documented command is `qsa-lab replay`; every other module is stopped."""
    marks = plant(report)
    p = run([sys.executable, "-m", *module, "calls/cell.safetensors", "--backend", "emulate"], report)
    assert sorted(x.name for x in marks.iterdir()) == [], p.stderr
    assert p.returncode == 1 and "verdict nan-leak" in p.stdout, p.stdout + p.stderr


@pytest.mark.skipif(sys.version_info < (3, 11), reason="python -P is new in 3.11")
def test_python_P_m_is_safe_from_a_planted_package_too(report):
    marks = plant(report, names=("shlex", "torch"), package=True)
    p = run([sys.executable, "-P", "-m", "qsa_lab.canary.replay", "calls/cell.safetensors", "--backend", "emulate"],
            report)
    assert sorted(x.name for x in marks.iterdir()) == [], p.stderr
    assert p.returncode == 1, p.stdout + p.stderr


def test_every_replay_line_a_report_prints_is_qsa_lab_replay():
    from qsa_lab.canary.replay import KernelNotNamed
    from qsa_lab.canary.report import _replay_command

    assert _replay_command("calls/x.safetensors", "torch:sdpa-math", None, {}).startswith("qsa-lab replay ")
    assert KernelNotNamed("calls/x.safetensors", "evil:boom").command.startswith("qsa-lab replay ")


# -- what a call file supplies reaches the terminal escaped ----------------------------------------

ESC = "\x1b[2J\x1b[31m"


def _forge(path, **meta):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        old, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(path), metadata={**old, **meta})


def _raw(text):
    return "\x1b" in text or "\r" in text


@pytest.mark.parametrize("meta", [{"kernel": f"torch:sdpa-math{ESC}\nverdict clean"},
                                  {"kernel": f"flashinfer:{ESC}x\rclean"},
                                  {"region": f"{ESC}stale-tail\nverdict clean", "plane": "v\r", "payload": ESC,
                                   "verdict": f"clean{ESC}\n"}])
def test_a_forged_call_file_never_writes_control_codes_to_the_terminal(report, meta, capsys):
    from qsa_lab.app.cli import main as cli
    from qsa_lab.canary.replay import main

    call = report / "calls" / "cell.safetensors"
    _forge(call, **meta)
    for run_replay in (lambda: main([str(call), "--backend", "emulate"]),
                       lambda: cli(["replay", str(call), "--backend", "emulate"])):
        code = run_replay()
        out, err = capsys.readouterr()
        assert not _raw(out) and not _raw(err), (out, err)
        assert "\\x1b" in out + err                         # shown, escaped
        assert not any(line.startswith("verdict clean") for line in out.splitlines())   # no forged line
        assert code in (1, 2, 3) and len(err.strip().splitlines()) <= 1, (code, err)


def test_an_old_route_name_in_a_call_file_is_bad_input(report, capsys):
    from qsa_lab.app.cli import main as cli
    from qsa_lab.canary.replay import main

    call = report / "calls" / "cell.safetensors"
    _forge(call, kernel="qsa:fixA")
    assert main([str(call)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("replay: error: call file: ") and "qsa:" in err and len(err.strip().splitlines()) == 1
    assert cli(["replay", str(call)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qsa-lab: error: CALL_FILE: ") and len(err.strip().splitlines()) == 1, err


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH is new in 3.11")
def test_the_second_process_of_a_run_in_a_received_folder_imports_nothing_from_it(tmp_path):
    """`qsa-lab canary` (e.g. --case calls/x.safetensors inside a report) starts multiprocessing's spawn
    children, which start as `python -c`, the current folder first on their path."""
    folder = tmp_path / "received"
    folder.mkdir()
    marks = plant(folder, names=("shlex",))
    (folder / "multiprocessing").mkdir()
    (folder / "multiprocessing" / "__init__.py").write_text(MARK.format(path=str(marks / "multiprocessing")))
    code = ("import sys; sys.path[:] = [p for p in sys.path if p]\n"
            "from qsa_lab.support.executor import SecondProcess\n"
            "s = SecondProcess('shlex'); print(s.submit(sum, [1, 2]).result()); s.close()\n")
    p = run([sys.executable, "-c", code], folder)
    assert sorted(x.name for x in marks.iterdir()) == [], p.stderr
    assert p.stdout.strip() == "3", p.stderr


def _copy_of_qsa_lab(folder: Path, planted: str) -> Path:
    """A whole copy of qsa_lab in `folder`, with a marker planted in its module `planted` (a
    received folder that carries its own qsa_lab/) -> the marker's path."""
    import shutil

    shutil.copytree(ROOT / "qsa_lab", folder / "qsa_lab", ignore=shutil.ignore_patterns("__pycache__"))
    marker = folder.parent / "COPY_MARKER"
    with open(folder / "qsa_lab" / planted, "a") as f:
        f.write("\n" + MARK.format(path=str(marker)))
    return marker


@pytest.mark.parametrize("argv, planted, runs", [
    (["-m", "qsa_lab", "--help"], "app/cli.py", (0, "usage:")),
    (["-m", "qsa_lab.canary.replay", "calls/cell.safetensors"], "canary/calls.py", (1, "verdict nan-leak"))])
def test_python_m_refuses_a_qsa_lab_copy_in_the_current_folder(report, argv, planted, runs):
    """`python -m` would import the folder's qsa_lab/ in place of the installed one: with the install's
    .pth read, the installed one runs as asked (exit code, output); without it, the entry point sees the
    copy and exits 2 in one line before it imports the rest of it."""
    marker = _copy_of_qsa_lab(report, planted)
    env = {"PATH": str(Path(sys.executable).parent), "HOME": str(report), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, *argv], cwd=report, env=env, capture_output=True, text=True, timeout=300)
    assert not marker.exists(), "the folder's copy of qsa_lab ran"
    if _pth_read():   # an install that carries qsa_lab-installed-only.pth: the copy is never imported
        assert "refused" not in out.stderr and out.returncode == runs[0] and runs[1] in out.stdout, out.stderr
        return
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "refused" in out.stderr and "current folder" in out.stderr


def _pth_read() -> bool:
    """Whether this interpreter's install read qsa_lab's .pth (qsa_lab.support.installed_only)."""
    return any(getattr(f, "__module__", "") == "_qsa_lab_installed_only.finder" for f in sys.meta_path)


def test_python_m_runs_the_checkout_from_its_root():
    """In development the checkout's own qsa_lab, found by the editable install or PYTHONPATH, is
    the installed one: `python -m qsa_lab` runs from the repository root."""
    env = {"PATH": str(Path(sys.executable).parent), "HOME": str(ROOT), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "qsa_lab", "--help"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and "usage: qsa-lab" in out.stdout, out.stderr


def test_the_documented_python_i_m_runs_no_qsa_lab_py_of_the_folder(tmp_path):
    """A qsa_lab.py lying in the folder runs before any code of the package could refuse it: the
    documented spelling `python -I -m qsa_lab` never has the folder on its path."""
    marker = tmp_path / "MARKER"
    (tmp_path / "qsa_lab.py").write_text(MARK.format(path=str(marker)))
    env = {"PATH": str(Path(sys.executable).parent), "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-I", "-m", "qsa_lab", "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "usage: qsa-lab" in out.stdout, out.stderr
    assert not marker.exists()

"""Reliability III (issue 33): no user file is written through a link or deleted by another
run's failure, no input is replaced, empty paths and unsafe pickles are bad input, a float8
output is judged, and `qsa-lab lab` takes its server down with it."""
import errno
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

import canary_kernels as ck
from qsa_lab.app.cli import main
from qsa_lab.canary import run_canary

ROOT = Path(__file__).parents[2]
SMALL = ["--regions", "stale-tail", "--payloads", "nan", "--planes", "v"]


def run_cli(argv, capsys):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err, needle):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qsa-lab: error: ") and needle in lines[0], err
    return lines[0]


# -- two repro runs at once: the failing one removes only what it made -----------------------------

def test_a_failing_repro_leaves_the_other_runs_files(tmp_path, monkeypatch, capsys):
    """Run 2 draws its figures while run 1 publishes its 35 figures and its repro.csv / .json;
    run 2 then finds repro.csv there: it exits 2 and removes its own figures, nothing else."""
    import qsa_lab.report.figures as figures
    import qsa_lab.report.repro as repro
    from qsa_lab.support import outputs, processes

    out, figs = tmp_path / "out", tmp_path / "figs"
    first = {figs / f"fig_{i:02d}.png": f"run 1 figure {i}" for i in range(33)}
    first.update({out / "repro.csv": "run 1 csv", out / "repro.json": "run 1 json"})

    def other_run_publishes():
        for p, text in first.items():
            p.parent.mkdir(exist_ok=True)
            p.write_text(text)

    def draw(results, out_dir, table=None, overwrite=False, **_):
        outputs.check_folder(out_dir, "--figures", create=True, parents=True)   # as export.save_rendered
        mine = [outputs.write_text(Path(out_dir) / f"mine_{i}.png", "run 2", "--figures") for i in range(2)]
        other_run_publishes()
        return mine

    monkeypatch.setattr(repro, "run_repro", lambda **kw: (pd.DataFrame({"case": ["x"]}), []))
    monkeypatch.setattr(repro, "format_table", lambda t: "table")
    monkeypatch.setattr(figures, "write_repro_figures", draw)
    monkeypatch.setattr(processes, "idle_core", lambda *a, **k: False)
    code, _, err = run_cli(["repro", "--out", out, "--figures", figs, "--backend", "emulate", "--quiet"], capsys)
    assert code == 2
    one_line(err, "appeared during the run")
    assert {p: p.read_text() for p in first} == first          # all 35 of run 1's files, untouched
    assert sorted(p.name for p in figs.iterdir()) == sorted(p.name for p in first if p.parent == figs)
    assert not [p for p in out.iterdir() if p.name.startswith(".")]   # no temporaries either


# -- no write through a link, no input replaced -------------------------------------------------------

def test_notebooks_force_refuses_a_notebook_named_symlink(tmp_path, capsys):
    dest, mine = tmp_path / "nb", tmp_path / "my_notes.ipynb"
    dest.mkdir()
    mine.write_text("mine")
    (dest / "01_e4m3_and_the_null_block.ipynb").symlink_to(mine)
    code, _, err = run_cli(["notebooks", dest, "--force"], capsys)
    assert code == 2
    one_line(err, "01_e4m3_and_the_null_block.ipynb is a symlink")
    assert mine.read_text() == "mine" and list(dest.iterdir()) == [dest / "01_e4m3_and_the_null_block.ipynb"]


def test_notebooks_on_a_full_disk_leave_no_truncated_notebook(tmp_path, monkeypatch, capsys):
    real, calls = pathlib.Path.write_bytes, []

    def full_disk(self, data):
        calls.append(self)
        if len(calls) == 3:
            real(self, data[:100])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)
    monkeypatch.setattr(pathlib.Path, "write_bytes", full_disk)
    dest = tmp_path / "nb"
    code, _, err = run_cli(["notebooks", dest], capsys)
    assert code == 3 and "No space left" in err
    assert not dest.exists()      # the two finished copies and the folder it made are gone too


@pytest.mark.parametrize("argv, flag", [(["notebooks", ""], "DIR"), (["canary", "--case", ""], "--case"),
                                        (["canary", "--report", ""], "--report")])
def test_an_empty_path_is_refused_not_taken_as_absent(argv, flag, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(argv, capsys)
    assert code == 2
    one_line(err, f"{flag}: empty path")
    assert list(tmp_path.iterdir()) == []


def _kernel_module(tmp_path, monkeypatch):
    src = tmp_path / "my_kernels.py"
    src.write_text("from canary_kernels import reference\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return src


@pytest.mark.parametrize("form", ["--kernels path", "--kernels module", "--kernel module"])
def test_json_force_never_replaces_the_kernels_source(form, tmp_path, monkeypatch, capsys):
    src = _kernel_module(tmp_path, monkeypatch)
    flag, how = form.split()
    spec = f"{src}:reference" if how == "path" else "my_kernels:reference"
    code, _, err = run_cli(["canary", flag, spec, "--json", src, "--force", *SMALL], capsys)
    assert code == 2
    one_line(err, "my_kernels.py")
    assert src.read_text() == "from canary_kernels import reference\n"


def test_a_report_folder_may_not_hold_the_case(tmp_path, capsys):
    from qsa_lab.canary.case import canary_case
    from qsa_lab.canary.calls import save_call
    from qsa_lab.model.regions import region_slots

    case = canary_case()
    call = save_call(tmp_path / "rep" / "calls" / "x.safetensors", case, "torch:sdpa-math", "stale-tail", "v", "nan",
                     region_slots(case, "stale-tail"), None, "nan-leak", {}, {})
    before = call.read_bytes()
    code, _, err = run_cli(["canary", "--case", call, "--report", tmp_path / "rep", "--force",
                            "--kernels", "torch:sdpa-math", *SMALL], capsys)
    assert code == 2
    one_line(err, "--report")
    assert call.read_bytes() == before


# -- smaller defects -----------------------------------------------------------------------------------

def test_a_pickle_refused_by_weights_only_is_bad_input(tmp_path, capsys):
    evil = tmp_path / "case.pt"
    torch.save({"kv_cache": object()}, evil)     # weights_only refuses to unpickle a plain object
    code, _, err = run_cli(["canary", "--case", evil, "--kernels", "torch:sdpa-math"], capsys)
    assert code == 2
    one_line(err, "--case")


def test_a_float8_output_is_judged(tmp_path):
    def f8(call):
        return ck.reference(call).to(torch.float8_e4m3fn)

    def f8_leaky(call):
        return ck.zero_times_v(call).float().to(torch.float8_e5m2)

    rep = run_canary({"f8": f8, "f8_leaky": f8_leaky}, regions=["null-block", "stale-tail"], payloads=["nan"],
                     planes=["v"], backend="emulate")
    got = {(r.kernel, r.region): r.verdict for r in rep.results}
    assert got == {("f8", "null-block"): "clean", ("f8", "stale-tail"): "clean",
                   ("f8_leaky", "null-block"): "nan-leak", ("f8_leaky", "stale-tail"): "nan-leak"}


LAB = """
import importlib.util, os, sys
import qsa_lab.support.package_data as data
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: real("json") if name == "jupyterlab" else real(name, *a)
data.lab_command = lambda folder, extra: [sys.executable, "-c",
    "import os, time; open({pidfile!r}, 'w').write(str(os.getpid())); time.sleep(120)"]
sys.argv = ["qsa-lab", "lab", {folder!r}, "--no-browser"]
from qsa_lab.app.cli import main
main()
"""


def test_lab_takes_its_server_down_on_sigterm(tmp_path):
    pidfile = tmp_path / "server.pid"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    lab = subprocess.Popen([sys.executable, "-c", LAB.format(pidfile=str(pidfile), folder=str(tmp_path / "nb"))],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    server = int(pidfile.read_text())
    try:
        lab.send_signal(signal.SIGTERM)
        assert lab.wait(60) == 143
        time.sleep(0.2)
        with pytest.raises(ProcessLookupError):
            os.kill(server, 0)     # ended (and reaped by qsa-lab), not left running
    finally:
        lab.kill()
        try:
            os.kill(server, signal.SIGKILL)
        except ProcessLookupError:
            pass

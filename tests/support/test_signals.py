"""Ctrl-C, SIGTERM and SIGHUP reaching `python -m qsa_lab` at start-up, mid-compute and
mid-write: one line, exit 130 / 143 / 129, no temporary file left, nothing published.

No timing: a small wrapper prints a marker at the moment of interest (torch's import begins;
the planner is computing, and keeps computing until the signal ends the process; a finished
temporary file waits to be published, and keeps waiting) and the test signals only after it
has read the marker. Generous timeouts for a loaded machine."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TINY = ["--rows", "19", "--context", "256", "--topk", "16", "--head-dim", "32", "--backend", "emulate"]
EXPECT = {signal.SIGINT: (130, "qsa-lab: interrupted"), signal.SIGTERM: (143, "qsa-lab: terminated (SIGTERM)"),
          signal.SIGHUP: (129, "qsa-lab: hung up (SIGHUP)")}

WRAPPER = r'''
import runpy, sys, time
mode, argv = sys.argv[1], sys.argv[2:]

def mark(text):
    sys.stderr.write(f"MARK {text}\n")
    sys.stderr.flush()

if mode == "startup":        # the marker as torch's import starts: the signal lands in it or just after
    class Hook:
        def find_spec(self, name, path=None, target=None):
            if name == "torch":
                sys.meta_path.remove(self)
                mark("importing torch")
            return None
    sys.meta_path.insert(0, Hook())
elif mode == "compute":      # the planner (torch ops) runs over and over until the signal
    import qsa_lab.model.plan as plan
    real = plan.plan_groups
    def planning(*a, **kw):
        mark("computing")
        while True:
            real(*a, **kw)
    plan.plan_groups = planning
elif mode.startswith("write"):        # a temporary file, written whole, waits to be published until the signal
    import qsa_lab.support.outputs as outputs
    import qsa_lab.support.signals as signals
    real_publish = outputs._publish
    def publish(tmp, path, force, arg):
        mark(f"writing {tmp}")
        while not signals._held:     # the signal ends the process here, or is noted (outputs published together)
            time.sleep(0.05)
        real_publish(tmp, path, force, arg)
    outputs._publish = publish
if "small-repro" in mode:   # repro on two tiny cases (the full table takes minutes)
    import qsa_lab.report.repro as repro
    real_repro = repro.run_repro
    repro.run_repro = lambda backend="auto", progress=True, beside=0: real_repro(
        backend=backend, cases=repro.REPRO_CASES[:2], progress=False, repeat=False, beside=beside,
        geometry_overrides=dict(context=256, topk=16, head_dim=32))
sys.argv = ["qsa-lab", *argv]
runpy.run_module("qsa_lab", run_name="__main__", alter_sys=True)
'''


def _default_signals():
    for s in (signal.SIGINT, signal.SIGHUP):   # the test runner may run with them ignored; a terminal does not
        signal.signal(s, signal.SIG_DFL)


def run_signalled(mode, argv, signum, cwd: Path):
    p = subprocess.Popen([sys.executable, "-c", WRAPPER, mode, *argv], cwd=cwd, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, preexec_fn=_default_signals)
    try:
        deadline = time.monotonic() + 600
        line = ""
        while not line.startswith("MARK"):
            line = p.stderr.readline()
            assert line or p.poll() is None, "the process ended before its marker"
            assert time.monotonic() < deadline, "no marker within 600 s"
        p.send_signal(signum)
        out, err = p.communicate(timeout=600)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, out, [ln for ln in err.splitlines() if not ln.startswith("MARK")]


def leftovers(folder: Path):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if ".tmp" in p.name)


@pytest.mark.parametrize("mode,signum", [
    ("startup", signal.SIGINT), ("startup", signal.SIGTERM),
    ("compute", signal.SIGINT), ("compute", signal.SIGTERM), ("compute", signal.SIGHUP),
])
def test_a_signal_during_start_up_or_compute_is_one_line(mode, signum, tmp_path):
    code, out, err = run_signalled(mode, ["diff", *TINY, "--save", "case.safetensors"], signum, tmp_path)
    assert (code, err) == (EXPECT[signum][0], [EXPECT[signum][1]]), err
    assert list(tmp_path.iterdir()) == []                     # nothing saved, no temporary


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_while_diff_publishes_its_written_output_publishes_it_whole(signum, tmp_path):
    """diff's outputs are published together (all or none): a signal once every temporary is written
    whole is noted, the output published, said in one line, and the run goes on (exit 0). A signal
    before that point publishes nothing: tests/app/test_reliability4.py."""
    code, out, err = run_signalled("write", ["diff", *TINY, "--json", "report.json"], signum, tmp_path)
    what = EXPECT[signum][1].removeprefix("qsa-lab: ")
    assert (code, err) == (0, [f"qsa-lab: {what} while publishing the outputs: every one was written whole; "
                               "going on"]), err
    assert leftovers(tmp_path) == [] and json.loads((tmp_path / "report.json").read_text())
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_repro_interrupted_mid_write_publishes_neither_table(tmp_path):
    code, out, err = run_signalled("write,small-repro", ["repro", "--backend", "emulate", "--out", "results",
                                                         "--no-figures", "--quiet"], signal.SIGINT, tmp_path)
    assert (code, err) == (130, ["qsa-lab: interrupted"]), err
    assert leftovers(tmp_path) == []
    assert not (tmp_path / "results" / "repro.csv").exists() and not (tmp_path / "results" / "repro.json").exists()


def test_an_ignored_hangup_stays_ignored(tmp_path):
    """nohup: SIGHUP ignored before the process starts stays ignored (the run completes)."""
    def ignore_hup():
        _default_signals()                               # Ctrl-C at its default, whatever the runner passed on
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    p = subprocess.Popen([sys.executable, "-c", WRAPPER, "compute", "diff", *TINY], cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=ignore_hup)
    try:
        assert p.stderr.readline().startswith("MARK")
        p.send_signal(signal.SIGHUP)
        p.send_signal(signal.SIGINT)        # still alive after the ignored SIGHUP: Ctrl-C ends it as usual
        out, err = p.communicate(timeout=600)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130 and err.splitlines()[-1] == "qsa-lab: interrupted"


def test_in_process_main_restores_the_previous_handlers():
    from qsa_lab.app.cli import main

    before = signal.getsignal(signal.SIGTERM)
    assert main(["diff", "--rows", "x"]) == 2
    assert signal.getsignal(signal.SIGTERM) is before


def test_repro_on_a_full_disk_publishes_nothing(tmp_path, monkeypatch, capsys):
    """The figures fail part-way (ENOSPC after one file): neither table is published, and the
    figure this run wrote is removed with the temporaries."""
    import errno

    import qsa_lab.report.figures
    import qsa_lab.report.repro
    from qsa_lab.app.cli import main

    real = qsa_lab.report.repro.run_repro
    monkeypatch.setattr(qsa_lab.report.repro, "run_repro", lambda backend="auto", progress=True, beside=0: real(
        backend=backend, cases=qsa_lab.report.repro.REPRO_CASES[:1], progress=False, repeat=False, beside=beside,
        geometry_overrides=dict(context=256, topk=16, head_dim=32)))

    def full_disk(results, out_dir, table=None, overwrite=False, ahead=None):
        from qsa_lab.support.outputs import write_bytes   # the figure writer's one way to write

        write_bytes(Path(out_dir, "01_e4m3_code_table.png"), b"half a figure set", "--figures")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(qsa_lab.report.figures, "write_repro_figures", full_disk)
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "mine.png").write_bytes(b"a user's figure")
    code = main(["repro", "--backend", "emulate", "--out", str(tmp_path / "results"), "--figures",
                 str(tmp_path / "figures"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 3 and "No space left on device" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "results").exists()
    assert sorted(os.listdir(tmp_path / "figures")) == ["mine.png"]


def test_the_console_script_handles_ctrl_c_during_its_imports(tmp_path):
    """`qsa-lab` itself (the console-script entry, cli.main): the marker comes from a
    sitecustomize on PYTHONPATH, which Python imports at start-up."""
    script = Path(sys.executable).parent / "qsa-lab"
    if not script.exists():
        pytest.skip("no qsa-lab console script beside this Python (package not installed)")
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import sys\n"
        "class Hook:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch':\n"
        "            sys.meta_path.remove(self)\n"
        "            sys.stderr.write('MARK importing torch\\n')\n"
        "            sys.stderr.flush()\n"
        "        return None\n"
        "sys.meta_path.insert(0, Hook())\n")
    work = tmp_path / "work"
    work.mkdir()
    p = subprocess.Popen([str(script), "diff", *TINY, "--save", "case.safetensors"], cwd=work,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_default_signals,
                         env={**os.environ, "PYTHONPATH": str(hook)})
    try:
        line = p.stderr.readline()
        assert line.startswith("MARK"), line
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=600)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130 and err.splitlines() == ["qsa-lab: interrupted"], err
    assert list(work.iterdir()) == []

"""`qsa-lab --help` and bad input answer before torch, pandas, matplotlib or numpy load.

Each command runs in a fresh interpreter that reports which heavy modules were imported by the
time `main` returned; the answer itself (exit code, one-line error naming the argument) is the
error contract of tests/app/test_bad_input.py.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "pandas", "matplotlib", "numpy")
PROBE = ("import json, sys\n"
         "from qsa_lab.app.cli import main\n"
         "rc = main(sys.argv[1:])\n"
         f"print(json.dumps({{'rc': rc, 'heavy': [m for m in {HEAVY!r} if m in sys.modules]}}), file=sys.stderr)\n")


def _probe(*argv):
    p = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=300)
    *lines, last = p.stderr.strip().splitlines()
    return json.loads(last), p.stdout, lines


@pytest.mark.parametrize("argv", [["--help"], ["diff", "--help"], ["repro", "--help"], ["canary", "--help"],
                                  ["bench", "--help"]])
def test_help_without_heavy_imports(argv):
    got, out, _ = _probe(*argv)
    assert got == {"rc": 0, "heavy": []}
    assert "usage: qsa-lab" in out


@pytest.mark.parametrize("argv, flag", [
    (["diff", "--rows", "abc"], "--rows"),
    (["diff", "--rows", "0"], "--rows"),
    (["diff", "--kv-dtype", "int8"], "--kv-dtype"),
    (["diff", "--context", "1000000", "--head-dim", "1024", "--max-memory", "1G"], "--requests"),
    (["diff", "--overlap", "0.5", "--selection", "random"], "--overlap"),
    (["diff", "--json", "/nonexistent-dir-qsa/x.json"], "--json"),
    (["diff", "--ro", "5"], "--ro"),
    (["nosuchcommand"], "command"),
    (["repro", "--out", "/nonexistent-dir-qsa/sub/"], "--out"),
    (["canary", "--payloads", ""], "--payloads"),
    (["canary", "--json", "/nonexistent-dir-qsa/x.json"], "--json"),
])
def test_bad_input_without_heavy_imports(argv, flag):
    got, _, err = _probe(*argv)
    assert got == {"rc": 2, "heavy": []}
    assert len(err) == 1 and err[0].startswith(f"qsa-lab: error: {flag}"), err


# the program ends with os._exit once its command is done (cli._leave): what a normal exit does
# that a user can see must still happen: atexit handlers run, buffered output reaches a pipe whole
LEAVE = ("import atexit, sys\n"
         "atexit.register(lambda: print('atexit ran', file=sys.stderr))\n"
         "sys.argv = ['qsa-lab', *sys.argv[1:]]\n"
         "from qsa_lab.app.cli import main\n"
         "sys.exit(main())\n")


@pytest.mark.parametrize("argv, rc", [(["diff", "--help"], 0), (["diff", "--rows", "abc"], 2)])
def test_the_program_runs_atexit_and_flushes_before_it_ends(argv, rc, capsys):
    p = subprocess.run([sys.executable, "-c", LEAVE, *argv], capture_output=True, text=True, timeout=300)
    assert p.returncode == rc
    assert p.stderr.splitlines()[-1] == "atexit ran"
    from qsa_lab.app.cli import main

    assert main(argv) == rc
    # stdout is a pipe there, so block-buffered: all of it arrives, as in-process
    assert p.stdout == capsys.readouterr().out


def test_a_full_run_piped_ends_with_its_whole_output(tmp_path):
    """A command that computes (torch loaded, tensors alive at the end) exits with its code and
    its whole JSON on a pipe."""
    p = subprocess.run([sys.executable, "-m", "qsa_lab", "diff", "--rows", "4", "--requests", "1", "--context", "64",
                        "--topk", "8", "--head-dim", "16", "--q-heads", "2", "--json", "-"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["routes"]

"""`qsa-lab --help` and bad input answer before torch, pandas, matplotlib or numpy load.

Each command runs in a fresh interpreter that reports which heavy modules were imported by the
time `main` returned; the answer itself (exit code, one-line error naming the argument) is the
error contract of tests/test_bad_input.py.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "pandas", "matplotlib", "numpy")
PROBE = ("import json, sys\n"
         "from qsa_lab.cli import main\n"
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

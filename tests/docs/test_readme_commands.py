"""A new user follows the README from the top: its first block of commands runs as written, in
one shell, from the checkout (set-up is already done by `make test`, so `make setup` is quick)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def first_block() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = re.search(r"^```\n(.*?)^```", text, re.S | re.M).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def test_the_first_commands_of_the_readme_run_as_written():
    commands = first_block()
    assert commands[0] == "make setup" and commands[1] == "source .venv/bin/activate"
    assert commands[-1].startswith("qsa-lab ")
    if Path(sys.prefix).resolve() != (REPO / ".venv").resolve():
        pytest.skip("these tests do not run in the checkout's .venv (a conda env?): the README's .venv lines do not apply")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(str(REPO)))
    script = "set -e\n" + "\n".join(commands[:-1]) + f"\n{commands[-1]} --json -\n"
    out = subprocess.run(["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    doc = json.loads(out.stdout[out.stdout.index("{"):])
    assert doc["routes"]["grouped"]["nan_count"] == 480

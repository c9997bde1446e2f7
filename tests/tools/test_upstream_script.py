"""scripts/upstream/cross_request_nan.py: the standalone check for upstream (torch only), run on the
CPU through the shim that binds upstream's op signature to qsa_lab's emulated routes: exit 1 on
kernel_fix (the merged fix leaks across requests), 0 on the complete fixes, 3 when it cannot run."""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "scripts" / "upstream"
SHIM = ROOT / "qsa_lab_shim.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("cross_request_nan", ROOT / "cross_request_nan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_script_imports_torch_only():
    tree = ast.parse((ROOT / "cross_request_nan.py").read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "qsa_lab" not in names and names <= {"__future__", "argparse", "importlib", "sys", "pathlib", "torch"}


@pytest.mark.parametrize("op, code", [("kernel_fix", 1), ("finite_pv", 0)])
def test_exit_codes_through_the_shim(script, op, code, capsys):
    assert script.main(["--op", f"{SHIM}:{op}", "--device", "cpu", "--small", "--requests", "1"]) == code
    out = capsys.readouterr().out
    assert "rows 40-47 hold requests [0, 1, 2]" in out
    if code:
        assert "LEAK: other requests' rows non-finite [(45, 0), (47, 2)]" in out
    else:
        assert "verdict: clean" in out


def test_cannot_run_is_3(script, capsys):
    assert script.main(["--op", "no_such_module_here:op", "--device", "cpu", "--small"]) == 3
    assert script.main(["--op", f"{SHIM}:finite_pv", "--device", "cpu", "--small", "--requests", "7"]) == 3
    assert script.main(["--op", f"{SHIM}:no_such_route", "--device", "cpu", "--small"]) == 3
    assert script.main(["--small", "--requests", "0"]) == 3     # upstream's op: no vllm here (and no GPU)
    err = capsys.readouterr().err
    assert err.count("cannot run") == 4

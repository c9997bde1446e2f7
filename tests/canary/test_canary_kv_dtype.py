"""A case brings its own pool dtype: the canary never runs it as another one silently."""
import subprocess
import sys

import pytest

from qsa_lab.canary import canary_case, run_canary


def test_a_case_and_a_different_kv_dtype_is_an_error_naming_kv_dtype():
    case = canary_case("e4m3")
    with pytest.raises(ValueError, match=r"^kv_dtype: the case's pool is e4m3, not 'fp16'"):
        run_canary(["qsa:reference"], case=case, kv_dtype="fp16", payloads=["nan"], planes=["v"])


def test_a_case_with_its_own_kv_dtype_or_none_runs_that_pool():
    case = canary_case("e5m2")
    for kv_dtype in ("e5m2", None):
        report = run_canary(["qsa:reference"], case=case, kv_dtype=kv_dtype, payloads=["nan"], planes=["v"])
        assert report.to_json()["kv_dtype"] == "e5m2"
    built = run_canary(["qsa:reference"], payloads=["nan"], planes=["v"])   # no case: fp16 is built
    assert built.to_json()["kv_dtype"] == "fp16"


def test_cli_refuses_kv_dtype_beside_case(tmp_path):
    path = tmp_path / "case.pt"
    path.write_bytes(b"the refusal comes before the file is read")
    res = subprocess.run([sys.executable, "-m", "qsa_lab", "canary", "--case", str(path), "--kv-dtype", "e4m3"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == ["qsa-lab: error: --case: takes no geometry option (got --kv-dtype)"]

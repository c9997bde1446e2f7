"""`qsa-lab canary`: the user kernels of test_canary.py through --kernels / --kernel, JSON, exit codes."""
import json
from pathlib import Path

import pytest

from qsa_lab.canary import SCHEMA, load_canary
from qsa_lab.app.cli import main

HERE = Path(__file__).resolve().parent
FAST = ["--regions", "null-block", "--backend", "emulate"]


def run(capsys, *argv):
    rc = main(["canary", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_document_and_a_leak_exits_1(capsys):
    rc, out, _ = run(capsys, "--kernels", "qsa:grouped,qsa:grouped+kernel_fix", "--payloads", "nan,inf", *FAST,
                     "--json", "-")
    doc = json.loads(out)
    assert rc == 1
    assert doc["schema"] == SCHEMA and doc["backend"] == "emulate" and doc["kv_dtype"] == "fp16"
    assert doc["payload_bits"]["nan"] == "0x7E00" and doc["payload_bits"]["inf"] == "0x7C00"
    assert len(doc["results"]) == 2 * 2 * 2
    verdicts = {(r["kernel"], r["plane"], r["payload"]): r["verdict"] for r in doc["results"]}
    assert verdicts[("qsa:grouped", "v", "nan")] == verdicts[("qsa:grouped", "v", "inf")] == "nan-leak"
    assert {v for (k, _, _), v in verdicts.items() if k == "qsa:grouped+kernel_fix"} == {"clean"}
    leak = next(r for r in doc["results"] if r["verdict"] != "clean")
    assert set(leak) >= {"kernel", "region", "plane", "payload", "verdict", "nan", "inf", "finite_changed", "rows",
                         "heads", "dims"}
    assert leak["nan"] == len(leak["rows"]) * len(leak["heads"]) * len(leak["dims"])


def test_clean_kernels_exit_0(capsys):
    rc, out, _ = run(capsys, "--kernels", "qsa:xqa,qsa:grouped+kernel_fix", *FAST)
    assert rc == 0 and "# 0 leaking of 12 checks (12 cells)" in out


def test_a_name_given_twice_runs_once(capsys):
    rc, out, _ = run(capsys, "--kernels", "qsa:xqa,qsa:xqa", "--regions", "null-block,null-block", "--payloads",
                     "nan,nan", "--planes", "v,v", "--backend", "emulate", "--json", "-")
    cells = [(r["kernel"], r["region"], r["plane"], r["payload"]) for r in json.loads(out)["results"]]
    assert rc == 0 and cells == [("qsa:xqa", "null-block", "v", "nan")]


@pytest.mark.parametrize("kernels, code", [("qsa:grouped", 1), ("qsa:xqa", 0)])
def test_the_removed_fail_on_leak_runs_as_before_and_says_to_drop_it(capsys, kernels, code):
    """Scripts of earlier versions pass --fail-on-leak: the same run, the same exit code and
    output, and one note on stderr; the option is in no help text."""
    from qsa_lab.app.canary import FAIL_ON_LEAK_GONE

    argv = ["--kernels", kernels, *FAST, "--payloads", "nan", "--planes", "v", "--json", "-"]
    rc, out, err = run(capsys, *argv)
    rc_old, out_old, err_old = run(capsys, *argv, "--fail-on-leak")
    assert rc == rc_old == code and json.loads(out)["results"] == json.loads(out_old)["results"]
    assert err_old == err + FAIL_ON_LEAK_GONE + "\n" and "--fail-on-leak" not in err
    assert FAIL_ON_LEAK_GONE.startswith("qsa-lab: note: --fail-on-leak: ")
    assert main(["canary", "--help"]) == 0
    assert "--json" in (text := capsys.readouterr().out) and "fail-on-leak" not in text


def test_bad_input_with_the_removed_option_is_still_one_line(capsys):
    rc, _, err = run(capsys, "--kernels", "qsa:nope", *FAST, "--fail-on-leak")
    assert rc == 2 and err.count("\n") == 1 and err.startswith("qsa-lab: error: --kernels: ")


@pytest.mark.parametrize("spec", ["test_canary:finite_leak_kernel", str(HERE / "test_canary.py") + ":finite_leak_kernel"])
def test_user_kernel_by_module_or_file(capsys, tmp_path, spec):
    path = tmp_path / "c.json"
    rc, out, _ = run(capsys, "--kernel", spec, *FAST, "--payloads", "nan,inf", "--json", str(path))
    doc = load_canary(path)
    got = {(r["plane"], r["payload"]): r["verdict"] for r in doc["results"]}
    assert rc == 1 and got == {("k", "nan"): "clean", ("k", "inf"): "finite-leak", ("v", "nan"): "clean",
                               ("v", "inf"): "finite-leak"}
    assert "F" in out and f"# wrote {path}" in out


def test_a_user_kernel_that_cannot_run_fails_the_run(capsys):
    rc, out, err = run(capsys, "--kernel", "test_canary:broken_kernel", *FAST)
    assert rc == 3 and "test_canary:broken_kernel: error at null-block / k,v / nan,inf,max" in out
    assert "qsa-lab: canary: test_canary:broken_kernel: error in 6 cell(s)" in err


@pytest.mark.parametrize("argv,message", [
    (["--kernels", "qsa:nope"], "--kernels: unknown qsa route"),
    (["--kernels", "torch:sdpa"], "--kernels: unknown torch kernel"),
    (["--kernels", "not_a_module_xyz:fn"], "--kernels: 'not_a_module_xyz:fn': cannot import"),
    (["--regions", "null-block,tail"], "--regions: unknown ['tail']"),
    (["--payloads", "nan,snan"], "--payloads: unknown ['snan']"),
    (["--backend", "gpu"], "--backend: invalid choice"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, argv, message):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and err.startswith(f"qsa-lab: error: {message}") and len(err.strip().splitlines()) == 1


def test_json_is_not_overwritten_without_force(capsys, tmp_path):
    path = tmp_path / "c.json"
    path.write_text("keep")
    rc, _, err = run(capsys, "--kernels", "qsa:xqa", *FAST, "--json", str(path))
    assert rc == 2 and "exists (add --force" in err and path.read_text() == "keep"
    rc, _, _ = run(capsys, "--kernels", "qsa:xqa", *FAST, "--json", str(path), "--force")
    assert rc == 0 and load_canary(path)["schema"] == SCHEMA


def test_cuda_backend_without_a_gpu_is_a_usage_error(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    rc, _, err = run(capsys, "--kernels", "qsa:xqa", "--backend", "cuda")
    assert rc == 2 and err.startswith("qsa-lab: error: --backend: 'cuda' needs a CUDA GPU")


def test_a_terminal_sees_what_runs_at_once_and_json_stdout_sees_none(capsys, monkeypatch):
    """On a terminal: the kernels before torch loads, then the cells and calls once the case is built."""
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    argv = ["--kernels", "qsa:grouped,qsa:grouped+kernel_fix", "--payloads", "nan,inf", *FAST]
    rc, _, err = run(capsys, *argv)
    lines = [x for x in err.splitlines() if x.startswith("# canary: ")]
    assert rc == 1 and lines[0] == "# canary: qsa:grouped, qsa:grouped+kernel_fix: importing torch, building the case"
    assert lines[1].startswith("# canary: 2 kernels x 2 cells (1 regions x k,v), each 4 calls (2 controls + nan,inf); "
                               "case: rows ")
    rc, _, err = run(capsys, *argv, "--json", "-")
    assert rc == 1 and "# canary" not in err

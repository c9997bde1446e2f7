"""The scribble's standalone scripts (qsa_lab.scribble.standalone): they import only their engine and
torch, reproduce their leak from a folder where qsa_lab cannot be imported (exit 1), stop it with
--workaround (exit 0), say they cannot run without the engine (exit 3); the shrinker and the report
folder. vLLM's script runs in vLLM's environment (.venv-vllm beside this checkout, or $VLLM_PYTHON),
skipped where there is none."""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qsa_lab.scribble.standalone import (DEFAULTS, KINDS, NAMES, SMALLEST, check_report_dir, script_name,
                                         script_text, shrink, write_report)
from qsa_lab.scribble.standalone.report import script_kind

REPO = Path(__file__).resolve().parents[2]
ALLOWED = {"argparse", "json", "math", "os", "sys", "tempfile", "torch", "transformers", "vllm", "safetensors"}


def imported(source: str) -> set:
    """The top-level names of every module `source` imports, anywhere in it."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." if node.level else node.module.split(".")[0])
    return names


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_generated_script_imports_only_its_engine_torch_and_the_standard_library(kind):
    for params in (DEFAULTS[kind], SMALLEST[kind]):
        names = imported(script_text(kind, params))
        assert "qsa_lab" not in names and names <= ALLOWED, names
    assert imported("import os\nfrom qsa_lab.scribble import scribble\n") == {"os", "qsa_lab"}   # the scan sees it


def test_a_script_carries_its_parameters_and_refuses_unknown_ones():
    text = script_text("transformers-other-requests", {"new_tokens": 3})
    params = next(ast.literal_eval(node.value) for node in ast.parse(text).body
                  if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "PARAMS")
    assert params == {**DEFAULTS["transformers-other-requests"], "new_tokens": 3}
    with pytest.raises(ValueError, match="params: unknown"):
        script_text("transformers-other-requests", {"pool": 3})
    with pytest.raises(ValueError, match="kind must be one of"):
        script_text("sglang", None)


def _run(python, script: Path, cwd: Path, *args, isolate=False) -> subprocess.CompletedProcess:
    """Run a script from `cwd`, where a package named qsa_lab that fails on import comes first on the
    path: a script that imported qsa_lab would stop there (the editable install stays shadowed)."""
    poison = cwd / "poison" / "qsa_lab"
    poison.mkdir(parents=True, exist_ok=True)
    (poison / "__init__.py").write_text("raise ImportError('the standalone script imported qsa_lab')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHOME", "PYTHONSTARTUP")}
    # first on the path; what else is there stays (make test's other transformers version, for one)
    env["PYTHONPATH"] = os.pathsep.join([str(cwd / "poison"), *filter(None, [os.environ.get("PYTHONPATH")])])
    flags = ["-I", "-S"] if isolate else []
    return subprocess.run([python, *flags, str(script), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=900)


def _script(tmp_path, kind) -> Path:
    path = tmp_path / script_name(kind)
    path.write_text(script_text(kind, SMALLEST[kind]))
    return path


def test_the_transformers_script_leaks_as_generated_and_not_with_the_workaround(tmp_path):
    script = _script(tmp_path, "transformers-other-requests")
    first = _run(sys.executable, script, tmp_path)
    assert first.returncode == 1 and "LEAK: reader(s) [0]" in first.stdout, first.stdout + first.stderr
    fixed = _run(sys.executable, script, tmp_path, "--workaround")
    assert fixed.returncode == 0 and "CLEAN" in fixed.stdout, fixed.stdout + fixed.stderr


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_without_its_engine_a_script_says_so_in_one_line_and_exits_3(tmp_path, kind):
    out = _run(sys.executable, _script(tmp_path, kind), tmp_path, isolate=True)   # -S: the standard library only
    assert out.returncode == 3 and out.stdout.count("\n") == 1 and out.stdout.startswith("CANNOT RUN: "), out


def _vllm_python() -> str:
    given = os.environ.get("VLLM_PYTHON")
    python = Path(given) if given else REPO / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        pytest.skip("no vLLM environment here (make vllm-env builds it; make test tries to)")
    return str(python)


def test_the_vllm_script_leaks_as_generated_and_not_with_the_workaround(tmp_path):
    python = _vllm_python()
    script = _script(tmp_path, "vllm-cpu-tail")
    first = _run(python, script, tmp_path)
    assert first.returncode == 1 and "LEAK: reader(s) [0]" in first.stdout, first.stdout + first.stderr[-3000:]
    fixed = _run(python, script, tmp_path, "--workaround")
    assert fixed.returncode == 0 and "CLEAN" in fixed.stdout, fixed.stdout + fixed.stderr[-3000:]


def test_the_shrinker_finds_the_smallest_leaking_workload_and_rechecks_it():
    """A stand-in for the script: it leaks while A is at least 4 tokens long, a reader is there, there are
    at least 3 new tokens and 3 blocks, and 2 layers unless the reader is at most 2 tokens long (so one
    layer is enough only once a later step shortened the reader: a second pass finds it); the workaround
    never leaks."""
    def runner(p, workaround):
        leaks = (p["prompt_lengths"][0] >= 4 and len(p["prompt_lengths"]) >= 2 and p["new_tokens"] >= 3
                 and p["blocks"] >= 3 and (p["layers"] >= 2 or p["prompt_lengths"][1] <= 2))
        return 1 if leaks and not workaround else 0

    shrunk = shrink("transformers-other-requests", python="unused", runner=runner)
    assert shrunk.params["prompt_lengths"] == [4, 1] and shrunk.params["new_tokens"] == 3
    assert shrunk.params["layers"] == 1 and shrunk.params["blocks"] == 3 and shrunk.params["batch_tokens"] == 8
    assert shrunk.check == {"as_written": 1, "workaround": 0}
    assert shrunk.smaller().startswith("requests 6 -> 2, prompt tokens 137 -> 5, new tokens 8 -> 3")
    assert all(r["exit"] in (0, 1) for r in shrunk.runs) and shrunk.runs[0]["params"] == {}


def test_the_shrinker_refuses_a_workload_that_does_not_leak_or_whose_workaround_leaks():
    from qsa_lab.scribble.standalone import ShrinkError

    with pytest.raises(ShrinkError, match="does not leak"):
        shrink("vllm-cpu-tail", python="unused", runner=lambda p, w: 0)
    with pytest.raises(ShrinkError, match="fails its re-check"):
        shrink("vllm-cpu-tail", python="unused", runner=lambda p, w: 1)


@pytest.fixture(scope="module")
def leak_report():
    """A real scribble of transformers' paged|eager at other-requests (NaN): it leaks."""
    from qsa_lab.scribble import TransformersEngine, scribble, tiny_model, workload

    engine = TransformersEngine(tiny_model("llama-gqa"), workload("chunked-prefill"), attn="paged|eager")
    return scribble(engine, regions=("other-requests",), payloads=("nan",))


def test_the_report_folder_says_who_read_whom_what_to_change_and_ships_a_script_that_leaks(tmp_path, leak_report):
    md = write_report(leak_report, tmp_path / "rep", command="qsa-lab scribble --report rep")
    folder = md.parent
    assert sorted(p.name for p in folder.iterdir()) == sorted(NAMES)
    assert json.loads((folder / "scribble.json").read_text()) == json.loads(json.dumps(leak_report.to_dict()))
    text = md.read_text()
    pair = leak_report.leaks()[0].pairs[0]
    assert f"| {pair['reader']} | {pair['poisoned']} | {pair['first_token']} |" in text
    assert "keep requests' columns out of each other's arithmetic" in text
    meta = json.loads((folder / "scripts" / "transformers_other_requests.json").read_text())
    assert meta["check"] == {"as_written": 1, "workaround": 0}, meta     # run here, from an empty folder
    assert meta["after"]["requests"] < meta["before"]["requests"] and "requests 6 -> 2" in text
    # the script the test above runs from a folder where qsa_lab cannot be imported
    assert (folder / "scripts" / "transformers_other_requests.py").read_text() == script_text(
        "transformers-other-requests", SMALLEST["transformers-other-requests"])


def test_the_report_lists_every_head_dim(tmp_path, leak_report):
    from dataclasses import replace

    cell = replace(leak_report.cells[-1], where={"step": 0, "layer": 1, "requests": ["req_1"], "query_rows": [3],
                                                 "heads": [0, 1, 2, 3], "dims": [*range(12), 14, 15]})
    report = replace(leak_report, cells=[cell])
    text = write_report(report, tmp_path / "rep", check=False).read_text()
    assert "Heads: 0-3. Head dims: 0-11, 14-15." in text


def test_a_report_folder_is_never_written_over(tmp_path, leak_report):
    folder = tmp_path / "rep"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="report: .* is not empty"):
        check_report_dir(folder)
    with pytest.raises(ValueError, match="is not empty"):
        write_report(leak_report, folder, check=False)
    with pytest.raises(ValueError, match="did not write"):
        write_report(leak_report, folder, check=False, force=True)
    assert [p.name for p in folder.iterdir()] == ["notes.txt"] and not list(tmp_path.glob(".rep.*"))


def test_only_the_leaks_a_script_reproduces_get_one(leak_report):
    cell = leak_report.leaks()[0]
    assert script_kind(leak_report, cell)[0] == "transformers-other-requests"
    from dataclasses import replace

    assert script_kind(replace(leak_report, engine="vllm+cuda"), cell) is None
    assert script_kind(replace(leak_report, engine="vllm"), cell)[0] == "vllm-cpu-tail"
    assert script_kind(replace(leak_report, engine="transformers:sdpa"), cell)[1]["attn"] == "sdpa"


@pytest.mark.parametrize("kind, page", [("vllm-cpu-tail", "upstream_vllm_cpu_tail.md"),
                                        ("transformers-other-requests", "upstream_transformers_cb.md")])
def test_the_committed_scripts_and_write_ups_come_from_the_committed_shrink_runs(kind, page):
    """examples/scribble/ holds the scripts as generated from the shrunk workload the evidence records
    (scripts/shrink_scribble_scripts.py); the report ships that workload, and the write-up quotes it."""
    evidence = json.loads((REPO / "evidence" / "scribble_standalone" / f"{kind}_shrink.json").read_text())
    assert evidence["check"] == {"as_written": 1, "workaround": 0} and evidence["params"] == SMALLEST[kind]
    assert (REPO / "examples" / "scribble" / script_name(kind)).read_text() == script_text(kind, SMALLEST[kind])
    text = (REPO / "docs" / page).read_text()
    assert evidence["smaller"] in " ".join(text.split()) and "__" not in text.replace("__init__", "")


def test_scribble_report_from_the_command_line_with_a_relative_folder(tmp_path):
    """`qsa-lab scribble --report rep` as a user types it: the folder relative to the current one, its script
    checked once (exit 1 as written, 0 with --workaround) and the check's outcome stated in report.md; the
    command's exit code is the report's (1: a leak)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-m", "qsa_lab", "scribble", "--regions", "other-requests", "--payloads",
                          "nan", "--report", "rep"], cwd=tmp_path, capture_output=True, text=True, env=env,
                         timeout=900)
    assert run.returncode == 1, run.stderr[-2000:]
    text = (tmp_path / "rep" / "report.md").read_text()
    assert "Checked here: as written: exit 1, workaround: exit 0." in text
    assert "qsa-lab scribble --regions other-requests --payloads nan --report rep" in text
    again = subprocess.run([sys.executable, "-m", "qsa_lab", "scribble", "--regions", "other-requests", "--report",
                            "rep"], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 2 and "--report" in again.stderr           # never written over


def test_the_other_transformers_pass_leaves_out_only_tests_that_exist():
    """scripts/test_other_transformers.sh deselects the vLLM script's run by name: a renamed test would
    run there again, under a transformers vLLM's environment does not pin."""
    import re

    text = (REPO / "scripts" / "test_other_transformers.sh").read_text()
    left_out = re.findall(r"--deselect (\S+)::(\w+)", text)
    assert left_out, "no --deselect in the script"
    for path, name in left_out:
        assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), f"{path}::{name}"

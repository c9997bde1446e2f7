"""tools/compare_commits.py: in a repository of this checkout's files, the commands
docs/contributing.md shows find one commit identical to itself and a commit whose emulation moves
one output element by one ulp (a change the bit-identity test's bounds let through) differing; bad
input exits 2 with one line naming the argument."""
from __future__ import annotations

import importlib.util
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "compare_commits.py"
PAGE = REPO / "docs" / "contributing.md"
GIT = ["git", "-c", "user.name=test", "-c", "user.email=test@example.invalid", "-c", "commit.gpgsign=false"]

# appended to qsa_lab/routes/emulate.py on the branch `nudged`: the first output element of the
# grouped kernel's first panel one ulp further out (its bits + 1)
NUDGE = '''

_unnudged = grouped_forward_many


def grouped_forward_many(*args, **kwargs):
    results = _unnudged(*args, **kwargs)
    bits = results[0][0].view(torch.int16)
    bits[(0,) * bits.dim()] += 1
    return results
'''


def tool():
    spec = importlib.util.spec_from_file_location("compare_commits", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shown() -> list[str]:
    """The compare_commits lines of the page's code blocks, comments dropped."""
    lines = [line.split("  #")[0].strip() for line in PAGE.read_text().splitlines()]
    return [line for line in lines if line.startswith("python tools/compare_commits.py")]


def run(repo: Path, line: str) -> subprocess.CompletedProcess:
    argv = shlex.split(line)
    return subprocess.run([sys.executable, *argv[1:]], cwd=repo, capture_output=True, text=True, timeout=1200)


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A git repository of this checkout's files (committed or not) on `main`, and a branch
    `nudged` that adds NUDGE to the emulation."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and a git checkout")
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, check=True).stdout.decode().split("\0")
    repo = tmp_path_factory.mktemp("repo")
    for f in filter(None, files):
        if (REPO / f).is_file():
            (repo / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, repo / f)
    git = [*GIT, "-C", str(repo)]
    subprocess.run([*git, "init", "-q", "-b", "main"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "base"], check=True)
    subprocess.run([*git, "checkout", "-q", "-b", "nudged"], check=True)
    emulate = repo / "qsa_lab" / "routes" / "emulate.py"
    emulate.write_text(emulate.read_text() + NUDGE)
    subprocess.run([*git, "commit", "-q", "-am", "nudge"], check=True)
    subprocess.run([*git, "checkout", "-q", "main"], check=True)
    return repo


def test_the_page_shows_the_full_run_and_the_quick_one():
    lines = shown()
    assert [shlex.split(line)[2:] for line in lines] == [["main", "HEAD"], ["--quick", "main", "HEAD"]], lines
    for line in lines:
        args = tool().parser().parse_args(shlex.split(line)[2:])
        assert (args.base, args.head) == ("main", "HEAD")


def test_a_commit_and_itself_are_identical(repo):
    out = run(repo, shown()[1])                       # on main: main against HEAD = main
    assert out.returncode == 0, out.stdout + out.stderr
    assert "IDENTICAL" in out.stdout and " arrays, bit for bit" in out.stdout
    assert "cross-request: the same exit codes, verdicts and counts" in out.stdout, out.stdout


def test_one_ulp_in_the_emulation_differs(repo):
    subprocess.run([*GIT, "-C", str(repo), "checkout", "-q", "nudged"], check=True)
    try:
        out = run(repo, shown()[1])
    finally:
        subprocess.run([*GIT, "-C", str(repo), "checkout", "-q", "main"], check=True)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "DIFFER" in out.stdout
    found = sections(out.stdout)
    # the driver's arrays name the case and the route; the diff command's saved tensors show it too
    assert found["bitid.npz"][0].startswith("small/0/out/grouped: 1 of 576 elements differ, first at [0, 0, 0]")
    assert any(line.startswith("out.grouped: 1 of ") for line in found["diff0.safetensors"]), found


def sections(stdout: str) -> dict:
    """The tool's report of differences: source -> its lines."""
    found, source = {}, None
    for line in stdout.splitlines():
        if line.startswith("  ") and not line.startswith("    "):
            source = line.strip().split(":")[0]
            found[source] = []
        elif line.startswith("    ") and source:
            found[source].append(line.strip())
    return found


@pytest.mark.parametrize("argv, says", [
    (["no-such-commit", "HEAD"], "BASE: unknown commit 'no-such-commit'"),
    (["HEAD", "HEAD~999999"], "HEAD: unknown commit 'HEAD~999999'"),
    (["HEAD"], "HEAD: required"),
])
def test_bad_input_exits_2_naming_the_argument(argv, says):
    out = subprocess.run([sys.executable, str(TOOL), *argv, "--repo", str(REPO)], capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("compare_commits.py: error: ") and says in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_a_folder_outside_git_exits_2(tmp_path):
    out = subprocess.run([sys.executable, str(TOOL), "main", "HEAD", "--repo", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.startswith("compare_commits.py: error: --repo: ")


# ------------------------------------------------------------------ the scribble and cross-request parts

SCRIBBLE = {"schema": "qsa_lab.scribble/1", "date": "2026-12-01T00:00:00Z", "control_seconds": 0.3,
            "facts": {"torch": "2.13.0", "gpu": "none (CPU)"}, "counts": {"cells": 1, "checks": 1, "leaking": 1},
            "results": [{"check": "read", "region": "other-requests", "payload": "nan", "verdict": "nan-leak",
                         "nan": 63, "inf": 0, "finite_changed": 0, "tokens_changed": 63, "seconds": 0.1}]}
CROSS = {"schema": "qsa_lab.cross_request/1", "backend": "emulate", "must_be_clean_leaks": 0, "runs": [],
         "records": [{"q_heads": 2, "kv_dtype": "e4m3", "route": "grouped", "payload": "nan", "poisoned_request": 0,
                      "request": 1, "rows": [46], "elements": 256, "verdict": "leak", "as_reference": False}]}


def outputs(tmp_path, label: str, scribble: dict, cross: dict, exits=(1, 0), stdout="table") -> tuple:
    """A commit's out folder holding the two probes' JSON, and its parts as run_commit returns them."""
    out = tmp_path / f"out-{label}"
    out.mkdir()
    (out / "scribble.json").write_text(json.dumps(scribble))
    (out / "cross_request.json").write_text(json.dumps(cross))
    parts = {name: {"argv": name, "exit": code, "stdout": stdout, "stderr": ""}
             for name, code in zip(("scribble", "cross-request"), exits)}
    return out, parts


def changed(doc: dict, **fields) -> dict:
    doc = json.loads(json.dumps(doc))
    doc[next(k for k in ("results", "records") if k in doc)][0].update(fields)
    return doc


def test_the_probes_compare_verdicts_and_counts_not_timings_facts_or_wording(tmp_path):
    later = {**SCRIBBLE, "date": "2027-01-01T00:00:00Z", "control_seconds": 9.9, "facts": {"torch": "2.14.0"}}
    later = changed(later, seconds=5.0)
    base = outputs(tmp_path, "BASE", SCRIBBLE, CROSS)
    head = outputs(tmp_path, "HEAD", later, CROSS, stdout="the same verdicts, another table")
    assert tool().differences(base[0], head[0], base[1], head[1]) == {}


def test_a_changed_verdict_or_count_or_exit_is_a_difference(tmp_path):
    base = outputs(tmp_path, "BASE", SCRIBBLE, CROSS)
    head = outputs(tmp_path, "HEAD", changed(SCRIBBLE, tokens_changed=62), changed(CROSS, verdict="own"), exits=(1, 1))
    found = tool().differences(base[0], head[0], base[1], head[1])
    assert found["scribble.json"][0] == ("read/other-requests/nan: ('nan-leak', 63, 0, 0, 63) -> "
                                         "('nan-leak', 63, 0, 0, 62)")
    assert found["cross_request.json"][:2] == ["2/e4m3/grouped/nan/0/1: ('leak', 256, '[46]', False) -> "
                                               "('own', 256, '[46]', False)", "verdict changes: leak -> own (1)"]
    assert found["cross-request"][0].startswith("exit differs: ")
    assert "scribble" not in found                  # same exit: its table's wording is not compared


def test_a_verdict_map_renames_base_s_verdicts_first(tmp_path):
    base = outputs(tmp_path, "BASE", SCRIBBLE, CROSS)
    head = outputs(tmp_path, "HEAD", SCRIBBLE, changed(CROSS, verdict="nan-leak"))
    assert tool().differences(base[0], head[0], base[1], head[1], {"leak": "nan-leak"}) == {}
    assert list(tool().differences(base[0], head[0], base[1], head[1])) == ["cross_request.json"]
    args = tool().parser().parse_args(["main", "HEAD", "--verdict-map", "leak=nan-leak,own=clean"])
    assert args.verdict_map == {"leak": "nan-leak", "own": "clean"}

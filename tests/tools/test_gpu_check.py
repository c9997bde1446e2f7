"""benchmarks/gpu_check.sh, the one GPU check: its stages (--list, one line each, one function each),
bad stage names refused naming them, a named stage that cannot run here skipped saying why and
counted as failed; and the variants its sanitize stage runs are routes.compiled's, read from
`benchmarks/sanitize_case.py --list-variants` (finite_pv included), never written in the script."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"
STAGES = ["build", "tests", "docs", "sanitize", "bench", "canary", "thirdparty", "search", "reports", "complete-fix",
          "scribble", "standalone", "ptx", "wheel"]


def gpu_check(*args, tmp_path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHON": sys.executable, **env})


def stage_body(name: str) -> str:
    text = SCRIPT.read_text()
    start = text.index(f"\nstage_{name.replace('-', '_')}() {{")
    return text[start:text.index("\n}\n", start)]


def test_list_names_each_stage_once_in_order_with_a_line_each(tmp_path):
    out = gpu_check("--list", tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split()[0] for line in lines] == STAGES
    assert all(len(line.split(maxsplit=1)) == 2 for line in lines)
    # every stage has its function, and every function is a listed stage
    defined = re.findall(r"^stage_(\w+)\(\) \{", SCRIPT.read_text(), flags=re.M)
    assert sorted(d.replace("_", "-") for d in defined) == sorted(STAGES)


def test_an_unknown_stage_is_an_error_naming_it(tmp_path):
    out = gpu_check("sanitize", "sanitise", tmp_path=tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert "unknown stage 'sanitise'" in out.stderr


def test_a_named_stage_that_cannot_run_here_is_skipped_with_why_and_fails_the_run(tmp_path):
    log = tmp_path / "check.log"
    out = gpu_check("ptx", "--out", str(tmp_path / "out"), "--log", str(log), tmp_path=tmp_path,
                    PTX_DIR=str(tmp_path / "no-ptx"))
    assert out.returncode == 1, out.stdout + out.stderr
    summary = log.read_text().split("######## summary")[1]
    assert re.search(r"^ptx +SKIPPED \((no CUDA GPU visible to torch here|no PTX in .*no-ptx.*)\)", summary, re.M), summary
    assert (tmp_path / "out" / "logs.tgz").is_file()


def test_the_variant_list_is_routes_compiled_s():
    from qsa_lab.routes import compiled

    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "sanitize_case.py"), "--list-variants"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().split(",") == list(compiled.VARIANTS)
    assert "finite_pv" in out.stdout


def test_the_sanitize_stage_takes_its_variants_from_that_list():
    body = stage_body("sanitize")
    assert 'all=$($PY benchmarks/sanitize_case.py --list-variants)' in body
    # memcheck runs every variant, racecheck every one but the race kept for the sanitizer (run apart)
    assert 'ok=$(echo "$all" | tr , \'\\n\' | grep -vx "$race" | paste -sd,)' in body
    variants = re.findall(r"--variants (\S+)", body)
    assert variants and set(variants) <= {'"$all"', '"$ok"', '"$race"', '"kernel_fix,$race"'}, variants
    assert body.count('--variants "$all"') == 1 and body.count('--variants "$ok"') == 3
    from qsa_lab.routes import compiled

    runs = [line.replace('"kernel_fix,$race"', "") for line in body.splitlines()
            if "sanitize_case.py" in line or "sanitizer " in line]
    literal = [v for v in compiled.VARIANTS if any(re.search(rf"\b{v}\b", line) for line in runs)]
    assert literal == [], f"variant names written in the sanitize stage's runs: {literal}"

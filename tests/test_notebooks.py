"""Every notebook runs top to bottom headless (nbclient, CPU, emulation, small geometry) and
finds what it claims; notebooks in git carry no outputs (issue 4, acceptance 1 and 3)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from qsa_lab import package_data

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NB_DIR = package_data.folder("notebooks")   # the checkout's, or an installed copy's
NOTEBOOKS = package_data.notebooks()
MARK = "QSA_LAB_KEY_RESULTS="


def run_notebook(path: Path, tmp_path: Path) -> dict:
    """Execute `path` with one extra cell that prints the notebook's key_results as JSON."""
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(f"import json; print({MARK!r} + json.dumps(key_results, default=str))"))
    env = {"QSA_LAB_BACKEND": "emulate", "QSA_LAB_SMALL": "1", "QSA_LAB_FIGURES": str(tmp_path / "figures"),
           "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                         resources={"metadata": {"path": str(tmp_path)}})
        client.execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    for out in nb.cells[-1].outputs:
        for line in out.get("text", "").splitlines():
            if line.startswith(MARK):
                return {"results": json.loads(line[len(MARK):]), "nb": nb}
    raise AssertionError(f"{path.name}: no key_results printed")


def _text(nb) -> str:
    return "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def test_numbered_notebooks_present():
    assert [p.name[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05", "06"]


HOW_TO_STRIP = ("strip it with `make strip` (python scripts/strip_outputs.py notebooks/NN_*.ipynb); "
                "open the notebooks with `make lab`, which saves them without outputs")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name}: a code cell carries outputs; {HOW_TO_STRIP}"
            assert cell.execution_count is None, f"{path.name}: a code cell carries an execution count; {HOW_TO_STRIP}"
    assert "widgets" not in nb.metadata, f"{path.name}: saved widget state in metadata; {HOW_TO_STRIP}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_thin(path):
    """Notebooks ask and show: no function or class definitions, short code cells."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert "def " not in cell.source and "class " not in cell.source, path.name
            assert len(cell.source.splitlines()) <= 12, f"{path.name}: long cell\n{cell.source}"
    assert nb.cells[0].cell_type == "markdown" and "Question" in nb.cells[0].source


def test_01_codes_and_rates(tmp_path):
    r = run_notebook(NB_DIR / "01_e4m3_and_the_null_block.ipynb", tmp_path)["results"]
    assert r["nan_codes"] == [0x7F, 0xFF]
    assert 0.0030 < r["fp16_state_rate"] < 0.0048           # ~0.39 %
    s = r["nan_bytes_by_site"]
    assert s["none"] == 0 and s["zeros"] == 0 and s["targeted"] == 20 and s["random"] > 0


def test_02_finds_report_fingerprint(tmp_path):
    run = run_notebook(NB_DIR / "02_reproduce_the_grouped_nan.ipynb", tmp_path)
    r = run["results"]
    assert r["backend"] == "emulate" and "backend: emulate" in _text(run["nb"])
    assert r["grouped_nan"] == 480
    assert r["grouped_nan_dims"] == [102, 152, 168, 170, 230]
    assert r["xqa_nan"] == 0
    assert r["identical_across_rows"]
    assert r["attributed_dims"] == [102, 152, 168, 170, 230] and r["attributed_to_padding"]


def test_03_playground_runs_headless(tmp_path):
    run = run_notebook(NB_DIR / "03_poison_playground.ipynb", tmp_path)
    r = run["results"]
    assert r["backend"] == "emulate" and r["nan_count"] == 480
    assert {"grouped", "grouped+kernel_fix", "grouped+pad_fix"} <= set(r["routes"])


def test_04_fixes_clean_and_stale_tail_finding(tmp_path):
    run = run_notebook(NB_DIR / "04_confirm_the_fix.ipynb", tmp_path)
    r = run["results"]
    html = "\n".join(o.get("data", {}).get("text/html", "") for c in run["nb"].cells if c.cell_type == "code"
                     for o in c.get("outputs", []))
    assert "fix A kernel" in html and "fix C masked" in html and "report: grouped NaN" in html
    assert "—" in html and ">nan<" not in html.lower() and "...</th>" not in html   # no NaN, no truncation
    assert r["backend"] == "emulate"
    assert r["fixed_nan_on_null_block_sites"] == 0
    assert r["bit_identical"]
    assert r["stale_pad_fix_nan"] > 0
    assert r["stale_kernel_fix_nan"] == 0 and r["stale_masked_load_nan"] == 0
    att = r["attended_k_nan"]   # a NaN key rows attend: NaN in XQA / reference, dropped by grouped
    assert att["xqa"] == att["reference"] > 0 and att["grouped"] < att["xqa"]


def test_05_reads_committed_timings(tmp_path):
    run = run_notebook(NB_DIR / "05_fix_overhead.ipynb", tmp_path)
    r = run["results"]
    assert r["live"] is False and "backend:" in _text(run["nb"])
    from qsa_lab.figdata import BENCH_JSON, load_bench

    df, meta = load_bench(BENCH_JSON)          # committed under data/
    assert r["records"] == len(df) > 0 and r["gpu"] == meta["gpu"] == "NVIDIA H200"


def test_make_lab_saves_project_notebooks_without_outputs(tmp_path):
    """`make lab`'s Jupyter config strips NN_*.ipynb on save (a notebook of your own keeps its
    outputs), and `make lab` passes --allow-root when run as root."""
    import secrets
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    pytest.importorskip("jupyterlab")
    repo = Path(__file__).resolve().parents[1]   # `make lab` of the checkout holding these tests
    dry = subprocess.run(["make", "-n", "lab"], cwd=repo, capture_output=True, text=True, timeout=60).stdout
    assert "--config=scripts/jupyter_lab_config.py" in dry
    assert ("--allow-root" in dry) == (os.geteuid() == 0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token, root = secrets.token_hex(8), tmp_path / "nb"
    root.mkdir()
    env = dict(os.environ, **{k: str(tmp_path / k) for k in ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR",
                                                             "JUPYTER_RUNTIME_DIR")})
    cmd = [sys.executable, "-m", "jupyter", "lab", f"--config={repo / 'scripts' / 'jupyter_lab_config.py'}",
           "--no-browser", "--ip=127.0.0.1", f"--port={port}", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={root}"] + (["--allow-root"] if os.geteuid() == 0 else [])
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{base}/status?token={token}", timeout=2).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "jupyter lab did not start"
                time.sleep(0.3)
        nb = nbformat.v4.new_notebook()
        cell = nbformat.v4.new_code_cell("print(1)", execution_count=4,
                                         outputs=[nbformat.v4.new_output("stream", text="1\n")])
        nb.cells.append(cell)
        nb.metadata["widgets"] = {"state": {}}
        for name in ("03_mine.ipynb", "scratch.ipynb"):
            body = json.dumps({"type": "notebook", "format": "json", "content": nb}).encode()
            req = urllib.request.Request(f"{base}/contents/{name}?token={token}", data=body, method="PUT",
                                         headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=30).close()
        saved = nbformat.read(root / "03_mine.ipynb", as_version=4)
        assert saved.cells[0].outputs == [] and saved.cells[0].execution_count is None
        assert "widgets" not in saved.metadata
        kept = nbformat.read(root / "scratch.ipynb", as_version=4)
        assert kept.cells[0].outputs and kept.cells[0].execution_count == 4
    finally:
        proc.terminate()
        proc.wait(timeout=30)

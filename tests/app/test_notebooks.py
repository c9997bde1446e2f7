"""Every notebook runs top to bottom headless (nbclient, CPU, emulation, small geometry) and
finds what it claims; notebooks in git carry no outputs (issue 4, acceptance 1 and 3)."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

import notebook_runs
from qsa_lab.support import package_data

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NB_DIR = package_data.folder("notebooks")   # the checkout's, or an installed copy's
NOTEBOOKS = package_data.notebooks()
MARK, CONCLUSION = notebook_runs.MARK, notebook_runs.CONCLUSION


def run_notebook(path: Path, tmp_path: Path, tmp_path_factory=None) -> dict:
    """Execute `path` with one extra cell that prints the notebook's key_results as JSON (in
    tmp_path; a notebook the site shows too runs once per test run, tests/notebook_runs.py, when
    tmp_path_factory is given) and check what every notebook must show. -> {"results", "nb",
    "conclusion", "folder": where it ran (its figures in folder/figures)}."""
    if tmp_path_factory is not None and path.name in notebook_runs.SHARED_WITH_SITE:
        nb, folder = notebook_runs.shared(path, tmp_path_factory)
    else:
        nb, folder = notebook_runs.execute(path, tmp_path), tmp_path
    found = {}
    for out in nb.cells[-1].outputs:
        for line in out.get("text", "").splitlines():
            for mark in (MARK, CONCLUSION):
                if line.startswith(mark):
                    found[mark] = json.loads(line[len(mark):])
    assert MARK in found, f"{path.name}: no key_results printed"
    check_conclusion(path, nb, found[CONCLUSION], found[MARK])
    check_figures_shown(path, nb)
    check_no_warnings(path, nb)
    check_verdict_order(path, nb)
    return {"results": found[MARK], "nb": nb, "conclusion": found[CONCLUSION], "folder": folder}


#: a code cell that draws a figure (a plotting or canary-figure call, or a written PNG shown)
DRAWS = re.compile(r"\b(plots\.plot_\w+|small_multiples|cf\.plot_\w+|show_png|verdict_grid)\(")


def check_figures_shown(path: Path, nb) -> None:
    """Each cell that draws shows its figure once, as an inline PNG: not lost, not shown twice
    (the notebooks disconnect pyplot's after-cell redraw, and 06 shows the files it wrote)."""
    drawing = [c for c in nb.cells if c.cell_type == "code" and DRAWS.search(c.source)]
    assert drawing or path.name.startswith("03_"), f"{path.name}: no cell draws a figure"  # 03: in its widget
    for c in drawing:
        if SKIPPED in _shown(c):          # 07's vLLM part, where no vLLM environment is built: said, not drawn
            continue
        images = [o for o in c.outputs if "image/png" in o.get("data", {})]
        assert len(images) == 1, f"{path.name}: {len(images)} images from the cell starting {c.source[:60]!r}"


#: what a cell shows when it skips a part this machine cannot run (07's vLLM part)
SKIPPED = "part is skipped"


def _shown(cell) -> str:
    return "".join(o.get("text", "") + o.get("data", {}).get("text/markdown", "") for o in cell.get("outputs", []))


WARNING = re.compile(r"\b\w*Warning\b|\bwarn(?:ing)?:", re.I)


def check_no_warnings(path: Path, nb) -> None:
    """A fresh run shows no warning: a red stderr block under a widget reads as an error
    (notebook 03 showed pandas' Pandas4Warning; issue 31)."""
    for c in nb.cells:
        for o in c.get("outputs", []) if c.cell_type == "code" else []:
            assert not (o.get("output_type") == "stream" and o.get("name") == "stderr"), \
                f"{path.name}: stderr under the cell starting {c.source[:60]!r}: {o.get('text', '')[:300]}"
            text = o.get("text", "") + "".join(v for v in o.get("data", {}).values() if isinstance(v, str))
            found = WARNING.search(text)
            assert not found, f"{path.name}: {found.group()!r} in the cell starting {c.source[:60]!r}"


def check_verdict_order(path: Path, nb) -> None:
    """A table of canary verdicts lists them in VERDICTS' order: leaks before failures before
    n/a (notebook 06's "not clean" table put n/a rows first; issue 31)."""
    from qsa_lab.analysis.leaks import VERDICTS

    cell = re.compile(r"<td>(" + "|".join(map(re.escape, VERDICTS)) + r")</td>")
    for c in nb.cells:
        if "results_table(" in c.get("source", ""):     # key_results, one value a row: not a table of verdicts
            continue
        for o in c.get("outputs", []) if c.cell_type == "code" else []:
            shown = [VERDICTS.index(v) for v in cell.findall(o.get("data", {}).get("text/html", ""))]
            assert shown == sorted(shown), f"{path.name}: verdicts out of order in the cell starting {c.source[:60]!r}"


def _formats(value) -> set:
    """Every way a number of key_results may be written in a conclusion."""
    if isinstance(value, bool) or value is None:
        return {str(value)}
    if isinstance(value, str):
        return set()
    if isinstance(value, dict):
        return set().union(*map(_formats, value.values())) if value else set()
    if isinstance(value, (list, tuple)):
        return set().union(*map(_formats, value)) if value else set()
    out = {f"{value:.{n}f}" for n in range(4)} | {f"{100 * value:.{n}f}" for n in range(4)}
    if float(value).is_integer():
        out |= {str(int(value)), f"0x{int(value):02X}"}
    return out


NUMBER = re.compile(r"0x[0-9A-Fa-f]+|\d+(?:\.\d+)?")
NAMES = re.compile(r"\b(?:sm_\d+|fp\d+|top-\d+|[EHV]\d+\w*|e\dm\d)\b")


def check_conclusion(path: Path, nb, conclusion: str, key_results: dict):
    """The notebook ends with its conclusion in words, then key_results; every number in the words
    is one of key_results' values (so none is typed in by hand), and most of them are used."""
    assert nb.cells[-3].cell_type == "code" and "conclusion = " in nb.cells[-3].source, path.name
    assert "key_results = " in nb.cells[-2].source, path.name
    shown = "".join(o.get("data", {}).get("text/markdown", "") for o in nb.cells[-3].outputs)
    assert shown == conclusion and conclusion.startswith("**Conclusion.**"), path.name
    allowed = _formats(key_results) | {"16"}            # the 16 rows of an M-tile are the kernel's shape
    words = NAMES.sub(" ", conclusion)                 # sm_90, fp16, top-512, E4M3, H200, V100: names
    numbers = NUMBER.findall(words)
    assert len(numbers) >= 3, (path.name, conclusion)
    stray = [n for n in numbers if n not in allowed]
    assert not stray, f"{path.name}: numbers {stray} in the conclusion are not key_results values: {conclusion}"


def _text(nb) -> str:
    return "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def test_numbered_notebooks_present():
    assert [p.name[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05", "06", "07"]


def test_the_notebooks_the_site_shows_from_the_tests_run_read_no_small_switch():
    """The site renders the tests' run of these (tests/notebook_runs.py), which sets QSA_LAB_SMALL:
    a notebook that read it would show the small geometry there."""
    for name in notebook_runs.SHARED_WITH_SITE:
        assert "QSA_LAB_SMALL" not in (NB_DIR / name).read_text(), \
            f"{name} reads QSA_LAB_SMALL: drop it from SHARED_WITH_SITE"


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
def test_metadata_is_what_jupyterlab_writes(path):
    """Committed with the metadata JupyterLab writes on opening (but the Python version, which
    `make lab` serves): opening marked every notebook modified (issue 31; in a real JupyterLab:
    tests/e2e/test_notebook_metadata_e2e.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("strip_outputs", NB_DIR.parent / "scripts" / "strip_outputs.py")
    if spec is None or not spec.loader or not Path(spec.origin).is_file():
        pytest.skip("no scripts/ beside the notebooks (an installed copy)")
    strip_outputs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(strip_outputs)
    assert path.name in strip_outputs.PROJECT_NOTEBOOKS, f"{path.name}: not stripped on save by `make lab`"
    assert json.loads(path.read_text())["metadata"] == strip_outputs.METADATA, path.name
    assert strip_outputs.METADATA["kernelspec"]["display_name"] == "Python 3 (ipykernel)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_as_jupyter_saves_it(path):
    """Keys sorted, indent 1, a final newline (nbformat.write): saving a notebook in JupyterLab,
    unchanged, leaves git status clean (07 was committed in another key order)."""
    text = path.read_text()
    assert text == json.dumps(json.loads(text), sort_keys=True, indent=1, ensure_ascii=False) + "\n", \
        f"{path.name}: not in the form Jupyter saves; {HOW_TO_STRIP}"


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
    assert "none" not in s and "zeros" not in s and s["targeted"] == 20 and s["random"] > 0


def test_02_finds_report_fingerprint(tmp_path):
    run = run_notebook(NB_DIR / "02_reproduce_the_grouped_nan.ipynb", tmp_path)
    r = run["results"]
    assert r["backend"] == "emulate" and "backend: emulate" in _text(run["nb"])
    assert r["grouped_nan"] == 480
    assert r["grouped_nan_dims"] == [102, 152, 168, 170, 230]
    assert r["xqa_nan"] == 0
    assert r["identical_across_rows"]
    assert r["attributed_dims"] == [102, 152, 168, 170, 230] and r["attributed_to_padding"]
    assert r["nan_groups"] * r["nan_m_tiles_per_group"] * 16 * r["n_dims"] == 480 and r["fixes_nan"] == 0
    assert "480 NaN = 2 groups × 3 M-tiles × 16 rows × 5 dims" in run["conclusion"]


def test_03_playground_runs_headless(tmp_path):
    run = run_notebook(NB_DIR / "03_poison_playground.ipynb", tmp_path)
    r = run["results"]
    assert r["backend"] == "emulate" and r["nan_count"] == 480 and r["fix_nan"] == 0
    assert {"grouped", "grouped+kernel_fix", "grouped+pad_fix"} <= set(r["routes"])
    assert r["stale_pad_fix_nan"] > 0 and r["stale_kernel_fix_nan"] == 0          # the suggested experiments
    assert r["attended_k_dropped"] > 0 and r["attended_k_grouped_nan"] < r["attended_k_reference_nan"]
    assert "Experiments to try" in "".join(c.source for c in run["nb"].cells if c.cell_type == "markdown")


def test_04_fixes_clean_and_stale_tail_finding(tmp_path):
    run = run_notebook(NB_DIR / "04_confirm_the_fix.ipynb", tmp_path)
    r = run["results"]
    html = "\n".join(o.get("data", {}).get("text/html", "") for c in run["nb"].cells if c.cell_type == "code"
                     for o in c.get("outputs", []))
    assert ">A<" in html and ">C<" in html and "report: grouped NaN" in html and ">ref<" in html
    assert "A = grouped+kernel_fix" in html and "fix A" not in html   # the letters beside the names
    assert "expected ≠ ref" in html and "as expected" in html
    from qsa_lab.report.repro import REPRO_CASES

    assert r["as_expected"] == r["cases"] == len(REPRO_CASES)
    assert "—" in html and ">nan<" not in html.lower() and "...</th>" not in html   # no NaN, no truncation
    assert r["backend"] == "emulate"
    assert r["fixed_nan_on_null_block_sites"] == 0
    assert r["bit_identical"]
    assert r["stale_pad_fix_nan"] > 0
    assert r["stale_kernel_fix_nan"] == 0 and r["stale_masked_load_nan"] == 0
    att = r["attended_k_nan"]   # a NaN key rows attend: NaN in XQA / reference, dropped by grouped
    assert att["xqa"] == att["reference"] > 0 and att["grouped"] < att["xqa"]
    # upstream's mixed batch: NaN in request 0's V reaches rows 46, 47, in request 1's rows 45, 47 (6 heads)
    assert r["cross_request_rows"] == 4 and r["poisoned_requests"] == [0, 1]
    assert {"grouped+kernel_fix", "grouped+both_fixes"} <= set(r["cross_request_leaking_routes"])
    assert not {"xqa", "grouped+request_groups", "grouped+finite_pv"} & set(r["cross_request_leaking_routes"])


def test_05_reads_committed_timings(tmp_path, tmp_path_factory):
    run = run_notebook(NB_DIR / "05_fix_overhead.ipynb", tmp_path, tmp_path_factory)
    r = run["results"]
    assert r["live"] is False and "backend:" in _text(run["nb"])
    from qsa_lab.analysis.figure_data import BENCH_JSON, load_bench

    df, meta = load_bench(BENCH_JSON)          # committed under data/
    assert r["records"] == len(df) > 0 and r["gpu"] == meta["gpu"] == "NVIDIA H200"
    nb = run["nb"]
    assert nb.cells[0].cell_type == "markdown" and "earlier version" not in json.dumps(nb.cells, default=str)
    first_output = next(c for c in nb.cells if c.cell_type == "code" and c.outputs)
    assert "text/html" not in json.dumps(first_output.outputs)               # opens with the question, no frame
    assert r["upstream_kernel_fix_ratio"] == [1.04, 1.045] and r["ours_kernel_fix_ratio"] == [1.063, 1.073]
    table = next(c for c in nb.cells if "fix_cost_frame(" in c.source)      # the fix-cost table
    text = "".join(o.get("data", {}).get("text/plain", "") for o in table.outputs)
    from qsa_lab.analysis import figure_data as figdata

    unfixed = figdata.fix_cost(figdata.bench_doc(False), figdata.load_upstream())["variants"]["unfixed"]["us_per_tile"]
    assert "kernel_fix (A)" in text and f"{unfixed:.2f}" in text and not re.search(r"\d\.\d{4,}", text), text  # rounded
    assert round(r["speed_ratio"], 1) == 2.3 and round(r["report_v100_ratio"], 2) == 1.25
    from qsa_lab.analysis.bench_data import COMPLETE_FIX_JSON   # the complete fixes' cost, once a GPU run is committed

    assert r["complete_fix_measured"] == COMPLETE_FIX_JSON.is_file()
    assert (r["complete_fix_ratio_span"] is None) == (not r["complete_fix_measured"])
    assert ("not measured yet" in run["conclusion"]) == (not r["complete_fix_measured"])
    assert "×1.040–1.045" in run["conclusion"] and "2.3× faster" in run["conclusion"]


JUPYTER_METADATA = {   # what JupyterLab writes into a notebook it opened and ran
    "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
    "language_info": {"codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py",
                      "mimetype": "text/x-python", "name": "python", "nbconvert_exporter": "python",
                      "pygments_lexer": "ipython3", "version": "3.11.2"},
    "widgets": {"application/vnd.jupyter.widget-state+json": {"state": {}, "version_major": 2}}}


def _as_jupyter_left_it(nb: dict) -> dict:
    """`nb` after opening, running and autosave: metadata rewritten, outputs and UI state added."""
    nb = json.loads(json.dumps(nb))
    nb["metadata"] = json.loads(json.dumps(JUPYTER_METADATA))
    cell = next(c for c in nb["cells"] if c["cell_type"] == "code")
    cell.update(execution_count=3, outputs=[{"output_type": "stream", "name": "stdout", "text": ["backend: x\n"]}])
    cell["metadata"].update(scrolled=True, execution={"iopub.status.busy": "2026-12-01T10:00:00Z"})
    return nb


def test_project_notebook_list_matches_the_folder():
    import sys

    sys.path.insert(0, str(NB_DIR.parent / "scripts"))
    from strip_outputs import PROJECT_NOTEBOOKS

    assert sorted(PROJECT_NOTEBOOKS) == [p.name for p in NOTEBOOKS]


def test_make_strip_undoes_what_jupyter_rewrites(tmp_path):
    import shutil
    import subprocess

    for name in ("01_e4m3_and_the_null_block.ipynb", "02_reproduce_the_grouped_nan-Copy1.ipynb"):
        used = _as_jupyter_left_it(json.loads((NB_DIR / name.replace("-Copy1", "")).read_text()))
        (tmp_path / name).write_text(json.dumps(used, indent=1))
    copy = (tmp_path / "02_reproduce_the_grouped_nan-Copy1.ipynb").read_bytes()
    script = NB_DIR.parent / "scripts" / "strip_outputs.py"
    out = subprocess.run(["python3", str(script), *map(str, sorted(tmp_path.iterdir()))], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert (tmp_path / "01_e4m3_and_the_null_block.ipynb").read_bytes() == \
        (NB_DIR / "01_e4m3_and_the_null_block.ipynb").read_bytes()           # git would show it unchanged
    assert (tmp_path / "02_reproduce_the_grouped_nan-Copy1.ipynb").read_bytes() == copy and "kept" in out
    shutil.rmtree(tmp_path)


def test_make_lab_saves_project_notebooks_without_outputs(tmp_path):
    """`make lab`'s Jupyter config: saving one of the project's notebooks after Jupyter rewrote its
    metadata and added outputs writes the committed bytes again (git shows nothing modified);
    a -Copy1 or a notebook of your own keeps its outputs; LAB_ARGS reach Jupyter; no
    pre-save-hook override warning; --allow-root when run as root."""
    import secrets
    import shutil
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    pytest.importorskip("jupyterlab")
    repo = Path(__file__).resolve().parents[2]   # `make lab` of the checkout holding these tests
    dry = subprocess.run(["make", "-n", "lab", "LAB_ARGS=--port 8899 --ip 0.0.0.0 --no-browser"], cwd=repo,
                         capture_output=True, text=True, timeout=60).stdout
    assert "--config=scripts/jupyter_lab_config.py" in dry and "--port 8899 --ip 0.0.0.0 --no-browser" in dry
    assert ("--allow-root" in dry) == (os.geteuid() == 0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token, root = secrets.token_hex(8), tmp_path / "nb"
    root.mkdir()
    project = ["01_e4m3_and_the_null_block.ipynb", "03_poison_playground.ipynb", "04_confirm_the_fix.ipynb"]
    for name in project:
        shutil.copy(NB_DIR / name, root / name)
    env = dict(os.environ, **{k: str(tmp_path / k) for k in ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR",
                                                             "JUPYTER_RUNTIME_DIR")})
    cmd = [sys.executable, "-m", "jupyter", "lab", f"--config={repo / 'scripts' / 'jupyter_lab_config.py'}",
           "--no-browser", "--ip=127.0.0.1", f"--port={port}", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={root}"] + (["--allow-root"] if os.geteuid() == 0 else [])
    log = tmp_path / "server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}/api"

    def put(name, nb):
        body = json.dumps({"type": "notebook", "format": "json", "content": nb}).encode()
        req = urllib.request.Request(f"{base}/contents/{name}?token={token}", data=body, method="PUT",
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=60).close()

    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{base}/status?token={token}", timeout=2).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "jupyter lab did not start"
                time.sleep(0.3)
        for name in project:
            with urllib.request.urlopen(f"{base}/contents/{name}?token={token}&content=1", timeout=60) as r:
                model = json.loads(r.read())
            put(name, _as_jupyter_left_it(model["content"]))
            assert (root / name).read_bytes() == (NB_DIR / name).read_bytes(), f"{name}: a save changed it"
        copy = _as_jupyter_left_it(json.loads((NB_DIR / "02_reproduce_the_grouped_nan.ipynb").read_text()))
        for name in ("02_reproduce_the_grouped_nan-Copy1.ipynb", "03_mine.ipynb", "scratch.ipynb"):
            put(name, copy)
            kept = nbformat.read(root / name, as_version=4)
            cell = next(c for c in kept.cells if c.cell_type == "code")
            assert cell.outputs and cell.execution_count == 3, name              # yours: kept as saved
            assert kept.metadata["kernelspec"]["display_name"] == "Python 3 (ipykernel)"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "Overriding existing pre_save_hook" not in log.read_text()


def test_07_scribble_finds_the_read_trash_dependency(tmp_path, tmp_path_factory):
    """transformers' continuous batching on the CPU: clean unpadded, the read trash leaks padded."""
    pytest.importorskip("transformers")
    from qsa_lab.scribble.versions import refusal

    if refusal() is not None:
        pytest.fail(refusal())   # the scribble extra pins the version the notebook was written for
    run = run_notebook(NB_DIR / "07_scribble_an_engine.ipynb", tmp_path, tmp_path_factory)
    r, nb = run["results"], run["nb"]
    assert r["checked"] > 0 and r["clean_unpadded"] == r["checked"] and r["strays_unpadded"] == 0
    assert r["other_requests_unpadded"] == ["nan-leak"]          # paged|eager's packed mask: 0 * NaN
    assert r["other_pairs"] > 0 and r["other_first_step"] == 1   # step 0 is every request's prefill
    assert r["padded_leak_regions"] == ["read-trash"] and r["padded_leaks"] >= 1
    assert r["first_step"] == 0 and r["first_layer"] == 0
    assert r["per_request_verdicts"] == ["clean"] and r["figures"] == 3
    # the vLLM part: run in the vLLM environment where `make vllm-env` built one, else said to be skipped
    shown = next(_shown(c) for c in nb.cells if c.cell_type == "code" and "scribble_in_vllm_env(" in c.source)
    from qsa_lab.scribble.engines.vllm.env import vllm_python

    if vllm_python() is not None:
        assert "nan → nan-leak" in shown, shown
    else:
        assert SKIPPED in shown, shown



def test_qsa_lab_lab_starts_jupyterlab_without_the_news_toast(tmp_path):
    """`qsa-lab lab` (issue 48): the settings `make lab` gives JupyterLab (scripts/lab_settings), so
    no "official Jupyter news?" toast lies over the notebooks: Lab's defaults become fetchNews "false"."""
    import secrets
    import socket
    import subprocess
    import time
    import urllib.request

    pytest.importorskip("jupyterlab")
    repo = Path(__file__).resolve().parents[2]
    assert package_data.LAB_OVERRIDES == json.loads((repo / "scripts" / "lab_settings" / "overrides.json").read_text())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token, settings = secrets.token_hex(8), tmp_path / "settings"
    settings.mkdir()
    env = dict(os.environ, **{k: str(tmp_path / k) for k in ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR",
                                                             "JUPYTER_RUNTIME_DIR")})
    cmd = package_data.lab_command(tmp_path, package_data.quiet_lab_args(settings) + [
        "--no-browser", "--ip=127.0.0.1", f"--port={port}", f"--IdentityProvider.token={token}"])
    with open(tmp_path / "server.log", "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/lab/api/settings/@jupyterlab/apputils-extension:notification?token={token}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    got = json.loads(r.read())
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
                time.sleep(0.3)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    defaults = {k: v["default"] for k, v in got["schema"]["properties"].items()}   # Lab's own: "none", True
    assert defaults["fetchNews"] == "false" and defaults["checkForUpdates"] is False, defaults


def test_qsa_lab_lab_passes_the_quiet_settings(tmp_path, monkeypatch):
    """The command itself gives JupyterLab the overrides (read while the server runs, removed after)."""
    import subprocess

    from qsa_lab.app.cli import main

    pytest.importorskip("jupyterlab")
    seen = {}

    class Server:
        def __init__(self, argv):
            where = next(a.split("=", 1)[1] for a in argv if a.startswith("--LabApp.app_settings_dir="))
            seen.update(argv=argv, where=where, overrides=json.loads((Path(where) / "overrides.json").read_text()))

        def wait(self, timeout=None):
            return 0

        def poll(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", Server)
    assert main(["lab", str(tmp_path / "nb"), "--no-browser"]) == 0
    assert seen["overrides"] == package_data.LAB_OVERRIDES and "--LabApp.news_url=None" in seen["argv"]
    assert not Path(seen["where"]).exists()

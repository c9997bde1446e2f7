"""A project notebook executed headless (nbclient, CPU, emulation), with one extra cell at its end that
prints its key_results and conclusion: the notebook tests (tests/app) check what it shows and finds.

The notebooks whose run does not depend on QSA_LAB_SMALL (SHARED_WITH_SITE) are executed once per
test run: their tests read that run, and the documentation site built by tests/docs renders the
same executed notebook (the extra cell dropped) instead of executing it a second time."""
from __future__ import annotations

import os
from pathlib import Path

MARK = "QSA_LAB_KEY_RESULTS="
CONCLUSION = "QSA_LAB_CONCLUSION="
#: notebooks that read no QSA_LAB_SMALL: the site shows what the tests' run shows
SHARED_WITH_SITE = ("05_fix_overhead.ipynb", "06_canary_any_kernel.ipynb", "07_scribble_an_engine.ipynb")


def execute(path: Path, folder: Path):
    """The notebook at `path` executed in `folder` (its figures in folder/figures), the extra cell
    appended: -> the executed nbformat notebook."""
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(f"import json; print({MARK!r} + json.dumps(key_results, default=str)); "
                                              f"print({CONCLUSION!r} + json.dumps(conclusion))"))
    env = {"QSA_LAB_BACKEND": "emulate", "QSA_LAB_SMALL": "1", "QSA_LAB_FIGURES": str(folder / "figures"),
           "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                         resources={"metadata": {"path": str(folder)}})
        client.execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb


def shared(path: Path, tmp_path_factory) -> tuple:
    """A SHARED_WITH_SITE notebook executed once per test run (tests/run_once.py): -> (the executed
    notebook, the folder it ran in). An execution that raises is tried again by the next test to ask."""
    import nbformat

    from run_once import once_per_run

    def run(folder: Path) -> tuple[str, str]:
        return nbformat.writes(execute(path, folder)), str(folder)

    nb, folder = once_per_run(tmp_path_factory, "notebook-" + path.stem, run)
    return nbformat.reads(nb, as_version=4), Path(folder)


def for_the_site(path: Path, tmp_path_factory, into: Path) -> Path:
    """The shared run of `path` as the site renders it (the extra cell dropped), written into `into`."""
    import nbformat

    nb, _ = shared(path, tmp_path_factory)
    nb.cells.pop()
    into.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, into / path.name)
    return into / path.name

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def pytest_configure(config):
    config.addinivalue_line("markers", "docs: builds the documentation site with mkdocs --strict (about 2 minutes)")


@pytest.fixture(scope="session")
def built_site(tmp_path_factory):
    """`mkdocs build --strict` into a temporary folder, once per test run (xdist workers share it):
    -> {"site": path, "returncode", "stderr"}. Skips where the docs dependency group is missing.
    The tutorial notebooks the notebook tests run as the site does (tests/notebook_runs.py) are
    shown from those runs (QSA_DOCS_EXECUTED, docs/hooks/qsa_docs.py), not executed again."""
    pytest.importorskip("mkdocs", reason="the docs dependency group is not installed (pip install --group docs)")
    pytest.importorskip("mkdocstrings")
    pytest.importorskip("mkdocs_jupyter")
    import notebook_runs
    from run_once import once_per_run

    def build(folder):
        for name in notebook_runs.SHARED_WITH_SITE:
            notebook_runs.for_the_site(REPO / "notebooks" / name, tmp_path_factory, folder / "executed" / "tutorial")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               "NO_MKDOCS_2_WARNING": "1", "QSA_LAB_FIGURES": str(folder / "figures"),
               "QSA_DOCS_EXECUTED": str(folder / "executed")}
        out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(folder / "site")],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
        return {"site": str(folder / "site"), "returncode": out.returncode, "stderr": out.stderr[-6000:]}

    return once_per_run(tmp_path_factory, "docs-site", build)

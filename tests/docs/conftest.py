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
    -> {"site": path, "returncode", "stderr"}. Skips where the docs dependency group is missing."""
    pytest.importorskip("mkdocs", reason="the docs dependency group is not installed (pip install --group docs)")
    pytest.importorskip("mkdocstrings")
    pytest.importorskip("mkdocs_jupyter")
    from run_once import once_per_run

    def build(folder):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               "NO_MKDOCS_2_WARNING": "1", "QSA_LAB_FIGURES": str(folder / "figures")}
        out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(folder / "site")],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
        return {"site": str(folder / "site"), "returncode": out.returncode, "stderr": out.stderr[-6000:]}

    return once_per_run(tmp_path_factory, "docs-site", build)

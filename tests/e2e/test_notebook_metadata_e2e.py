"""Opening a notebook in JupyterLab leaves it unmodified: Lab rewrites the kernelspec and
language_info it finds different from the running kernel's, which marked every notebook
modified (a dirty tab, a diff in git) the moment it opened (issue 31). Each notebook is opened
in a real JupyterLab in headless Chromium (fixtures: conftest.py), its kernel left to start,
then it must show no unsaved change, and a save must keep its metadata as committed."""

from __future__ import annotations

import json
import time

import pytest

from qsa_lab.support import package_data

pytestmark = pytest.mark.e2e

SETTLE_S = 2.0   # Lab writes the kernel's language_info once the kernel answers its info request


@pytest.mark.parametrize("path", package_data.notebooks(), ids=lambda p: p.stem)
def test_opening_and_saving_keeps_the_notebook_unmodified(path, lab_server, browser_context, results_dir):
    from tests.e2e.test_playground_e2e import kernel_state, no_dialog, wait_until

    committed = json.loads(path.read_text())["metadata"]
    page = browser_context.new_page()
    try:
        page.goto(lab_server.url(f"lab/tree/{path.name}?reset"))
        page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=60_000)
        wait_until("the notebook's kernel idle", lambda: no_dialog(page) or
                   kernel_state(lab_server, path.name) == "idle", 60)
        time.sleep(SETTLE_S)
        tab = page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text=path.name)
        assert tab.count() == 1, f"{tab.count()} tabs named {path.name}"
        dirty = "jp-mod-dirty" in (tab.get_attribute("class") or "")
        page.keyboard.press("Control+s")
        wait_until("the notebook saved (tab not dirty)",
                   lambda: "jp-mod-dirty" not in (tab.get_attribute("class") or ""), 20)
        saved = wait_until("the saved file whole", lambda: _metadata(lab_server.root_dir / path.name), 20)
        assert not dirty and saved == committed, \
            f"{path.name}: opening marked it modified ({dirty}); Lab saves metadata {saved}, committed {committed}"
    except BaseException:
        page.screenshot(path=str(results_dir / f"failure-metadata-{path.stem}.png"))
        raise
    finally:
        page.close()


def _metadata(path) -> dict | None:
    """The notebook's metadata, None while the file is being written."""
    try:
        return json.loads(path.read_text())["metadata"]
    except (OSError, ValueError, KeyError):
        return None

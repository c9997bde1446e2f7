"""Where qsa_lab's own files are: the kernel sources (csrc/), the data the notebooks and
`qsa-lab repro` read (data/) and the notebooks (notebooks/).

In the repository they stay at the top level, beside the package. A wheel or sdist carries
them inside the package (qsa_lab/csrc, qsa_lab/data, qsa_lab/notebooks: the [tool.setuptools]
tables of pyproject.toml), and an installed copy reads them from there through
importlib.resources. A checkout (an editable install, or the repository on sys.path) reads its
own top-level folders. This module is the only place that knows either layout.
"""
from __future__ import annotations

import importlib.resources
import json
import os
import sys
from pathlib import Path

KINDS = ("csrc", "data", "notebooks")
NOTEBOOK_GLOB = "[0-9][0-9]_*.ipynb"   # the project's notebooks (README.md beside them)
_PACKAGE = __name__.split(".")[0]   # qsa_lab: an install carries them as qsa_lab/csrc ...


class MissingPackageData(FileNotFoundError):
    """A file qsa_lab ships is not where it should be: an incomplete install."""


def checkout() -> Path | None:
    """The repository this package runs from (editable install or checkout), else None."""
    root = Path(__file__).resolve().parents[2]
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and 'name = "qsa_lab"' in pyproject.read_text(errors="replace"):
        return root
    return None


def _installed(kind: str) -> Path:
    return Path(str(importlib.resources.files(_PACKAGE).joinpath(kind)))


def locate(kind: str) -> Path:
    """Where `kind` ("csrc", "data" or "notebooks") is, installed or in the checkout; where it
    should be (the installed place) when it is in neither. Never raises for a missing folder."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    installed = _installed(kind)
    root = checkout()
    if not installed.is_dir() and root is not None and (root / kind).is_dir():
        return root / kind
    return installed


def folder(kind: str) -> Path:
    """locate(kind), which must exist: MissingPackageData (with the remedy) otherwise."""
    found = locate(kind)
    if not found.is_dir():
        raise MissingPackageData(f"qsa_lab's {kind}/ folder is missing (looked for {found}): this install is "
                                 "incomplete; reinstall it (pip install --force-reinstall qsa_lab, or "
                                 "pip install -e . in a checkout)")
    return found


def path(kind: str, name: str) -> Path:
    """One file inside folder(kind); MissingPackageData when it is not there."""
    p = folder(kind) / name
    if not p.is_file():
        raise MissingPackageData(f"{p} is missing: this qsa_lab install is incomplete; reinstall it")
    return p


def origin() -> str:
    """'installed' (the package's own copy) or 'checkout' (the repository's top-level folders)."""
    return "installed" if _installed("csrc").is_dir() else "checkout"


def notebooks() -> list[Path]:
    """The project's notebooks, in reading order."""
    return sorted(folder("notebooks").glob(NOTEBOOK_GLOB))


def copy_notebooks(dest, *, force: bool = False, keep: bool = False) -> list[Path]:
    """Copy the notebooks (and their README.md) into folder `dest`, created if needed, and
    return the files written. A file already there is refused (FileExistsError naming it, and
    nothing is copied) unless `force` replaces it or `keep` leaves it as it is. A symlink among
    them is refused even with `force` (a write never follows a link out of `dest`). Each file is
    written whole (qsa_lab.support.outputs); when one fails (a full disk) the files and folder
    this call made are removed again: no truncated notebook, no half copy."""
    from qsa_lab.support.outputs import check_folder, check_no_links, undone_on_failure, write_bytes

    if dest is None or not str(dest).strip():
        raise ValueError("dest: empty path (name the folder to copy the notebooks into)")
    dest = Path(dest).expanduser()
    if dest.exists() and not dest.is_dir():
        raise ValueError(f"dest: {dest} is a file, not a folder")
    sources = notebooks() + [p for p in [folder("notebooks") / "README.md"] if p.is_file()]
    if not sources:
        raise MissingPackageData(f"no notebooks in {folder('notebooks')}: this install is incomplete")
    targets = [dest / s.name for s in sources]
    existing = [t for t in targets if t.exists() or t.is_symlink()]
    if keep and not force:
        sources = [s for s, t in zip(sources, targets) if t not in existing]
        targets = [dest / s.name for s in sources]
    elif existing and not force:
        raise FileExistsError(f"dest: {existing[0]} exists ({len(existing)} of the {len(targets)} files are "
                              "already there); pass --force to replace them")
    check_no_links(dest, [t.name for t in targets], "dest")
    with undone_on_failure():
        check_folder(dest, "dest", create=True, parents=True)
        for s, t in zip(sources, targets):
            write_bytes(t, s.read_bytes(), "dest", force=force)
    return targets


#: JupyterLab's settings defaults for `qsa-lab lab`, as scripts/lab_settings/overrides.json gives them to
#: `make lab`: no "official Jupyter news?" toast over the notebooks (Lab asks while fetchNews is "none",
#: whatever news_url says) and no update check; a setting the user saves still wins
LAB_OVERRIDES = {"@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False}}


def quiet_lab_args(settings_dir) -> list[str]:
    """Write LAB_OVERRIDES into `settings_dir` (a folder of the command's own) -> the options that make
    JupyterLab read them there (it replaces the environment's <app_dir>/settings, which a pip or conda
    install leaves empty) and fetch no news."""
    (Path(settings_dir) / "overrides.json").write_text(json.dumps(LAB_OVERRIDES, indent=2) + "\n")
    return [f"--LabApp.app_settings_dir={settings_dir}", "--LabApp.news_url=None"]


def lab_command(notebook_dir, extra=()) -> list[str]:
    """The command that opens JupyterLab on `notebook_dir` with this Python (--allow-root as
    root, as on many GPU nodes)."""
    root = ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    return [sys.executable, "-m", "jupyter", "lab", f"--notebook-dir={Path(notebook_dir).resolve()}", *root, *extra]

"""The current folder off the import path, for commands run inside a folder someone sent.

`python -m module` and `python -c` put the current folder first on sys.path, so a `shlex.py`,
`torch.py` or `safetensors/` lying in a received report folder would be imported in place of the
real module, and run. An entry point that may run there calls `drop_current_folder()` before it
imports anything else; this module itself imports nothing that Python has not loaded at start-up.
(The `qsa-lab` program never has the current folder on its path: its script's folder is first.)
"""
import contextlib
import os
import sys


def drop_current_folder() -> None:
    """Remove the entry `python -m` / `python -c` put first on sys.path ('' or the current folder)."""
    if sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]


def refuse_shadowed(command: str, package: str = "qsa_lab") -> None:
    """After drop_current_folder() in a `python -m` entry point: exit 2 with one line when the
    `package` running is not the one the import path finds without the current folder (an
    installed copy, an editable install's folder, a PYTHONPATH entry), i.e. a `qsa_lab/` lying in
    the current folder was imported in its place. Everything else it would import stays unrun.

    (A `qsa_lab.py` or a `qsa_lab/__init__.py` lying there has run already when this runs: an installed
    qsa_lab's .pth (support.installed_only) keeps them from being imported at all, as do `qsa-lab`,
    `python -I -m` and `python -P -m`; this is the check for where that file is not read.) In a
    checkout run from its root, the editable install or PYTHONPATH finds this very folder: allowed."""
    here = getattr(sys.modules.get(package), "__file__", None)
    there = None
    for finder in sys.meta_path:        # the package as an import would find it now, cwd dropped
        try:
            spec = finder.find_spec(package, None)
        except Exception:  # noqa: BLE001 - a finder that cannot answer does not know the package
            continue
        if spec is not None:
            there = spec.origin
            break
    if here is None or there is None or os.path.realpath(here) != os.path.realpath(there):
        where = os.path.dirname(os.path.realpath(here)) if here else "?"
        print(f"{command}: refused: the {package} imported here is the one in the current folder ({where}), not the "
              f"installed one ({os.path.dirname(os.path.realpath(there)) if there else 'none found'}); run "
              f"`qsa-lab` (or `python -I -m {package}`) instead", file=sys.stderr)
        sys.exit(2)


def take_path(cwd: str, path: list) -> None:
    """In a worker started by support.processes.spawn: the caller's import path, then the current
    folder `cwd` LAST, so a module the user names there is found but a torch.py or qsa_lab/ lying
    there never takes an installed module's place."""
    sys.path[:0] = [p for p in path if p and p != cwd and p not in sys.path]
    if cwd not in sys.path:
        sys.path.append(cwd)


#: `python -c` code that starts `module` as `python -m module` would, without the current folder on
#: its path (for a second process started in a folder the user received: qsa_lab.support.processes)
RUN_MODULE = ("import sys; sys.path[:] = [p for p in sys.path if p]; import runpy; "
              "runpy.run_module({!r}, run_name='__main__', alter_sys=True)")


@contextlib.contextmanager
def children_off_the_current_folder():
    """Processes started inside (multiprocessing's spawn children and its resource tracker, which
    start as `python -c ...`) get no current folder on their path: PYTHONSAFEPATH (Python 3.11+;
    3.10 has no such switch) is set while they start, then put back as it was."""
    old = os.environ.get("PYTHONSAFEPATH")
    os.environ["PYTHONSAFEPATH"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONSAFEPATH", None)
        else:
            os.environ["PYTHONSAFEPATH"] = old

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

"""`import qsa_lab` finds the installed copy, never one lying in the current folder.

`python -m qsa_lab ...`, `python -m qsa_lab.canary.replay ...` and `python -c` put the current
folder (a script: its own folder) first on the import path, so a `qsa_lab.py` or `qsa_lab/` lying in
a folder someone sent would be imported, and run, before any line of the package could object.
The wheel and the editable install therefore carry a copy of this file as the module
`_qsa_lab_installed_only.finder` (in a namespace package: tools/build_pth.py says why) and a `.pth`
file whose one line imports it while Python starts, before the current folder joins the path (tools/build_pth.py writes both): it puts
`InstalledOnly` first on
`sys.meta_path`.

`InstalledOnly` answers for the one name `qsa_lab` (any other import costs one string comparison):
it asks the usual finders with the import path minus the entries Python added for the current
folder or the script's folder after start-up. So the installed copy (site-packages, the editable
install's finder) or a PYTHONPATH entry the user set is found, the folder's copy never. Nothing
here imports qsa_lab; with `python -P`, `-I` or PYTHONSAFEPATH it steps aside (nothing was added).
"""
import os
import sys

NAME = "qsa_lab"


class InstalledOnly:
    """A sys.meta_path finder for the top-level name `qsa_lab` alone."""

    startup = frozenset()   # sys.path when Python started (PYTHONPATH, site-packages): kept

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != NAME or path is not None or getattr(sys.flags, "safe_path", False):
            return None
        added = cls.added_folders()
        if not added:
            return None
        rest = [p for p in sys.path if p not in added]
        for finder in sys.meta_path:
            if finder is cls or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, rest, target)
            if spec is not None:
                return spec
        # the install this .pth belongs to is gone (a removed checkout): the folder's copy is no stand-in
        raise ModuleNotFoundError(f"No module named {name!r} outside the current folder (the installed one is "
                                  f"missing; {sorted(added)} are not searched for it)", name=name)

    @classmethod
    def added_folders(cls) -> set:
        """The import path's entries, absent at start-up, that are the current folder or the
        folder of the script Python runs."""
        try:
            here = {os.getcwd()}
        except OSError:         # the current folder was removed: '' and '.' still name it
            here = set()
        if sys.argv and sys.argv[0] not in ("", "-c", "-m") and os.path.isfile(sys.argv[0]):
            here.add(os.path.dirname(os.path.abspath(sys.argv[0])))
        here = {os.path.realpath(h) for h in here}
        return {p for p in sys.path if isinstance(p, str) and p not in cls.startup
                and (p in ("", ".") or os.path.realpath(p) in here)}


def install() -> None:
    """Put InstalledOnly first on sys.meta_path, remembering the start-up import path; once, even
    where the .pth is read twice (each read defines the class anew)."""
    if not any(getattr(f, "__qualname__", None) == InstalledOnly.__qualname__ for f in sys.meta_path):
        InstalledOnly.startup = frozenset(p for p in sys.path if isinstance(p, str))
        sys.meta_path.insert(0, InstalledOnly)


if __name__ == "_qsa_lab_installed_only.finder":   # the installed copy, imported by the .pth line (tools/build_pth.py)
    install()

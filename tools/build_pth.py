"""setuptools' build_py plus two files at the top of the install (pyproject.toml: [tool.setuptools.cmdclass]):
`_qsa_lab_installed_only/finder.py`, a copy of qsa_lab/support/installed_only.py, and `qsa_lab-installed-only.pth`,
whose one line, which Python runs while it starts, imports it, so that `import qsa_lab` never finds a
copy lying in the current folder (`python -m qsa_lab` in a folder someone sent). A module rather than
code in the .pth line: pip byte-compiles it, so Python's start-up imports it (a fraction of a
millisecond) instead of compiling source every time (a few milliseconds).

A wheel gets the files beside the package (build_lib); an editable install (`pip install -e .`,
PEP 660) ignores build_lib, so there they go where setuptools points `install_lib`: the root of
the editable wheel."""
from pathlib import Path

from setuptools.command.build_py import build_py

SOURCE = Path(__file__).resolve().parents[1] / "qsa_lab" / "support" / "installed_only.py"
#: the name installed_only.py installs its finder under: a module of a namespace package (a folder with no
#: __init__.py), so that pytest, which lists the top-level modules and packages of every distribution that
#: registers a plugin (qsa_lab does), never finds it imported already and warns in every user's test run
MODULE = "_qsa_lab_installed_only.finder"
PTH = "qsa_lab-installed-only.pth"


def pth_line() -> str:
    """The .pth's one line (site.py runs a line that starts with `import`)."""
    return f"import {MODULE}\n"


class BuildPy(build_py):
    def run(self):
        super().run()
        root = Path(self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib)
        root.mkdir(parents=True, exist_ok=True)
        module = root.joinpath(*MODULE.split(".")).with_suffix(".py")
        module.parent.mkdir(parents=True, exist_ok=True)
        module.write_text(SOURCE.read_text())
        (root / PTH).write_text(pth_line())

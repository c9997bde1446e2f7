"""setuptools' build_py plus one file, `qsa_lab-installed-only.pth`, at the top of the install
(pyproject.toml: [tool.setuptools.cmdclass]). Its one `import` line, which Python runs while it
starts, runs qsa_lab/support/installed_only.py, so that `import qsa_lab` never finds a copy lying
in the current folder (`python -m qsa_lab` in a folder someone sent).

A wheel gets the file beside the package (build_lib); an editable install (`pip install -e .`,
PEP 660) ignores build_lib, so there it goes where setuptools points `install_lib`: the root of
the editable wheel."""
import ast
from pathlib import Path

from setuptools.command.build_py import build_py

SOURCE = Path(__file__).resolve().parents[1] / "qsa_lab" / "support" / "installed_only.py"
PTH = "qsa_lab-installed-only.pth"


def pth_line(source: str) -> str:
    """The .pth's one line: compile and run `source` as the module `_qsa_lab_installed_only`, its
    docstrings and comments left out (compiling them at every start of Python would cost the most)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            body[0] = ast.Pass()
    source = ast.unparse(tree)
    return (f"import sys; exec(compile({source!r}, {PTH!r}, 'exec'), "
            "{'__name__': '_qsa_lab_installed_only'})\n")


class BuildPy(build_py):
    def run(self):
        super().run()
        root = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        Path(root).mkdir(parents=True, exist_ok=True)
        (Path(root) / PTH).write_text(pth_line(SOURCE.read_text()))

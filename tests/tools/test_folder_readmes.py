"""benchmarks/, scripts/, tools/ and examples/ each have a README that lists every file in the folder,
one line each (a table row naming it), and names no file that is not there."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def listed(folder: Path) -> list[str]:
    """The file names of the README's table rows (first cell, in backquotes)."""
    return re.findall(r"^\| `([^`]+)` \|", (folder / "README.md").read_text(), flags=re.M)


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.is_file() and p.name != "README.md" and "__pycache__" not in p.parts
                  and not any(part.startswith(".") for part in p.relative_to(folder).parts))


@pytest.mark.parametrize("name", ["benchmarks", "scripts", "tools", "examples"])
def test_the_readme_lists_every_file_once(name):
    folder = REPO / name
    rows = listed(folder)
    assert rows, f"{name}/README.md has no table of files"
    assert len(rows) == len(set(rows)), f"{name}/README.md lists a file twice"
    assert sorted(rows) == files(folder), (
        f"{name}/README.md: not listed {sorted(set(files(folder)) - set(rows))}, "
        f"listed but absent {sorted(set(rows) - set(files(folder)))}")


def test_a_file_missing_from_the_readme_is_found(tmp_path):
    (tmp_path / "README.md").write_text("| file | what |\n|---|---|\n| `a.py` | A. |\n")
    (tmp_path / "a.py").write_text("")
    (tmp_path / "b.sh").write_text("")
    assert listed(tmp_path) == ["a.py"] and files(tmp_path) == ["a.py", "b.sh"]

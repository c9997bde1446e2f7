"""support/outputs.py's folder primitive and its failure ledger (issue 33, item 2)."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from qsa_lab.support import outputs

ROOT = Path(__file__).parents[2]


def leftovers(folder: Path) -> list:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_writing_folder_appears_whole(tmp_path):
    dest = tmp_path / "report"
    with outputs.writing_folder(dest, "--report") as tmp:
        (tmp / "report.md").write_text("# r")
        (tmp / "calls").mkdir()
        assert not dest.exists()          # nothing at the name until the folder is complete
    assert (dest / "report.md").read_text() == "# r" and (dest / "calls").is_dir()
    assert leftovers(tmp_path) == []


def test_a_failed_folder_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), outputs.writing_folder(tmp_path / "report", "--report") as tmp:
        (tmp / "report.md").write_text("half")
        raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []


def test_a_symlink_at_the_folder_is_refused_naming_it(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "report").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="--report: .*report is a symlink"):
        with outputs.writing_folder(tmp_path / "report", "--report", force=True):
            pass
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_an_existing_folder_is_kept_unless_forced(tmp_path):
    dest = tmp_path / "report"
    dest.mkdir()
    (dest / "report.md").write_text("edited by the user")
    with pytest.raises(ValueError, match="add --force"):
        with outputs.writing_folder(dest, "--report", names=("report.md",)):
            pass
    assert (dest / "report.md").read_text() == "edited by the user"
    with outputs.writing_folder(dest, "--report", force=True, names=("report.md",)) as tmp:
        (tmp / "report.md").write_text("new")
    assert (dest / "report.md").read_text() == "new" and leftovers(tmp_path) == []


def test_a_folder_that_appears_during_the_run_is_kept(tmp_path):
    dest = tmp_path / "report"
    with pytest.raises((ValueError, FileExistsError), match="appeared during the run|not empty"):
        with outputs.writing_folder(dest, "--report") as tmp:
            (tmp / "report.md").write_text("mine")
            dest.mkdir()
            (dest / "theirs").write_text("theirs")
    assert [p.name for p in dest.iterdir()] == ["theirs"] and leftovers(tmp_path) == []


SIGNALLED = """
import os, signal, sys
from pathlib import Path
from qsa_lab.support import outputs, signals
signals.install()
with outputs.writing_folder(Path(sys.argv[1]) / "report", "--report") as tmp:
    (tmp / "report.md").write_text("half")
    os.kill(os.getpid(), signal.SIGTERM)
"""


def test_sigterm_while_writing_a_folder_leaves_nothing(tmp_path):
    r = subprocess.run([sys.executable, "-c", SIGNALLED, str(tmp_path)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert r.returncode == 143, r.stderr
    assert list(tmp_path.iterdir()) == []


def test_undone_on_failure_removes_only_what_this_run_made(tmp_path):
    out = tmp_path / "out"
    theirs = tmp_path / "theirs.txt"
    with pytest.raises(RuntimeError), outputs.undone_on_failure():
        outputs.check_folder(out, "--out", create=True)
        outputs.write_text(out / "mine.csv", "mine", "--out")
        outputs.write_text(out / "replaced_later.csv", "mine", "--out")
        (out / "replaced_later.csv").unlink()
        (out / "replaced_later.csv").write_text("another run's")   # same name, not ours any more
        (out / "theirs.json").write_text("another run's")
        theirs.write_text("another run's")
        raise RuntimeError
    assert sorted(p.name for p in out.iterdir()) == ["replaced_later.csv", "theirs.json"]
    assert (out / "replaced_later.csv").read_text() == "another run's" and theirs.exists()


def test_undone_on_failure_removes_its_own_empty_folder(tmp_path):
    with pytest.raises(RuntimeError), outputs.undone_on_failure():
        outputs.check_folder(tmp_path / "a" / "b", "--figures", create=True, parents=True)
        outputs.write_text(tmp_path / "a" / "b" / "f.png", "x", "--figures")
        raise RuntimeError
    assert list(tmp_path.iterdir()) == []


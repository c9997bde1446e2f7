"""The installed package's .pth (issue 48): `import qsa_lab` skips a qsa_lab.py or qsa_lab/ lying in
the current folder, which `python -m` / `python -c` put first on the import path, and answers for no
other name. The wheel test (tests/app/test_wheel.py) runs the built .pth end to end."""
import os
import subprocess
import sys
from importlib.machinery import PathFinder
from pathlib import Path

import pytest

from build_pth import MODULE, PTH, SOURCE, pth_line
from qsa_lab.support.installed_only import InstalledOnly

ROOT = Path(__file__).parents[2]


@pytest.fixture
def received(tmp_path, monkeypatch):
    """A folder with a hostile qsa_lab.py, the current folder, put first on the path after start-up."""
    (tmp_path / "qsa_lab.py").write_text("raise SystemExit('the folder ran')\n")
    (tmp_path / "json.py").write_text("raise SystemExit('the folder ran')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(InstalledOnly, "startup", frozenset(p for p in sys.path if p not in ("", str(tmp_path))))
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + [p for p in sys.path if p != ""])
    return tmp_path


@pytest.mark.parametrize("entry", ["", ".", "cwd"])
def test_qsa_lab_is_found_past_the_current_folder(received, entry, monkeypatch):
    sys.path[0] = str(received) if entry == "cwd" else entry
    assert PathFinder.find_spec("qsa_lab").origin == str(received / "qsa_lab.py")    # the threat
    spec = InstalledOnly.find_spec("qsa_lab")
    assert spec is not None and Path(spec.origin).resolve() == (ROOT / "qsa_lab" / "__init__.py").resolve()


def test_only_the_top_level_name_qsa_lab_is_answered(received):
    assert InstalledOnly.find_spec("json") is None                  # other packages: the usual lookup
    assert InstalledOnly.find_spec("qsa_lab_extra") is None
    assert InstalledOnly.find_spec("qsa_lab.app", [str(ROOT / "qsa_lab")]) is None   # submodules: the package's path


def test_a_path_entry_present_at_start_up_counts(received, monkeypatch):
    """PYTHONPATH=$PWD is the user's own choice: the current folder is then searched as usual."""
    monkeypatch.setattr(InstalledOnly, "startup", InstalledOnly.startup | {str(received)})
    assert InstalledOnly.find_spec("qsa_lab") is None


def test_the_pth_is_one_import_line_that_installs_the_finder_once(tmp_path):
    line = pth_line()
    assert line.startswith("import ") and line.count("\n") == 1 and line.endswith("\n")
    (tmp_path / PTH).write_text(line)
    (tmp_path / f"{MODULE}.py").write_text(SOURCE.read_text())
    code = ("import site, sys\n"
            "site.addsitedir(sys.argv[1]); site.addsitedir(sys.argv[1])\n"
            "print(sum(getattr(f, '__module__', '') == '_qsa_lab_installed_only.finder' for f in sys.meta_path),"
            " sys.meta_path[0].__name__)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-I", "-c", code, str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["1", "InstalledOnly"], out.stdout + out.stderr


def test_with_the_install_gone_the_folders_copy_is_no_stand_in(received, monkeypatch):
    monkeypatch.setattr(sys, "path", [str(received)] + [p for p in sys.path[1:] if p != str(ROOT)
                                                         and not os.path.isdir(os.path.join(p, "qsa_lab"))])
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if "editable" not in repr(f).lower()])
    with pytest.raises(ModuleNotFoundError, match="outside the current folder"):
        InstalledOnly.find_spec("qsa_lab")


def test_a_removed_current_folder_is_no_error(received, monkeypatch):
    def gone():
        raise FileNotFoundError(2, "No such file or directory")

    sys.path[0] = ""
    monkeypatch.setattr(os, "getcwd", gone)
    spec = InstalledOnly.find_spec("qsa_lab")
    assert spec is not None and Path(spec.origin).resolve() == (ROOT / "qsa_lab" / "__init__.py").resolve()

"""qsa_lab.support.package_data: one resolver for csrc/, data/ and notebooks/ (installed copy first, then
the checkout), the notebooks command, and what the first kernel build says."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qsa_lab.app import cli
from qsa_lab.routes import compiled as kernels
from qsa_lab.support import package_data

REPO = Path(__file__).resolve().parents[2]


def test_a_checkout_reads_its_top_level_folders():
    assert package_data.checkout() == REPO
    for kind in package_data.KINDS:
        assert package_data.folder(kind) == REPO / kind
    assert package_data.path("data", "report_verification.csv").is_file()
    assert [p.name for p in package_data.notebooks()] == sorted(p.name for p in (REPO / "notebooks").glob("[0-9]*.ipynb"))
    assert kernels.CSRC == REPO / "csrc" and kernels.missing_sources() == []


def test_pyproject_lists_every_package_and_maps_the_top_level_folders():
    """pyproject.toml lists the packages (find cannot take the mapped folders too): every folder of
    qsa_lab/ with an __init__.py, plus csrc/, data/ and notebooks/ as qsa_lab.<kind>; tools/ never."""
    from setuptools import find_packages

    tomllib = pytest.importorskip("tomllib")   # Python 3.11+

    conf = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    bundled = {f"qsa_lab.{kind}": kind for kind in package_data.KINDS}
    assert conf["package-dir"] == bundled
    assert sorted(conf["packages"]) == sorted(find_packages(str(REPO), include=["qsa_lab", "qsa_lab.*"]) + list(bundled))


def test_data_holds_only_what_the_package_reads_and_evidence_the_rest():
    """data/ ships in every wheel: each file there is a string literal of the package or its
    notebooks (a file they open); measured logs and JSON live in evidence/. Each folder's README gives every file's provenance."""
    code = [p.read_text() for p in (REPO / "qsa_lab").rglob("*.py")]
    code += [p.read_text() for p in (REPO / "notebooks").glob("*.ipynb")]
    for kind in ("data", "evidence"):
        files = sorted(p.name for p in (REPO / kind).iterdir() if p.is_file() and p.name != "README.md")
        readme = (REPO / kind / "README.md").read_text()
        assert files and all(f"`{name}`" in readme for name in files), kind
        for name in files:
            opened = any(f'"{name}"' in text or f'\\"{name}\\"' in text for text in code)  # a string literal
            assert opened == (kind == "data"), f"{kind}/{name}"


def test_the_installed_copy_wins_and_a_missing_folder_says_so(tmp_path, monkeypatch):
    (tmp_path / "csrc").mkdir()
    monkeypatch.setattr(package_data, "_installed", lambda kind: tmp_path / kind)
    assert package_data.folder("csrc") == tmp_path / "csrc" and package_data.origin() == "installed"
    assert package_data.folder("data") == REPO / "data"           # not installed: the checkout's
    monkeypatch.setattr(package_data, "checkout", lambda: None)
    with pytest.raises(package_data.MissingPackageData, match="data/ folder is missing.*reinstall"):
        package_data.folder("data")
    with pytest.raises(ValueError, match="kind"):
        package_data.folder("src")


def test_notebooks_command_never_overwrites_without_force(tmp_path, capsys):
    dest = tmp_path / "nb"
    assert cli.main(["notebooks", str(dest)]) == 0
    names = sorted(p.name for p in dest.iterdir())
    assert names == sorted([p.name for p in package_data.notebooks()] + ["README.md"])
    (dest / names[0]).write_text("my edits")
    capsys.readouterr()
    assert cli.main(["notebooks", str(dest)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qsa-lab: error: DIR: ") and "--force" in err and err.count("\n") == 1
    assert (dest / names[0]).read_text() == "my edits"
    assert package_data.copy_notebooks(dest, keep=True) == []          # `qsa-lab lab`: keeps the user's copy
    assert (dest / names[0]).read_text() == "my edits"
    assert cli.main(["notebooks", str(dest), "--force"]) == 0
    assert (dest / names[0]).read_bytes() == (package_data.folder("notebooks") / names[0]).read_bytes()
    assert cli.main(["notebooks", str(dest / names[1])]) == 2           # a file, not a folder


def test_lab_opens_jupyterlab_on_the_copy(tmp_path, monkeypatch):
    pytest.importorskip("jupyterlab")
    import subprocess

    seen = []

    class Server:   # qsa-lab waits for the server (and passes a signal on to it)
        def __init__(self, cmd):
            seen.append(cmd)

        wait = staticmethod(lambda *a: 0)
        poll = staticmethod(lambda: 0)
    monkeypatch.setattr(subprocess, "Popen", Server)
    assert cli.main(["lab", str(tmp_path / "nb"), "--port", "8899", "--no-browser"]) == 0
    cmd = seen[0]
    assert cmd[1:4] == ["-m", "jupyter", "lab"] and f"--notebook-dir={(tmp_path / 'nb').resolve()}" in cmd
    assert "--port=8899" in cmd and "--no-browser" in cmd
    assert any(p.suffix == ".ipynb" for p in (tmp_path / "nb").iterdir())


def test_first_build_announces_itself_and_a_failure_names_the_first_error(tmp_path, monkeypatch, capsys):
    """On a (pretend) V100: the build is announced with arch, duration and cache folder before it
    starts, and the compiler's first error heads the failure."""
    from torch.utils import cpp_extension

    log = ("Error building extension 'qsa_lab_kernels': [1/2] nvcc ... -c bindings.cu\nFAILED: bindings.cuda.o\n"
           "csrc/grouped_page4.cuh(12): error: identifier \"wmma\" is undefined\n"
           "csrc/grouped_page4.cuh(30): error: second one\nninja: build stopped: subcommand failed.\n")

    def fake_load(**kw):
        assert kw["sources"] == [str(kernels.CSRC / "bindings.cu")]
        raise RuntimeError(log)

    monkeypatch.setenv("QSA_LAB_BUILD_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 0))
    monkeypatch.setattr(torch.version, "cuda", "12.6")
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(kernels, "_ext", None)
    monkeypatch.setattr(kernels, "_error", None)
    monkeypatch.setattr(kernels, "_first_error", None)
    with pytest.raises(RuntimeError) as e:
        kernels.load()
    err = capsys.readouterr().err
    assert f"building the kernels for sm_70 (first use, about 1.5 minutes" in err and str(tmp_path / "ext") in err
    assert str(e.value).splitlines()[0].endswith('failed: csrc/grouped_page4.cuh(12): error: identifier "wmma" is undefined')
    assert kernels._first_error == 'csrc/grouped_page4.cuh(12): error: identifier "wmma" is undefined'


def test_missing_sources_stop_the_build(tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "CSRC", tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "12.6")
    monkeypatch.setattr(kernels, "_ext", None)
    monkeypatch.setattr(kernels, "_error", None)
    assert set(kernels.missing_sources()) == set(kernels.SOURCES + kernels.HEADERS)
    with pytest.raises(RuntimeError, match="kernel sources are missing.*reinstall"):
        kernels.load()

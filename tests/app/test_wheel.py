"""A pip user's qsa_lab: build the sdist, build the wheel from that sdist (pyproject.toml alone),
install the wheel into a fresh venv and run it from a folder outside the checkout. The kernel
sources, the data and the notebooks must come with it, the developer tooling (tools/) and the
measured evidence/ must not, and the installed copy (not the checkout) must be what runs; its
pytest plugin loads once, through its entry point, `-p` or a conftest, and `-p no:` turns it off.

The venv sees this test environment's packages (torch, numpy, ... through a .pth line, which does
not load this environment's editable qsa_lab) and gets only the wheel installed, so it is made in
seconds and without a network.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from run_once import once_per_run

pytestmark = pytest.mark.wheel
REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 1800  # a loaded 2-core machine: the repro alone takes minutes


def _layout() -> dict[str, list[str]]:
    """Every file the package must carry, by folder, as the checkout has them."""
    return {"csrc": sorted(p.name for p in (REPO / "csrc").iterdir() if p.is_file()),
            "data": sorted(p.name for p in (REPO / "data").iterdir() if p.is_file()),
            "notebooks": sorted(p.name for p in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")) + ["README.md"]}


def doctor_rows(text: str) -> dict:
    """`qsa-lab doctor`'s 'key  value' rows (the verdict line aside)."""
    return {(line.split(None, 1) + [""])[0]: (line.split(None, 1) + [""])[1]
            for line in text.splitlines() if line.strip() and not line.startswith("verdict")}


def _run(cmd, cwd, **kw):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT,
                          env={**env, **kw.pop("env", {})}, **kw)


def _ok(res, what):
    assert res.returncode == 0, f"{what} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


def _build(out: Path) -> tuple[Path, Path]:
    hook = "import sys; from setuptools import build_meta as b; print(getattr(b, sys.argv[1])(sys.argv[2]))"
    sdist = out / _ok(_run([sys.executable, "-c", hook, "build_sdist", out], REPO), "build_sdist").stdout.split()[-1]
    with tarfile.open(sdist) as tar:
        tar.extractall(out / "src", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    src = next((out / "src").iterdir())
    wheel = out / _ok(_run([sys.executable, "-c", hook, "build_wheel", out], src), "build_wheel").stdout.split()[-1]
    return sdist, wheel


def _make_venv(root: Path, wheel: Path) -> Path:
    _ok(_run([sys.executable, "-m", "venv", "--without-pip", root], root), "venv")
    site = Path(_ok(_run([root / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         root), "purelib").stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "_qsa_lab_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    # -I: this test environment's editable qsa_lab is visible through the .pth and must not count
    _ok(_run([root / "bin" / "python", "-m", "pip", "install", "-q", "-I", "--no-deps", "--no-index", wheel], root),
        "pip install the wheel")
    return root / "bin"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(sdist, wheel built from that sdist) through setuptools' PEP 517 hooks, as pip or build call them.
    Built once per test run: pytest-xdist's workers share it (two builds in the checkout at
    once would also race on its egg-info and sdist staging folder)."""
    return once_per_run(tmp_path_factory, "wheel-dist", _build)


@pytest.fixture(scope="module")
def venv(built, tmp_path_factory):
    """A fresh venv holding the wheel, made once per test run; returns its bin folder. The
    tests only run its commands, each from a folder of its own."""
    return once_per_run(tmp_path_factory, "wheel-venv", lambda root: _make_venv(root, built[1]))


@pytest.fixture()
def elsewhere(tmp_path):
    """A working folder outside the checkout."""
    assert REPO not in tmp_path.resolve().parents
    return tmp_path


def test_sdist_and_wheel_carry_csrc_data_and_notebooks(built):
    sdist, wheel = built
    with tarfile.open(sdist) as tar:
        in_sdist = {Path(*Path(n).parts[1:]).as_posix() for n in tar.getnames()}
    with zipfile.ZipFile(wheel) as z:
        in_wheel = set(z.namelist())
    for kind, names in _layout().items():
        assert names, kind
        for name in names:
            assert f"{kind}/{name}" in in_sdist, f"sdist lacks {kind}/{name}"
            assert f"qsa_lab/{kind}/{name}" in in_wheel, f"wheel lacks qsa_lab/{kind}/{name}"
    for name in ("LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml", "environment.yml"):
        assert name in in_sdist, name
    assert "setup.py" not in in_sdist
    # at the top: site-packages reads the .pth at start-up, and its line imports the finder's module
    assert {"qsa_lab-installed-only.pth", "_qsa_lab_installed_only/finder.py"} <= in_wheel
    # developer tooling and measured evidence stay in the repository
    tools = sorted(p.name for p in (REPO / "tools").glob("*.py"))
    evidence = sorted(p.name for p in (REPO / "evidence").iterdir() if p.name != "README.md")
    assert tools and evidence
    assert not [n for n in in_wheel if n.startswith("tools/") or Path(n).name in tools + evidence]
    assert not [n for n in in_sdist if n.startswith("evidence/")]
    meta = next(n for n in in_wheel if n.endswith(".dist-info/METADATA"))
    with zipfile.ZipFile(wheel) as z:
        text = z.read(meta).decode()
    from qsa_lab import __version__

    assert f"\nVersion: {__version__}\n" in text and "License-Expression: Apache-2.0" in text


def test_installed_copy_runs_the_readme_commands_from_elsewhere(venv, elsewhere):
    where = _ok(_run([venv / "python", "-c", "import qsa_lab; print(qsa_lab.__file__)"], elsewhere), "import")
    assert Path(where.stdout.strip()).is_relative_to(venv.parent), where.stdout   # the wheel's copy runs

    doctor = _ok(_run([venv / "qsa-lab", "doctor"], elsewhere), "qsa-lab doctor").stdout
    rows = doctor_rows(doctor)
    assert rows["kernel_sources"].endswith("(installed)") and str(venv.parent) in rows["kernel_sources"]
    assert doctor.strip().splitlines()[-1].startswith("verdict: ")

    diff = _ok(_run([venv / "qsa-lab", "diff", "decode", "--poison", "targeted", "--json", "-"], elsewhere), "diff")
    routes = json.loads(diff.stdout)["routes"]
    assert routes["grouped"]["nan_count"] == 480 and routes["grouped"]["nan_dims"] == [102, 152, 168, 170, 230]
    assert all(routes[r]["nan_count"] == 0 for r in routes if r != "grouped")

    _ok(_run([venv / "qsa-lab", "repro", "--out", "results", "--quiet"], elsewhere), "qsa-lab repro")
    table = json.loads((elsewhere / "results" / "repro.json").read_text())
    report = [c["report_grouped_nan"] for c in table["cases"] if c.get("report_grouped_nan") is not None]
    assert report, "the report's own numbers (data/report_verification.csv) are missing from the table"
    assert any(p.suffix == ".png" for p in (elsewhere / "figures").iterdir())


def test_installed_copy_resolves_every_kernel_source_and_notebook(venv, elsewhere):
    code = ("import json; from qsa_lab.support import package_data as pd; from qsa_lab.routes import compiled as kernels;"
            "print(json.dumps({k: [str(pd.folder(k)), sorted(p.name for p in pd.folder(k).iterdir())] for k in pd.KINDS}"
            " | {'missing': kernels.missing_sources(), 'kernels_csrc': str(kernels.CSRC), 'nb': [str(p) for p in pd.notebooks()]}))")
    got = json.loads(_ok(_run([venv / "python", "-c", code], elsewhere), "resolver").stdout)
    assert got["missing"] == [] and Path(got["kernels_csrc"]).is_relative_to(venv.parent)
    for kind, names in _layout().items():
        folder, listed = got[kind]
        assert Path(folder).is_relative_to(venv.parent), (kind, folder)
        assert set(names) <= set(listed), (kind, sorted(set(names) - set(listed)))
        for name in names:  # the very bytes of the checkout
            assert (Path(folder) / name).read_bytes() == (REPO / kind / name).read_bytes(), (kind, name)
    assert [Path(p).name for p in got["nb"]] == _layout()["notebooks"][:-1]

    copied = elsewhere / "nb"
    _ok(_run([venv / "qsa-lab", "notebooks", copied], elsewhere), "qsa-lab notebooks")
    assert sorted(p.name for p in copied.iterdir()) == sorted(_layout()["notebooks"])
    again = _run([venv / "qsa-lab", "notebooks", copied], elsewhere)
    assert again.returncode == 2 and "--force" in again.stderr    # never overwritten without --force


HOSTILE = "import pathlib\npathlib.Path({path!r}).write_text('ran')\nraise SystemExit('the folder ran')\n"


@pytest.mark.parametrize("planted", ["qsa_lab.py", "qsa_lab/__init__.py"])
def test_python_m_runs_the_installed_copy_past_a_qsa_lab_in_the_current_folder(venv, elsewhere, planted):
    """`python -m` puts the current folder first on the path; the wheel's .pth makes `import qsa_lab`
    skip it, so a received folder's qsa_lab.py (which would run before any line of the package) never runs."""
    marker = elsewhere.parent / f"MARKER-{elsewhere.name}"
    (elsewhere / planted).parent.mkdir(exist_ok=True)
    (elsewhere / planted).write_text(HOSTILE.format(path=str(marker)))
    for argv, said in ((["-m", "qsa_lab", "--help"], "usage: qsa-lab"),
                       (["-m", "qsa_lab.canary.replay", "--help"], "usage: python -m qsa_lab.canary.replay"),
                       (["-c", "import qsa_lab; print(qsa_lab.__file__)"], str(venv.parent))):
        res = _ok(_run([venv / "python", *argv], elsewhere), f"python {argv}")
        assert said in res.stdout and not marker.exists(), (argv, res.stdout, res.stderr)
    # the finder answers for qsa_lab alone: another module in the folder is found there as usual
    (elsewhere / "mine.py").write_text("X = 1\n")
    _ok(_run([venv / "python", "-c", "import mine"], elsewhere), "import mine")


PLUGIN = "qsa_lab.canary.pytest_plugin"
# how often pytest holds the plugin module, and whether loading it brought torch in
PROBE = f"""
import sys

def test_probe(request):
    mod = sys.modules.get({PLUGIN!r})
    held = sum(p is mod for p in request.config.pluginmanager.get_plugins()) if mod else 0
    print("plugin", held, "torch", "torch" in sys.modules)
"""


@pytest.mark.parametrize("args, conftest, held", [
    pytest.param([], None, 1, id="entry-point-alone"),
    pytest.param(["-p", PLUGIN], None, 1, id="dash-p"),
    pytest.param([], f"pytest_plugins = [{PLUGIN!r}]\n", 1, id="conftest"),
    pytest.param(["-p", f"no:{PLUGIN}"], None, 0, id="dash-p-no"),
])
def test_installed_pytest_plugin_loads_once_however_asked(venv, elsewhere, args, conftest, held):
    """The pytest11 entry point carries the plugin's own module name, so pytest counts every way
    of asking for it as one plugin (under another name `-p` and `pytest_plugins` would register the
    module a second time, which pytest refuses); importing it loads no torch."""
    (elsewhere / "test_probe.py").write_text(PROBE)
    if conftest:
        (elsewhere / "conftest.py").write_text(conftest)
    res = _ok(_run([venv / "python", "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", *args, "test_probe.py"],
                   elsewhere), f"pytest {args} (conftest: {conftest})")
    assert f"plugin {held} torch False" in res.stdout, res.stdout

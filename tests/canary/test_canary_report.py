"""The leak report (--report DIR), its replayable calls, and the pytest plugin, on the CPU with
the torch / qsa kernels and two hand-written kernels (tests/data/canary_kernels.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from run_once import once_per_run
from qsa_lab.canary import run_canary
from qsa_lab.canary.case import canary_case
from qsa_lab.canary.calls import load_call
from qsa_lab.canary.report import write_report

pytest_plugins = ["pytester"]
DATA = Path(__file__).parents[1] / "data"
LEAKY = f"{DATA / 'canary_kernels.py'}:leaky"
MASKED = f"{DATA / 'canary_kernels.py'}:masked"
GQA = dict(q_heads=8, kv_heads=2, head_dim=32, requests=3, context=40, query_len=2)
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}


def run(*args, timeout=900):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=ENV)


def in_process(capsys, module, *argv):
    """`python -m module *argv` called in this process (its main(argv), exit code as returned):
    what the command prints and returns, without a second torch import."""
    from importlib import import_module

    capsys.readouterr()
    code = import_module(module).main(list(argv))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess([module, *argv], code, out, err)


@pytest.fixture(scope="module")
def window_report(tmp_path_factory):
    def build(folder):
        case = canary_case("fp16", attend="window:8", **GQA)
        report = run_canary([LEAKY, MASKED], case=case, backend="emulate", payloads=["nan", "max"])
        write_report(report, folder / "report")
        return report, folder / "report"
    return once_per_run(tmp_path_factory, "window-report", build)


@pytest.fixture(scope="module")
def masked_report():
    """The clean kernel on the window case, every payload: one run (a worker process) for the tests
    that read it."""
    return run_canary([MASKED], case=canary_case("fp16", attend="window:8", **GQA), backend="emulate",
                      payloads=["nan", "inf", "max"])


def test_report_has_figure_versions_case_spec_grouped_per_kernel_region_plane(window_report):
    report, out = window_report
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert (out / "leak_matrix.png").stat().st_size > 1000 and 'src="leak_matrix.png"' in md
    for text in ("| torch |", "| gpu |", "| driver |", "| cuda |", "attend window:8", "Hkv 2", "D 32"):
        assert text in md, text
    leaks = report.leaks()
    assert leaks and all(r.kernel == LEAKY for r in leaks)
    assert md.count(f"## Kernel {LEAKY}") == 1 and md.count(f"## Kernel {MASKED}") == 1
    for r in leaks:   # one entry per region x plane, every leaking payload folded into it
        assert md.count(f"### {r.region} / {r.plane.upper()} plane") == 1
        assert f"{r.payload}: {r.verdict} ({r.nan} NaN, {r.inf} Inf" in md
        w = r.where()
        assert f"rows {w['rows'][0]}-{w['rows'][-1]}" in md
    assert "first NaN at [row, head, dim] [" in md
    assert "<table>" in page and "max-width:100%" in page and "qsa-lab replay" in page
    assert json.loads((out / "canary.json").read_text())["schema"] == "qsa_lab.canary/1"
    assert "backend None" not in md and "backend None" not in page


def test_the_leak_matrix_fits_a_1280_px_window_and_never_says_backend_none(masked_report):
    from PIL import Image

    from qsa_lab.canary.figures import leak_matrix

    report = masked_report
    assert "backend" not in leak_matrix(report)["title"]   # no qsa route ran: no backend to name
    wide = report.to_json()
    wide["results"] = [dict(r, region=f"{r['region']}{i}") for i in range(4) for r in wide["results"]]
    from qsa_lab.canary import report as rep

    class Doc:   # 4x the columns of a real run: the width cap must hold
        results = True

        def to_json(self):
            return wide
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        rep._figure(Doc(), Path(d) / "m.png")
        assert Image.open(Path(d) / "m.png").width <= rep.MATRIX_MAX_PX


def test_each_leaking_region_and_plane_gets_its_smallest_call_one_poisoned_slot(window_report):
    report, out = window_report
    files = sorted((out / "calls").glob("*.safetensors"))
    assert len(files) == len({(r.region, r.plane) for r in report.leaks()})
    for f in files:
        assert f.stat().st_mode & 0o777 == (out / "report.md").stat().st_mode & 0o777   # 0644, not 0600
        with safe_open(str(f), framework="pt") as g:
            meta, slots = g.metadata(), g.get_tensor("poisoned_slots")
        assert int(slots.sum()) == 1, f"{f.name}: one NaN V slot is enough to leak through 0 * V"
        control, poisoned, _ = load_call(f)
        assert meta["kernel"] == LEAKY and meta["plane"] == "v" and "/" not in f.name and "work" not in f.name
        assert (control.kv_cache != poisoned.kv_cache).any() and control.spec.kind == "window"
        assert (f"qsa-lab replay calls/{f.name} --kernel kernels/canary_kernels.py:leaky"
                in (out / "report.md").read_text())
    assert (out / "kernels" / "canary_kernels.py").read_bytes() == (DATA / "canary_kernels.py").read_bytes()


def test_the_report_travels_zipped_and_its_replay_lines_run_from_the_unpacked_folder(window_report, tmp_path):
    import re
    import shutil
    import zipfile

    _, out = window_report
    copy = tmp_path / "written"
    shutil.copytree(out, copy)
    archive = shutil.make_archive(str(tmp_path / "report"), "zip", copy)
    shutil.rmtree(copy)                                  # nothing of the writing machine's folder is left
    unpacked = tmp_path / "elsewhere" / "unpacked"
    zipfile.ZipFile(archive).extractall(unpacked)
    lines = re.findall(r"^qsa-lab replay .*$", (unpacked / "report.md").read_text(), re.M)
    assert lines
    for line in lines[:1]:
        r = subprocess.run([str(Path(sys.executable).parent / "qsa-lab"), *line.split()[1:]], cwd=unpacked,
                           capture_output=True, text=True, timeout=300, env=ENV)
        assert r.returncode == 1 and "verdict nan-leak" in r.stdout, r.stdout + r.stderr
    call = line.split()[2]
    missing = in_process_replay(unpacked / call, "--kernel", str(tmp_path / "nope.py:leaky"))
    assert missing == 3                                  # a kernel that cannot load: cannot run, not bad input


def test_inside_the_unpacked_report_replay_without_kernel_names_the_copy_there(window_report, tmp_path):
    """Run unnamed from inside the unpacked folder, replay refuses (exit 2) and its hint names the
    kernel as the report's copy (kernels/...), and that hint, run as printed, reproduces the leak."""
    import shlex
    import shutil

    _, out = window_report
    unpacked = tmp_path / "unpacked"
    shutil.copytree(out, unpacked)
    call = next((unpacked / "calls").glob("*__v__nan.safetensors")).relative_to(unpacked)
    r = subprocess.run([sys.executable, "-m", "qsa_lab", "replay", str(call)], cwd=unpacked, capture_output=True,
                       text=True, timeout=300, env=ENV)   # as a user runs it: `qsa-lab replay`
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    hint = r.stderr.split("then run: ", 1)[1].strip()
    assert hint.startswith("qsa-lab replay ") and hint.endswith("--kernel kernels/canary_kernels.py:leaky"), hint
    again = subprocess.run([sys.executable, "-m", "qsa_lab", *shlex.split(hint)[1:]], cwd=unpacked, capture_output=True, text=True,
                           timeout=300, env=ENV)
    assert again.returncode == 1 and "verdict nan-leak" in again.stdout, again.stdout + again.stderr


def test_each_leak_says_what_to_change_and_a_users_kernel_is_promised_no_script(window_report):
    from qsa_lab.canary.report import WHAT_TO_CHANGE

    report, out = window_report
    md = (out / "report.md").read_text()
    for region, plane in {(r.region, r.plane) for r in report.leaks()}:
        entry = md.split(f"### {region} / {plane.upper()} plane", 1)[1].split("###", 1)[0]
        assert f"What to change: {WHAT_TO_CHANGE[region]}; " in entry, entry
    replaying = md.split("## Replaying", 1)[1].split("##", 1)[0]
    assert not (out / "repro").exists() and "standalone script (repro/" not in replaying
    assert "no standalone script" in replaying and "kernels/" in replaying
    assert "None" not in md


def in_process_replay(*argv):
    from qsa_lab.canary.replay import main

    return main([str(a) for a in argv])


def test_the_replay_command_recreates_the_nan_and_a_masked_kernel_is_clean(window_report, capsys):
    _, out = window_report
    call = next((out / "calls").glob("*out-of-window__v__nan.safetensors"))
    unnamed = in_process(capsys, "qsa_lab.canary.replay", str(call))   # a file.py kernel runs only when named
    assert unnamed.returncode == 2 and "verdict" not in unnamed.stdout and "--kernel" in unnamed.stderr
    leaked = in_process(capsys, "qsa_lab.canary.replay", str(call), "--kernel", LEAKY)
    assert leaked.returncode == 1, leaked.stderr
    assert "control 0 NaN; poisoned" in leaked.stdout and "verdict nan-leak" in leaked.stdout
    nan = int(leaked.stdout.split("poisoned ")[1].split(" NaN")[0])
    assert nan > 0
    fixed = in_process(capsys, "qsa_lab.canary.replay", str(call), "--kernel", MASKED)
    assert fixed.returncode == 0 and "poisoned 0 NaN, 0 Inf, 0 finite changed" in fixed.stdout, fixed.stdout
    bad = in_process(capsys, "qsa_lab.canary.replay", str(out / "canary.json"))
    assert bad.returncode == 2 and "replay: error: path:" in bad.stderr


def test_cli_report_on_a_qsa_route_writes_replayable_calls(tmp_path, capsys):
    out = tmp_path / "grouped"
    r = in_process(capsys, "qsa_lab.app.cli", "canary", "--kernels", "qsa:grouped", "--backend", "emulate",
                   "--payloads", "nan", "--report", str(out))
    assert r.returncode == 1, r.stderr                       # the canary's exit code for a leak
    md = (out / "report.md").read_text()
    assert "qsa:grouped" in md and "nan-leak" in md
    call = sorted((out / "calls").glob("qsa_grouped__*__v__nan.safetensors"))
    assert call, sorted(p.name for p in (out / "calls").iterdir())
    replay = in_process(capsys, "qsa_lab.canary.replay", str(call[0]), "--backend", "emulate")
    assert replay.returncode == 1 and "verdict nan-leak" in replay.stdout, replay.stdout + replay.stderr
    again = in_process(capsys, "qsa_lab.app.cli", "canary", "--kernels", "qsa:grouped", "--backend", "emulate",
                       "--report", str(out))
    assert again.returncode == 2 and again.stderr.strip().splitlines()[-1].startswith(
        "qsa-lab: error: --report:") and "--force" in again.stderr


def test_a_clean_kernel_gets_a_report_without_calls(masked_report, tmp_path):
    write_report(masked_report, tmp_path / "r")
    assert "No leak: every check ran clean." in (tmp_path / "r" / "report.md").read_text()
    assert not (tmp_path / "r" / "calls").exists()


# -- the pytest plugin ------------------------------------------------------------------------------

PLUGIN_TEST = f'''
import importlib.util
import pytest

spec = importlib.util.spec_from_file_location("canary_kernels", {str(DATA / "canary_kernels.py")!r})
kernels = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kernels)
GEOMETRY = dict(attend="window:8", kv_heads=2, q_heads=8, head_dim=32, requests=3, context=40, query_len=2,
                payloads=["nan", "max"], backend="emulate")


@pytest.mark.qsa_canary(kernels.leaky, **GEOMETRY)
def test_leaky(qsa_canary_cell):
    qsa_canary_cell.check()


@pytest.mark.qsa_canary(kernels.masked, **GEOMETRY)
def test_masked(qsa_canary_cell):
    qsa_canary_cell.check()


@pytest.mark.qsa_canary("flashinfer:decode", **GEOMETRY)
def test_flashinfer(qsa_canary_cell):
    qsa_canary_cell.check()
'''


def test_pytest_plugin_one_test_per_cell_and_leaks_fail_naming_the_cell(pytester, tmp_path):
    pytester.makepyfile(test_kernels=PLUGIN_TEST)
    result = pytester.runpytest("-p", "qsa_lab.canary.pytest_plugin", "-rfs", "--qsa-canary-report",
                                str(tmp_path / "reports"))
    regions = ("null-block", "stale-tail", "stale-microblock", "free-pages", "other-requests", "out-of-window")
    cells = [f"{r}-{pl}-{p}" for r in regions for pl in ("k", "v") for p in ("nan", "max")]
    out = result.stdout.str()
    outcomes = result.parseoutcomes()
    leaking = ["stale-tail-v-nan", "stale-microblock-v-nan", "out-of-window-v-nan"]
    # the absent library: no cell of that marker can check anything, so each fails (never green on nothing)
    assert outcomes.get("failed") == len(leaking) + len(cells), out
    assert out.count("FAILED test_kernels.py::test_leaky[") == len(leaking)
    for c in leaking:
        assert f"FAILED test_kernels.py::test_leaky[{c}]" in out
    region = "out-of-window"
    assert (f"leaks nan from region {region} on the V plane: nan-leak" in out
            and "output(s) NaN" in out and "&& qsa-lab replay calls/" in out), out
    # the masked kernel passes wherever the cell ran, the absent library fails with its reason
    assert "flashinfer is not installed" in out and "the gate would pass on nothing" in out
    assert outcomes.get("passed", 0) >= len(cells) - len(leaking)


def test_pytest_plugin_collects_ids_per_region_plane_payload(pytester):
    pytester.makepyfile(test_kernels=PLUGIN_TEST)
    result = pytester.runpytest("-p", "qsa_lab.canary.pytest_plugin", "--collect-only", "-q", "-k", "masked")
    ids = [line for line in result.stdout.lines if "test_masked[" in line]
    assert len(ids) == 6 * 2 * 2 and any("out-of-window-v-max" in i for i in ids), result.stdout.str()


def test_pytest_plugin_refuses_a_marker_without_a_kernel(pytester):
    pytester.makepyfile(test_bad='''
import pytest

@pytest.mark.qsa_canary(attend="dense")
def test_x(qsa_canary_cell):
    qsa_canary_cell.check()
''')
    result = pytester.runpytest("-p", "qsa_lab.canary.pytest_plugin")
    assert result.ret != 0 and "qsa_canary marker: give exactly one kernel" in result.stdout.str() + result.stderr.str()


QSA_PLUGIN_TEST = '''
import pytest


@pytest.mark.qsa_canary("qsa:grouped", backend="emulate", payloads=["nan"])
def test_grouped(qsa_canary_cell):
    qsa_canary_cell.check()


@pytest.mark.qsa_canary("qsa:grouped+both_fixes", backend="emulate", payloads=["nan"])
def test_fixed(qsa_canary_cell):
    qsa_canary_cell.check()
'''


def test_pytest_plugin_on_the_qsa_routes_fails_exactly_the_grouped_leaks(pytester):
    pytester.makepyfile(test_routes=QSA_PLUGIN_TEST)
    result = pytester.runpytest("-p", "qsa_lab.canary.pytest_plugin", "-rfs")
    out = result.stdout.str()
    leaking = ("null-block", "stale-tail", "stale-microblock", "other-requests")
    # both fixes too leak other-requests: a group of 8 rows spans requests, and the fixes zero only
    # tokens that no row of the group attends (tests/canary/test_canary.py says more)
    assert result.parseoutcomes().get("failed") == len(leaking) + 1, out
    for region in leaking:
        assert f"FAILED test_routes.py::test_grouped[{region}-v-nan]" in out
        assert f"qsa:grouped leaks nan from region {region} on the V plane: nan-leak" in out
    failed = out.split("short test summary")[1].split("SKIPPED")[0]
    assert "test_fixed[other-requests-v-nan]" in failed and failed.count("test_fixed") == 1
    assert "n/a (the call's inputs reference no byte of this region)" in out      # free pages: skipped, not passed

"""benchmarks/track.py: the JSON it writes (rows against their floor, beside a base), on trivial commands
(no timing is asserted: only the shape, the interleaving's counts and the exit-code checks)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def track(monkeypatch):
    spec = importlib.util.spec_from_file_location("track", REPO / "benchmarks" / "track.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "ROWS", {"noop": ("a process that does nothing", ["-c", "pass"], ["-c", "pass"], {0}),
                                      "leaks": ("exits 1", ["-c", "raise SystemExit(1)"], ["-c", "pass"], {1})})
    monkeypatch.setattr(mod, "DEFAULT_ROWS", ["noop", "leaks"])
    return mod


def test_quick_run_writes_each_row_beside_its_floor_and_the_base(track, tmp_path):
    out = tmp_path / "t.json"
    assert track.main(["--quick", "--base", str(REPO), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == "qsa_lab.track/1" and doc["quick"] is True
    assert {"python", "torch", "cpu_count"} <= set(doc["machine"]) and len(doc["load_before"]) == 3
    assert set(doc["commits"]) == {"current", "base"} and list(doc["rows"]) == ["noop", "leaks"]
    for name, row in doc["rows"].items():
        assert row["reps"] == 2 and len(row["load_before"]) == len(row["load_after"]) == 3
        for side in ("floor", "current", "base"):
            s = row[side]
            assert len(s["runs"]) == 2 and s["min_s"] <= s["median_s"] <= s["max_s"]
        assert row["current"]["exit"] == row["base"]["exit"] == ([0] if name == "noop" else [1])
        assert row["current"]["x_floor"] == pytest.approx(row["current"]["median_s"] / row["floor"]["median_s"])
        assert row["x_base"] == pytest.approx(row["current"]["median_s"] / row["base"]["median_s"])


def test_an_unexpected_exit_code_stops_the_row_naming_it(track):
    rows = {"bad": ("exits 2", ["-c", "raise SystemExit(2)"], ["-c", "pass"], {0, 1})}
    with pytest.raises(RuntimeError, match=r"bad \(current.*exit 2, expected \[0, 1\]"):
        track.track_row("bad", 1, {"current": REPO}, track.sys.executable, None, 1, rows=rows)


@pytest.mark.parametrize("argv, message", [(["--rows", "nope"], "--rows: unknown"), (["--reps", "0"], "--reps: must be"),
                                           (["--base", "no-such-ref-xyz"], "--base: 'no-such-ref-xyz' is neither")])
def test_bad_arguments_are_one_line_naming_the_argument(track, tmp_path, argv, message):
    with pytest.raises(SystemExit, match=message):
        track.main([*argv, "--json", str(tmp_path / "t.json")])


def test_a_canary_rows_cells_give_cells_per_second(track):
    """A command whose last line counts its cells ('# ... (N cells)', as the canary's does) gets N and
    N / its median; one that prints none gets neither."""
    says = "print('# 3 leaking of 8 checks (12 cells)'); raise SystemExit(1)"
    rows = {"cells": ("prints a cell count", ["-c", says], ["-c", "pass"], {1}),
            "none": ("prints nothing", ["-c", "pass"], ["-c", "pass"], {0})}
    row = track.track_row("cells", 2, {"current": REPO}, track.sys.executable, None, 1, rows=rows)
    assert row["current"]["cells"] == 12
    assert row["current"]["cells_per_s"] == pytest.approx(12 / row["current"]["median_s"])
    quiet = track.track_row("none", 1, {"current": REPO}, track.sys.executable, None, 1, rows=rows)
    assert "cells" not in quiet["current"] and "cells_per_s" not in quiet["current"]


def test_a_second_floor_is_timed_beside_the_first(track):
    """A row with a second floor (the canary's: its FlexAttention kernels alone) gets that floor's
    runs and the command's ratio to it; a second floor that fails stops the row, naming it."""
    rows = {"two": ("two floors", ["-c", "raise SystemExit(1)"], ["-c", "pass"], {1},
                    ("the second floor", ["-c", "import time; time.sleep(0.2)"])),
            "broken": ("a failing second floor", ["-c", "pass"], ["-c", "pass"], {0},
                       ("fails", ["-c", "raise SystemExit(3)"]))}
    row = track.track_row("two", 2, {"current": REPO}, track.sys.executable, None, 1, rows=rows)
    assert row["floor_kernels"]["what"] == "the second floor" and len(row["floor_kernels"]["runs"]) == 2
    assert row["floor_kernels"]["min_s"] >= 0.2
    assert row["current"]["x_floor_kernels"] == pytest.approx(row["current"]["median_s"]
                                                               / row["floor_kernels"]["median_s"])
    with pytest.raises(RuntimeError, match=r"broken \(floor_kernels.*exit 3, expected 0"):
        track.track_row("broken", 1, {"current": REPO}, track.sys.executable, None, 1, rows=rows)


def test_the_canary_flexattention_floor_runs():
    """The canary row's second floor is a program that runs on this checkout (exit 0), not a string
    that rots: it imports what the canary's second process imports and makes its calls."""
    spec = importlib.util.spec_from_file_location("track", REPO / "benchmarks" / "track.py")
    track = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(track)
    out = subprocess.run([track.sys.executable, *track.ROWS["canary"][4][1]], cwd=REPO, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    verdicts, _, regions, _ = out.stdout.split()     # "N verdicts, R regions": 2 kernels x R x 2 planes x 3 payloads
    assert int(regions) >= 4 and int(verdicts) == 2 * int(regions) * 2 * 3, out.stdout


def test_a_scribble_row_pools_wall_and_cpu_times_and_their_ratios(track, tmp_path):
    """The scribble rows read bench_scribble.py's JSON: plain and guard generations pooled over the
    processes, the guard's ratio to plain by wall clock and by CPU time (bench_scribble's cpu_runs)."""
    tree = tmp_path / "tree"
    (tree / "benchmarks").mkdir(parents=True)
    (tree / "benchmarks" / "bench_scribble.py").write_text(
        "import json, sys\n"
        "out = sys.argv[sys.argv.index('--json') + 1]\n"
        "r = {'plain': {'runs': [0.04, 0.14, 0.14], 'cpu_runs': [0.04, 0.04, 0.05]},\n"
        "     'guard': {'runs': [0.05, 0.05, 0.05], 'cpu_runs': [0.05, 0.05, 0.06]}}\n"
        "json.dump({'threads': 1, 'results': {'eager-loop': r}}, open(out, 'w'))\n")
    rows = {"s": ("a scribble row", "scribble:transformers", None, {0})}
    row = track.track_row("s", 2, {"current": tree}, track.sys.executable, None, 3, rows=rows)
    cur = row["current"]
    assert len(cur["plain"]["runs"]) == len(cur["plain_cpu"]["runs"]) == 6
    assert cur["x_floor"] == pytest.approx(0.05 / 0.14) and cur["x_floor_cpu"] == pytest.approx(0.05 / 0.04)

"""What a user without a GPU waits for, timed as whole processes, beside a base commit.

Each row is one thing a user does on the CPU emulation: `qsa-lab --help`, a bad-input error,
`qsa-lab diff decode --poison targeted`, `diff causal3`, the default `qsa-lab canary`, `qsa-lab
repro`, the six notebooks run headless, the playground's first draw and a redraw, and the pytest
part of `make test`; repro_second and canary_second are repro and canary with their second
process started whatever the machine's load (on a busy machine the others run in one process). Every repetition runs the row as a fresh process (python -m qsa_lab ...,
wall clock by perf_counter around the process) on the code in this checkout AND on a base
commit checked out in a temporary `git worktree` (default d412ef2, main before the speed-ups),
alternating which goes first, so every figure comes with its ratio to the base measured in the
same run, under the same load. The median of each row's repetitions is reported.

    python benchmarks/bench_cpu.py                         # every row; writes results/bench_cpu.json
    python benchmarks/bench_cpu.py --evidence              # ... and writes evidence/bench_cpu.json instead
    python benchmarks/bench_cpu.py --rows help,diff_decode --reps 3
    python benchmarks/bench_cpu.py --resume                # rows already in the output file are kept

Repetitions: 5 per row, fewer for the slow rows (repro 3, notebooks 2, make_test 1); --reps N
sets every row, --reps repro=5,make_test=2 single rows; the JSON states each row's count.
The output is rewritten after every row, so an interrupted run keeps what it measured and
--resume goes on from there (a row is redone when either commit changed). The JSON records the
machine (CPU model, cores, memory), torch's thread count, both commits, and the 1/5/15-minute
load average before and after each row: wall times on a shared machine scale with its load,
so the committed figures should come from an otherwise idle machine.
Takes about 15 minutes on a quiet 2-core machine (most of it the base commit's repro,
notebooks and test suite).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_BASE = "d412ef2"
SCHEMA = "qsa_lab.bench_cpu/1"

# the playground: first draw of the report's 3-request preset (its name changed across commits,
# hence the prefix), then a redraw for a poison the cache has not seen; printed as JSON
PLAYGROUND = r"""
import contextlib, io, json, time
import matplotlib
matplotlib.use("Agg")
try:
    from qsa_lab.analysis.playground import PRESETS, Params, RunCache
except ImportError:     # a base commit before the playground's split: its data lived in qsa_lab.widgets
    from qsa_lab.widgets import PRESETS, Params, RunCache
from qsa_lab.widgets import Playground
preset = next(p for p in PRESETS if p.startswith("3-req scatter causal, 24 rows, ctx 8192"))
t = time.perf_counter()
with contextlib.redirect_stdout(io.StringIO()):
    pg = Playground(Params(preset=preset), cache=RunCache(size=16))
first = time.perf_counter() - t
t = time.perf_counter()
with contextlib.redirect_stdout(io.StringIO()):
    ok = pg.set(dims="1,2")
redraw = time.perf_counter() - t
assert ok, pg.message.value
print("QSA_BENCH=" + json.dumps({"first_draw_s": first, "redraw_s": redraw}))
"""

# the six notebooks, headless, as a user runs them (full size, emulation), in a scratch folder
NOTEBOOKS = r"""
import json, os, sys, tempfile, time
from pathlib import Path
import nbclient, nbformat
times = {}
with tempfile.TemporaryDirectory() as tmp:
    os.environ.update({"QSA_LAB_BACKEND": "emulate", "QSA_LAB_FIGURES": str(Path(tmp) / "figures"),
                       "MPLBACKEND": "module://matplotlib_inline.backend_inline"})
    for path in sorted(Path("notebooks").glob("[0-9][0-9]_*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        t = time.perf_counter()
        nbclient.NotebookClient(nb, timeout=1200, kernel_name="python3",
                                resources={"metadata": {"path": tmp}}).execute()
        times[path.stem[:2]] = time.perf_counter() - t
print("QSA_BENCH=" + json.dumps({f"notebook_{k}_s": v for k, v in times.items()}))
"""

# a command with its second process whatever the machine's load: idle_core() answers yes, so the
# row measures the second process (figures and repeats of repro, FlexAttention of the canary)
# against the same work in one process on a busy machine; on either commit
SECOND = r"""
import importlib, runpy, sys
for name in ("qsa_lab.support.processes", "qsa_lab.procs"):   # the module's name on this commit
    try:
        procs = importlib.import_module(name)
        break
    except ImportError:
        pass
procs.idle_core = lambda others=None: True
sys.argv = ["qsa-lab", *sys.argv[1:]]
runpy.run_module("qsa_lab", run_name="__main__", alter_sys=True)
"""

#: name -> (what the user runs, how it is run, default repetitions, targets {metric: seconds})
ROWS = {
    "help": ("qsa-lab --help", ["-m", "qsa_lab", "--help"], 5, {"wall_s": 0.35}),
    "bad_input": ("qsa-lab diff --rows 0 (exit 2, one line)", ["-m", "qsa_lab", "diff", "--rows", "0"], 5,
                  {"wall_s": 0.35}),
    "diff_decode": ("qsa-lab diff decode --poison targeted", ["-m", "qsa_lab", "diff", "decode", "--poison",
                                                              "targeted"], 5, {"wall_s": 1.5}),
    "diff_causal3": ("qsa-lab diff causal3", ["-m", "qsa_lab", "diff", "causal3"], 5, {}),
    "canary": ("qsa-lab canary (default: every CPU kernel)", ["-m", "qsa_lab", "canary"], 5, {"wall_s": 1.5}),
    "repro": ("qsa-lab repro --out DIR", ["-m", "qsa_lab", "repro", "--out", "{tmp}/results", "--figures",
                                          "{tmp}/figures", "--force"], 3, {"wall_s": 15.0}),
    "repro_second": ("qsa-lab repro --out DIR, its second process started whatever the load",
                     ["-c", SECOND, "repro", "--out", "{tmp}/results", "--figures", "{tmp}/figures", "--force"], 3,
                     {}),
    "canary_second": ("qsa-lab canary, its second process started whatever the load", ["-c", SECOND, "canary"], 5,
                      {}),
    "notebooks": ("all six notebooks, headless (nbclient, emulation, full size)", ["-c", NOTEBOOKS], 2,
                  {"wall_s": 20.0}),
    "playground": ("playground: first draw of the 3-request ctx 8192 preset, then a redraw (in-process times)",
                   ["-c", PLAYGROUND], 3, {"first_draw_s": 1.0, "redraw_s": 0.2}),
    "make_test": ("make test, the pytest part (the Makefile's own pytest command)", "make_test", 1,
                  {"wall_s": 90.0}),
}
# accepted exit codes: a bad input exits 2; the default canary finds the grouped route's leaks, and
# since this round a leak exits 1 (before it, 0)
EXIT_OK = {"bad_input": {2}, "canary": {0, 1}, "canary_second": {0, 1}}


def git(*args, cwd=REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def describe(tree: Path) -> str:
    sha = git("rev-parse", "HEAD", cwd=tree)
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=tree).returncode != 0
    return sha + ("+uncommitted changes" if dirty else "")


def pytest_command(tree: Path) -> list[str]:
    """The pytest line of the tree's Makefile `test` target, $(PY) -> this python."""
    text = (tree / "Makefile").read_text()
    body = re.search(r"^test:.*\n((?:\t.*\n)+)", text, re.M).group(1)
    line = next(l.strip() for l in body.splitlines() if "-m pytest" in l)
    workers = re.search(r"^TEST_WORKERS \?= *(\S+)", text, re.M)
    line = line.replace("$(TEST_WORKERS)", workers.group(1) if workers else "auto")
    return [sys.executable] + line.split()[1:]


def machine() -> dict:
    model = ""
    with contextlib.suppress(OSError):
        model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")
    mem = 0
    with contextlib.suppress(OSError, StopIteration):
        mem = int(next(l.split()[1] for l in open("/proc/meminfo") if l.startswith("MemTotal:"))) * 1024
    threads = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads(), torch.__version__)"],
                             capture_output=True, text=True).stdout.split()
    return {"platform": platform.platform(), "cpu": model or platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "memory_bytes": mem, "python": platform.python_version(),
            "torch": threads[1] if len(threads) > 1 else None,
            "torch_threads": int(threads[0]) if threads else None}


def run_once(name: str, tree: Path) -> dict:
    """One repetition of a row on one tree, as a fresh process -> {metric: seconds}."""
    _, how, _, _ = ROWS[name]
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    with tempfile.TemporaryDirectory(prefix="qsa-bench-") as tmp:
        cmd = pytest_command(tree) if how == "make_test" else [sys.executable] + [a.replace("{tmp}", tmp) for a in how]
        t = time.perf_counter()
        p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        wall = time.perf_counter() - t
    if p.returncode not in EXIT_OK.get(name, {0}):
        tail = (p.stdout + p.stderr).strip().splitlines()[-5:]
        raise RuntimeError(f"{name} on {tree}: exit {p.returncode}: " + " | ".join(tail))
    out = {"wall_s": wall}
    for line in p.stdout.splitlines():
        if line.startswith("QSA_BENCH="):
            out.update(json.loads(line[len("QSA_BENCH="):]))
    return out


def summarize(samples: list[dict]) -> dict:
    return {"samples": samples, "median": {k: statistics.median(s[k] for s in samples) for k in samples[0]}}


def bench_row(name: str, reps: int, trees: dict) -> dict:
    what, _, _, targets = ROWS[name]
    load_before = os.getloadavg()
    runs = {side: [] for side in trees}
    for i in range(reps):
        order = list(trees) if i % 2 == 0 else list(trees)[::-1]  # alternate who goes first
        for side in order:
            print(f"# {name} [{i + 1}/{reps}] {side} ...", file=sys.stderr, flush=True)
            runs[side].append(run_once(name, trees[side]))
    row = {"what": what, "reps": reps, "load_before": list(load_before), "load_after": list(os.getloadavg()),
           **{side: summarize(s) for side, s in runs.items()}}
    cur, base = row["current"]["median"], row["base"]["median"]
    row["ratio_to_base"] = {k: cur[k] / base[k] for k in cur if k in base and base[k] > 0}
    row["targets_s"] = targets
    row["met"] = {k: cur[k] <= t for k, t in targets.items() if k in cur} or None
    return row


def parse_reps(text: str | None) -> dict:
    reps = {name: row[2] for name, row in ROWS.items()}
    for part in (text or "").split(","):
        if not part:
            continue
        if "=" in part:
            k, v = part.split("=", 1)
            if k not in ROWS:
                raise SystemExit(f"--reps: unknown row {k!r}; rows: {', '.join(ROWS)}")
            reps[k] = int(v)
        else:
            reps = {k: int(part) for k in reps}
    if any(v < 1 for v in reps.values()):
        raise SystemExit("--reps: every count must be >= 1")
    return reps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", help=f"comma-separated rows to run (default all: {','.join(ROWS)})")
    ap.add_argument("--reps", help="N (every row) or row=N,... (default 5; repro 3, notebooks 2, make_test 1)")
    ap.add_argument("--base", default=DEFAULT_BASE, help=f"base commit (default {DEFAULT_BASE})")
    ap.add_argument("--base-tree", type=Path, help="an existing checkout of the base instead of a temporary worktree")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "bench_cpu.json",
                    help="output JSON (default results/bench_cpu.json)")
    ap.add_argument("--evidence", action="store_true", help="write evidence/bench_cpu.json (the committed figures)")
    ap.add_argument("--resume", action="store_true", help="keep the rows the output file has for these commits")
    ap.add_argument("--note", default="", help="free text stored in the JSON")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the temporary worktree is removed on the way out
    rows = args.rows.split(",") if args.rows else list(ROWS)
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"--rows: unknown {unknown}; rows: {', '.join(ROWS)}")
    reps = parse_reps(args.reps)
    out = REPO / "evidence" / "bench_cpu.json" if args.evidence else args.out
    base_sha = git("rev-parse", args.base)
    with contextlib.ExitStack() as stack:
        if args.base_tree:
            base_tree = args.base_tree.resolve()
        else:
            base_tree = Path(tempfile.mkdtemp(prefix="qsa-bench-base-"))
            git("worktree", "add", "--detach", "--force", str(base_tree), base_sha)
            stack.callback(lambda: (subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=REPO,
                                                   capture_output=True), shutil.rmtree(base_tree, ignore_errors=True)))
        trees = {"base": base_tree, "current": REPO}
        commits = {"current": describe(REPO), "base": describe(base_tree)}
        doc = {"schema": SCHEMA, "machine": machine(), "commits": commits, "rows": {}}
        if args.resume and out.exists():
            old = json.loads(out.read_text())
            if old.get("commits") == commits:
                doc["rows"] = old.get("rows", {})
        doc.update(started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   note=args.note, method="each repetition a fresh process on each tree, alternating which runs "
                                          "first; wall clock by perf_counter; medians over the repetitions")
        doc["torch_threads"] = doc["machine"]["torch_threads"]
        for name in rows:
            if name in doc["rows"]:
                print(f"# {name}: kept from {out}", file=sys.stderr)
                continue
            doc["rows"][name] = bench_row(name, reps[name], trees)
            r = doc["rows"][name]
            print(f"{name:13s} " + "  ".join(f"{k} {r['current']['median'][k]:.3f} s (base {r['base']['median'][k]:.3f}, "
                                             f"x{r['ratio_to_base'][k]:.2f})" for k in r["ratio_to_base"]
                                             if k in r["targets_s"] or k == "wall_s")
                  + f"  load {r['load_before'][0]:.2f}->{r['load_after'][0]:.2f}", flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            doc["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"# wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

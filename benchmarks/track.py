"""Every slow command of issue 47 against its floor, so the next change that slows one is seen.

Rows (`--rows`, default all but `canary_search`):
  canary         qsa-lab canary (the CPU emulation)                      floor: python -c "import torch";
                 also its FlexAttention floor: what its second process must do, alone in one process
                 (import torch and torch._dynamo, then the 140 FlexAttention calls: runner.run_overlap)
  own_kernel     the own-kernel command of docs/canary.md (Llama-8B geometry)   floor: import torch
  cross_request  qsa-lab cross-request (defaults)                        floor: import torch
  canary_search  qsa-lab canary --search on paged_decode_fixed, --budget 5        floor: import torch
  canary_gpu     qsa-lab canary --backend cuda (needs a CUDA GPU; also cells per second)   floor: import torch
  scribble_transformers, scribble_vllm   a generation with the scribble's write guard, floor: the same
                 generation without it (benchmarks/bench_scribble.py's own measurement, one process a
                 repetition, its plain and guard generations pooled; vLLM in its environment, --vllm-python);
                 by wall clock and by CPU time (x_floor_cpu: at its end a transformers generation may wait
                 up to 0.1 s for its idle loop to stop, in either mode, which a 0.04 s generation's wall
                 clock shows)
Method: each repetition runs every side once as a fresh process, interleaved and in an order that rotates
from one repetition to the next: the floor, the command on this checkout and, with --base, the same
command on a base checkout (its PYTHONPATH); wall clock by perf_counter around the process. A floor ends
with os._exit, as the commands do (qsa_lab.app.cli._leave): the interpreter's teardown (0.3 s after
import torch, 0.7 s with torch._dynamo) is no work a command must do. Per side
median, min and max; x_floor = median / the floor's median; x_base = median / the base's median. A
command's exit code must be the one it is expected to give (the verdicts: canary and own kernel leak,
exit 1) and the same on both sides. The JSON (schema qsa_lab.track/1) records the machine
(qsa_lab.support.machine.machine_facts, CPU model, cores), both commits and the load average before and
after every row; on a shared machine the times scale with its load, ratios measured in one run do less.

    python benchmarks/track.py                                  # results/track.json
    python benchmarks/track.py --quick                          # 2 repetitions, scribble 2 generations
    python benchmarks/track.py --base a9ebb86 --rows canary     # beside a commit (temporary git worktree)
    python benchmarks/track.py --base ../other-checkout --json evidence/track_cpu.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
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
SCHEMA = "qsa_lab.track/1"
TORCH = ["-c", "import os, torch; os._exit(0)"]
#: the canary's FlexAttention floor: its second process's imports and calls (canary/overlap.py), alone
FLEX = ["-c", "import os, torch, torch._dynamo\n"
        "from qsa_lab.canary.case import canary_case\n"
        "from qsa_lab.canary.runner import DEFAULT_PAYLOADS, run_overlap\n"
        "from qsa_lab.model.regions import region_parts, regions_of\n"
        "case = canary_case('fp16', attend='sparse')\n"
        "parts = {r: region_parts(case, r) for r in regions_of(case.spec)}\n"
        "regions = [r for r, ps in parts.items() if any(s.any() for s, _ in ps)]\n"
        "got = run_overlap(['torch:flex', 'torch:flex-paged'], case, parts, regions, ['k', 'v'], list(DEFAULT_PAYLOADS),"
        " None)\n"
        "print(sum(len(v[0]) for v in got.values()), 'verdicts,', len(regions), 'regions', flush=True)\n"
        "os._exit(0)"]
OWN_KERNEL = ["canary", "--kernel", "examples/mykernels.py:paged_decode", "--attend", "dense", "--q-heads", "32",
              "--kv-heads", "8", "--head-dim", "128", "--page-size", "16", "--context", "1000", "--requests", "4"]
#: name -> (what it is, argv after python, the floor's argv, expected exit codes[, (what a second floor is,
#: its argv)]); "scribble:ENGINE" rows run bench_scribble.py instead
ROWS = {
    "canary": ("qsa-lab canary (default, CPU emulation)", ["-m", "qsa_lab", "canary"], TORCH, {1},
               ("its FlexAttention kernels alone: import torch and torch._dynamo, then the calls its second "
                "process makes (runner.run_overlap)", FLEX)),
    "own_kernel": ("qsa-lab " + " ".join(OWN_KERNEL) + " (docs/canary.md)", ["-m", "qsa_lab", *OWN_KERNEL],
                   TORCH, {1}),
    "cross_request": ("qsa-lab cross-request (defaults)", ["-m", "qsa_lab", "cross-request"], TORCH, {0, 1}),
    "canary_search": ("qsa-lab canary --search --kernel examples/mykernels.py:paged_decode_fixed --attend dense "
                      "--budget 5", ["-m", "qsa_lab", "canary", "--search", "--kernel",
                                     "examples/mykernels.py:paged_decode_fixed", "--attend", "dense", "--budget", "5"],
                      TORCH, {0}),
    "canary_gpu": ("qsa-lab canary --backend cuda (default matrix, compiled kernels)",
                   ["-m", "qsa_lab", "canary", "--backend", "cuda"], TORCH, {1}),
    "scribble_transformers": ("a generation with the write guard, beside the same without it (transformers, "
                              "benchmarks/bench_scribble.py)", "scribble:transformers", None, {0}),
    "scribble_vllm": ("a generation with the write guard, beside the same without it (vLLM CPU, "
                      "benchmarks/bench_scribble.py)", "scribble:vllm", None, {0}),
}
DEFAULT_ROWS = [r for r in ROWS if r not in ("canary_search", "canary_gpu")]


def git(*args, cwd=REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def describe(tree: Path) -> str:
    try:
        sha = git("rev-parse", "HEAD", cwd=tree)
    except (subprocess.CalledProcessError, FileNotFoundError):
        return f"{tree} (not a git checkout)"
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=tree).returncode != 0
    return sha + ("+uncommitted changes" if dirty else "")


def host() -> dict:
    """machine_facts plus what it leaves out on Linux: the CPU model, cores, memory."""
    from qsa_lab.support.machine import machine_facts
    facts = machine_facts("transformers")
    with contextlib.suppress(OSError, StopIteration):
        facts["cpu_model"] = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    with contextlib.suppress(OSError, StopIteration):
        facts["memory_bytes"] = int(next(l.split()[1] for l in open("/proc/meminfo") if l.startswith("MemTotal:"))) * 1024
    facts["cpu_count"] = os.cpu_count()
    return facts


def stats(times: list[float]) -> dict:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "runs": times}


def run_process(python: str, argv: list[str], tree: Path) -> tuple[float, int, str]:
    """One fresh process in `tree` (its qsa_lab first on the path) -> (seconds, exit code, output's tail)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    start = time.perf_counter()
    p = subprocess.run([python, *argv], cwd=tree, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    return wall, p.returncode, " | ".join((p.stdout + p.stderr).strip().splitlines()[-3:])


def scribble_once(python: str, engine: str, tree: Path, generations: int) -> dict:
    """One process of the tree's benchmarks/bench_scribble.py -> its plain and guard generation times."""
    with tempfile.TemporaryDirectory(prefix="qsa-track-") as tmp:
        out = Path(tmp) / "s.json"
        wall, code, tail = run_process(python, [str(tree / "benchmarks" / "bench_scribble.py"), "--engine", engine,
                                                "--device", "cpu", "--repeats", str(generations), "--json", str(out)],
                                       tree)
        if code != 0 or not out.exists():
            raise RuntimeError(f"bench_scribble --engine {engine} in {tree}: exit {code}: {tail}")
        doc = json.loads(out.read_text())
    result = next(iter(doc["results"].values()))
    return {"process_s": wall, "plain": result["plain"]["runs"], "guard": result["guard"]["runs"],
            "plain_cpu": result["plain"].get("cpu_runs", []), "guard_cpu": result["guard"].get("cpu_runs", []),
            "threads": doc.get("threads")}


def track_row(name: str, reps: int, trees: dict, python: str, vllm_python: str | None, generations: int,
              rows: dict | None = None) -> dict:
    """One row: `reps` interleaved repetitions of the floor and each tree's command."""
    what, how, floor, exits, *second = (rows or ROWS)[name]
    second = second[0] if second else None
    load_before = os.getloadavg()
    row = {"what": what, "reps": reps, "load_before": list(load_before)}
    if isinstance(how, str):                                           # scribble:ENGINE
        engine = how.split(":", 1)[1]
        py = vllm_python if engine == "vllm" else python
        if not py:
            return {**row, "skipped": "no vLLM environment (--vllm-python, or .venv-vllm in the checkout)"}
        runs = {side: [] for side in trees}
        for i in range(reps):
            for side in list(trees)[i % len(trees):] + list(trees)[:i % len(trees)]:
                print(f"# {name} [{i + 1}/{reps}] {side}", file=sys.stderr, flush=True)
                runs[side].append(scribble_once(py, engine, trees[side], generations))
        for side, got in runs.items():
            plain = [t for r in got for t in r["plain"]]
            guard = [t for r in got for t in r["guard"]]
            row[side] = {"guard": stats(guard), "plain": stats(plain), "process": stats([r["process_s"] for r in got]),
                         "threads": got[0]["threads"], "x_floor": statistics.median(guard) / statistics.median(plain)}
            plain_cpu = [t for r in got for t in r["plain_cpu"]]
            guard_cpu = [t for r in got for t in r["guard_cpu"]]
            if plain_cpu and guard_cpu:     # CPU time: no engine's idle waits (bench_scribble's method)
                row[side].update(guard_cpu=stats(guard_cpu), plain_cpu=stats(plain_cpu),
                                 x_floor_cpu=statistics.median(guard_cpu) / statistics.median(plain_cpu))
        row["command"] = f"{py} benchmarks/bench_scribble.py --engine {engine} --device cpu --repeats {generations}"
        row["floor"] = "the same generation without the guard (bench_scribble's plain mode, same process)"
    else:
        sides = {"floor": (floor, trees["current"]), **({"floor_kernels": (second[1], trees["current"])} if second
                                                         else {}), **{s: (how, t) for s, t in trees.items()}}
        floors = [s for s in sides if s.startswith("floor")]
        times, codes = {s: [] for s in sides}, {s: set() for s in sides if s not in floors}
        cells = {}          # a canary's cell count, from its last line "# ... (N cells)"
        order = list(sides)
        for i in range(reps):
            for side in order[i % len(order):] + order[:i % len(order)]:      # rotate who goes first
                print(f"# {name} [{i + 1}/{reps}] {side}", file=sys.stderr, flush=True)
                argv, tree = sides[side]
                wall, code, tail = run_process(python, argv, tree)
                if side in floors and code != 0 or side not in floors and code not in exits:
                    raise RuntimeError(f"{name} ({side}, {tree}): exit {code}, expected "
                                       f"{0 if side in floors else sorted(exits)}: {tail}")
                times[side].append(wall)
                if side not in floors:
                    codes[side].add(code)
                    if found := re.search(r"\((\d+) cells\)", tail):
                        cells[side] = int(found.group(1))
        if len({frozenset(c) for c in codes.values()}) > 1:
            raise RuntimeError(f"{name}: the exit codes differ between the checkouts: {codes}")
        row["command"] = "python " + " ".join(how)
        row["floor_command"] = "python " + " ".join(floor)
        row["floor"] = stats(times.pop("floor"))
        if second:
            row["floor_kernels"] = {"what": second[0], "command": "python " + " ".join(second[1]),
                                    **stats(times.pop("floor_kernels"))}
        for side, t in times.items():
            row[side] = {**stats(t), "exit": sorted(codes[side]),
                         "x_floor": statistics.median(t) / row["floor"]["median_s"]}
            if second:
                row[side]["x_floor_kernels"] = statistics.median(t) / row["floor_kernels"]["median_s"]
            if side in cells:
                row[side].update(cells=cells[side], cells_per_s=cells[side] / statistics.median(t))
    if "base" in trees:
        key = "guard" if isinstance(how, str) else None
        cur, base = (row["current"][key], row["base"][key]) if key else (row["current"], row["base"])
        row["x_base"] = cur["median_s"] / base["median_s"]
    row["load_after"] = list(os.getloadavg())
    return row


@contextlib.contextmanager
def base_tree(ref: str | None):
    """--base: a folder is used as it is; anything else is a commit checked out in a temporary worktree."""
    if not ref:
        yield None
    elif Path(ref).is_dir():
        yield Path(ref).resolve()
    else:
        try:
            sha = git("rev-parse", "--verify", ref + "^{commit}")
        except subprocess.CalledProcessError:
            raise SystemExit(f"--base: {ref!r} is neither a folder nor a commit of {REPO}") from None
        tmp = Path(tempfile.mkdtemp(prefix="qsa-track-base-"))
        git("worktree", "add", "--detach", "--force", str(tmp), sha)
        try:
            yield tmp
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tmp)], cwd=REPO, capture_output=True)
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", help=f"comma-separated rows (default {','.join(DEFAULT_ROWS)}; all: {','.join(ROWS)})")
    ap.add_argument("--reps", type=int, help="repetitions of each row (default 5, 3 for own_kernel; --quick 2)")
    ap.add_argument("--generations", type=int, help="generations per mode in each bench_scribble process "
                                                    "(default 5; --quick 2)")
    ap.add_argument("--quick", action="store_true", help="2 repetitions, 2 generations: a fast, rougher run")
    ap.add_argument("--base", "--vs", dest="base", metavar="COMMIT_OR_DIR",
                    help="also time a base: a commit (checked out in a temporary worktree) or a checkout's folder")
    ap.add_argument("--vllm-python", help="the Python of vLLM's environment (default .venv-vllm/bin/python of this "
                                          "checkout; without one the vLLM row is skipped)")
    ap.add_argument("--json", type=Path, default=REPO / "results" / "track.json", help="output (default results/track.json)")
    ap.add_argument("--note", default="", help="free text stored in the JSON")
    args = ap.parse_args(argv)
    rows = args.rows.split(",") if args.rows else [r for r in DEFAULT_ROWS if r in ROWS]
    if unknown := [r for r in rows if r not in ROWS]:
        raise SystemExit(f"--rows: unknown {unknown}; rows: {', '.join(ROWS)}")
    for flag in ("reps", "generations"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise SystemExit(f"--{flag}: must be >= 1, got {getattr(args, flag)}")
    vllm_python = args.vllm_python or (str(REPO / ".venv-vllm/bin/python")
                                       if (REPO / ".venv-vllm/bin/python").exists() else None)
    generations = args.generations or (2 if args.quick else 5)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))           # a temporary worktree is removed too
    with base_tree(args.base) as base:
        trees = {"current": REPO, **({"base": base} if base else {})}
        doc = {"schema": SCHEMA, "method": __doc__.split("\n\n")[1].split("Method: ", 1)[1].replace("\n", " "),
               "machine": host(), "commits": {s: describe(t) for s, t in trees.items()}, "quick": args.quick,
               "generations": generations, "note": args.note, "load_before": list(os.getloadavg()), "rows": {}}
        for name in rows:
            reps = args.reps or (2 if args.quick else 3 if name == "own_kernel" else 5)
            row = doc["rows"][name] = track_row(name, reps, trees, sys.executable, vllm_python, generations)
            if "skipped" in row:
                print(f"{name:22s} skipped: {row['skipped']}", flush=True)
            else:
                cur = row["current"]["guard"] if "guard" in row["current"] else row["current"]
                print(f"{name:22s} {cur['median_s']:8.3f} s  x{row['current']['x_floor']:.2f} its floor"
                      + (f" (x{row['current']['x_floor_kernels']:.2f} its kernels' floor)"
                         if "x_floor_kernels" in row["current"] else "")
                      + (f" (CPU time x{row['current']['x_floor_cpu']:.2f})" if "x_floor_cpu" in row["current"] else "")
                      + (f"  x{row['x_base']:.2f} the base" if "x_base" in row else "")
                      + (f"  {cur['cells_per_s']:.1f} cells/s" if "cells_per_s" in cur else "")
                      + (f" (base {row['base']['cells_per_s']:.1f})" if "cells_per_s" in row.get("base", {}) else "")
                      + f"  (load {row['load_before'][0]:.1f} -> {row['load_after'][0]:.1f})", flush=True)
            doc["load_after"] = list(os.getloadavg())
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(doc, indent=1) + "\n")       # rewritten after every row
    print(f"# wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

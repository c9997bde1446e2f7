"""How long `qsa-lab canary --search` takes to find each known leak from a blank start, how small
the shrunk case is beside the grid's case, and whether correct kernels search clean.

    python benchmarks/canary_search.py --out evidence/canary_search_cpu.json          # the CPU half
    python benchmarks/canary_search.py --out canary_search_h200.json --backend cuda   # on a GPU: FlashInfer too

Each search is its own process (`python -m qsa_lab canary --search ... --json FILE`): its time
includes starting Python and importing torch. A leak target records the case where its cell first
leaked and the seconds to it (the search keeps drawing until its budget ends; the time to the
finding is read from the case's timestamp), the whole run's wall time, and the shrunk case's rows,
requests, query heads, tokens and pages beside the grid's (the default canary case). A clean target
records its cases and exit code (0 wanted). A target whose library does not import here, or that
needs a GPU, is recorded "not run" with the reason. The machine, the load average before and after
each run and the commit are recorded with the results (schema qsa_lab.bench-canary-search/1).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's qsa_lab, as the other benchmarks

REPO = Path(__file__).resolve().parents[1]
#: (name, kernel, extra options, cells that count as the leak (region, plane or None), library, GPU)
LEAKS = [
    ("grouped: null block", "qsa:grouped", [], [("null-block", None)], None, False),
    ("grouped+kernel_fix: across requests", "qsa:grouped+kernel_fix", [], [("other-requests", None)], None, False),
    ("FlashInfer FA2 prefill, custom mask", "flashinfer:prefill-fa2", [], [("unselected", None), ("out-of-window", None)],
     "flashinfer", True),
    ("FlashInfer CUDA-core decode, window", "flashinfer:decode", [], [("out-of-window", None)], "flashinfer", True),
    ("FlashInfer FA3 prefill, window", "flashinfer:prefill", ["--kv-dtype", "fp16"], [("out-of-window", None)],
     "flashinfer", True),
]
#: correct kernels (for what they claim): a search must find nothing
CLEAN = [
    ("xqa", "qsa:xqa", []),
    ("grouped+request_groups", "qsa:grouped+request_groups", []),
    ("grouped+finite_pv", "qsa:grouped+finite_pv", []),
    ("torch sdpa-math, dense", "torch:sdpa-math", ["--attend", "dense"]),
]


def loadavg() -> list:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def machine() -> dict:
    import torch

    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "cpu": cpu, "cuda": torch.cuda.is_available(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "commit": commit}


def why_not(library: str | None, gpu: bool) -> str | None:
    if library and importlib.util.find_spec(library) is None:
        return f"{library} does not import here (not installed)"
    if gpu:
        import torch

        if not torch.cuda.is_available():
            return "needs a CUDA GPU; none here"
    return None


def size(p: dict) -> dict:
    """rows, requests, query heads, tokens, pages of a case (a search's params dict)."""
    rows, req = sum(p["request_rows"]), len(p["request_rows"])
    tokens = [p["context"] - r for r in range(req)]
    return {"rows": rows, "requests": req, "q_heads": p["q_heads"], "kv_heads": p["kv_heads"],
            "head_dim": p["head_dim"], "tokens": sum(tokens), "pages": sum(-(-t // p["page_size"]) for t in tokens),
            "attend": p["attend"]}


def grid_size() -> dict:
    """The same numbers for the grid's case: the default canary case."""
    from qsa_lab.canary.case import canary_case

    c = canary_case()
    seq = c.seq_lens.tolist()
    return {"rows": c.rows, "requests": c.requests, "q_heads": c.q_heads, "kv_heads": c.kv_heads,
            "head_dim": c.head_dim, "tokens": sum(seq), "pages": sum(-(-s // c.page_size) for s in seq),
            "attend": str(c.spec)}


def run_search(kernel: str, extra: list, budget: str, seed: int, backend: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "search.json"
        cmd = [sys.executable, "-m", "qsa_lab", "canary", "--search", "--kernels", kernel, *extra, "--budget", budget,
               "--seed", str(seed), "--backend", backend, "--json", str(out)]
        before, t0 = loadavg(), time.perf_counter()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)   # this checkout's qsa_lab there too
        wall = time.perf_counter() - t0
        doc = json.loads(out.read_text()) if out.is_file() else None
    return {"command": " ".join(["qsa-lab", *cmd[3:-2]]), "exit_code": done.returncode, "wall_s": round(wall, 2),
            "loadavg_before": before, "loadavg_after": loadavg(), "doc": doc,
            "stderr_tail": done.stderr.strip().splitlines()[-3:]}


def leak_row(name, kernel, extra, cells, library, gpu, args, grid) -> dict:
    row = {"target": name, "kernel": kernel, "kind": "leak"}
    why = why_not(library, gpu)
    if why:
        return {**row, "status": "not run", "why": why}
    r = run_search(kernel, extra, args.leak_budget, args.seed, args.backend)
    doc = r.pop("doc")
    row.update(r)
    if doc is None:
        return {**row, "status": "failed", "why": "no JSON came back"}
    s = doc["searches"][0]
    hit = [f for f in s["findings"] if any(c[0] == want and (pl is None or c[1] == pl)
                                           for c in f["cells"] for want, pl in cells)]
    row.update(cases=len(s["cases"]), search_s=s["seconds"], shrink_s=s["shrink_seconds"])
    if not hit:
        return {**row, "status": "not found"}
    f = min(hit, key=lambda f: f["found_at_case"])
    return {**row, "status": "found", "cells": f["cells"], "found_at_case": f["found_at_case"],
            "found_at_s": f["found_at_s"], "reproduced": f["reproduced"], "shrink_runs": f["shrink_runs"],
            "found_case": size(f["found"]), "shrunk_case": size(f["shrunk"]), "grid_case": grid}


def clean_row(name, kernel, extra, args) -> dict:
    r = run_search(kernel, extra, args.clean_budget, args.seed, args.backend)
    doc = r.pop("doc")
    row = {"target": name, "kernel": kernel, "kind": "clean", **r}
    if doc is None:
        return {**row, "status": "failed", "why": "no JSON came back"}
    s = doc["searches"][0]
    row.update(cases=len(s["cases"]), search_s=s["seconds"],
               findings=[{"cells": f["cells"], "shrunk_case": size(f["shrunk"])} for f in s["findings"]],
               failed_cases=sum(c["outcome"] == "failed" for c in s["cases"]))
    row["status"] = "clean" if r["exit_code"] == 0 else "leak" if r["exit_code"] == 1 else "failed"
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the JSON to write")
    ap.add_argument("--leak-budget", default="120s", help="--budget of each leak search (default 120s)")
    ap.add_argument("--clean-budget", default="60s", help="--budget of each clean search (default 60s)")
    ap.add_argument("--seed", type=int, default=0, help="the searches' seed (default 0)")
    ap.add_argument("--backend", default="auto", help="the canary's --backend (default auto)")
    ap.add_argument("--only", action="append", help="run only targets whose name holds this text (repeatable)")
    args = ap.parse_args(argv)

    def wanted(name):
        return not args.only or any(o in name for o in args.only)

    grid = grid_size()
    rows = []
    for t in LEAKS:
        if wanted(t[0]):
            rows.append(leak_row(*t, args, grid))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "grid_case"}), flush=True)
    rows.append({"target": "FlashAttention 3 (flash-attn), window", "kind": "leak", "status": "not run",
                 "why": "qsa_lab has no adapter for the flash-attn package's own kernels; FlashInfer's FA3 "
                        "backend is the 'FlashInfer FA3 prefill, window' row"})
    for t in CLEAN:
        if wanted(t[0]):
            rows.append(clean_row(*t, args))
            print(json.dumps(rows[-1]), flush=True)
    doc = {"schema": "qsa_lab.bench-canary-search/1", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": machine(), "seed": args.seed, "leak_budget": args.leak_budget,
           "clean_budget": args.clean_budget, "backend": args.backend, "targets": rows}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

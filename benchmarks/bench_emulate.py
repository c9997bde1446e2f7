"""How long the default `qsa-lab diff` case takes on the PyTorch emulation (CPU).

Method: one warm-up, then N timed repetitions of build -> poison -> all 7 routes, wall clock
(time.perf_counter; CPU work is synchronous), median reported. Writes JSON with the machine.
Usage: python benchmarks/bench_emulate.py [--reps 5] [--json evidence/bench_emulate_cpu.json]
"""
import argparse
import json
import os
import platform
import statistics
import time

import torch

from qsa_lab import __version__
from qsa_lab.model.case import Geometry, build_case
from qsa_lab.model.poison import apply_poison
from qsa_lab.routes.run import run_routes


def stage_times(geometry: Geometry) -> dict:
    t0 = time.perf_counter()
    case = build_case(geometry)
    t1 = time.perf_counter()
    case = apply_poison(case, "targeted")
    t2 = time.perf_counter()
    run_routes(case, backend="emulate")
    t3 = time.perf_counter()
    return {"build": t1 - t0, "poison": t2 - t1, "routes": t3 - t2, "total": t3 - t0}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    g = Geometry()
    stage_times(g)  # warm-up: imports, allocator, MKL threads
    runs = [stage_times(g) for _ in range(args.reps)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    doc = {"schema": "qsa_lab.bench_emulate/1", "qsa_lab": __version__, "torch": torch.__version__,
           "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
           "torch_threads": torch.get_num_threads(), "geometry": g.to_dict(), "reps": args.reps,
           "method": "perf_counter, 1 warm-up, median of reps", "median_s": med}
    print(json.dumps(doc, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()

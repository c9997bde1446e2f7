"""Benchmark the grouped page4 kernel, its fixes, XQA and a PyTorch baseline on this GPU.

    python benchmarks/bench.py --json data/bench_h200.json     (same as `qsa-lab bench --json ...`)

The method (CUDA events, warm-up, medians, rotated inputs, L2 flush) is in
qsa_lab/routes/bench.py's docstring and in the JSON's "method" field.
"""
import argparse

from qsa_lab.routes.bench import run_bench

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--quick", action="store_true", help="report geometry + a 2-point sweep")
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    run_bench(a.json, quick=a.quick, reps=a.reps)

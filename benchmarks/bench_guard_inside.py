"""Time inside the scribble's write guard per generation: the Scribbler's hooks and its comparisons around
the engine's calls between steps, and for vLLM the StepView the adapter builds only for hooks; beside it
the plain and the guarded generation, interleaved (tiny Llama, chunked-prefill). One JSON line.

    python benchmarks/bench_guard_inside.py TREE ENGINE N      # TREE: the checkout whose qsa_lab is timed
    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/bench_guard_inside.py . vllm 15
    python benchmarks/bench_guard_inside.py TREE ENGINE N REGION   # the guard and REGION filled with NaN

On a loaded machine the time inside the guard is steadier than a wall-clock ratio of whole generations
(evidence/bench_scribble_guard_paired_cpu.json).
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time


def main() -> int:
    tree, engine_name, n = os.path.abspath(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    region = sys.argv[4] if len(sys.argv) > 4 else None
    sys.path.insert(0, tree)
    from qsa_lab.scribble.guard import Scribbler
    inside = [0.0]

    def timed(f):
        def g(*a, **k):
            start = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                inside[0] += time.perf_counter() - start
        return g

    class Timed(Scribbler):
        before_step = timed(Scribbler.before_step)
        after_step = timed(Scribbler.after_step)

        @contextlib.contextmanager
        def engine_call(self, name, pool, moves):
            start = time.perf_counter()
            cm = Scribbler.engine_call(self, name, pool, moves)
            cm.__enter__()
            inside[0] += time.perf_counter() - start
            try:
                yield
            finally:
                start = time.perf_counter()
                cm.__exit__(None, None, None)
                inside[0] += time.perf_counter() - start

    if engine_name == "vllm":
        from qsa_lab.scribble import VllmEngine, vllm_model, vllm_workload
        from qsa_lab.scribble.engines.vllm import pool
        pool.PoolMap.view = timed(pool.PoolMap.view)
        pool.PoolMap.warmup_view = timed(pool.PoolMap.warmup_view)
        engine = VllmEngine(vllm_model("llama-gqa"), vllm_workload("chunked-prefill"), remove_model_dir=True)
    else:
        from qsa_lab.scribble import TransformersEngine
        from qsa_lab.scribble.models import tiny_model, workload
        engine = TransformersEngine(tiny_model("llama-gqa", device="cpu"), workload("chunked-prefill"))
    engine.generate()
    engine.generate(Timed(region, region and "nan"))
    plain, guard, hooks = [], [], []
    for _ in range(n):
        start = time.perf_counter()
        engine.generate()
        plain.append(time.perf_counter() - start)
        inside[0] = 0.0
        start = time.perf_counter()
        engine.generate(Timed(region, region and "nan"))
        guard.append(time.perf_counter() - start)
        hooks.append(inside[0])

    def ms(v):
        return round(v * 1e3, 2)
    print(json.dumps({"tree": os.path.basename(tree), "engine": engine_name, "n": n, "region": region,
                      "plain_ms": ms(statistics.median(plain)), "guard_ms": ms(statistics.median(guard)),
                      "inside_guard_ms": ms(statistics.median(hooks)), "plain_min_ms": ms(min(plain)),
                      "inside_min_ms": ms(min(hooks)), "est_x_min": round(1 + min(hooks) / min(plain), 3),
                      "est_x_median": round(1 + statistics.median(hooks) / statistics.median(plain), 3),
                      "loadavg": open("/proc/loadavg").read().split()[:3]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

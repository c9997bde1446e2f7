"""Playground redraw time on the emulation (issue 4, acceptance 4: <= 0.5 s for the default geometry).

Method: build the default Playground (first draw warms torch and fills the case cache),
then time `redraw()` end to end (read controls -> data -> render -> PNG -> Output) after
each of a fixed sequence of control changes, each repeated; report the median and max
per kind of change. Changes that need new poison re-run every toggled route; a fix
toggle re-runs one route at most; cached ones only redraw. Writes JSON with --json.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import platform
import statistics
import sys
import time

import matplotlib

matplotlib.use("Agg")

CHANGES = [
    ("dims (new poison, all routes)", [{"dims": "102,152"}, {"dims": "102,152,168,170,230"}]),
    ("fix toggle", [{"kernel_fix": False}, {"kernel_fix": True}]),
    ("site (new poison)", [{"site": "random"}, {"site": "targeted"}]),
    ("seed (new random poison)", [{"site": "random", "seed": 1}, {"seed": 2}, {"seed": 3}]),
    ("plane", [{"plane": "k"}, {"plane": "v"}]),
    ("nan_map route", [{"nan_map": "grouped+pad_fix"}, {"nan_map": "grouped"}]),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--limit", type=float, default=0.5)
    args = ap.parse_args(argv)

    from qsa_lab.widgets import Playground, RunCache

    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        pg = Playground(cache=RunCache(size=64))
    first = time.perf_counter() - t0
    results = {}
    for label, steps in CHANGES:
        times = []
        for rep in range(args.repeat):
            for step in steps:
                if rep:  # later repeats see a fresh poison: clear outputs so nothing is free
                    pg.cache.results.clear()
                    pg.cache.poisoned.clear()
                t = time.perf_counter()
                with contextlib.redirect_stdout(io.StringIO()):  # outside a kernel, Output echoes reprs
                    pg.set(**step)
                times.append(time.perf_counter() - t)
        results[label] = {"median_s": statistics.median(times), "max_s": max(times), "n": len(times)}
    all_t = [r["median_s"] for r in results.values()]
    doc = {"benchmark": "playground redraw", "backend": pg.last_data["backend"], "preset": pg.params.preset,
           "machine": platform.processor() or platform.machine(), "python": sys.version.split()[0],
           "first_draw_s": first, "changes": results, "worst_median_s": max(all_t), "limit_s": args.limit}
    for label, r in results.items():
        print(f"{label:32s} median {r['median_s'] * 1000:6.0f} ms   max {r['max_s'] * 1000:6.0f} ms   (n={r['n']})")
    print(f"first draw (cold: imports, case build) {first:.2f} s; worst median {max(all_t) * 1000:.0f} ms "
          f"(limit {args.limit * 1000:.0f} ms) on {doc['backend']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return 0 if max(all_t) <= args.limit else 1


if __name__ == "__main__":
    sys.exit(main())

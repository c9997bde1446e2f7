"""What the scribble costs: a clean generation vs the same generation with one region scribbled.

Method: the tiny model and workload of `qsa-lab scribble` (default llama-gqa, chunked-prefill); one untimed
warm-up generation per mode, then `--repeats` rounds of one generation per mode in turn, wall clock
(time.perf_counter, the device synchronised by transformers' synchronous batching before a generation
returns) and this process's CPU time (time.process_time, every thread); medians. On the CPU read the CPU
time for transformers: once idle, its generation loop waits in steps of 0.1 s, and generate_batch's stop
waits for the step under way, so a 0.04 s generation takes 0.04 or 0.14 s of wall clock, by chance, in
either mode.
Modes: `plain` (no hooks), `guard` (write guard only: every pool row compared around every step),
`scribble` (guard + one region filled before every step: read-trash, nan). A full matrix costs
about (2 + regions x payloads + requests x payloads for other-requests) x the scribble time, plus two
re-runs for each leak it confirms; `--matrix` also times one whole matrix (every region x payload),
once.

    python benchmarks/bench_scribble.py --json results/bench_scribble.json
    python benchmarks/bench_scribble.py --device cuda --cuda-graph --json ...   # on a GPU
    .venv-vllm/bin/python benchmarks/bench_scribble.py --engine vllm --matrix --json ...   # vLLM (CPU)
"""
from __future__ import annotations

import argparse
import os
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def time_modes(engine, repeats: int) -> dict:
    from qsa_lab.scribble.guard import Scribbler
    modes = {"plain": lambda: None, "guard": lambda: Scribbler(), "scribble": lambda: Scribbler("read-trash", "nan")}
    for hooks in modes.values():
        engine.generate(hooks())                      # warm-up: allocator, graphs, first-call costs
    times, cpu, steps = {name: [] for name in modes}, {name: [] for name in modes}, {}
    for _ in range(repeats):                          # the modes in turn: a change of load hits all of them
        for name, hooks in modes.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            gen = engine.generate(hooks())
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
            if gen.error:
                raise RuntimeError(f"{name}: {gen.error}")
            steps[name] = len(gen.steps)
    out = {name: {"median_s": statistics.median(t), "min_s": min(t), "runs": t, "steps": steps[name],
                  "cpu_median_s": statistics.median(cpu[name]), "cpu_runs": cpu[name]}
           for name, t in times.items()}
    for name in ("guard", "scribble"):
        out[name]["x_plain"] = out[name]["median_s"] / out["plain"]["median_s"]
        out[name]["x_plain_cpu"] = out[name]["cpu_median_s"] / out["plain"]["cpu_median_s"]
    return out


LOAD_START = os.getloadavg()[0]   # CPU times swing with load: the JSON records it


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-gqa")
    p.add_argument("--workload", default="chunked-prefill")
    p.add_argument("--attn", default="paged|eager")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--cuda-graph", action="store_true", help="also time with CUDA graphs (CUDA only)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--engine", default="transformers", choices=("transformers", "vllm"))
    p.add_argument("--matrix", action="store_true", help="also time one whole matrix")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    if args.engine == "vllm":
        from qsa_lab.scribble.engines.vllm.env import VLLM as gate
    else:
        from qsa_lab.scribble.versions import TRANSFORMERS as gate
    if gate.refusal():
        print(f"bench_scribble: {gate.refusal()}", file=sys.stderr)
        return 3
    import torch

    from qsa_lab.scribble import TransformersEngine
    from qsa_lab.support.machine import machine_facts
    from qsa_lab.scribble.models import tiny_model, workload
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    configs = [("eager-loop", False)] + ([("cuda-graph", True)] if args.cuda_graph and device == "cuda" else [])
    if args.engine == "vllm":
        configs = [("vllm", False)]
    results = {}
    for label, graphs in configs:
        if args.engine == "vllm":
            from qsa_lab.scribble import VllmEngine, vllm_model, vllm_workload
            wl = vllm_workload(args.workload)
            engine = VllmEngine(vllm_model(args.model), wl, remove_model_dir=True)
        else:
            wl = workload(args.workload)
            engine = TransformersEngine(tiny_model(args.model, device=device), wl, attn=args.attn, cuda_graph=graphs)
        results[label] = time_modes(engine, args.repeats)
        r = results[label]
        if args.matrix:
            from qsa_lab.scribble import scribble
            start = time.perf_counter()
            report = scribble(engine)
            r["matrix"] = {"seconds": time.perf_counter() - start, "cells": len(report.cells)}
        print(f"{label:10} plain {r['plain']['median_s'] * 1e3:8.1f} ms   guard {r['guard']['median_s'] * 1e3:8.1f} ms "
              f"(x{r['guard']['x_plain']:.2f}; CPU x{r['guard']['x_plain_cpu']:.2f})   scribble "
              f"{r['scribble']['median_s'] * 1e3:8.1f} ms (x{r['scribble']['x_plain']:.2f}; CPU "
              f"x{r['scribble']['x_plain_cpu']:.2f})   {r['plain']['steps']} steps")
    doc = {"schema": "qsa_lab.bench_scribble/1", "method": __doc__.split("\n\n")[1].replace("\n", " "),
           "load_avg_1min": {"start": LOAD_START, "end": os.getloadavg()[0]},
           "model": args.model, "workload": wl.to_dict(), "engine": args.engine,
           "attn": args.attn if args.engine == "transformers" else "vLLM's own", "device": device,
           "repeats": args.repeats, "threads": torch.get_num_threads(), "facts": machine_facts("transformers") | getattr(engine, "facts", {}), "results": results}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The scribble on a CUDA GPU: paged|eager and sdpa, each without and with CUDA graphs.

    python benchmarks/scribble_gpu.py OUT_DIR [--dtype float16] [--configs eager,eager+graphs,sdpa,sdpa+graphs]

Writes OUT_DIR/scribble_<config>.json (schema qsa_lab.scribble/1, with machine facts), OUT_DIR/summary.json
and OUT_DIR/scribble_gpu.log (the tables), and prints one verdict table per config. Self-checks against
what the CPU runs and the issue lead us to expect, and says EXPECTED / UNEXPECTED per config:
  without graphs: every read and write verdict clean or n/a;
  with graphs:    read-trash leaks (padded rows read it with weight 0), every other region clean or n/a.
Exit 0 when every config ran (whatever it found; the verdicts are the result), 3 when one could not run
(no CUDA, an unsupported transformers: carry the wheel of the supported version, it is pure Python).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIGS = {"eager": ("paged|eager", False), "eager+graphs": ("paged|eager", True),
           "sdpa": ("sdpa", False), "sdpa+graphs": ("sdpa", True)}
LEAKS = ("nan-leak", "inf-leak", "finite-leak", "stray-write")


def expectation(report, graphs: bool) -> list:
    """The cells that differ from the expectation (empty: as expected)."""
    off = []
    for c in report.cells:
        leaking = c.verdict in LEAKS
        if c.verdict in ("error", "unstable-control"):
            off.append(f"{c.check} {c.region}/{c.payload}: {c.verdict}")
        elif graphs and c.check == "read" and c.region == "read-trash" and c.payload == "nan":
            if c.verdict != "nan-leak":
                off.append(f"read read-trash/nan: {c.verdict}, expected nan-leak under graphs")
        elif leaking and not (graphs and c.check == "read" and c.region == "read-trash"):
            off.append(f"{c.check} {c.region}/{c.payload}: {c.verdict}")
    return off


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="output folder (created)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--model", default="llama-gqa")
    p.add_argument("--workload", default="chunked-prefill")
    p.add_argument("--dtype", default="float16", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--payloads", default="nan,inf,max")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "scribble_gpu.log", "a")

    def say(text=""):
        print(text, flush=True)
        log.write(text + "\n")
        log.flush()

    from qsa_lab.scribble.versions import refusal, transformers_version
    if refusal():
        say(f"scribble_gpu: {refusal()}")
        return 3
    import torch
    if not torch.cuda.is_available():
        say("scribble_gpu: torch sees no CUDA device")
        return 3
    from qsa_lab.scribble.check import scribble
    from qsa_lab.scribble.versions import machine_facts
    from qsa_lab.scribble.hf_engine import TransformersEngine
    from qsa_lab.scribble.models import tiny_model, workload

    facts = machine_facts()
    say(f"== scribble_gpu {time.strftime('%Y-%m-%d %H:%M:%S')} {facts['gpu']} torch {facts['torch']} "
        f"transformers {transformers_version()} dtype {args.dtype}")
    summary, failed = {"facts": facts, "configs": {}}, False
    for name in [c.strip() for c in args.configs.split(",") if c.strip()]:
        if name not in CONFIGS:
            say(f"scribble_gpu: --configs: unknown config {name!r}; choose from {', '.join(CONFIGS)}")
            return 2
        attn, graphs = CONFIGS[name]
        start = time.perf_counter()
        try:
            model = tiny_model(args.model, dtype=getattr(torch, args.dtype), device="cuda")
            engine = TransformersEngine(model, workload(args.workload), attn=attn, cuda_graph=graphs)
            report = scribble(engine, payloads=tuple(args.payloads.split(",")))
        except Exception:
            failed = True
            say(f"-- {name}: could not run\n{traceback.format_exc()}")
            summary["configs"][name] = {"error": traceback.format_exc()}
            continue
        report.facts = facts | {"dtype": args.dtype, "seconds": time.perf_counter() - start}
        (out / f"scribble_{name.replace('+', '_')}.json").write_text(json.dumps(report.to_dict(), indent=1) + "\n")
        off = expectation(report, graphs)
        say(f"-- {name}: {'EXPECTED' if not off else 'UNEXPECTED: ' + '; '.join(off)} "
            f"({time.perf_counter() - start:.1f} s, exit code {report.exit_code()})")
        say(report.table())
        summary["configs"][name] = {"exit_code": report.exit_code(), "unexpected": off,
                                    "verdicts": {f"{c.check}:{c.region}:{c.payload}": c.verdict for c in report.cells}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 3 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

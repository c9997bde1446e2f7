"""The canary on the built-in third-party kernels (FlashInfer, vLLM's Triton unified attention)
at a production geometry: head_dim 128, 8 query heads over 2 KV heads (GQA 4:1), 16-token
pages, fp16 and e4m3 pools, under the dense, window, window+sink and sparse specs, decode (one
row per request) and a 4-row prefill chunk; plus a padded block table (PADDED: requests of 33, 32
and 31 tokens hold 3, 2 and 2 pages, so two block-table rows end in a padding entry pointing at
the null block: vLLM's padded-table path; FlashInfer reads a page list, so its null-block cells
are n/a there). Writes one JSON document and a Markdown table.

    python benchmarks/canary_thirdparty.py --json evidence/canary_thirdparty_h200.json \
        [--vllm-src PATH] [--jobs 12] [--kernels flashinfer:decode,...] [--kv-dtypes fp16,e4m3] \
        [--regions other-rows,other-requests]

--regions runs those regions instead of each spec's defaults (e.g. the per-row rule, other-rows).

Each (kernel, kv dtype) runs in its own worker process, several at once (--jobs): FlashInfer
compiles one module per configuration on first use, and the workers compile theirs in
parallel. Kernels that cannot run here are listed with the reason, never dropped.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCHEMA = "qsa_lab.canary-thirdparty/1"
KERNELS = ("flashinfer:decode", "flashinfer:decode-tc", "flashinfer:prefill", "flashinfer:prefill-fa2",
           "vllm:unified", "vllm:unified-3d")
DECODE_ONLY = ("flashinfer:decode", "flashinfer:decode-tc", "vllm:unified-3d")
SPECS = ("dense", "window:8", "window:8,sink:4", "sparse")
GEOMETRY = dict(q_heads=8, kv_heads=2, head_dim=128, page_size=16, requests=3, context=40)
#: a geometry whose block-table rows carry padding entries (spec, extra geometry), run for every kernel
PADDED = ("dense", dict(context=33))
TOPK = {"sparse": 4}          # 4 selected 4-token blocks of ~40 tokens: an unselected region exists
PREFILL_ROWS = 4


def cases(kernel: str, kv_dtype: str):
    """(attend, query_len, CanaryCase) this kernel runs on; the padded block table's runs are
    labelled '<spec> padded-table'."""
    from qsa_lab.canary.case import canary_case

    for query_len in ((1,) if kernel in DECODE_ONLY else (1, PREFILL_ROWS)):
        for spec in SPECS:
            geo = dict(GEOMETRY, topk=TOPK.get(spec, 16))
            yield spec, query_len, canary_case(kv_dtype, attend=spec, query_len=query_len, **geo)
        spec, extra = PADDED
        yield f"{spec} padded-table", query_len, canary_case(kv_dtype, attend=spec, query_len=query_len,
                                                             **dict(GEOMETRY, **extra))


def summarize(doc: dict) -> str:
    """One cell of the table: 'clean', 'skipped: why', or the non-clean verdicts by plane."""
    results = doc["results"]
    if not results:
        reasons = [s.get("reason", "") for s in doc.get("skipped", []) if "kernel" in s] or \
                  [s.get("reason", "") for s in doc.get("skipped", [])]
        return "not run: " + "; ".join(sorted({_short(r) for r in reasons}))
    bad = {}
    for r in results:
        if r["verdict"] not in ("clean", "n/a"):
            bad.setdefault((r["plane"].upper(), r["verdict"]), []).append(f"{r['region']}({r['payload']})")
    if not bad:
        return "clean"
    return "; ".join(f"{plane} {v}: {', '.join(dict.fromkeys(where))}" for (plane, v), where in sorted(bad.items()))


def _short(reason: str) -> str:
    """A skip reason without the kernel's name and advice: 'the decode wrapper takes no custom mask'."""
    text = reason.split(": ", 1)[1] if re.match(r"^[a-z]+:[a-z0-9-]+: ", reason) else reason
    return re.split(r", so | \(", text)[0].strip()


def worker(kernel: str, kv_dtype: str, out: Path) -> None:
    from qsa_lab.canary import run_canary

    runs = []
    for spec, query_len, case in cases(kernel, kv_dtype):
        t0 = time.time()
        try:
            regions = os.environ.get("QSA_LAB_THIRDPARTY_REGIONS")
            report = run_canary([kernel], case=case, backend="auto", regions=regions.split(",") if regions else None)
            doc = report.to_json()
        except Exception as e:  # noqa: BLE001 - record it, carry on with the next case
            doc = {"results": [], "skipped": [{"kernel": kernel, "reason": f"run_canary raised {type(e).__name__}: "
                                                                            f"{e}"}]}
        report_dir = os.environ.get("QSA_LAB_THIRDPARTY_REPORT")
        if report_dir and doc["results"] and report.leaks():
            try:
                write_leak_report(report, Path(report_dir) / f"{kernel.replace(':', '_')}_{kv_dtype}_"
                                                               f"{spec.replace(':', '').replace(',', '_').replace(' ', '_')}_q{query_len}")
            except Exception as e:  # noqa: BLE001 - the verdicts stand without the report
                print(f"  report failed: {type(e).__name__}: {e}", flush=True)
        runs.append({"kernel": kernel, "kv_dtype": kv_dtype, "attend": spec, "query_len": query_len,
                     "seconds": round(time.time() - t0, 2), "summary": summarize(doc),
                     "geometry": doc.get("geometry"), "regions": doc.get("regions"),
                     "results": [{k: r[k] for k in ("region", "plane", "payload", "verdict", "nan", "inf",
                                                    "finite_changed") if k in r} for r in doc["results"]],
                     "skipped": doc.get("skipped", [])})
        print(f"[{kernel} {kv_dtype} {spec} q{query_len}] {runs[-1]['summary']} ({runs[-1]['seconds']} s)",
              flush=True)
    out.write_text(json.dumps(runs))


def write_leak_report(report, folder: Path) -> None:
    """--report: the leak report of one run, and a replay of each of its saved calls (logged)."""
    from qsa_lab.canary.replay import replay
    from qsa_lab.canary.report import write_report

    write_report(report, folder, force=True)
    for f in sorted((folder / "calls").glob("*.safetensors")):
        r = replay(f)
        print(f"  replay {f.name}: control {r['control_nan']} NaN; poisoned {r['nan']} NaN, {r['inf']} Inf, "
              f"{r['finite_changed']} finite changed of {r['outputs']} (rows {r['rows']}) -> {r['verdict']}",
              flush=True)


def machine() -> dict:
    import torch

    from qsa_lab.canary.report import environment

    env = environment(KERNELS)
    env.update({"cpus": os.cpu_count(), "loadavg": list(os.getloadavg()), "platform": platform.platform()})
    if torch.cuda.is_available():
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2 ** 30, 1)
    return env


def table(runs: list, env: dict) -> str:
    """Markdown: one row per library x kernel x spec, one column per kv dtype x query rows."""
    from qsa_lab.canary.names import parse_kernel

    lib = {"flashinfer": ("FlashInfer", env.get("flashinfer")), "vllm": ("vLLM", env.get("vllm_rev") or env.get("vllm"))}
    cols = list(dict.fromkeys((r["kv_dtype"], r["query_len"]) for r in runs))
    head = [f"{d}, {'decode' if q == 1 else f'{q}-row chunk'}" for d, q in cols]
    cell = {(r["kernel"], r["attend"], r["kv_dtype"], r["query_len"]): r["summary"] for r in runs}
    keys = list(dict.fromkeys((r["kernel"], r["attend"]) for r in runs))
    lines = ["| library | version | kernel | spec | " + " | ".join(head) + " |", "|---" * (4 + len(cols)) + "|"]
    for k, spec in keys:
        name, version = lib[parse_kernel(k).source]
        lines.append(f"| {name} | {version} | `{k}` | `{spec}` | "
                     + " | ".join(cell.get((k, spec, d, q), "-") for d, q in cols) + " |")
    return "\n".join(lines)


def dump(doc: dict) -> str:
    """The document as JSON with one run per line."""
    rest = {k: v for k, v in doc.items() if k != "runs"}
    runs = ",\n".join("  " + json.dumps(r, separators=(",", ":")) for r in doc["runs"])
    return json.dumps(rest, indent=1)[:-2] + ',\n "runs": [\n' + runs + "\n ]\n}\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="output JSON path (a .md table is written beside it)")
    p.add_argument("--kernels", default=",".join(KERNELS))
    p.add_argument("--kv-dtypes", default="fp16,e4m3")
    p.add_argument("--vllm-src", help="vLLM source checkout for vllm:* (else QSA_LAB_VLLM_SRC / an installed vllm)")
    p.add_argument("--vllm-rev", help="what --vllm-src holds, for the table (e.g. 'main @ 0013943')")
    p.add_argument("--label", help="recorded in the JSON (e.g. the qsa_lab commit that ran)")
    p.add_argument("--jobs", type=int, default=12)
    p.add_argument("--report", metavar="DIR", help="also write a leak report (qsa_lab.canary.report) per leaking run")
    p.add_argument("--regions", metavar="R,..", help="regions to run instead of each spec's defaults (e.g. other-rows)")
    p.add_argument("--worker", nargs=3, metavar=("KERNEL", "KV_DTYPE", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.vllm_src:
        os.environ["QSA_LAB_VLLM_SRC"] = str(Path(args.vllm_src).resolve())
    if args.report:
        os.environ["QSA_LAB_THIRDPARTY_REPORT"] = str(Path(args.report).resolve())
    if args.regions:
        os.environ["QSA_LAB_THIRDPARTY_REGIONS"] = args.regions
    if args.worker:
        worker(args.worker[0], args.worker[1], Path(args.worker[2]))
        return 0
    if not args.json:
        p.error("--json is required")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    parts_dir = Path(tempfile.mkdtemp(prefix="canary_thirdparty."))
    jobs = [(k, d) for k in args.kernels.split(",") for d in args.kv_dtypes.split(",")]
    t0, running, done = time.time(), [], []
    queue = list(jobs)
    while queue or running:
        while queue and len(running) < args.jobs:
            k, d = queue.pop(0)
            part = parts_dir / f"{k.replace(':', '_')}_{d}.json"
            running.append((k, d, part, subprocess.Popen([sys.executable, __file__, "--worker", k, d, str(part)])))
        time.sleep(1)
        for job in [j for j in running if j[3].poll() is not None]:
            running.remove(job)
            done.append(job)
    runs = []
    for k, d, part, proc in sorted(done, key=lambda j: jobs.index((j[0], j[1]))):
        if part.is_file():
            runs += json.loads(part.read_text())
        else:
            runs.append({"kernel": k, "kv_dtype": d, "attend": "-", "query_len": "-", "results": [], "skipped": [],
                         "summary": f"worker exited {proc.returncode} without results"})
    env = machine()
    if args.vllm_rev:
        env["vllm_rev"] = args.vllm_rev
    doc = {"schema": SCHEMA, "label": args.label, "machine": env, "geometry": GEOMETRY, "specs": list(SPECS),
           "padded_table": {"attend": PADDED[0], "geometry": dict(GEOMETRY, **PADDED[1])},
           "prefill_rows": PREFILL_ROWS, "regions_asked": args.regions, "wall_s": round(time.time() - t0, 1),
           "runs": runs}
    out.write_text(dump(doc))
    md = table(runs, env)
    out.with_suffix(".md").write_text(md + "\n")
    print(md)
    print(f"wrote {out} ({len(runs)} runs, {doc['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The scribble on a CUDA GPU, under every supported transformers: the matrix, CUDA graphs included.

    python benchmarks/scribble_gpu.py OUT_DIR [--wheels .whl] [--versions 5.24.0,5.25.0] [--budget 480]

For each transformers version: the installed one runs as it is; another is installed from its wheel in
--wheels (`transformers-<version>-py3-none-any.whl`; if it does not import with the packages installed here,
again with every other wheel carried there, e.g. a newer huggingface_hub and its own new dependencies) into
$TMPDIR/qsa_lab-transformers-<version> without dependencies, and runs in a child process with that folder
first on its path. Every region (other-requests included), payloads nan,
inf and max, fp16, the tiny Llama on workload chunked-prefill, for the configs of the committed matrix:
  eager, eager+graphs, sdpa, sdpa+graphs       (paged|eager and sdpa, each without and with CUDA graphs)
then, while the time budget lasts, the extras:
  per-request                                  (qsa_lab.scribble.examples.per_request_attention, no graphs)
  eager+graphs/offload, eager+graphs/fork      (CPU swap pool restores and fork copies under graphs)
Writes OUT_DIR/<version>/scribble_<config>.json (schema qsa_lab.scribble/1, with machine facts),
OUT_DIR/summary.json and OUT_DIR/scribble_gpu.log (every table), and says EXPECTED / UNEXPECTED per config:
  every config:   no stray write, no error, no unstable control; every pool region but the read trash clean
                  or n/a; other-requests a nan-leak for nan (paged|eager and sdpa pack the batch: 0 * NaN),
                  clean for per-request
  with graphs:    read-trash a nan-leak for nan (padded rows read it with weight 0)
Exit 0 when every config it reached ran (whatever it found; the verdicts are the result), 3 when one could
not run (no CUDA, a version it could not import: carry its wheel).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MATRIX = {"eager": ("paged|eager", False, "chunked-prefill"), "eager+graphs": ("paged|eager", True, "chunked-prefill"),
          "sdpa": ("sdpa", False, "chunked-prefill"), "sdpa+graphs": ("sdpa", True, "chunked-prefill")}
PER_REQUEST = "qsa_lab.scribble.examples:per_request_attention"
EXTRAS = {"per-request": (PER_REQUEST, False, "chunked-prefill"),
          "eager+graphs/offload": ("paged|eager", True, "offload"), "eager+graphs/fork": ("paged|eager", True, "fork")}
CONFIGS = MATRIX | EXTRAS
LEAKS = ("nan-leak", "inf-leak", "finite-leak", "stray-write")
STOCK_LEAKS = {"other-requests"}     # paged|eager and sdpa pack a batch: one request's NaN reaches the others


def expectation(report, attn: str, graphs: bool) -> list:
    """The cells that differ from the expectation (empty: as expected)."""
    off = []
    for c in report.cells:
        cell = f"{c.check} {c.region}/{c.payload}: {c.verdict}"
        if c.verdict in ("error", "unstable-control") or c.verdict == "stray-write":
            off.append(cell)
        elif c.check != "read":
            continue
        elif c.region == "read-trash" and graphs:
            if c.payload == "nan" and c.verdict != "nan-leak":
                off.append(cell + ", expected nan-leak under graphs")
        elif c.region == "other-requests" and attn != PER_REQUEST:
            if c.payload == "nan" and c.verdict != "nan-leak":
                off.append(cell + ", expected nan-leak (a packed batch)")
        elif c.verdict in LEAKS:
            off.append(cell)
    return off


def run_configs(out: Path, names: list, dtype: str, payloads: tuple, deadline: float, say, device: str) -> dict:
    """This process's transformers: each config in turn, until the deadline. -> {config: summary}."""
    import torch

    from qsa_lab.scribble import refusal, scribble
    from qsa_lab.scribble.isolated import build_engine, is_user_attention
    from qsa_lab.support.machine import machine_facts

    line = refusal()
    if line or (device == "cuda" and not torch.cuda.is_available()):
        say(f"scribble_gpu: {line or 'torch sees no CUDA device'}")
        return {name: {"error": line or "no CUDA device"} for name in names}
    facts = machine_facts("transformers")
    out.mkdir(parents=True, exist_ok=True)
    say(f"== scribble_gpu {time.strftime('%Y-%m-%d %H:%M:%S')} {facts['gpu']} torch {facts['torch']} "
        f"transformers {facts['transformers']} dtype {dtype}")
    results = {}
    for name in names:
        if time.time() > deadline:
            say(f"-- {name}: skipped (time budget spent)")
            results[name] = {"skipped": "time budget spent"}
            continue
        attn, graphs, wl = CONFIGS[name]
        start = time.perf_counter()
        try:
            if is_user_attention(attn):
                from qsa_lab.support.loading import load_callable
                attn_fn, attn_name = load_callable(attn, "attn"), attn
            else:
                attn_fn, attn_name = attn, None
            engine = build_engine(attn=attn_fn, attn_name=attn_name, workload=wl, cuda_graph=graphs, dtype=dtype,
                                  device=device)
            report = scribble(engine, payloads=payloads)
        except Exception:
            say(f"-- {name}: could not run\n{traceback.format_exc()}")
            results[name] = {"error": traceback.format_exc()}
            continue
        report.facts = facts | {"dtype": dtype, "seconds": time.perf_counter() - start}
        (out / f"scribble_{name.replace('+', '_').replace('/', '_')}.json").write_text(
            json.dumps(report.to_dict(), indent=1) + "\n")
        off = expectation(report, attn, graphs)
        say(f"-- {name}: {'EXPECTED' if not off else 'UNEXPECTED: ' + '; '.join(off)} "
            f"({time.perf_counter() - start:.1f} s, exit code {report.exit_code()})")
        say(report.table())
        results[name] = {"exit_code": report.exit_code(), "unexpected": off, "transformers": facts["transformers"],
                         "events": report.events, "moved_rows": report.moved_rows, "summary": report.verdict_line(),
                         "verdicts": {f"{c.check}:{c.region}:{c.payload}": c.verdict for c in report.cells}}
    return results


def site_packages_for(version: str, wheels: Path, say) -> Path | None:
    """A folder holding transformers `version` that imports here, or None: the wheel alone, else with every
    other wheel carried in `wheels` (a newer huggingface_hub and what it needs, when the installed one is too
    old for that transformers)."""
    target = Path(tempfile.gettempdir()) / f"qsa_lab-transformers-{version}"     # not under OUT: 130 MB
    if (target / ".installed").exists():
        return target
    found = sorted(wheels.glob(f"transformers-{version}-*.whl"))
    if not found:
        say(f"scribble_gpu: transformers {version}: no wheel {wheels}/transformers-{version}-*.whl (carry it)")
        return None
    others = [w for w in sorted(wheels.glob("*.whl")) if not w.name.startswith("transformers-")]
    for extra in ([], others) if others else ([],):
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--upgrade",
                               "--target", str(target), str(found[-1]), *map(str, extra)],
                              capture_output=True, text=True)
        if done.returncode:
            say(f"scribble_gpu: transformers {version}: pip could not install the wheel: {done.stderr.strip()[-500:]}")
            return None
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")]))
        check = subprocess.run([sys.executable, "-c", "import transformers.generation.continuous_batching"], env=env,
                               capture_output=True, text=True)
        if check.returncode == 0:
            (target / ".installed").touch()
            return target
    say(f"scribble_gpu: transformers {version} does not import here (carry the wheels it needs, e.g. a newer "
        f"huggingface_hub, in {wheels}): {check.stderr.strip().splitlines()[-1] if check.stderr.strip() else ''}")
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="output folder (created)")
    p.add_argument("--wheels", default=str(REPO / ".whl"), help="folder of the transformers wheels (default .whl)")
    p.add_argument("--versions", default=None, help="comma list (default: every supported version)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)} (default all)")
    p.add_argument("--dtype", default="float16", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--payloads", default="nan,inf,max")
    p.add_argument("--budget", type=float, default=480.0,
                   help="seconds for the whole call: configs not begun by then are skipped (default 480)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: a dry run of the configs without graphs (default cuda)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)   # VERSION: run here, print a JSON summary
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "scribble_gpu.log", "a")

    def say(text=""):
        print(text, flush=True)
        log.write(text + "\n")
        log.flush()

    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    for name in names:
        if name not in CONFIGS:
            say(f"scribble_gpu: --configs: unknown config {name!r}; choose from {', '.join(CONFIGS)}")
            return 2
    payloads = tuple(args.payloads.split(","))
    if args.child:
        results = run_configs(out / args.child, names, args.dtype, payloads, args.deadline, say, args.device)
        (out / args.child / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        return 0

    from qsa_lab.scribble.versions import TRANSFORMERS
    versions = args.versions.split(",") if args.versions else list(TRANSFORMERS.supported)
    deadline = time.time() + args.budget
    summary, failed = {"configs": {}, "versions": {}}, False
    # the committed matrix under every version first, then the extras while the budget lasts
    for phase in ([n for n in names if n in MATRIX], [n for n in names if n in EXTRAS]):
        for version in versions if phase else []:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
            if version != TRANSFORMERS.installed():
                folder = site_packages_for(version, Path(args.wheels), say)
                if folder is None:
                    failed = True
                    summary["versions"][version] = "could not install"
                    continue
                env["PYTHONPATH"] = os.pathsep.join([str(folder), env["PYTHONPATH"]])
            log.flush()
            subprocess.run([sys.executable, __file__, str(out), "--child", version, "--configs", ",".join(phase),
                            "--dtype", args.dtype, "--payloads", args.payloads, "--deadline", str(deadline),
                            "--device", args.device], env=env)
            got = out / version / "results.json"
            results = json.loads(got.read_text()) if got.exists() else {n: {"error": "the child process failed"}
                                                                        for n in phase}
            got.unlink(missing_ok=True)
            for name, r in results.items():
                summary["configs"][f"{name} ({version})"] = r
                failed |= "error" in r
            summary["versions"][version] = "ran"
    facts_files = sorted(out.glob("*/scribble_*.json"))
    if facts_files:
        doc = json.loads(facts_files[0].read_text())
        facts = {**doc, **doc["facts"]}                   # the header's machine facts and the engine's
        facts = {k: facts[k] for k in ("gpu", "torch", "cuda", "python", "qsa_lab_version", "transformers", "machine",
                                       "processor") if k in facts}
        ran = [v for v in versions if summary["versions"].get(v) == "ran"]
        summary["facts"] = facts | {"transformers": ", ".join(ran)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    say(f"== scribble_gpu done: {sum('exit_code' in r for r in summary['configs'].values())} configs ran, "
        f"{sum(bool(r.get('unexpected')) for r in summary['configs'].values())} UNEXPECTED, "
        f"{sum('skipped' in r for r in summary['configs'].values())} skipped, "
        f"{sum('error' in r for r in summary['configs'].values())} could not run")
    return 3 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

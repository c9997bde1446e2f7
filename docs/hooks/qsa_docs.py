"""MkDocs hook: every generated part of the documentation site.

Pages hold markers; this hook replaces them while the site builds, from the code and from the
committed measurements, so nothing in them is copied by hand:

    <!-- qsa:cli -->                         the CLI reference, walked from the argparse parser
    <!-- qsa:routes -->                      every route and fix, from qsa_lab.routes.labels
    <!-- qsa:doctor -->                      `qsa-lab doctor`'s verdicts, from qsa_lab.support.machine.verdict
    <!-- qsa:perf NAME -->                   a performance table from committed JSON (see PERF; complete-fix,
                                             cross-request and other-rows say which file is not committed yet)
    <!-- qsa:log FILE "== SECTION" -->       one section of a committed log, verbatim
    [[evidence:FILE]]                        the path of a committed evidence file

and writes the figures the pages show (`assets/nan_map.png`: the report's case through the
unfixed grouped route) with the package's own plotting code.

The constants below are the one place the docs point at the code's layout.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import io
import json
import logging
import os
import re
import statistics
import subprocess
import tempfile
from pathlib import Path

#: the module whose build_parser() builds the `qsa-lab` parser
CLI_MODULE = "qsa_lab.app.cli"
#: the module holding the pure verdict(info) of `qsa-lab doctor`
DOCTOR_MODULE = "qsa_lab.support.machine"
#: where the measured logs and JSON live, relative to the repository root: evidence/, and data/ for
#: the measurements the package itself reads (the H200 bench, upstream's fix cost, the canary matrix)
EVIDENCE_DIRS = ("evidence", "data")
#: the figure data and the plotting code the site's figures are drawn with
FIGDATA_MODULE = "qsa_lab.analysis.figure_data"
PLOTTING_MODULE = "qsa_lab.plotting.plots"

REPO = Path(__file__).resolve().parents[2]
#: mkdocstrings' note that it formats signatures without Black or Ruff: `make docs` printed it as its
#: one line beyond MkDocs' own (the signatures read as they are written)
NO_FORMATTER = "Formatting signatures requires either Black or Ruff"
MARKER = re.compile(r"<!-- qsa:(\w+)(?: ([^>]*?))? -->")
EVIDENCE = re.compile(r"\[\[evidence:([\w./-]+)\]\]")


def evidence(name: str) -> Path:
    for folder in EVIDENCE_DIRS:
        if (REPO / folder / name).is_file():
            return REPO / folder / name
    raise FileNotFoundError(f"docs: evidence file {name} is in none of {', '.join(EVIDENCE_DIRS)}")


def _where(name: str) -> str:
    """'evidence/bench_cpu.json' or 'data/bench_h200.json': the committed path of an evidence file."""
    return evidence(name).relative_to(REPO).as_posix()


def _committed(name: str) -> str:
    """The date of the commit that last changed an evidence file (its measurement's date)."""
    out = subprocess.run(["git", "log", "-1", "--format=%cs", "--", _where(name)], cwd=REPO,
                         capture_output=True, text=True)
    return out.stdout.strip() or "not committed yet"


def _md_escape(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(header, rows) -> str:
    """A Markdown table; a `|` in a header or a cell is escaped (unescaped, it split the row and
    the page showed the table as raw pipes)."""
    lines = ["| " + " | ".join(_md_escape(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_md_escape(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------ the routes

LABELS_MODULE = "qsa_lab.routes.labels"


def routes_table() -> str:
    """Every route and fix, from qsa_lab.routes.labels: its name with its letter, what it is, and
    whether a NaN one request attends can reach another request's rows through it."""
    labels = importlib.import_module(LABELS_MODULE)
    leaky = {"grouped", *(r for r in labels.FIXED_ROUTES if r not in labels.COMPLETE_FIXES)}
    rows = []
    for route in labels.ROUTES:
        name = f"`{route}`" + (f" ({labels.FIXES[labels.fix_of(route)]})" if labels.fix_of(route) in labels.FIXES
                               else "")
        rows.append([name, labels.ROUTE_TEXT[route], "yes" if route in leaky else "no"])
    return table(["route", "what it is", "leaks across requests"], rows)


# ------------------------------------------------------------------ the CLI reference

def build_parser() -> argparse.ArgumentParser:
    return importlib.import_module(CLI_MODULE).build_parser()


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _helps(parser) -> dict[str, str]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {c.dest: c.help or "" for c in action._choices_actions}


def _option_cell(action: argparse.Action) -> str:
    """`--opt` and what it takes: its choices, or its metavar in italics (a `|` inside a code span
    would print its escaping backslash in a Markdown table)."""
    names = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.metavar or action.dest}`"
    if action.nargs == 0:
        return names
    if action.choices:
        return f"{names} " + " / ".join(f"`{c}`" for c in action.choices)
    metavar = action.metavar or action.dest.upper()
    return f"{names} *{metavar}*"


def options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string the parser and its subcommands accept."""
    found = {o for a in parser._actions for o in a.option_strings}
    for sub in subcommands(parser).values():
        found |= {o for a in sub._actions for o in a.option_strings}
    return found


def cli_reference() -> str:
    parser = build_parser()
    helps = _helps(parser)
    out = [f"`qsa-lab` (also `python -I -m qsa_lab`). Generated from the parser in `{CLI_MODULE}` when this site "
           "was built; `qsa-lab COMMAND --help` prints the same.", "",
           "```", parser.format_usage().strip(), "```", ""]
    for name, sub in subcommands(parser).items():
        out += [f"## `qsa-lab {name}`", "", _md_escape(sub.description or helps.get(name, "")), "",
                "```", sub.format_usage().strip(), "```", ""]
        for group in sub._action_groups:
            rows = [(_option_cell(a), a.help or "") for a in group._group_actions
                    if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
            if not rows:
                continue
            title = {"options": "options", "optional arguments": "options",
                     "positional arguments": "arguments"}.get(group.title, group.title)
            out += [f"**{title}**", "", table(("option", "meaning (default)"), rows), ""]
    return "\n".join(out)


# ------------------------------------------------------------------ doctor's verdicts

_V100 = {"cuda_available": True, "gpu": "Tesla V100-SXM2-32GB", "capability": "7.0", "torch": "2.14.1+cu126",
         "torch_cuda": "12.6", "torch_arch_list": ["sm_70", "sm_80", "sm_90"], "nvcc": "/usr/local/cuda/bin/nvcc",
         "nvcc_version": "Cuda compilation tools, release 12.6, V12.6.85", "host_compiler": "/usr/bin/c++",
         "built": False, "error": None}
_SMI = {"gpus": [{"name": "Tesla V100-SXM2-32GB", "capability": "7.0", "driver": "550.54.15"}],
        "driver_cuda": "12.4", "hidden": False}
#: machine states shown on the Install page: (what you have, the status dict doctor would read)
DOCTOR_STATES = [
    ("no GPU, CPU torch", {"cuda_available": False, "torch_cuda": None}),
    ("V100 seen by nvidia-smi, PyPI's CUDA 13 torch", {"cuda_available": False, "torch": "2.13.0",
                                                      "torch_cuda": "13.0", "nvidia_smi": _SMI}),
    ("V100 seen by nvidia-smi, CPU torch", {"cuda_available": False, "torch": "2.13.0+cpu", "torch_cuda": None,
                                           "nvidia_smi": _SMI}),
    ("V100, torch without sm_70 kernels", {**_V100, "torch": "2.13.0", "torch_cuda": "13.0",
                                           "torch_arch_list": ["sm_75", "sm_80", "sm_90"]}),
    ("V100, no nvcc", {**_V100, "nvcc": None, "nvcc_version": None}),
    ("V100, nvcc from CUDA 13", {**_V100, "nvcc_version": "Cuda compilation tools, release 13.0, V13.0.48"}),
    ("V100, nvcc and torch of different CUDA majors", {**_V100, "torch_cuda": "11.8",
                                                       "nvcc_version": "Cuda compilation tools, release 12.6"}),
    ("V100, no host compiler", {**_V100, "host_compiler": None}),
    ("V100, g++ newer than nvcc accepts", {**_V100, "nvcc_host_compiler": "/usr/bin/gcc",
                                           "nvcc_host_compiler_version": "14.2.0"}),
    ("V100, the build failed", {**_V100, "error": "...", "build_error": "grouped_page4.cuh(120): error: ..."}),
    ("V100, ready to build", _V100),
    ("V100, built", {**_V100, "built": True}),
    ("kernel sources missing from the install", {**_V100, "sources_missing": ["bindings.cu"],
                                                 "kernel_sources": "site-packages/qsa_lab/csrc"}),
]


def doctor_table() -> str:
    verdict = importlib.import_module(DOCTOR_MODULE).verdict
    rows = [(state, "`" + verdict(info).removeprefix("verdict: ").replace("`", "'") + "`")
            for state, info in DOCTOR_STATES]
    return (f"Each line below is what `{DOCTOR_MODULE}.verdict` answers for that machine, computed when this "
            "site was built.\n\n" + table(("machine", "last line of `qsa-lab doctor`, after `verdict:`"), rows))


# ------------------------------------------------------------------ performance tables

def _med(samples, key="wall_s"):
    return statistics.median(s[key] for s in samples)


#: what a row of an older measurement calls the notebooks, as this site names them
_THEN = {"all six notebooks": "notebooks 01-06"}


def perf_cpu(name: str = "bench_cpu.json") -> str:
    """The whole-process timings beside the base commit. What the file says about how it was made
    (its commits, its note, the targets it was measured against) is provenance: evidence/README.md."""
    doc = json.loads(evidence(name).read_text())
    m = doc["machine"]
    rows, loads = [], []
    for row in doc["rows"].values():
        cur, base = row["current"], row["base"]
        what = row["what"]
        for old, new in _THEN.items():
            what = what.replace(old, new)
        loads += [v[0] for v in (row["load_before"], row["load_after"]) if v]
        for k in (k for k in cur["samples"][0] if k.endswith("_s")):
            now = cur.get("median", {}).get(k, _med(cur["samples"], k))      # the file's own median
            then = base.get("median", {}).get(k, _med(base["samples"], k))
            ratio = (row.get("ratio_to_base") or {}).get(k, now / then)
            part = "" if k == "wall_s" else f": {k.removesuffix('_s').replace('_', ' ')}"
            rows.append((what + part, f"{now:.2f} s", f"{then:.2f} s", f"×{ratio:.2f}", row["reps"]))
    load = f"load (1 min) {min(loads):.1f} to {max(loads):.1f}" if loads else "load not recorded"
    head = (f"Measured {doc['started'][:10]} on {m['cpu']}, {m['cpu_count']} cores, torch {m['torch']} "
            f"({m['torch_threads']} threads), Python {m['python']}, {load}; the base is the code before the CPU "
            f"speed-ups, run in the same session. Method: {doc.get('method', '')}. Source: `{_where(name)}`.")
    return head + "\n\n" + table(("what", "median", "base", "ratio", "reps"), rows)


_FIX = {"unfixed": "grouped", "kernel_fix": "grouped+kernel_fix (A)", "pad_fix": "grouped+pad_fix (B)",
        "both_fixes": "grouped+both_fixes (A+B)", "masked_load": "grouped+masked_load (C)",
        "early_v": "early_v (not upstream)", "pad_fix_op": "the pad-fix op alone", "xqa": "xqa",
        "torch_sdpa": "torch SDPA"}


def perf_h200(name: str = "bench_h200.json") -> str:
    from qsa_lab.analysis.bench_data import current_names

    doc = current_names(json.loads(evidence(name).read_text()))   # a run of an earlier version reads the same
    rg = doc["report_geometry"]
    g = rg["geometry"]
    rows = [(_FIX.get(k, k), f"{v:.3f}", f"{rg['us_per_tile'][k]:.2f}" if k in rg["us_per_tile"] else "-",
             f"×{rg['ratio_to_unfixed'][k]:.3f}", rg["barriers_per_tile"].get(k, "-"))
            for k, v in rg["ms"].items()]
    head = (f"{doc['gpu']} (sm {doc['capability']}, {doc['sm_count']} SMs), torch {doc['torch']}, CUDA {doc['cuda']}; "
            f"committed {_committed(name)}; machine load not recorded (a lent GPU, one job). Method: {doc['method']}. "
            f"Case: {g['rows']} rows, context {g['context']}, top-{g['topk']}, {g['kv_dtype']}, {g['selection']} "
            f"selections, {rg['tiles_per_group_mean']} tiles per group, L2 flushed. Source: `{_where(name)}`.")
    out = head + "\n\n" + table(("route", "ms", "µs per tile", "× unfixed", "barriers per tile"), rows)
    sweep = [(s["geometry"]["rows"], s["geometry"]["context"], f"{s['ms']['unfixed']:.3f}",
              f"{s['us_per_tile']['unfixed']:.2f}", f"×{s['ratio_to_unfixed']['kernel_fix']:.3f}",
              f"×{s['ratio_to_unfixed']['masked_load']:.3f}", f"{s['ms']['xqa']:.3f}") for s in doc["sweep"]]
    out += "\n\nThe sweep (same method):\n\n" + table(
        ("rows", "context", "grouped ms", "µs per tile", "kernel_fix (A)", "masked_load (C)", "xqa ms"), sweep)
    kf = doc["kernel_fix_vs_report"]
    out += (f"\n\nThe report measured kernel_fix (A) at ×{kf['report_v100_ratio']} per iteration on a V100; here it "
            f"is ×{kf['here_ratio']:.3f} (+{kf['here_us_per_tile']['kernel_fix_minus_unfixed']:.2f} µs per tile). "
            f"What differs: {kf['differs']}")
    return out


def perf_upstream(name: str = "upstream_fix_cost_h200.json") -> str:
    from qsa_lab.analysis.bench_data import load_upstream

    doc = load_upstream(evidence(name))
    up = doc["upstream"]
    rows = [(r["rows"], r["upstream_unfixed_us_per_tile"],
             f"×{r['upstream_kernel_fix_ratio']} (+{r['upstream_kernel_fix_extra_us']} µs)",
             r["qsa_lab_unfixed_us_per_tile"], f"×{r['qsa_lab_kernel_fix_ratio']} (+{r['qsa_lab_kernel_fix_extra_us']} µs)")
            for r in doc["rows"]]
    head = (f"{doc['what']}: {doc['gpu']}, committed {_committed(name)}. Upstream: {up['repo']} `{up['file']}` "
            f"@{up['unfixed_commit']}, kernel_fix (A) @{up['kernel_fix_commit']} ({up['kernel_fix_source']}; {up['built']}). "
            f"Method: {doc['method']}. Checks: {doc['checks']} Source: `{_where(name)}`.")
    return head + "\n\n" + table(("rows", "upstream µs/tile", "upstream kernel_fix (A)", "qsa_lab µs/tile",
                                  "qsa_lab kernel_fix (A)"), rows)


def perf_playground(name: str = "bench_playground_cpu.json") -> str:
    doc = json.loads(evidence(name).read_text())
    rows = [(p, f"{v['first_draw_s']:.2f} s", f"{v['median_redraw_s']:.2f} s", f"{v['worst_median_s']:.2f} s")
            for p, v in doc["presets"].items()]
    head = (f"Playground redraws on the emulation: {doc['machine']}, {doc['cpus']} cores, torch {doc['torch']} "
            f"({doc['torch_threads']} threads), committed {_committed(name)}, load (1 min) {doc['load_avg_1min_start']} "
            f"at start, {doc['load_avg_1min_end']} at the end; {doc['repeat']} repeats. Source: `{_where(name)}`.")
    return head + "\n\n" + table(("preset", "first draw", "median redraw", "slowest kind of change (median)"), rows)


def perf_emulate(name: str = "bench_emulate_cpu.json") -> str:
    doc = json.loads(evidence(name).read_text())
    g = doc["geometry"]
    head = (f"The default `diff` case ({g['rows']} rows, context {g['context']}, top-{g['topk']}, {g['kv_dtype']}) "
            f"through all 7 routes on the emulation, in process: {doc['machine']}, torch {doc['torch']} "
            f"({doc['torch_threads']} threads), committed {_committed(name)}, load not recorded. Method: {doc['method']} "
            f"({doc['reps']} reps). Source: `{_where(name)}`.")
    return head + "\n\n" + table(("step", "median"), [(k, f"{v:.3f} s") for k, v in doc["median_s"].items()])


def _canary_counts(name: str = "canary_h200.json") -> str:
    doc = json.loads(evidence(name).read_text())
    counts: dict[str, int] = {}
    for r in doc["results"]:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    cells = ", ".join(f"{v} {k}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
    return (f"{len(doc['results'])} cells on {doc['gpu']} (torch {doc['torch']}, committed {_committed(name)}): {cells}. "
            f"Source: `{_where(name)}`.")


def _kernel_summary(doc: dict) -> dict[str, str]:
    """kernel -> its non-clean cells grouped by plane and verdict ('V nan-leak: null-block (nan, inf)'),
    'clean' / 'n/a only', or the reason it was not run."""
    by: dict[str, dict] = {k: {} for k in doc["kernels"]}
    verdicts: dict[str, set] = {k: set() for k in doc["kernels"]}
    for r in doc["results"]:
        verdicts[r["kernel"]].add(r["verdict"])
        if r["verdict"] not in ("clean", "n/a"):
            key = (r["plane"].upper(), r["verdict"])
            by[r["kernel"]].setdefault(key, {}).setdefault(r["region"], []).append(r["payload"])
    skipped = {s["kernel"]: s["reason"] for s in doc.get("skipped", []) if s.get("kernel") and not s.get("region")}
    out = {}
    for k in doc["kernels"]:
        if by[k]:
            out[k] = "; ".join(f"{p} {v}: " + ", ".join(f"{reg} ({', '.join(dict.fromkeys(pay))})"
                                                        for reg, pay in regions.items())
                               for (p, v), regions in sorted(by[k].items()))
        elif verdicts[k]:
            out[k] = "clean" if "clean" in verdicts[k] else "n/a only"
        else:
            out[k] = "not run: " + skipped.get(k, "no cell")
    return out


@functools.lru_cache(maxsize=1)
def _cpu_canary() -> dict:
    from qsa_lab.canary import run_canary

    return run_canary(backend="emulate").to_json()


def canary_matrix(name: str = "canary_h200.json") -> str:
    """The built-in kernels' verdicts: run now on this machine's CPU, beside the committed GPU run."""
    here = _cpu_canary()
    gpu = json.loads(evidence(name).read_text())
    cpu_s, gpu_s = _kernel_summary(here), _kernel_summary(gpu)
    kernels = list(dict.fromkeys([*gpu["kernels"], *here["kernels"]]))
    rows = [(f"`{k}`", cpu_s.get(k, "-"), gpu_s.get(k, "-")) for k in kernels]
    head = (f"The canary's default case ({here['kv_dtype']} pool, every region × K/V × nan, inf, max). CPU: run while "
            f"this site was built (torch {here['torch']}, qsa routes on the emulation). GPU: {gpu['gpu']}, torch "
            f"{gpu['torch']}, compiled kernels, committed {_committed(name)} (`{_where(name)}`).")
    return head + "\n\n" + table(("kernel", "CPU (this build)", gpu["gpu"]), rows)


def thirdparty(name: str = "canary_thirdparty_h200.json") -> str:
    doc = json.loads(evidence(name).read_text())
    m = doc["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in m.items() if isinstance(v, (str, int, float)) and k not in ("platform", "vllm", "loadavg"))
    cells: dict[tuple, dict] = {}
    order = {}
    for run in doc["runs"]:
        key = (run["kernel"], run["attend"])
        col = f"{run['kv_dtype']}, {'decode' if run['query_len'] == 1 else str(run['query_len']) + '-row chunk'}"
        order[col] = (run["query_len"], run["kv_dtype"] != "fp16")
        leaks: dict[tuple, list] = {}
        for r in run.get("results", []):
            if r["verdict"] not in ("clean", "n/a"):
                leaks.setdefault((r["plane"].upper(), r["verdict"], r["region"]), []).append(r["payload"])
        text = "; ".join(f"{p} {v}: {reg} ({', '.join(pay)})" for (p, v, reg), pay in sorted(leaks.items()))
        cells.setdefault(key, {})[col] = text or run["summary"]
    cols = sorted(order, key=order.get)
    rows = [(f"`{k}`", f"`{a}`", *(v.get(c, "-") for c in cols)) for (k, a), v in cells.items()]
    load = m.get("loadavg")
    load = f"{load[0]:.1f} (1 min)" if isinstance(load, list) and load else load if load is not None else "not recorded"
    head = f"{versions}; load {load}; committed {_committed(name)}. Source: `{_where(name)}`."
    return head + "\n\n" + table(("kernel", "spec", *cols), rows)


def tile_rig(name: str = "tile_rig_h200.txt") -> str:
    """What each part of a tile costs: the unfixed kernel (L2 flushed) beside copies that leave one part out."""
    text = evidence(name).read_text()
    parts = {}
    for section in re.split(r"^== ", text, flags=re.M)[1:]:
        title, _, body = section.partition("\n")
        m = re.search(r"^unfixed\s+L2-flush\s+[\d.]+ us\s+([\d.]+) us/tile", body, re.M)
        if m:
            parts[title.strip()] = float(m.group(1))
    base = parts.pop("base")
    rows = [("the whole tile (csrc/)", f"{base:.2f}", "-")]
    rows += [(k.replace("_", " "), f"{v:.2f}", f"{base - v:.2f}") for k, v in parts.items()]
    first = re.sub(r" \(UUID: [^)]*\)", "", text.splitlines()[0].lstrip("# "))   # the lent GPU's id is no fact
    head = (f"{first}; committed {_committed(name)}. The unfixed grouped kernel, L2 "
            f"flushed, µs per 32-token tile. Source: `{_where(name)}`.")
    return head + "\n\n" + table(("copy", "µs per tile", "saved against the whole tile"), rows)


PERF = {"tile-rig": tile_rig, "canary-matrix": canary_matrix, "cpu": perf_cpu, "h200": perf_h200, "upstream": perf_upstream, "playground": perf_playground,
        "emulate": perf_emulate, "canary-counts": _canary_counts, "thirdparty": thirdparty}


# ------------------------------------------------------------------ the cross-request leak (issue 37)

def _first_committed(*names: str) -> str | None:
    """The first of `names` committed under evidence/ or data/ (None: none is)."""
    for name in names:
        try:
            evidence(name)
            return name
        except FileNotFoundError:
            continue
    return None


def complete_fix(name: str = "complete_fix_h200.json") -> str:
    """The complete fixes' cost beside kernel_fix (A) and the unfixed route, per shape."""
    if _first_committed(name) is None:
        return ("The complete fixes' cost on a GPU is not measured yet: `bash benchmarks/gpu_check.sh complete-fix` "
                f"on a GPU writes it, to be committed as `data/{name}`.")
    doc = json.loads(evidence(name).read_text())
    heads = ("grouped+masked_load", "grouped+request_groups", "grouped+finite_pv", "grouped+finite_pv, NaN in V", "xqa")
    rows = []
    for sh in doc["shapes"]:
        r = sh["routes"]
        fix = r["grouped+kernel_fix"]["median_us"]
        rows.append([sh["name"], f"{r['grouped']['median_us']:.1f}", f"{fix:.1f}"]
                    + [f"×{r[h]['median_us'] / fix:.2f} ({r[h]['p10_us'] / fix:.2f}–{r[h]['p90_us'] / fix:.2f})" for h in heads]
                    + [f"{r['grouped+kernel_fix']['groups']}+{r['grouped+kernel_fix']['xqa_rows']} | "
                       f"{r['grouped+request_groups']['groups']}+{r['grouped+request_groups']['xqa_rows']}"])
    head = (f"{doc['gpu']} (sm {doc['capability']}), torch {doc['torch']}, CUDA {doc['cuda']}; committed {_committed(name)}. "
            f"Method: {doc['method']}. Each ratio is to grouped+kernel_fix (A)'s median, its own 10th–90th percentile "
            f"in brackets. Source: `{_where(name)}`.")
    out = head + "\n\n" + table(["shape", "grouped µs", "kernel_fix (A) µs", "masked_load (C)", "request_groups (R)",
                                   "finite_pv (F)", "finite_pv, NaN in V", "xqa (all rows)",
                                   "groups + XQA rows: A | R"], rows)
    rem = doc.get("remainder")
    if rem:
        pts = [(p["context"], p["rows"], f"{p['xqa']['median_us']:.1f}", f"{p['padded_group']['median_us']:.1f}",
                p["cheaper"]) for p in rem["points"]]
        out += ("\n\nA request's remainder rows, XQA or one padded group (kernel_fix's kernel, empty query slots): "
                f"measured threshold {rem['remainder_group_min_measured']} rows (8: XQA always), the code's "
                f"REMAINDER_GROUP_MIN {rem['remainder_group_min_in_code']}.\n\n"
                + table(["context", "rows", "XQA µs", "padded group µs", "cheaper"], pts))
    goals = doc.get("goals", {})
    if goals:
        out += "\n\n" + "; ".join(f"{k}: never slower than kernel_fix beyond the spread: {v['never_slower']}, faster on "
                                    f"{len(v['faster_on_mixed'])} of {v['mixed_shapes']} mixed shapes"
                                    for k, v in goals.items()) + "."
    return out


def _leak_cells(doc: dict, q_heads: int, kv_dtype: str, payload: str) -> dict:
    """route -> 'r0→46,47 · r1→45,47' (the other requests' rows each poisoned request reached)."""
    out: dict[str, dict] = {}
    for r in doc["records"]:
        if r["route"] is None or (r["q_heads"], r["kv_dtype"], r["payload"]) != (q_heads, kv_dtype, payload):
            continue
        cell = out.setdefault(r["route"], {})
        if r["request"] != r["poisoned_request"] and r["rows"]:    # a leak, in the words of either schema (/1, /2)
            cell.setdefault(r["poisoned_request"], []).extend(r["rows"])
    from qsa_lab.analysis.leaks import spans

    return {route: " · ".join(f"r{p}→{spans(rows)}" for p, rows in sorted(c.items())) or "-"
            for route, c in out.items()}


def cross_request(names=("cross_request_h200.json", "cross_request_cpu.json")) -> str:
    """Which other requests' rows each poisoned request reaches, per route and query-head count."""
    name = _first_committed(*names)
    doc = json.loads(evidence(name).read_text())
    g = doc["runs"][0]["geometry"]
    out = (f"`qsa-lab cross-request` ({doc['mix']}: rows per request {g['request_rows']}, context {g['context']}, head "
           f"dim {g['head_dim']}; backend {doc['backend']}; committed {_committed(name)}; source `{_where(name)}`). A cell "
           "lists, per poisoned request, the rows of OTHER requests that went non-finite; `-`: none.")
    nowhere = []
    for kv, payload in sorted({(r["kv_dtype"], r["payload"]) for r in doc["records"] if r["route"] is not None}):
        heads = sorted({r["q_heads"] for r in doc["records"] if r["kv_dtype"] == kv})
        cells = {h: _leak_cells(doc, h, kv, payload) for h in heads}
        routes = list(dict.fromkeys(r for h in heads for r in cells[h]))
        if all(c == "-" for h in heads for c in cells[h].values()):
            nowhere.append(f"{payload} in the {kv} cache")
            continue
        out += f"\n\n**{payload} in one request's V, {kv} cache**\n\n" + table(
            ["route"] + [f"{h} query heads" for h in heads], [[f"`{r}`"] + [cells[h].get(r, "-") for h in heads]
                                                                for r in routes])
    if nowhere:
        out += f"\n\nNo route gave another request's row a non-finite value with {' or '.join(nowhere)} (every head count)."
    return out


def _matrix_rows(runs) -> list:
    """One row per kernel, query rows and summary, naming the pools and specs that gave it."""
    grouped: dict = {}
    for r in runs:
        cell = grouped.setdefault((f"`{r['kernel']}`", r["query_len"], r["summary"]), {})
        cell.setdefault(r["kv_dtype"], []).append(f"`{r['attend']}`")
    return [(k, q, summary, "; ".join(f"{kv}: {', '.join(specs)}" for kv, specs in pools.items()))
            for (k, q, summary), pools in grouped.items()]


def other_rows(names=("canary_other_rows_cpu.json", "canary_other_rows_h200.json",
                      "canary_other_rows_flashinfer_h200.json")) -> str:
    """The per-row rule (other-rows) beside other-requests, per kernel, from each committed run."""
    found = [n for n in names if _first_committed(n)]
    out = []
    for name in found:
        doc = json.loads(evidence(name).read_text())
        if "runs" in doc:   # the third-party matrix: one canary run per kernel, dtype, spec and query rows
            out.append(f"FlashInfer {doc['machine'].get('flashinfer')} over the third-party matrix on the "
                       f"{doc['machine'].get('gpu')}, regions {doc.get('regions_asked')} (committed {_committed(name)}, "
                       f"`{_where(name)}`; each row gathers the pools and specs that gave one summary):\n\n"
                       + table(("kernel", "query rows", "summary", "pool: specs"), _matrix_rows(doc["runs"])))
            continue
        rows = [(f"`{k}`", v) for k, v in _kernel_summary(doc).items()]
        where = ("the CPU, qsa routes on the emulation" if doc.get("device") == "cpu" else
                 f"{doc.get('gpu')}, qsa routes on the {'compiled kernels' if doc.get('backend') == 'cuda' else 'emulation'}")
        out.append(f"The canary's case, regions other-rows and other-requests ({where}; committed {_committed(name)}; "
                   f"`{_where(name)}`):\n\n" + table(("kernel", "non-clean cells"), rows))
    missing = [n for n in names if n not in found]
    if missing:
        out.append("Not committed yet: " + ", ".join(f"`evidence/{n}`" for n in missing)
                   + " (`bash benchmarks/gpu_check.sh` on a GPU writes them).")
    return "\n\n".join(out)


PERF.update({"complete-fix": complete_fix, "cross-request": cross_request, "other-rows": other_rows})


def scribble_h200(name: str = "scribble_h200/summary.json") -> str:
    """Per configuration of the H200 run: every check that was not clean or n/a."""
    doc = json.loads(evidence(name).read_text())
    facts = doc["facts"]
    rows = []
    for config, got in doc["configs"].items():
        if "error" in got or "skipped" in got:
            rows.append([f"`{config}`", "could not run" if "error" in got else f"skipped ({got['skipped']})", ""])
            continue
        shown = {}
        for cell, verdict in got["verdicts"].items():
            if verdict not in ("clean", "n/a"):
                check, region, payload = cell.split(":")
                shown.setdefault((check, region, verdict), []).append(payload)
        found = "; ".join(f"{check} `{region}`: {verdict} ({', '.join(p)})" for (check, region, verdict), p in shown.items())
        rows.append([f"`{config}`", found or "every check clean or n/a", str(got["exit_code"])])
    return (table(["configuration", "what was not clean", "exit"], rows)
            + f"\n\n*{facts['gpu']}, torch {facts['torch']}, transformers {facts['transformers']}, tiny Llama in fp16, "
              f"workload chunked-prefill (issue32 in older runs) unless the configuration names another; "
              f"committed {_committed(name)}. Source: `{_where(name)}`.*")


def scribble_vllm(folder: str = "scribble_vllm_cpu") -> str:
    """Per configuration of the vLLM CPU matrix: the regions each check covered and every cell that was
    not clean (a clean configuration says so)."""
    rows = []
    facts = None
    for path in sorted((REPO / "evidence" / folder).glob("*.json")):
        doc = json.loads(path.read_text())
        facts = facts or {**doc, **doc["facts"]}    # the header's machine facts (torch, ...) and the engine's
        wl = doc["workload"]["name"]
        caching = "on" if doc["facts"].get("prefix_caching") else "off"
        shown = {}
        for c in doc["results"]:
            if c["verdict"] not in ("clean", "n/a"):
                shown.setdefault((c["check"], c["region"], c["verdict"]), []).append(c["payload"])
        found = "; ".join(f"{check} `{region}`: {verdict} ({', '.join(p)})" for (check, region, verdict), p in shown.items())
        held = sorted({c["region"] for c in doc["results"] if c["check"] == "read" and c["verdict"] != "n/a"})
        e = doc["events"]
        engine = (f"{e['steps']} steps, {e['chunked_prefill']} chunked prefills, {e['preempted']} preempted, "
                  f"{e['prefix_hit_tokens']} prefix-hit tokens, {e['blocks_reused']} blocks reused")
        rows.append([f"`{doc['model']}`, `{wl}`, prefix caching {caching}", engine, ", ".join(held),
                     found or "every check clean or n/a", f"`{path.relative_to(REPO).as_posix()}`"])
    return (table(["configuration", "the engine did", "regions checked", "what was not clean", "source"], rows)
            + f"\n\n*vLLM {facts['vllm']} (CPU backend, attention `{facts['attention']}`, ISA `{facts['isa']}`), "
              f"torch {facts['torch']}, {facts['processor']}; payloads nan, inf, max.*")


def scribble_cost(names=("bench_scribble_cpu.json", "scribble_h200/bench_scribble_h200_graphs.json",
                         "bench_scribble_transformers_cpu.json", "bench_scribble_vllm_cpu.json")) -> str:
    """What one generation costs plain, with the write guard, and with one region scribbled."""
    rows = []
    for name in names:
        doc = json.loads(evidence(name).read_text())
        gpu = doc["facts"].get("gpu")
        where = (gpu if gpu and gpu != "none (CPU)" else None) or doc["facts"].get("processor") or doc["device"]
        load = doc.get("load_avg_1min", {}).get("start")
        engine = f"{doc['engine']}, " if doc.get("engine") == "transformers" else ""    # vLLM's mode is "vllm"
        for mode, r in doc["results"].items():
            matrix = r.get("matrix")
            rows.append([f"{where}, {engine}{mode}" + (f" (load {load:.1f})" if load is not None else ""),
                         f"{1e3 * r['plain']['median_s']:.0f} ms", f"×{r['guard']['x_plain']:.2f}",
                         f"×{r['scribble']['x_plain']:.2f}", f"{matrix['seconds']:.0f} s" if matrix else "",
                         f"`{_where(name)}`"])
    return table(["machine, mode", "plain generation", "write guard", "guard + one region", "whole matrix", "source"],
                 rows)


def log_section(spec: str) -> str:
    """`FILE "== header"`: that header's lines up to the next `==` or `#` line, as a code block."""
    m = re.fullmatch(r'(\S+) "(.+)"', spec.strip())
    if not m:
        raise ValueError(f"docs: qsa:log wants FILE \"HEADER\", got {spec!r}")
    lines = evidence(m.group(1)).read_text().splitlines()
    try:
        start = lines.index(m.group(2))
    except ValueError:
        raise ValueError(f"docs: {m.group(2)!r} is not a line of {_where(m.group(1))}") from None
    body = []
    for line in lines[start + 1:]:
        if line.startswith(("==", "# ")):
            break
        body.append(line)
    return f"```\n$ {m.group(2).removeprefix('== ')}\n" + "\n".join(body).rstrip() + "\n```"


# ------------------------------------------------------------------ public API names

DIRECTIVE = re.compile(r"^::: (qsa_lab[\w.]*)[ \t]*\n((?:    .*\n)*)", re.M)


def resolve(public: str) -> str:
    """The dotted path where a public name (`qsa_lab.build_case`, loaded lazily by the package)
    is defined, so the API page keeps the public names while modules move beneath them."""
    import sys

    module, _, name = public.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        try:
            importlib.import_module(public)
            return public                     # a module
        except ImportError:
            raise ValueError(f"docs: the documented API name {public} does not exist") from None
    where, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(where, str) and where.startswith("qsa_lab") and qual == name:
        return f"{where}.{qual}"
    holders = [n for n, mod in sorted(sys.modules.items())   # a constant: the modules that hold it,
               if n.startswith("qsa_lab.") and n != module and vars(mod).get(name) is obj]
    for mod_name in holders:                                   # the one that assigns it first
        source = Path(sys.modules[mod_name].__file__).read_text()
        if re.search(rf"^{re.escape(name)}\s*[:=]", source, re.M):
            return f"{mod_name}.{name}"
    return f"{holders[0]}.{name}" if holders else public


def api_directives(markdown: str) -> str:
    def one(m):
        public = m.group(1)
        real = resolve(public)
        block = m.group(2)
        if real == public:
            return m.group(0)
        if "    options:\n" not in block:
            block = "    options:\n" + block
        block = block.replace("    options:\n", f"    options:\n      heading: \"{public}\"\n", 1)
        return f"::: {real}\n{block}"
    return DIRECTIVE.sub(one, markdown)


def expand(markdown: str) -> str:
    def marker(m):
        kind, arg = m.group(1), (m.group(2) or "").strip()
        if kind == "cli":
            return cli_reference()
        if kind == "routes":
            return routes_table()
        if kind == "doctor":
            return doctor_table()
        if kind == "perf":                       # perf KIND [FILE]
            kind, _, name = arg.partition(" ")
            return PERF[kind](name) if name else PERF[kind]()
        if kind == "log":
            return log_section(arg)
        if kind == "scribble_h200":
            return scribble_h200()
        if kind == "scribble_cost":
            return scribble_cost()
        if kind == "scribble_vllm":
            return scribble_vllm()
        raise ValueError(f"docs: unknown marker qsa:{kind}")

    markdown = api_directives(MARKER.sub(marker, markdown))
    return EVIDENCE.sub(lambda m: f"`{evidence(m.group(1)).relative_to(REPO).as_posix()}`", markdown)


# ------------------------------------------------------------------ figures

def nan_map_png() -> bytes:
    """The report's decode-like case (19 rows, 5 poisoned dims) through the unfixed grouped route."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from qsa_lab import Geometry, apply_poison, build_case, run_routes

    figdata, plotting = importlib.import_module(FIGDATA_MODULE), importlib.import_module(PLOTTING_MODULE)
    case = apply_poison(build_case(Geometry(rows=19)), "targeted", dims=[102, 152, 168, 170, 230])
    result = run_routes(case, backend="emulate")
    ax = plotting.plot_nan_map(figdata.nan_map(result, "grouped"))
    buf = io.BytesIO()
    ax.figure.savefig(buf, format="png", dpi=100, bbox_inches="tight", metadata={"Software": None})
    plt.close(ax.figure)
    return buf.getvalue()


# ------------------------------------------------------------------ MkDocs events

_TEMPORARY = []   # folders on_config made for the build (the kernels' sockets, the notebooks' figures)
_ENVIRON = {}     # the variables on_config set, as they were before


def on_post_build(config):
    import shutil

    while _TEMPORARY:
        shutil.rmtree(_TEMPORARY.pop(), ignore_errors=True)
    for key, value in _ENVIRON.items():     # `mkdocs serve` builds again from the same environment
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _ENVIRON.clear()


def _setenv(key: str, value: str) -> None:
    _ENVIRON.setdefault(key, os.environ.get(key))
    os.environ[key] = value


def on_startup(command, dirty):
    logging.getLogger("mkdocs.plugins.mkdocstrings_handlers.python._internal.rendering").addFilter(
        lambda record: NO_FORMATTER not in record.getMessage())


def on_config(config):
    # the notebooks run on the CPU emulation, and write their figures out of the checkout
    _setenv("QSA_LAB_BACKEND", "emulate")
    if not os.environ.get("QSA_LAB_FIGURES"):
        _TEMPORARY.append(tempfile.mkdtemp(prefix="qsa_docs_figures_"))
        _setenv("QSA_LAB_FIGURES", _TEMPORARY[-1])
    # their kernels keep Jupyter's inline backend (a notebook without `%matplotlib inline` draws
    # its figures too: no MPLBACKEND here), and talk to the build over IPC sockets in a folder of
    # their own (an absolute path: a kernel runs in its notebook's folder), not over unencrypted
    # TCP, which every kernel warns about
    if os.name == "posix":
        folder = Path(tempfile.mkdtemp(prefix="qsa_docs_jupyter_"))
        _TEMPORARY.append(folder)
        (folder / "jupyter_nbconvert_config.json").write_text(
            json.dumps({"KernelManager": {"transport": "ipc", "ip": str(folder / "kernel")}}))
        _setenv("JUPYTER_CONFIG_PATH", os.pathsep.join(
            p for p in (str(folder), os.environ.get("JUPYTER_CONFIG_PATH")) if p))
    return config


def on_files(files, config):
    from mkdocs.structure.files import File

    # the NaN map the README shows (docs/assets/nan_map.png, committed) is drawn again for the site
    old = files.get_file_from_path("assets/nan_map.png")
    if old is not None:
        files.remove(old)
    files.append(File.generated(config, "assets/nan_map.png", content=nan_map_png()))
    # QSA_DOCS_EXECUTED: a folder laid out as docs/ holding notebooks executed already (by the test
    # suite, which runs them for its own checks): those are shown as they ran there, not run again
    executed = os.environ.get("QSA_DOCS_EXECUTED")
    for file in files if executed else ():
        ran = Path(executed) / file.src_uri
        if ran.suffix == ".ipynb" and ran.is_file():
            file.abs_src_path = str(ran)
            config["plugins"]["mkdocs-jupyter"].config["execute_ignore"].append(str(ran))
    return files


def on_page_markdown(markdown, page, config, files):
    return expand(markdown)


IMG = re.compile(r"(<img\b[^>]*\bsrc=\"(?!data:)([^\"]+)\"[^>]*>)")


def link_figures(html: str) -> str:
    """Every figure that is a file becomes a link to that file (its full size; the lightbox of
    assets/figures.js opens it in place, and notebooks' inline figures too)."""
    def one(m):
        start = html.rfind("<", 0, m.start())
        if html.startswith("<a ", start) and html.find("</a>", m.end()) != -1 and "href" in html[start:m.start()]:
            return m.group(1)
        return f'<a href="{m.group(2)}" class="qsa-figure-link">{m.group(1)}</a>'
    return IMG.sub(one, html)


def on_page_content(html, page, config, files):
    return link_figures(html)


def on_page_context(context, page, config, nav):
    # a notebook page gives its figures the width of the table of contents beside it
    if page.file.src_uri.endswith(".ipynb"):
        page.meta["hide"] = sorted({*page.meta.get("hide", []), "toc"})
    return context


if __name__ == "__main__":  # python docs/hooks/qsa_docs.py: print a page's expansion, or write the README figure
    import sys

    if sys.argv[1:] == ["--readme-figure"]:
        (REPO / "docs" / "assets" / "nan_map.png").write_bytes(nan_map_png())
    else:
        print(expand(Path(sys.argv[1]).read_text()))

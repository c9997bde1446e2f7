"""A leak report a kernel's maintainer can act on: `qsa-lab canary ... --report DIR`.

    from qsa_lab.canary import run_canary
    from qsa_lab.canary.report import write_report
    write_report(run_canary(["flashinfer:prefill-fa2"], attend="sparse", ...), "leak-report")

The folder travels: copy or zip it, and everything in it works from wherever it is unpacked.
This module builds the report's data (blocks); qsa_lab.canary.calls writes the call files and
runs the calls that find the smallest leak, qsa_lab.canary.render writes the Markdown and HTML.

    report.md, report.html  the counts (qsa_lab.analysis.leaks.counts: the same numbers as the
                            command line and canary.json), the command line that wrote it, the
                            versions (qsa_lab, torch, CUDA, GPU, driver, libraries), the case and
                            its attention spec, the leak matrix, then kernel -> region -> plane
                            with the payloads folded into one entry: verdicts, where the leak
                            lands (rows, heads, dims, first NaN), the call file, replay line and
                            standalone script
    leak_matrix.png, canary.json
    calls/<cell>.safetensors  per leaking kernel x region x plane, the smallest poisoned call
                            found that still leaks (the region's slots halved while one half
                            alone leaks); also a case file for `qsa-lab canary --case`
    kernels/<file>.py       a user's kernel file (`file.py:function`), copied in
    repro/<cell>.py         for a built-in third-party kernel (FlashInfer, vLLM): a standalone
                            script, torch + safetensors + the library only (qsa_lab.canary.standalone)

Replay lines are relative to the report folder (`cd DIR` first):

    qsa-lab replay calls/<cell>.safetensors [--kernel kernels/<file>.py:fn]

`qsa-lab replay`, never `python -m ...`: the folder is data someone sent, and `python -m` puts the
current folder first on the import path (a `torch.py` or `qsa_lab/` there would run). A standalone
script takes its own folder off the path before importing anything (qsa_lab.canary.standalone).

Exit codes of replay and of every standalone script: 1 the leak reproduces, 0 it does not,
3 it cannot run or cannot tell here (2: bad input, for replay).

The folder is written whole (qsa_lab.support.outputs.writing_folder): beside its final name,
renamed into place when complete, so a failed or interrupted run leaves nothing; an existing
folder is replaced only with force, only when it holds nothing but a report's files (none of
them a symlink), and never when it holds one of the run's inputs.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from qsa_lab.analysis.leaks import CLEAN, INF_LEAK, LEAKS, NA, NAN_LEAK, counts, summary
from qsa_lab.canary.calls import call_stem, kernel_runner, save_call, smallest_leak
from qsa_lab.canary.names import FILE, MODULE, parse_kernel
from qsa_lab.canary.render import html, markdown


def environment(kernels=()) -> dict:
    """Versions a maintainer asks for first: qsa_lab, Python, torch, CUDA, GPU, driver, libraries."""
    from qsa_lab.canary.adapters import versions
    from qsa_lab.support.machine import machine_facts

    facts = machine_facts(driver=True)
    out = {"qsa_lab": facts["qsa_lab_version"], **{k: facts[k] for k in ("python", "torch", "cuda", "gpu", "driver")}}
    out.update({lib: v or "not installed" for lib, v in versions(kernels).items()})
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception:  # noqa: BLE001 - optional
        pass
    return out


# -- the report -----------------------------------------------------------------------------------

#: what a report folder holds: the only names `--force` replaces
NAMES = ("report.md", "report.html", "leak_matrix.png", "canary.json", "calls", "kernels", "repro")
MATRIX_MAX_PX = 1200   # the leak matrix's width cap: it fits a 1280-px window beside the page margins


def check_report_dir(out_dir, force: bool = False, inputs: dict | None = None, outputs: dict | None = None) -> Path:
    """The report folder, checked before any work (qsa_lab.support.outputs.check_new_folder):
    absent or empty; with force, a report folder (NAMES only, no symlink among them); never a
    folder holding one of `inputs` ({option: path}, e.g. --case, a kernel file) or `outputs` (--json)."""
    from qsa_lab.support.outputs import check_new_folder

    return check_new_folder(out_dir, "report", force, NAMES, inputs, outputs)


def write_report(report, out_dir, force: bool = False, minimize: bool = True, fns: dict | None = None,
                 progress=None, command: str | None = None, inputs: dict | None = None) -> Path:
    """Write the report folder (see the module's docstring), whole: beside `out_dir`, renamed into
    place when complete. `fns`: kernel name -> callable (default: resolved from the names; give
    it for kernels passed as callables). `command`: the command line that ran the canary.
    `inputs`: {option: path} the folder must not hold. -> the Markdown file's path."""
    from qsa_lab.support.outputs import writing_folder

    out = Path(out_dir)
    with writing_folder(out, "report", force, NAMES, inputs) as tmp:
        env = environment(report.kernels)
        doc = report.to_json()
        (tmp / "canary.json").write_text(json.dumps(doc, indent=1) + "\n")
        figure = _figure(report, tmp / "leak_matrix.png")
        kernel_files = _copy_kernel_files(report.names, tmp)
        calls = _leak_calls(report, tmp, env, minimize, fns or {}, progress, kernel_files)
        blocks = _blocks(report, doc, env, figure, calls, command, kernel_files)
        (tmp / "report.md").write_text(markdown(blocks))
        (tmp / "report.html").write_text(html(blocks))
    return out / "report.md"


def _figure(report, path: Path) -> str | None:
    if not report.results:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from qsa_lab.canary.figures import leak_matrix, plot_leak_matrix

    fig = plot_leak_matrix(leak_matrix(report)).figure
    fig.canvas.draw()
    width_in = fig.get_tightbbox(fig.canvas.get_renderer()).width + 0.2
    fig.savefig(path, dpi=min(120, MATRIX_MAX_PX / width_in), bbox_inches="tight")
    plt.close(fig)
    return path.name


def _copy_kernel_files(names: dict, out: Path) -> dict:
    """A user's `file.py:function` kernels ({kernel name: KernelName}) -> {kernel name:
    'kernels/<file>.py:function'}, the files copied into the report (a maintainer's replay needs
    them; a name taken twice is numbered)."""
    import shutil

    copied, taken = {}, {}
    for kernel, name in names.items():
        if name.kind != FILE or not Path(name.source).is_file():
            continue
        src = Path(name.source).resolve()
        if src not in taken:
            stem, n = src.stem, 1
            while f"{stem}.py" in taken.values():
                n += 1
                stem = f"{src.stem}_{n}"
            taken[src] = f"{stem}.py"
            (out / "kernels").mkdir(exist_ok=True)
            shutil.copyfile(src, out / "kernels" / taken[src])
        copied[kernel] = f"kernels/{taken[src]}:{name.function}"
    return copied


def _replay_command(call_file: str, kernel: str, name, kernel_files: dict) -> str:
    """The replay line, relative to the report folder. Built-in names (`name`, the kernel's
    KernelName) are looked up by replay; a copied kernel file is named on the command line; a
    module, or a Python callable whose module:qualname is one, too; any other callable has no
    loadable name."""
    cmd = f"qsa-lab replay {call_file}"   # never python -m: it would import from the folder (module docstring)
    if name is not None and name.in_process:
        return cmd
    if kernel in kernel_files:
        return f"{cmd} --kernel {kernel_files[kernel]}"
    if name is None:
        try:
            name = parse_kernel(kernel)
        except ValueError:
            pass
    if name is not None and name.kind == MODULE:
        return f"{cmd} --kernel {name.text}"
    return cmd + " --kernel MODULE:FUNCTION"


PAYLOAD_ORDER = ("nan", "inf", "max", "zero")

#: what to change in a kernel whose output a region reached (qsa_lab.model.regions names them):
#: the report's one sentence per leaking region
WHAT_TO_CHANGE = {
    "null-block": "keep padding entries (of the block table or of the kernel's own plan) out of P @ V: skip "
                  "them, point them at a real page, or zero every row no query attends after the load",
    "stale-tail": "bound each request's last page by seq_len where it is loaded, or zero the rows at or past "
                  "seq_len before P @ V",
    "stale-microblock": "zero (or never load) the never-written slots after seq_len in the last partial "
                        "microblock, which a microblock-granular load brings in with the attended tokens",
    "free-pages": "walk only the pages the block table (or page list) gives each request: the kernel read "
                  "pages that no request owns",
    "other-requests": "keep every row's loads inside its own request's pages: check the block-table row and "
                      "page offset each row uses, and where a tile's rows span requests, zero per row what "
                      "that row does not attend, not per tile",
    "unselected": "load (or zero) only the blocks a row's selection names",
    "out-of-window": "load (or zero) only the tokens inside each row's window and sink",
    "masked": "load (or zero) only the tokens the mask attends",
}


def what_to_change(region: str, plane: str, verdicts) -> str:
    """One sentence: what to change for a leak from `region` through `plane` (K or V)."""
    fix = WHAT_TO_CHANGE.get(region, "load (or zero) only the tokens each row attends")
    why = ("a NaN key makes its score NaN: mask scores with a select (a where), never by adding -inf or "
           "multiplying by 0, and keep such keys out of the loads" if plane == "k" else
           "a probability of 0 does not stop 0 × NaN = NaN" if set(verdicts) & {NAN_LEAK, INF_LEAK} else
           "the unattended slots got weight (check the mask itself)")
    return f"What to change: {fix}; {why}."


def _entries(report) -> list:
    """The leaking (kernel, region, plane) entries, payloads folded: [{"kernel", "region",
    "plane", "cells": [LeakResult] (leaking, nan first), "where"}], in run order."""
    groups = {}
    for r in report.leaks():
        groups.setdefault((r.kernel, r.region, r.plane), []).append(r)
    out = []
    for (kernel, region, plane), cells in groups.items():
        cells.sort(key=lambda r: PAYLOAD_ORDER.index(r.payload) if r.payload in PAYLOAD_ORDER else 9)
        out.append({"kernel": kernel, "region": region, "plane": plane, "cells": cells, "where": _where(cells[0])})
    return out


def _where(r) -> dict:
    """Where a leaking cell's changed outputs land: rows, heads, dims, and the first NaN [row, head, dim]."""
    w = r.where()
    first = None
    if r.output is not None and r.leak is not None:
        nan = torch.isnan(r.output) & r.leak
        first = torch.nonzero(nan)[0].tolist() if bool(nan.any()) else None
    return {**w, "first_nan": first}


#: regions judged part by part on some rows only (qsa_lab.model.regions.region_parts): a call file
#: judges every row, and the poisoned requests' own rows attend those pages, so a replay would blame
#: a correct kernel. Such a leak is reported with where it lands, without a call file.
JUDGED_BY_PART = ("other-requests", "other-rows")


def _leak_calls(report, out: Path, env: dict, minimize: bool, fns: dict, progress, kernel_files: dict) -> list:
    """One smallest leaking call per (kernel, region, plane), for its first leaking payload; its
    replay line and, for a built-in third-party kernel, its standalone script."""
    from qsa_lab.canary.standalone import write_script
    from qsa_lab.model.regions import region_slots

    calls, runners, used = [], {}, set()
    device = torch.device(report.device) if report.device else torch.device("cpu")
    try:
        for e in _entries(report):
            r = e["cells"][0]
            if r.region in JUDGED_BY_PART:
                calls.append({**e, "payload": r.payload, "verdict": r.verdict, "slots": [], "file": None})
                continue
            slots = region_slots(report.case, r.region)
            verdict, counts = r.verdict, {"nan": r.nan, "inf": r.inf, "finite_changed": r.finite_changed}
            if minimize:
                if progress:
                    progress(f"report: smallest leaking call of {r.kernel} {r.region}/{r.plane}/{r.payload}")
                try:
                    if r.kernel not in runners:
                        kernel = fns.get(r.kernel) or report.names.get(r.kernel) or r.kernel
                        runners[r.kernel] = kernel_runner(kernel, report.backend,
                                                          getattr(report, "timeout", 600.0))
                    slots, verdict, counts = smallest_leak(runners[r.kernel], report.case, r.region, r.plane,
                                                           r.payload, None, device)
                except Exception as err:  # noqa: BLE001 - keep the whole region; say why
                    counts = {**counts, "minimize_error": f"{type(err).__name__}: {err}"}
            name = stem = call_stem(report.names.get(r.kernel, r.kernel), r.region, r.plane, r.payload)
            n = 1
            while name in used:     # two kernel files of one name (a/k.py, b/k.py): one call file each
                n += 1
                name = f"{stem}_{n}"
            used.add(name)
            save_call(out / "calls" / f"{name}.safetensors", report.case, r.kernel, r.region, r.plane, r.payload,
                      slots, None, verdict, counts, env, copy=kernel_files.get(r.kernel))
            n = int(slots.sum())
            script = write_script(out / "repro" / f"{name}.py", report.names.get(r.kernel), report.case,
                                  f"{name}.safetensors",
                                  {"region": r.region, "plane": r.plane, "payload": r.payload, "slots": n})
            calls.append({**e, "payload": r.payload, "verdict": verdict, "counts": counts,
                          "slots": torch.nonzero(slots).tolist(), "file": f"calls/{name}.safetensors",
                          "replay": _replay_command(f"calls/{name}.safetensors", r.kernel, report.names.get(r.kernel),
                                                    kernel_files),
                          "script": f"repro/{name}.py" if script else None,
                          "full_region": int(region_slots(report.case, r.region).sum())})
    finally:
        for runner in runners.values():
            runner.close()
    return calls


def _span(values: list, limit: int = 12) -> str:
    """[0, 1, 2, 3, 7] -> '0-3, 7' (at most `limit` runs)."""
    runs = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    text = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs[:limit])
    return text + (" ..." if len(runs) > limit else "") if runs else "none"


def _blocks(report, doc: dict, env: dict, figure, calls, command, kernel_files) -> list:
    c = report.case
    b = [("h1", "qsa_lab canary leak report"),
         ("p", f"{summary(doc['counts'])}; kernels: {', '.join(report.kernels)}. A cell is one kernel x region x "
               "plane x payload; a check is a cell whose leak check ran (clean or a leak): n/a cells and "
               "failures (error, unstable control, modified input) are cells but not checks."),
         ("h2", "Command"),
         ("code", command or "(written from Python, not from the command line)"),
         ("h2", "Versions"), ("table", ["component", "version"], [[k, str(v)] for k, v in env.items()]),
         ("h2", "Case and attention spec"),
         ("p", c.describe()),
         ("p", f"Attention spec: {c.spec} (what each query row attends; every other byte the call can "
               "reach is poisoned, one region, plane and payload at a time, and compared bit for bit "
               "against a zero-filled control run of the same kernel)."),
         ("table", ["region", "slots"], [[k, str(v)] for k, v in doc.get("regions", {}).items()])]
    if kernel_files:
        b.append(("p", "Kernel files copied into this folder: "
                       + "; ".join(f"{k} -> {v}" for k, v in kernel_files.items()) + "."))
    if figure:
        b += [("h2", "Leak matrix"), ("img", figure)]
    b += [("h2", "Replaying"), ("p", _replaying(calls, kernel_files))]
    by_kernel = {}
    for call in calls:
        by_kernel.setdefault(call["kernel"], []).append(call)
    for kernel in report.kernels:
        b += _kernel_blocks(report, kernel, by_kernel.get(kernel, []))
    if report.skipped:
        b += [("h2", "Not run"),
              ("table", ["what", "reason"], [["/".join(str(s[k]) for k in ("kernel", "region", "plane", "payload")
                                                        if k in s) or "-", s.get("reason", "")]
                                               for s in report.skipped])]
    return b


def _replaying(calls: list, kernel_files: dict) -> str:
    """The Replaying section's words: what this folder holds to run the calls again, and only that."""
    text = ("Every path below is relative to this folder: cd into it (wherever it was copied or unpacked), then "
            "run a replay line (it needs qsa_lab)")
    scripts = any(c.get("script") for c in calls)
    if scripts:
        text += (" or a standalone script (repro/: it needs only the kernel's library, torch and safetensors). "
                 "Exit codes, for both")
    else:
        text += ". Exit codes"
    text += ": 1 the leak reproduces, 0 it does not, 3 it cannot run or cannot tell here (replay: 2 bad input)."
    if kernel_files:
        text += (" A kernel file of your own is copied into kernels/, and its replay line names that copy. It has "
                 "no standalone script: qsa_lab cannot write your library's call for you, so the replay line "
                 "(qsa_lab and the copied file) is how to run it again.")
    return text + (" Replay as written, `qsa-lab replay`, never `python -m qsa_lab.canary.replay`: `python -m` puts "
                   "the current folder first on Python's import path, so a file lying in this folder (a torch.py, a "
                   "qsa_lab/ folder) would be imported and run; `qsa-lab replay` and the standalone scripts import "
                   "nothing from this folder but the call file and the kernel file you name.")


def _kernel_blocks(report, kernel: str, calls: list) -> list:
    """One kernel: its counts, its leaks (region -> plane, payloads folded), its other non-clean cells."""
    mine = [r for r in report.results if r.kernel == kernel]
    b = [("h2", f"Kernel {kernel}"), ("p", summary(counts(r.verdict for r in mine)) + ".")]
    for call in calls:
        w, n = call["where"], len(call["slots"])
        payloads = "; ".join(f"{r.payload}: {r.verdict} ({r.nan} NaN, {r.inf} Inf, {r.finite_changed} finite changed)"
                             for r in call["cells"])
        b += [("h3", f"{call['region']} / {call['plane'].upper()} plane"),
              ("p", f"Payloads: {payloads}."),
              ("p", what_to_change(call["region"], call["plane"], [r.verdict for r in call["cells"]])),
              ("p", f"Where it lands: rows {_span(w['rows'])}; heads {_span(w['heads'])}; dims {_span(w['dims'])}; "
                    f"first NaN at [row, head, dim] {w['first_nan'] if w['first_nan'] is not None else 'none'}.")]
        if call["file"] is None:
            b.append(("p", "No call file: this region is judged one request at a time (each request's rows "
                           "against the other requests' pages), which a replayed call, judged on every row, "
                           "cannot express. Run the canary again with --regions " + call["region"] + "."))
            continue
        b += [("p", f"Smallest call ({call['payload']}): {call['verdict']}, {call['counts'].get('nan', 0)} NaN, "
                    f"{call['counts'].get('inf', 0)} Inf, {call['counts'].get('finite_changed', 0)} finite changed "
                    f"with {n} of the region's {call['full_region']} slots poisoned (physical [page, slot]: "
                    f"{call['slots'][:8]}{' ...' if n > 8 else ''}); nothing else differs from the control call. "
                    f"Call file: {call['file']}."),
              ("code", call["replay"] + (f"\npython {call['script']}" if call["script"] else ""))]
    other = [r for r in mine if r.verdict not in (CLEAN, NA) and r.verdict not in LEAKS]
    if other:
        b.append(("table", ["region", "plane", "payload", "verdict", "note"],
                  [[r.region, r.plane, r.payload, r.verdict, (r.error or r.note or ", ".join(r.modified))[:200]]
                   for r in other]))
    na = list(dict.fromkeys(f"{r.region}/{r.plane}" for r in mine if r.verdict == NA))
    if na:
        b.append(("p", "n/a (the call's inputs reference no byte of the region, so no leak can be drawn): "
                       + ", ".join(na) + "."))
    if not calls and not other:
        b.append(("p", "No leak: every check ran clean." if any(r.verdict == CLEAN for r in mine)
                  else "No check ran."))
    return b

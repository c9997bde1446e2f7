"""A scribble report a maintainer can act on: `qsa-lab scribble ... --report DIR`.

    from qsa_lab.scribble import TransformersEngine, scribble, tiny_model, workload
    from qsa_lab.scribble.standalone import check_report_dir, write_report
    check_report_dir("rep")                        # before any work: refuse a folder it may not write
    write_report(scribble(engine), "rep")          # -> rep/report.md

How the command line calls it: `qsa-lab scribble --report DIR [--force]` runs
`check_report_dir(DIR, force)` before building the engine (a bad folder is bad input, exit 2), then,
after the matrix, `write_report(report, DIR, force=force, command=<the command line>,
python=sys.executable, progress=<stderr printer>)`; the command's exit code stays the report's
(`report.exit_code()`). Under `--engine vllm` the command already runs in vLLM's environment, so
`sys.executable` is the Python the vLLM script is checked with.

The folder (written whole, beside its final name, renamed into place when complete:
qsa_lab.support.outputs.writing_folder; an existing folder is never replaced without force, and
with force only when it holds nothing but these names):

    report.md          what leaked (region, payload, verdict, counts), which request read which
                       request's rows at which step and layer, every head and head dim the leak
                       reached, and per leak what an engine developer changes
    scribble.json      the report's JSON (the same as `--json`)
    verdict_grid.png   qsa_lab.scribble.verdict_grid
    scripts/<name>.py  per confirmed leak kind a standalone script (engine + torch only, exit 1 leak /
                       0 clean / 3 cannot run; `--workaround` applies an engine-side fix: exit 0)
    scripts/<name>.json  its workload, how much smaller it is than the default workload, its checks

The script's workload is the smallest known to leak (SMALLEST: found by
qsa_lab.scribble.standalone.shrink and committed with its runs), checked again here when `check`
(exit 1 as written, 0 with --workaround, in `python` from an empty folder); `shrink=True` searches
again from the default workload (minutes on the CPU; vLLM's engine starts once per candidate).
"""
from __future__ import annotations

import json
from pathlib import Path

from .scripts import DEFAULTS, EXIT_CLEAN, EXIT_LEAK, script_name, script_text
from .shrink import ShrinkError, run_script, shrink as shrink_workload, size

NAMES = ("report.md", "scribble.json", "verdict_grid.png", "scripts")

#: the smallest workloads found to leak (scripts/shrink_scribble_scripts.py, evidence/scribble_standalone/)
SMALLEST = {
    "vllm-cpu-tail": {"prompt_lengths": [2, 1], "new_tokens": 1, "layers": 1, "blocks": 2, "batch_tokens": 32,
                      "bad": 7, "bad_at": 1, "vocab": 512, "seed": 0, "dtype": "float32", "prefix_caching": True},
    "transformers-other-requests": {"prompt_lengths": [1, 1], "new_tokens": 1, "layers": 1, "page_size": 8,
                                    "blocks": 2, "batch_tokens": 8, "bad": 7, "bad_at": 0, "vocab": 128, "seed": 0,
                                    "attn": "paged|eager"},
}

#: what an engine developer changes, per region that leaked (the engine's family decides where it
#: differs); the scripts' --workaround is the first change named
WHAT_TO_CHANGE = {
    ("vllm", "unwritten-tail"): "zero or mask V past each request's length inside its last block before P @ V "
                                "(mask with a select, never by multiplying V by P = 0), or zero each block when "
                                "the allocator hands it out (vLLM's own new_block_ids_to_zero, today enabled only "
                                "for Mamba and mixed-precision caches)",
    ("vllm", "other-requests"): "the same change as for unwritten-tail: a block handed to a new request still "
                                "holds its previous owner's KV past the new request's length, and the attention "
                                "reads it with weight 0; zero blocks on hand-out, or mask V past each request's "
                                "length inside its last block",
    ("vllm", "out-of-window"): "start a sliding window's first tile at the window's first token, or zero or mask "
                               "V before the window inside that tile",
    ("transformers", "other-requests"): "keep requests' columns out of each other's arithmetic: run each request's "
                                        "rows against its own keys (a varlen kernel given cu_seq_lens, or one call "
                                        "per request) instead of one call over the packed batch with an additive "
                                        "mask; or select masked probabilities' V contributions away (where), never "
                                        "multiply them by 0",
    ("transformers", "read-trash"): "keep padded query rows off the read-trash block (or keep it zeroed) and mask "
                                    "padded columns with a select, not an additive mask",
}
#: what each script does, in one sentence for report.md
HOW = {
    "vllm-cpu-tail": "the way a running engine meets it: a request whose prompt holds a token with a NaN embedding "
                     "row finishes and frees its blocks; a request that never holds that token is handed one and "
                     "reads the stale slots past its own length with weight 0",
    "transformers-other-requests": "the way a running engine meets it: a request whose prompt holds a token with a "
                                   "NaN embedding row (so its own KV is NaN) is batched with a request that never "
                                   "holds it, whose tokens and logprobs are compared with a finite control",
}
GENERIC = ("load (or zero) only the slots each request attends; where a masked slot is loaded, mask with a select "
           "(0 x NaN = NaN: a probability of 0 does not make a read safe)")
STRAY = "write only the step's own slots (the write guard names the step and the call that wrote elsewhere)"


def family(engine: str) -> str:
    """'vllm', 'vllm+cuda', 'vllm+no-prefix-caching' -> 'vllm'; 'transformers:...' -> 'transformers'."""
    return "vllm" if engine.startswith("vllm") else "transformers" if engine.startswith("transformers") else engine


def what_to_change(engine: str, cell) -> str:
    if cell.check == "write":
        return STRAY
    return WHAT_TO_CHANGE.get((family(engine), cell.region), GENERIC)


def script_kind(report, cell) -> tuple | None:
    """(kind, params) of the standalone script that reproduces a confirmed leak `cell`, or None: vLLM's CPU
    attention at unwritten-tail / other-requests; transformers' paged|eager or sdpa at other-requests."""
    engine = report.engine
    if cell.check != "read":
        return None
    if engine.startswith("vllm") and "+cuda" not in engine and cell.region in ("unwritten-tail", "other-requests"):
        return "vllm-cpu-tail", {**SMALLEST["vllm-cpu-tail"], "prefix_caching": "no-prefix-caching" not in engine}
    if engine.startswith("transformers:") and cell.region == "other-requests" and not report.graphs:
        attn = engine.split(":", 1)[1].split("+")[0]
        if attn in ("paged|eager", "sdpa"):
            return "transformers-other-requests", {**SMALLEST["transformers-other-requests"], "attn": attn}
    return None


def check_report_dir(folder, force: bool = False, outputs: dict | None = None):
    """The report folder, checked before any work (qsa_lab.support.outputs.check_new_folder); never
    one that would hold another output (`outputs`, {option: path}: --json)."""
    from qsa_lab.support.outputs import check_new_folder

    return check_new_folder(folder, "report", force, NAMES, outputs=outputs)


def write_report(report, folder, force: bool = False, check: bool = True, shrink: bool = False,
                 python: str | None = None, command: str | None = None, progress=None) -> Path:
    """Write the report folder (the module's docstring) for a ScribbleReport, whole. check: run each
    script (exit 1 as written, 0 with --workaround) in `python` (default: this interpreter); shrink:
    search the smallest workload again instead of SMALLEST's. -> the path of report.md."""
    import sys

    from qsa_lab.support.outputs import writing_folder

    python = python or sys.executable
    out = Path(folder)
    with writing_folder(out, "report", force, NAMES) as tmp:
        doc = report.to_dict()
        (tmp / "scribble.json").write_text(json.dumps(doc, indent=1) + "\n")
        figure = _figure(report, tmp / "verdict_grid.png")
        scripts = _scripts(report, tmp / "scripts", check, shrink, python, progress)
        (tmp / "report.md").write_text(markdown(report, scripts, figure, command))
    return out / "report.md"


def _figure(report, path: Path) -> str | None:
    """The verdict grid's file name; None without cells, '' without matplotlib."""
    if not report.cells:
        return None
    try:
        import matplotlib
    except ImportError:        # vLLM's environment has none: the report says so in place of the figure
        return ""

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from qsa_lab.scribble import verdict_grid

    ax = verdict_grid(report)
    ax.figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(ax.figure)
    return path.name


def _scripts(report, folder: Path, check: bool, shrink: bool, python: str, progress) -> dict:
    """kind -> {"file", "json", "cells", "params", "smaller", "check"}: one script per leak kind."""
    kinds = {}
    for cell in report.leaks():
        found = script_kind(report, cell)
        if found:
            entry = kinds.setdefault(found[0], {"params": found[1], "cells": []})
            entry["cells"].append(f"{cell.region}/{cell.payload}")
    if kinds:
        folder.mkdir()
    for kind, entry in kinds.items():
        params, checked = entry["params"], {}
        if shrink:
            keep = {k: params[k] for k in ("attn", "prefix_caching") if k in params}
            try:
                found = shrink_workload(kind, python, keep, progress=progress)
                params, checked = found.params, found.check
            except ShrinkError as e:      # the known smallest workload instead, checked below; the report says why
                entry["shrink_error"] = str(e)
        name = script_name(kind)
        (folder / name).write_text(script_text(kind, params))
        if check and not checked:
            if progress:
                progress(f"report: checking scripts/{name} (as written, then --workaround)")
            checked = {"as_written": run_script(python, folder / name, {}),
                       "workaround": run_script(python, folder / name, {}, workaround=True)}
        before, after = size(DEFAULTS[kind]), size(params)
        entry.update(file=f"scripts/{name}", params=params, check=checked,
                     smaller=", ".join(f"{k} {before[k]} -> {after[k]}" for k in before),
                     before=before, after=after)
        meta = {k: entry[k] for k in ("cells", "params", "before", "after", "smaller", "check", "shrink_error")
                if k in entry}
        (folder / (Path(name).stem + ".json")).write_text(json.dumps(meta, indent=1) + "\n")
        entry["json"] = f"scripts/{Path(name).stem}.json"
    return kinds


def _span(values) -> str:
    """[0, 1, 2, 3, 7] -> '0-3, 7': every value, consecutive ones as a range (nothing is cut)."""
    import itertools

    parts = []
    for _, group in itertools.groupby(enumerate(values), key=lambda iv: iv[1] - iv[0]):
        run = [v for _, v in group]
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}")
    return ", ".join(parts) if parts else "none"


def _table(header: list, rows: list) -> list:
    def cell(v) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")
    return ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)] + \
           ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]


def _check_text(check: dict) -> str:
    if not check:
        return "not run here"
    want = {"as_written": EXIT_LEAK, "workaround": EXIT_CLEAN}
    return ", ".join(f"{k.replace('_', ' ')}: exit {v}" + ("" if v == want[k] else f" (expected {want[k]})")
                     for k, v in check.items())


def markdown(report, scripts: dict, figure: str | None, command: str | None) -> str:
    """report.md's text."""
    wl = report.workload
    lines = ["# qsa_lab scribble leak report", "",
             f"Engine **{report.engine}** (reads the pool by {report.reads_pool}"
             f"{', CUDA graphs' if report.graphs else ''}) on {report.model}, workload `{wl.get('name')}`: "
             f"prompts {list(wl.get('prompt_lengths', []))}, {wl.get('new_tokens')} new tokens, pages of "
             f"{wl.get('page_size')} tokens, {wl.get('num_blocks')} blocks.", "",
             f"Summary: {report.verdict_line()}.", "", "## Command", "", "```",
             command or "(written from Python, not from the command line)", "```", ""]
    if report.facts:
        lines += ["## Versions and facts", ""] + _table(["what", "value"], [[k, v] for k, v in report.facts.items()])
        lines.append("")
    if figure:
        lines += ["## Verdicts", "", f"![verdict grid]({figure})", ""]
    elif figure == "":
        lines += ["## Verdicts", "", "No verdict grid: matplotlib is not installed where the report was written "
                  "(the verdicts are in scribble.json).", ""]
    leaks = report.leaks()
    lines += ["## What leaked", ""]
    if not leaks:
        lines += ["No leak: " + ("every check ran clean." if not report.failures() else
                                 "no check found one, but some failed (see scribble.json)."), ""]
    for cell in leaks:
        title = f"{cell.region} / {cell.payload}" if cell.check == "read" else f"{cell.region} (write guard)"
        lines += [f"### {title}: {cell.verdict}", "",
                  f"{cell.nan} values became NaN, {cell.inf} Inf, {cell.finite_changed} finite values changed, "
                  f"{cell.tokens_changed} tokens changed; {cell.slots} rows filled over the run.", ""]
        w = cell.where
        if w:
            lines += [f"First seen at step {w.get('step')}, layer {w.get('layer')}, in requests {w.get('requests')} "
                      f"(query rows {_span(w.get('query_rows', []))}).",
                      f"Heads: {_span(w.get('heads', []))}. Head dims: {_span(w.get('dims', []))}.", ""]
        if cell.pairs:
            lines += ["Which request read which request's rows:", ""]
            lines += _table(["reader", "read the rows of", "first changed token", "step", "layer"],
                            [[p["reader"], p["poisoned"], p["first_token"], p.get("step", "-"), p.get("layer", "-")]
                             for p in cell.pairs])
            lines.append("")
            if not w:
                lines += ["(The other-requests check names each pair's first step and layer; heads and head dims "
                          "are localised for the pool regions.)", ""]
        for s in cell.strays:
            lines.append(f"- {s.get('when')}{' in ' + s['call'] if s.get('call') else ''}: {s.get('region')}, "
                         f"{s.get('where')}, rows {s.get('rows')}")
        lines += [f"**What an engine developer changes:** {what_to_change(report.engine, cell)}.", ""]
    if scripts:
        lines += ["## Standalone scripts", "",
                  "Each needs only the engine (and torch), not qsa_lab, and runs from anywhere this folder is "
                  "copied: `python scripts/<name>.py` exits 1 when the leak reproduces, 0 when it does not, 3 "
                  "when it cannot run here (the engine missing or another version); `--workaround` applies the "
                  "engine-side change in the script's own process and exits 0.", ""]
        for kind, e in scripts.items():
            lines += [f"### {e['file']}", "",
                      f"Reproduces {', '.join(e['cells'])} {HOW[kind]}. Workload: `{json.dumps(e['params'])}`.",
                      f"Smaller than the scribble's default workload (`reuse`, 2 layers): {e['smaller']}.",
                      f"Checked here: {_check_text(e['check'])}."
                      + (f" Shrinking again failed ({e['shrink_error']}): this is the smallest workload known "
                         "to leak." if e.get("shrink_error") else ""), "", "```",
                      f"python {e['file']}\npython {e['file']} --workaround", "```", ""]
    return "\n".join(lines)

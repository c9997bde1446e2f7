"""The report's verification table, plus this project's extra cases and controls."""
from __future__ import annotations

import contextlib
import csv
from dataclasses import dataclass, field

import torch

from qsa_lab.support import package_data, processes as procs
from qsa_lab.analysis.fingerprints import max_abs_diff, nan_dims
from qsa_lab.model.case import Geometry, build_case
from qsa_lab.model.geometry import CAUSAL3, CAUSAL3_SEED, DECODE  # noqa: F401 - the report's presets
from qsa_lab.model.poison import REPORT_DIMS, apply_poison
from qsa_lab.routes.labels import FIXED_ROUTES, GROUPED, SHORT, short_key, short_routes
from qsa_lab.routes.run import RunResult, run_routes

REPORT_CSV = package_data.locate("data") / "report_verification.csv"
FIXES = list(FIXED_ROUTES)


@dataclass
class ReproCase:
    name: str
    geometry: Geometry
    poison: dict = field(default_factory=dict)
    report_key: str | None = None   # row of data/report_verification.csv this case reproduces
    expect: str = ""                # what the route's mechanism predicts
    # routes whose NaN mask the mechanism predicts to differ from the float64 reference's
    # (every other route must equal it): the "expected" column of the table
    differs: tuple = ()


REPRO_CASES = [
    ReproCase("report: decode-like, targeted", DECODE, {"site": "targeted", "dims": list(REPORT_DIMS)},
              "rows19-targeted", "unfixed grouped NaN on the 5 dims; every fix clean", ("grouped",)),
    ReproCase("report: 3-req scatter causal, targeted", CAUSAL3, {"site": "targeted", "dims": list(REPORT_DIMS)},
              "rows24-targeted", "unfixed grouped NaN on the 5 dims; every fix clean", ("grouped",)),
    ReproCase("report: decode-like, random page 0", DECODE, {"site": "random"}, "both-random",
              "unfixed NaN dims = poisoned dims of tokens 0-3", ("grouped",)),
    ReproCase("report: 3-req, random page 0", CAUSAL3, {"site": "random"}, "both-random",
              "unfixed NaN dims = poisoned dims of tokens 0-3", ("grouped",)),
    ReproCase("fp16 recurrent state on page 0", DECODE, {"site": "fp16-state"}, None,
              "~0.39% NaN bytes; unfixed NaN, fixes clean", ("grouped",)),
    ReproCase("stale tail bytes (beyond the report)", CAUSAL3, {"site": "stale-tail", "dims": list(REPORT_DIMS)}, None,
              "unfixed AND pad_fix NaN; kernel_fix and masked_load clean", ("grouped", "grouped+pad_fix")),
    ReproCase("control: K plane only", DECODE, {"site": "targeted", "plane": "k", "dims": list(REPORT_DIMS)},
              None, "clean everywhere (select masking discards K)"),
    ReproCase("control: fp16 KV", DECODE.replace(kv_dtype="fp16"), {"site": "targeted", "dims": list(REPORT_DIMS)},
              None, "clean everywhere (bytes read back finite)"),
    ReproCase("control: zero page 0", DECODE, {"site": "zeros"}, None, "clean everywhere (0 * 0 = 0)"),
    ReproCase("regression: unpoisoned", CAUSAL3, {"site": "none"}, None, "clean, matches reference"),
    # beyond the report: a non-finite code in a token the rows DO attend (the most attended one)
    ReproCase("NaN in an attended key (beyond the report)", DECODE, {"site": "attended-k", "dims": list(REPORT_DIMS)},
              None, "route divergence: grouped rows finite (fmaxf ignores the NaN score, the key's "
                    "probability rounds to 0: silently dropped); XQA and the reference NaN on every dim",
              GROUPED),
    ReproCase("NaN in the query (beyond the report)", DECODE, {"site": "query", "dims": list(REPORT_DIMS)},
              None, "route divergence: grouped rows exactly 0 (every score NaN, fmaxf ignores them, every "
                    "probability exp(-80) is 0 in fp16); XQA, the reference and the remainder rows NaN on every dim",
              GROUPED),
    ReproCase("NaN in an attended value (beyond the report)", DECODE, {"site": "attended-v", "dims": list(REPORT_DIMS)},
              None, "every route NaN on the poisoned dims of every row that attends the token, fixes too"),
]


def report_rows() -> dict:
    """The report's own verification table (data/report_verification.csv), by key."""
    with open(package_data.path("data", REPORT_CSV.name), newline="") as f:
        return {r["key"]: r for r in csv.DictReader(f)}


def run_case(rc: ReproCase, backend: str = "auto", geometry_overrides: dict | None = None,
             builds: dict | None = None) -> RunResult:
    """Build, poison and run one case. builds: {Geometry: unpoisoned case} kept by the caller, so
    cases of one geometry share one build (apply_poison poisons a copy)."""
    g = rc.geometry.replace(**(geometry_overrides or {}))
    kw = dict(rc.poison)
    if "dims" in kw:
        kw["dims"] = [d % g.head_dim for d in kw["dims"]]
    if builds is None:
        base = build_case(g)
    elif g in builds:
        base = builds[g]
    else:
        base = builds[g] = build_case(g)
    case = apply_poison(base, **kw)
    return run_routes(case, backend=backend)


def summarize(rc: ReproCase, result: RunResult, repeat: RunResult | None = None, report: dict | None = None) -> dict:
    """One row of the differential table: poisoned dims, NaN per route, max |fix - xqa|."""
    out = result.outputs
    row = {"case": rc.name, "rows": rc.geometry.rows, "requests": rc.geometry.requests,
           "kv_dtype": result.case.geometry.kv_dtype, "site": result.case.poison["site"],
           "plane": result.case.poison["plane"], "nan_bytes": result.case.poison["nan_bytes"],
           "poisoned_dims": result.case.poison["poisoned_dims"]}
    ref_nan = torch.isnan(result.reference64)
    for route, o in out.items():
        row[f"nan[{route}]"] = int(torch.isnan(o).sum())
    differ = tuple(r for r, o in out.items() if not torch.equal(torch.isnan(o), ref_nan))
    row["differs_from_reference"] = ",".join(differ)     # routes whose NaN mask is not the reference's
    row["expected_to_differ"] = ",".join(rc.differs)
    row["as_expected"] = set(differ) == set(rc.differs)
    row["grouped_nan_dims"] = nan_dims(out["grouped"])
    # elements the grouped route returns finite where XQA is NaN: the silently dropped NaN key
    row["grouped_finite_where_xqa_nan"] = int((torch.isnan(out["xqa"]) & ~torch.isnan(out["grouped"])).sum())
    for route in FIXES:
        row[f"max|{route}-xqa|"] = max_abs_diff(out[route], out["xqa"])
    row["max|xqa-reference|"] = max_abs_diff(out["xqa"], result.reference64)
    if repeat is not None:
        row["bit_identical_repeat"] = all(torch.equal(o.view(torch.int16), repeat.outputs[r].view(torch.int16))
                                          for r, o in out.items())
    if report:
        row["report_grouped_nan"] = report.get("grouped_nan_unfixed")
        row["report_max|grouped-xqa|"] = report.get("max_abs_grouped_minus_xqa")
    row["expect"] = rc.expect
    return row


def run_repro(backend: str = "auto", cases=None, progress: bool = True, repeat: bool = True,
              geometry_overrides: dict | None = None, parallel: bool | None = None, beside: int = 0):
    """-> (DataFrame, list[RunResult]). Each case runs twice when `repeat` to check bit-identity.

    The repeats run in a second process (support.executor.SecondProcess) beside the cases when
    `parallel` (default: on the emulation when a core is idle, procs.idle_core, counting the
    `beside` processes the caller already runs, e.g. `qsa-lab repro`'s figures): it takes them
    from the last case back while this one runs the cases and then the repeats from the first on,
    each taking back only what was not sent yet (executor.Relay), and torch's threads are shared
    between the two. Else here, after each case, on the threads the cores free now give (the
    previous count restored after; a user's OMP_NUM_THREADS or MKL_NUM_THREADS is kept). Either
    way a repeat rebuilds, poisons and runs again from nothing it shares with the first run, and
    the outputs do not depend on the process or thread count."""
    import pandas as pd
    from tqdm.auto import tqdm

    from qsa_lab.support.executor import Relay, start_second

    cases = REPRO_CASES if cases is None else list(cases)
    report = report_rows()
    others = max(procs.others_running(), beside)
    if parallel is None:
        parallel = repeat and len(cases) > 1 and _emulated(backend) and procs.idle_core(others)
    mine, theirs = _threads(2 if parallel else 1, others)
    # one build per geometry for the cases, and a second, separate one for their repeats
    builds, rebuilds = {}, {}
    results, again = [], {}
    bar = tqdm(total=len(cases) * (2 if repeat else 1), disable=not progress,
               desc="repro: each case twice, the repeats in a second process" if parallel and repeat else "repro")
    second = relay = None
    try:
        with procs.torch_threads(mine) if mine else contextlib.nullcontext():
            second = start_second(__name__) if parallel and repeat else None
            if second is not None:       # else no second process: the repeats run here
                relay = Relay(second, answered=lambda key: bar.update(1))
                for i in reversed(range(len(cases))):
                    relay.add(i, repeat_outputs, cases[i], backend, geometry_overrides, theirs)
            for rc in cases:
                results.append(run_case(rc, backend, geometry_overrides, builds))
                bar.update(1)
            for i, rc in enumerate(cases if repeat else ()):
                if relay is not None and not relay.take(i):
                    break   # the second process has this one and every one after it
                again[i] = run_case(rc, backend, geometry_overrides, rebuilds).outputs
                bar.update(1)
            for i in range(len(again), len(cases) if repeat else 0):
                out = relay.result(i)
                if out is None:          # it failed: this process runs what it did not answer
                    out = run_case(cases[i], backend, geometry_overrides, rebuilds).outputs
                    bar.update(1)
                again[i] = out
    finally:
        if second is not None:
            second.close()
        bar.close()
    rows = [summarize(rc, res, Repeat(again[i]) if repeat else None,
                      report.get(rc.report_key) if rc.report_key else None)
            for i, (rc, res) in enumerate(zip(cases, results))]
    return pd.DataFrame(rows), results


#: the second process's builds, one per geometry, kept across its repeats (that process's own:
#: a repeat shares nothing with the caller's first run)
_REPEAT_BUILDS: dict = {}


def repeat_outputs(rc: ReproCase, backend: str, geometry_overrides: dict | None, threads: int | None) -> dict:
    """In run_repro's second process: case `rc` again, built, poisoned and run there -> its outputs."""
    if threads:
        torch.set_num_threads(threads)
    return run_case(rc, backend, geometry_overrides, _REPEAT_BUILDS).outputs


@dataclass
class Repeat:
    """A repeat's outputs (route -> tensor), all summarize compares."""
    outputs: dict


def _emulated(backend: str) -> bool:
    from qsa_lab.routes.run import resolve_backend

    try:
        return resolve_backend(backend) == "emulate"
    except ValueError:
        return False


def _threads(processes: int, others: float) -> tuple:
    """Torch threads for this process and the second one: the cores no other running process
    (`others` of them: inf where unknown) holds, shared between `processes` (at least 1 each);
    (None, None) where the user set OMP_NUM_THREADS or MKL_NUM_THREADS."""
    if procs.threads_set_by_user():
        return None, None
    free = max(processes, procs.cores() - others)
    mine = int(min(torch.get_num_threads(), max(1, free // processes)))
    return mine, int(max(1, min(free - mine, torch.get_num_threads()))) if processes > 1 else None


def format_table(table, width: int = 120) -> str:
    """The repro table for a terminal, every line <= `width` characters: NaN elements per
    route (headed by labels.SHORT, whose key follows the table), the report's
    number, the worst max |fix - xqa|, which routes' NaN mask differs from the reference's
    (`*` marks a count whose mask differs) against what the mechanism predicts, and a verdict.
    The expectations follow the table, one line per case; a case name longer than its column
    goes on under it, whole."""
    import math
    import textwrap

    routes = [r for r in SHORT if f"nan[{r}]" in table.columns]
    counts = [[str(int(r[f"nan[{x}]"])) + ("*" if x in set(str(r.get("differs_from_reference", "")).split(",")) else "")
               for x in routes] for _, r in table.iterrows()]
    # a route column is 6 wide, narrower (its widest cell and a space) when the table would not fit; and
    # where it still would not, the 'mask differs' column is left out (the `*` marks say the same)
    cw = 6 if len(routes) * 6 + 54 <= width else max([len(SHORT[x]) for x in routes] + [len(c) for row in counts
                                                                                          for c in row]) + 1
    differs_col = len(routes) * cw + 54 <= width
    case_w = max(8, width - (len(routes) * cw + (46 if differs_col else 30)))
    head = (f"{'#':>2} {'case':<{case_w}}" + "".join(f"{SHORT[r]:>{cw}}" for r in routes)
            + f"{'report':>7} {'max|fix-xqa|':>12}  " + ("mask differs   " if differs_col else "") + "ok")
    lines = [head]
    for i, r in table.reset_index(drop=True).iterrows():
        cells = "".join(f"{c:>{cw}}" for c in counts[i])
        rep = r.get("report_grouped_nan")
        rep = "—" if rep is None or (isinstance(rep, float) and math.isnan(rep)) or str(rep) == "" else str(rep)
        rep = rep if len(rep) <= 6 else "=dims" if "dims" in rep else rep[:5] + "…"   # the report's words, short
        diffs = [r[c] for c in table.columns if c.startswith("max|grouped+") and r[c] is not None and r[c] == r[c]]
        worst = f"{max(diffs):.1e}" if diffs else "NaN"
        got = short_routes(r.get("differs_from_reference", ""))
        name, *more = textwrap.wrap(str(r["case"]), case_w, break_on_hyphens=False) or [""]  # whole, never cut
        lines.append(f"{i + 1:>2} {name:<{case_w}}{cells}{rep:>7} {worst:>12}  " + (f"{got:<14} " if differs_col else "")
                     + f"{'yes' if r.get('as_expected') else 'NO'}")
        lines += [f"{'':>2} {part}" for part in more]
    lines += _wrap(f"# NaN elements per route ({short_key(routes)}; the reference in float64);", width, "# ", ", ")
    lines += ["# * and 'mask differs': the route's NaN mask is not the reference's; ok: exactly the routes",
              "# the mechanism predicts differ. report: the report's grouped NaN count (=dims: its words",
              "# 'matches poisoned dims'). Expected, by case (predicted to differ in brackets):"]
    for i, r in table.reset_index(drop=True).iterrows():
        lines += _wrap(f"#{i + 1:>3}: {r.get('expect', '')} [{short_routes(str(r.get('expected_to_differ', '')))}]",
                       width, "#      ")
    return "\n".join(lines)


def _wrap(text: str, width: int, indent: str, sep: str = " ") -> list[str]:
    """text as lines of at most `width` characters, cut after a `sep` (kept but for its spaces), else
    at a space; the lines after the first indented."""
    lines = []
    while len(text) > width:
        cut = text.rfind(sep, len(indent), width - len(sep.rstrip()) + 1)
        if cut < 0:
            sep, cut = " ", text.rfind(" ", 0, width + 1)
        lines.append(text[:cut + len(sep.rstrip())])
        text = indent + text[cut + len(sep):]
    return lines + [text]

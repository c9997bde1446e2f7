"""The report's verification table, plus this project's extra cases and controls."""
from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .analysis import max_abs_diff, nan_dims
from .case import Geometry, build_case
from .geometry import CAUSAL3, CAUSAL3_SEED, DECODE  # noqa: F401 - the report's presets
from .poison import REPORT_DIMS, apply_poison
from .routes import GROUPED, RunResult, run_routes

REPORT_CSV = Path(__file__).resolve().parent.parent / "data" / "report_verification.csv"
FIXES = [r for r in GROUPED if r != "grouped"]


@dataclass
class ReproCase:
    name: str
    geometry: Geometry
    poison: dict = field(default_factory=dict)
    report_key: str | None = None   # row of data/report_verification.csv this case reproduces
    expect: str = ""                # what the route's mechanism predicts


REPRO_CASES = [
    ReproCase("report: decode-like, targeted", DECODE, {"site": "targeted", "dims": list(REPORT_DIMS)},
              "rows19-targeted", "unfixed grouped NaN on the 5 dims; every fix clean"),
    ReproCase("report: 3-req scatter causal, targeted", CAUSAL3, {"site": "targeted", "dims": list(REPORT_DIMS)},
              "rows24-targeted", "unfixed grouped NaN on the 5 dims; every fix clean"),
    ReproCase("report: decode-like, random page 0", DECODE, {"site": "random"}, "both-random",
              "unfixed NaN dims = poisoned dims of tokens 0-3"),
    ReproCase("report: 3-req, random page 0", CAUSAL3, {"site": "random"}, "both-random",
              "unfixed NaN dims = poisoned dims of tokens 0-3"),
    ReproCase("fp16 recurrent state on page 0", DECODE, {"site": "fp16-state"}, None,
              "~0.39% NaN bytes; unfixed NaN, fixes clean"),
    ReproCase("stale tail bytes (beyond the report)", CAUSAL3, {"site": "stale-tail", "dims": list(REPORT_DIMS)}, None,
              "unfixed AND pad-fix NaN; kernel fix and masked load clean"),
    ReproCase("control: K plane only", DECODE, {"site": "targeted", "plane": "k", "dims": list(REPORT_DIMS)},
              None, "clean everywhere (select masking discards K)"),
    ReproCase("control: fp16 KV", DECODE.replace(kv_dtype="fp16"), {"site": "targeted", "dims": list(REPORT_DIMS)},
              None, "clean everywhere (bytes read back finite)"),
    ReproCase("control: zero page 0", DECODE, {"site": "zeros"}, None, "clean everywhere (0 * 0 = 0)"),
    ReproCase("regression: unpoisoned", CAUSAL3, {"site": "none"}, None, "clean, matches reference"),
    # beyond the report: a non-finite code in a token the rows DO attend (the most attended one)
    ReproCase("NaN in an attended key (beyond the report)", DECODE, {"site": "attended-k", "dims": list(REPORT_DIMS)},
              None, "route divergence: grouped rows finite (fmaxf ignores the NaN score, the key's "
                    "probability rounds to 0: silently dropped); XQA and the reference NaN on every dim"),
    ReproCase("NaN in an attended value (beyond the report)", DECODE, {"site": "attended-v", "dims": list(REPORT_DIMS)},
              None, "every route NaN on the poisoned dims of every row that attends the token, fixes too"),
]


def report_rows() -> dict:
    """The report's own verification table (data/report_verification.csv), by key."""
    with open(REPORT_CSV, newline="") as f:
        return {r["key"]: r for r in csv.DictReader(f)}


def run_case(rc: ReproCase, backend: str = "auto", geometry_overrides: dict | None = None) -> RunResult:
    g = rc.geometry.replace(**(geometry_overrides or {}))
    kw = dict(rc.poison)
    if "dims" in kw:
        kw["dims"] = [d % g.head_dim for d in kw["dims"]]
    case = apply_poison(build_case(g), **kw)
    return run_routes(case, backend=backend)


def summarize(rc: ReproCase, result: RunResult, repeat: RunResult | None = None, report: dict | None = None) -> dict:
    """One row of the differential table: poisoned dims, NaN per route, max |fix - xqa|."""
    out = result.outputs
    row = {"case": rc.name, "rows": rc.geometry.rows, "requests": rc.geometry.requests,
           "kv_dtype": result.case.geometry.kv_dtype, "site": result.case.poison["site"],
           "plane": result.case.poison["plane"], "nan_bytes": result.case.poison["nan_bytes"],
           "poisoned_dims": result.case.poison["poisoned_dims"]}
    for route, o in out.items():
        row[f"nan[{route}]"] = int(torch.isnan(o).sum())
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
              geometry_overrides: dict | None = None):
    """-> (DataFrame, list[RunResult]). Each case runs twice when `repeat` to check bit-identity."""
    import pandas as pd
    from tqdm.auto import tqdm

    cases = REPRO_CASES if cases is None else cases
    report = report_rows()
    rows, results = [], []
    for rc in tqdm(cases, desc="repro", disable=not progress):
        res = run_case(rc, backend, geometry_overrides)
        again = run_case(rc, backend, geometry_overrides) if repeat else None
        rows.append(summarize(rc, res, again, report.get(rc.report_key) if rc.report_key else None))
        results.append(res)
    return pd.DataFrame(rows), results

"""Data for the timing figures (figdata's, without torch): the bench JSON (`qsa-lab bench`,
data/bench_h200.json) and upstream's fix-cost measurement reshaped into what plotting.plot_bench
and plotting.plot_fix_cost draw. Notebook 05 reads the committed H200 runs with these alone, so
on a machine without a GPU it never imports torch; qsa_lab.analysis.figure_data names them too.
"""
from __future__ import annotations

import json
from pathlib import Path

from qsa_lab.support.package_data import locate

BENCH_JSON = locate("data") / "bench_h200.json"
UPSTREAM_JSON = BENCH_JSON.with_name("upstream_fix_cost_h200.json")
#: bench variant -> the label fix-cost figures and tables use (upstream names in brackets)
FIX_LABELS = {"unfixed": "unfixed", "kernel_fix": "fix A (kernel)", "pad_fix": "fix B (pad)",
              "both": "fix A+B", "masked_load": "fix C (masked load)"}


def _bench_records(doc) -> list[dict]:
    """Flatten `qsa-lab bench` JSON (qsa_lab.bench/1): one record per (sweep point, route)."""
    out = []
    for point in doc["sweep"]:
        g = point["geometry"]
        for route, ms in point["ms"].items():
            out.append({"route": route, "context": g["context"], "rows": g["rows"], "median_ms": ms,
                        "ratio_to_unfixed": point["ratio_to_unfixed"].get(route),
                        "gbps": point.get("gbps", {}).get(route)})
    return out


def bench_frame(doc, source: str = ""):
    """A bench document -> (DataFrame of records, meta dict). Accepts a list of records or
    {"gpu": ..., "records"|"results"|"timings": [...], ...}; a record names its route ('route'
    or 'variant') and 'median_ms', and optionally 'context', 'rows', 'ratio_to_unfixed', 'gbps'."""
    import pandas as pd

    if isinstance(doc, list):
        records, meta = doc, {}
    elif doc.get("schema") == "qsa_lab.bench/1":
        records, meta = _bench_records(doc), {k: v for k, v in doc.items() if k not in ("sweep", "report_geometry", "report_geometry_l2_warm")}
    else:
        key = next((k for k in ("records", "results", "timings", "rows") if isinstance(doc.get(k), list)), None)
        if key is None:
            raise ValueError(f"{source or 'bench'}: no list of records under records/results/timings")
        records, meta = doc[key], {k: v for k, v in doc.items() if k != key}
    df = pd.DataFrame(records)
    if "route" not in df.columns and "variant" in df.columns:
        df = df.rename(columns={"variant": "route"})
    missing = {"route", "median_ms"} - set(df.columns)
    if missing:
        raise ValueError(f"{source or 'bench'}: records lack {sorted(missing)}")
    if "gpu" not in meta:
        meta["gpu"] = str(df["gpu"].iloc[0]) if "gpu" in df.columns and len(df) else "unknown GPU"
    meta.setdefault("source", source)
    return df, meta


def load_bench(path: str | Path = BENCH_JSON):
    """The committed bench JSON -> (DataFrame, meta); see bench_frame."""
    return bench_frame(json.loads(Path(path).read_text()), str(Path(path).name))


def bench_data(live: bool, path: str | Path = BENCH_JSON):
    """(DataFrame, meta) of route/fix timings: measured now when `live` (needs a GPU and
    qsa_lab.routes.bench), else read from `path`; None when neither is available."""
    if live:
        from qsa_lab.routes.bench import run_bench

        doc = run_bench()
        df, meta = bench_frame(doc, "measured live")
        meta["live"] = True
        return df, meta
    if not Path(path).exists():
        return None
    df, meta = load_bench(path)
    meta["live"] = False
    return df, meta


def bench_doc(live: bool, path: str | Path = BENCH_JSON) -> dict:
    """The qsa_lab.bench/1 document: measured now when `live` (needs a GPU), else read from `path`."""
    if live:
        from qsa_lab.routes.bench import run_bench

        return run_bench()
    return json.loads(Path(path).read_text())


def load_upstream(path: str | Path = UPSTREAM_JSON) -> dict:
    """The committed measurement of upstream's own kernel beside ours (qsa_lab.upstream_fix_cost/1)."""
    doc = json.loads(Path(path).read_text())
    if doc.get("schema") != "qsa_lab.upstream_fix_cost/1":
        raise ValueError(f"{path}: not a qsa_lab.upstream_fix_cost/1 document")
    return doc


def fix_cost(bench: dict, upstream: dict | None = None, source: str = "") -> dict:
    """What each fix costs, per 32-token tile, at the report's geometry -> dict for plot_fix_cost.

    bench: a qsa_lab.bench/1 document (live or data/bench_h200.json); upstream: load_upstream().
    variants: label -> us per tile, ratio to unfixed, extra us per tile, and the ratio's range over
    the sweep; upstream: its rows table (upstream's kernel and ours, same GPU and inputs)."""
    rep = bench["report_geometry"]
    variants = {}
    for v, label in FIX_LABELS.items():
        if v not in rep.get("us_per_tile", {}):
            continue
        sweep = [p["ratio_to_unfixed"][v] for p in bench.get("sweep", []) if v in p.get("ratio_to_unfixed", {})]
        us = rep["us_per_tile"][v]
        variants[label] = {"us_per_tile": us, "ratio": rep["ratio_to_unfixed"][v],
                           "extra_us": us - rep["us_per_tile"]["unfixed"],
                           "sweep_ratio": (min(sweep), max(sweep)) if sweep else None,
                           "barriers": rep.get("barriers_per_tile", {}).get(v)}
    report = bench.get("fix_a_vs_report", {}).get("report_v100_ratio") or (upstream or {}).get("report_v100_fix_a_ratio")
    g = rep["geometry"]
    return {"gpu": bench.get("gpu", "unknown GPU"), "source": source, "variants": variants,
            "report_v100_ratio": report, "tiles_per_group": rep.get("tiles_per_group_mean"),
            "geometry": f"{g['rows']} rows, ctx {g['context']}, top-{g['topk']}, {g['kv_dtype'].upper()}",
            "upstream": None if upstream is None else {
                "rows": upstream["rows"], "gpu": upstream["gpu"],
                "commits": f"{upstream['upstream']['repo']} @{upstream['upstream']['unfixed_commit']}, "
                           f"fix A @{upstream['upstream']['fix_a_commit']}"}}


def fix_cost_table(upstream: dict):
    """The upstream-vs-qsa_lab table as a DataFrame (one row per row count), for notebooks."""
    import pandas as pd

    df = pd.DataFrame(upstream["rows"]).set_index("rows")
    df.columns = ["upstream unfixed µs/tile", "upstream ×fix A", "upstream +µs", "qsa_lab unfixed µs/tile",
                  "qsa_lab ×fix A", "qsa_lab +µs"]
    return df

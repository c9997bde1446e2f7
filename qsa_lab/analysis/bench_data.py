"""Data for the timing figures (figure_data's, without torch): the bench JSON (`qsa-lab bench`,
data/bench_h200.json) and upstream's fix-cost measurement reshaped into what plotting.plot_bench
and plotting.plot_fix_cost draw. Notebook 05 reads the committed H200 runs with these alone, so
on a machine without a GPU it never imports torch; qsa_lab.analysis.figure_data names them too.
"""
from __future__ import annotations

import json
from pathlib import Path

from qsa_lab.routes.labels import FIXES, current_keys, fix_label, renamed_fix
from qsa_lab.support.package_data import locate

BENCH_JSON = locate("data") / "bench_h200.json"
UPSTREAM_JSON = BENCH_JSON.with_name("upstream_fix_cost_h200.json")
#: the complete fixes' cost (benchmarks/gpu_check.sh complete-fix); absent until a GPU run is committed
COMPLETE_FIX_JSON = BENCH_JSON.with_name("complete_fix_h200.json")
#: the routes the complete-fix cost compares, in the order its tables and figure show them
COST_ROUTES = ("grouped", "grouped+kernel_fix", "grouped+masked_load", "grouped+request_groups", "grouped+finite_pv",
               "grouped+finite_pv, NaN in V", "xqa")
#: the bench variants fix-cost figures and tables show: the unfixed kernel and every fix
FIX_VARIANTS = ("unfixed", *FIXES)
#: a bench point's tables that are keyed by variant
PER_VARIANT = ("ms", "us_per_tile", "barriers_per_tile", "ratio_to_unfixed", "gbps", "sm_clock_mhz_after")


def current_names(doc: dict) -> dict:
    """A qsa_lab.bench/1 document with every variant and key by its name now (routes.labels): runs
    measured before a rename (data/bench_h200.json) are read through labels.renamed_fix and
    labels.current_keys, numbers unchanged."""
    def point(p):
        return {k: {renamed_fix(v) or v: x for v, x in t.items()} if k in PER_VARIANT else t for k, t in p.items()}

    out = current_keys(doc)
    for k in ("report_geometry", "report_geometry_l2_warm"):
        if k in out:
            out[k] = point(out[k])
    if "sweep" in out:
        out["sweep"] = [point(p) for p in out["sweep"]]
    return out


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
        doc = current_names(doc)
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
    return current_names(json.loads(Path(path).read_text()))


def load_upstream(path: str | Path = UPSTREAM_JSON) -> dict:
    """The committed measurement of upstream's own kernel beside ours (qsa_lab.upstream_fix_cost/1),
    keys by their names now (labels.current_keys: a file in the keys of an earlier version loads too)."""
    doc = json.loads(Path(path).read_text())
    if doc.get("schema") != "qsa_lab.upstream_fix_cost/1":
        raise ValueError(f"{path}: not a qsa_lab.upstream_fix_cost/1 document")
    return current_keys(doc)


def fix_cost_frame(cost: dict):
    """fix_cost's variants as a table to read: µs to 2 decimals, ratios to 3, the sweep's range
    as one "1.056–1.076" (the raw floats printed as 3.488375)."""
    import pandas as pd

    rows = {v["label"]: {"µs per tile": round(v["us_per_tile"], 2), "extra µs": round(v["extra_us"], 2),
                         "× unfixed": round(v["ratio"], 3),
                         "× over the sweep": "–".join(f"{r:.3f}" for r in v["sweep_ratio"]) if v["sweep_ratio"] else "-",
                         "barriers": int(v["barriers"])} for v in cost["variants"].values()}
    return pd.DataFrame.from_dict(rows, orient="index")


def fix_cost(bench: dict, upstream: dict | None = None, source: str = "") -> dict:
    """What each fix costs, per 32-token tile, at the report's geometry -> dict for plot_fix_cost.

    bench: a qsa_lab.bench/1 document (live or data/bench_h200.json); upstream: load_upstream().
    variants: variant (unfixed or a fix) -> its label (labels.fix_label), us per tile, ratio to
    unfixed, extra us per tile, and the ratio's range over the sweep; upstream: its rows table
    (upstream's kernel and ours, same GPU and inputs)."""
    bench = current_names(bench)
    rep = bench["report_geometry"]
    variants = {}
    for v in FIX_VARIANTS:
        if v not in rep.get("us_per_tile", {}):
            continue
        sweep = [p["ratio_to_unfixed"][v] for p in bench.get("sweep", []) if v in p.get("ratio_to_unfixed", {})]
        us = rep["us_per_tile"][v]
        variants[v] = {"label": fix_label(v), "us_per_tile": us, "ratio": rep["ratio_to_unfixed"][v],
                       "extra_us": us - rep["us_per_tile"]["unfixed"],
                       "sweep_ratio": (min(sweep), max(sweep)) if sweep else None,
                       "barriers": rep.get("barriers_per_tile", {}).get(v)}
    upstream = None if upstream is None else current_keys(upstream)
    report = (bench.get("kernel_fix_vs_report", {}).get("report_v100_ratio")
              or (upstream or {}).get("report_v100_kernel_fix_ratio"))
    g = rep["geometry"]
    return {"gpu": bench.get("gpu", "unknown GPU"), "source": source, "variants": variants,
            "report_v100_ratio": report, "tiles_per_group": rep.get("tiles_per_group_mean"),
            "geometry": f"{g['rows']} rows, ctx {g['context']}, top-{g['topk']}, {g['kv_dtype'].upper()}",
            "upstream": None if upstream is None else {
                "rows": upstream["rows"], "gpu": upstream["gpu"],
                "commits": f"{upstream['upstream']['repo']} @{upstream['upstream']['unfixed_commit']}, "
                           f"{fix_label('kernel_fix')} @{upstream['upstream']['kernel_fix_commit']}"}}


def fix_cost_table(upstream: dict):
    """The upstream-vs-qsa_lab table as a DataFrame (one row per row count), for notebooks."""
    import pandas as pd

    df = pd.DataFrame(current_keys(upstream)["rows"]).set_index("rows")
    fix = fix_label("kernel_fix")
    df.columns = ["upstream unfixed µs/tile", f"upstream ×{fix}", "upstream +µs", "qsa_lab unfixed µs/tile",
                  f"qsa_lab ×{fix}", "qsa_lab +µs"]
    return df


def load_complete_fix(path: str | Path = COMPLETE_FIX_JSON) -> dict | None:
    """The committed cost of the complete fixes (qsa_lab.complete_fix_cost/1), or None when no GPU run
    has been committed yet."""
    path = Path(path)
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    if doc.get("schema") != "qsa_lab.complete_fix_cost/1":
        raise ValueError(f"{path}: not a qsa_lab.complete_fix_cost/1 document")
    return doc


def _route_heading(route: str) -> str:
    from qsa_lab.routes.labels import label

    base, _, extra = route.partition(", ")
    return label(base) + (f", {extra}" if extra else "")


def complete_fix_table(doc: dict):
    """One row per shape: µs per call (median) of the unfixed route and kernel_fix (A), each other
    route's ratio to kernel_fix (10th-90th percentile of its own replays in brackets, as ratios), and
    the groups / XQA rows of kernel_fix and request_groups."""
    import pandas as pd

    rows = {}
    for shape in doc["shapes"]:
        r = shape["routes"]
        fix = r["grouped+kernel_fix"]["median_us"]
        row = {"grouped µs": round(r["grouped"]["median_us"], 1), "kernel_fix (A) µs": round(fix, 1)}
        for route in COST_ROUTES:
            if route in r and route != "grouped+kernel_fix":
                v = r[route]
                row[f"{_route_heading(route)} ×A"] = (f"{v['median_us'] / fix:.2f} "
                                                       f"({v['p10_us'] / fix:.2f}–{v['p90_us'] / fix:.2f})")
        row["groups + XQA rows: A | R"] = (f"{r['grouped+kernel_fix']['groups']} + {r['grouped+kernel_fix']['xqa_rows']} | "
                                           f"{r['grouped+request_groups']['groups']} + "
                                           f"{r['grouped+request_groups']['xqa_rows']}")
        rows[shape["name"]] = row
    return pd.DataFrame.from_dict(rows, orient="index")


def complete_fix_data(doc: dict | None) -> dict | None:
    """What plotting.plots.plot_complete_fix_cost draws: per shape and route the median and the
    10th-90th percentile as ratios to kernel_fix (A)."""
    if doc is None:
        return None
    routes = [r for r in COST_ROUTES if r != "grouped+kernel_fix" and all(r in s["routes"] for s in doc["shapes"])]
    shapes = []
    for s in doc["shapes"]:
        fix = s["routes"]["grouped+kernel_fix"]["median_us"]
        shapes.append({"name": s["name"], "ratios": {r: (s["routes"][r]["median_us"] / fix, s["routes"][r]["p10_us"] / fix,
                                                         s["routes"][r]["p90_us"] / fix) for r in routes}})
    return {"gpu": doc["gpu"], "routes": routes, "labels": {r: _route_heading(r) for r in routes}, "shapes": shapes}

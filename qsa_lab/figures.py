"""The figures of notebooks 01-04, written without Jupyter (`qsa-lab repro`, `make demo`).

Each figure is built by the same figdata + plotting calls the notebooks make, then
written by export.export_figure (PNG, SVG, PDF with metadata).
"""
from __future__ import annotations

from pathlib import Path

from . import figdata, fp8, plotting
from .export import export_figure
from .routes import RunResult


def _figure(fn, data, figsize):
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout="constrained")
    fn(data, ax=fig.add_subplot())
    return fig


def _pick(results, rows: int, site: str, plane: str = "v", kv_dtype: str = "e4m3") -> RunResult | None:
    for r in results:
        g, p = r.case.geometry, r.case.poison
        if g.rows == rows and p["site"] == site and p["plane"] == plane and g.kv_dtype == kv_dtype:
            return r
    return None


def write_repro_figures(results, out_dir="figures", table=None, overwrite: bool = False) -> list[Path]:
    """results: the list[RunResult] of repro.run_repro; table: its DataFrame (recomputed from
    the results' route tables when absent). -> paths written (3 per figure).

    Without overwrite an existing figure is kept and the new one numbered (export_figure);
    `make demo` passes --force to refresh its own figures.
    """
    from matplotlib.figure import Figure

    out_dir = Path(out_dir)
    results = list(results)
    backend = results[0].backend if results else "none"
    paths: list[Path] = []

    def save(fig, name, case=""):
        paths.extend(export_figure(fig, name, {"case": case, "backend": backend}, out_dir=out_dir,
                                   overwrite=overwrite))

    # 01: E4M3 and the null block
    save(_figure(plotting.plot_code_table, fp8.code_table("e4m3"), (9, 8.5)), "01_e4m3_code_table", "e4m3 codes")
    save(_figure(plotting.plot_byte_nan_rates, figdata.fp16_state_rates(), (7.5, 4)), "01_fp16_byte_nan_rates",
         "fp16 state N(0, 0.5), 2^20 values")
    maps = figdata.page_byte_maps()
    fig = Figure(figsize=(10, 2.6 * len(maps)), layout="constrained")
    for d, ax in zip(maps, fig.subplots(len(maps), 1)):
        plotting.plot_page_bytes(d, ax=ax)
    save(fig, "01_page0_byte_maps", "every poison site, V plane")

    # 02: the report's decode-like case
    r = _pick(results, 19, "targeted")
    if r is not None:
        case = r.case.describe()
        save(_figure(plotting.plot_plan, figdata.plan_table(r.plan, r.case), (9, 4)), "02_plan", case)
        nm = figdata.nan_map(r, "grouped")
        save(_figure(plotting.plot_nan_map, nm, (11, 0.045 * nm["values"].shape[0] + 1.6)), "02_nan_maps", case)
        save(_figure(plotting.plot_attribution, figdata.attribution_map(r), (10, 2.8)), "02_attribution", case)
        rn = figdata.route_nans(r)
        save(_figure(plotting.plot_route_comparison, rn, (11, 0.42 * len(rn["routes"]) + 1.8)), "02_routes", case)

    # 03: the playground's default view, drawn statically
    from .widgets import Params, playground_data, render_playground

    pd_ = playground_data(Params(backend=backend if backend in ("emulate", "cuda") else "emulate"))
    save(render_playground(pd_), "03_playground_default", pd_["case"])

    # 04: the differential table and the stale-tail finding
    if table is None and results:
        table = _table_from_results(results)
    if table is not None and len(table):
        save(_figure(plotting.plot_repro_table, table, (12, 0.3 * len(table) + 0.9)), "04_repro_table",
             f"{len(table)} repro cases")
    st = next((x for x in results if x.case.poison["site"] == "stale-tail"), None)
    if st is not None:
        rn = figdata.route_nans(st)
        save(_figure(plotting.plot_route_comparison, rn, (11, 0.42 * len(rn["routes"]) + 1.8)),
             "04_stale_tail_routes", st.case.describe())
    return paths


def _table_from_results(results):
    import pandas as pd

    from .analysis import route_table

    rows = []
    for r in results:
        t = route_table(r)
        row = {"case": r.case.describe(), "poisoned_dims": r.case.poison["poisoned_dims"]}
        row.update({f"nan[{k}]": int(v) for k, v in t["nan_count"].items()})
        row.update({f"max|{k}-xqa|": v for k, v in t["max_abs_diff_vs_xqa"].items() if k.startswith("grouped+")})
        rows.append(row)
    return pd.DataFrame(rows)

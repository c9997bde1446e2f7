"""The figures of notebooks 01-05, written without Jupyter (`qsa-lab repro`, `make demo`).

Each figure is built by the same figdata + plotting calls the notebooks make, then rendered
and written as export.export_figure does (PNG, SVG, PDF with metadata). The fix-cost figure
(05) is drawn from the committed H200 timings (data/bench_h200.json,
data/upstream_fix_cost_h200.json) and says so in its title and metadata, whatever machine
draws it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from qsa_lab.analysis import figure_data as figdata
from qsa_lab.model import fp8
from qsa_lab.plotting import plots as plotting
from qsa_lab.plotting.export import figures_dir, render_figure, save_rendered
from qsa_lab.routes.run import RunResult


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


def fix_cost_figure(bench_path=figdata.BENCH_JSON, upstream_path=figdata.UPSTREAM_JSON, doc=None):
    """The fix-cost figure from a bench document (default: the committed H200 run) -> (Figure, meta)."""
    import json

    from matplotlib.figure import Figure

    from qsa_lab.plotting.export import gpu_name

    live = doc is not None
    doc = doc if live else json.loads(Path(bench_path).read_text())
    upstream = figdata.load_upstream(upstream_path) if Path(upstream_path).exists() else None
    here = gpu_name()
    here = "a CPU machine" if here.startswith("none") else here
    source = ("measured live" if live else
              f"committed {doc.get('gpu', 'GPU')} run, data/{Path(bench_path).name}, drawn on {here}")
    fig = plotting.plot_fix_cost(figdata.fix_cost(doc, upstream, source=source), Figure(figsize=(14, 4.6),
                                                                                      layout="constrained"))
    return fig, {"case": "report geometry: 16 rows, ctx 8192, top-512, E4M3", "backend": "cuda timings",
                 "timings_from": source, "timings_gpu": doc.get("gpu", "")}


#: the figures that need no repro results: `qsa-lab repro` renders them in a second process
#: (draw_ahead) while this one runs the cases, when a core is idle
INDEPENDENT = ("01_e4m3_code_table", "01_fp16_byte_nan_rates", "01_page0_byte_maps", "03_playground_default",
               "05_fix_cost")
#: figures of the results that process renders too, once done with INDEPENDENT, while this one
#: renders the others (02): about half of the results' rendering each
HANDED = ("04_repro_table", "04_stale_tail_routes")


@dataclass(frozen=True)
class Spec:
    """One figure to draw: fn(data, ax=) on a constrained Figure of `figsize`, with `meta`; or,
    with figsize None, fn() -> (Figure, meta). Those of HANDED pickle (plotting function, data)."""
    name: str
    fn: Callable
    data: object = None
    figsize: tuple | None = None
    meta: dict | None = None

    def draw(self):
        if self.figsize is None:
            return self.fn()
        return _figure(self.fn, self.data() if callable(self.data) else self.data, self.figsize), self.meta


def figure_specs(results, table=None, backend: str = "none"):
    """Every figure of write_repro_figures as a Spec, in the order it writes them. A figure whose
    data is absent is left out: with no results, exactly INDEPENDENT."""
    from matplotlib.figure import Figure

    def spec(name, fn, data, figsize, case=""):
        return Spec(name, fn, data, figsize, {"case": case, "backend": backend})

    # 01: E4M3 and the null block
    yield spec("01_e4m3_code_table", plotting.plot_code_table, lambda: fp8.code_table("e4m3"), (9, 8.5),
               "e4m3 codes")
    yield spec("01_fp16_byte_nan_rates", plotting.plot_byte_nan_rates, figdata.fp16_state_rates, (7.5, 4),
               "fp16 state N(0, 0.5), 2^20 values")

    def byte_maps():
        maps = figdata.page_byte_maps()
        fig = Figure(figsize=(15, 2.5 * -(-len(maps) // 2)), layout="constrained")
        for d, ax in zip(maps, fig.subplots(-(-len(maps) // 2), 2).flat):
            plotting.plot_page_bytes(d, ax=ax)
        return fig, {"case": "the page and plane each poison site writes", "backend": backend}

    yield Spec("01_page0_byte_maps", byte_maps)

    # 02: the report's decode-like case
    r = _pick(results, 19, "targeted")
    if r is not None:
        case = r.case.describe()
        yield spec("02_plan", plotting.plot_plan, figdata.plan_table(r.plan, r.case), (9, 4), case)
        nm = figdata.nan_map(r, "grouped")
        yield spec("02_nan_maps", plotting.plot_nan_map, nm, (11, 0.045 * nm["values"].shape[0] + 1.6), case)
        yield spec("02_attribution", plotting.plot_attribution, figdata.attribution_map(r), (10, 2.8), case)
        rn = figdata.route_nans(r)
        yield spec("02_routes", plotting.plot_route_comparison, rn, (11, 0.42 * len(rn["routes"]) + 1.8), case)

    # 03: the playground's default view, drawn statically
    def playground():
        from qsa_lab.analysis.playground import Params, playground_data
        from qsa_lab.plotting.playground import render_playground

        pd_ = playground_data(Params(backend=backend if backend in ("emulate", "cuda") else "emulate"))
        return render_playground(pd_), {"case": pd_["case"], "backend": backend}

    yield Spec("03_playground_default", playground)

    # 04: the differential table and the stale-tail finding
    if table is None and results:
        table = _table_from_results(results)
    if table is not None and len(table):
        yield spec("04_repro_table", plotting.plot_repro_table, table, plotting.repro_table_figsize(table),
                   f"{len(table)} repro cases")
    st = next((x for x in results if x.case.poison["site"] == "stale-tail"), None)
    if st is not None:
        rn = figdata.route_nans(st)
        yield spec("04_stale_tail_routes", plotting.plot_route_comparison, rn, (11, 0.42 * len(rn["routes"]) + 1.8),
                   st.case.describe())

    # 05: what the fix costs, from the committed H200 timings
    if figdata.BENCH_JSON.exists():
        yield Spec("05_fix_cost", fix_cost_figure)


def render_spec(spec: Spec):
    """-> export.Rendered: the bytes export_figure would write for this figure."""
    fig, meta = spec.draw()
    return render_figure(fig, spec.name, meta)


def render_named(name: str, backend: str):
    """In the second process: figure `name` of INDEPENDENT for `backend` -> export.Rendered (its
    Spec is made there: the data functions of those figures do not pickle)."""
    return render_spec(next(s for s in figure_specs([], None, backend) if s.name == name))


def draw_ahead(second, backend: str):
    """Ask the second process (support.executor.SecondProcess) for INDEPENDENT's figures now,
    while this one runs the cases -> the Relay to give to write_repro_figures."""
    from qsa_lab.support.executor import Relay

    ahead = Relay(second)
    for name in INDEPENDENT:
        ahead.add(name, render_named, name, backend)
    return ahead


def collect(ahead, specs: list) -> dict:
    """{name: export.Rendered} of `specs`, asked of the second process: this one renders, from the
    last one back, those not sent to it yet (the two meet in the middle), then takes its answers.
    An answer is used only when it is whole and drawn by this code on this machine (commit, csrc,
    GPU, version); any other, or a call that failed, is rendered here."""
    from qsa_lab.plotting.export import META_KEYS, Rendered, full_meta

    here = {k: v for k, v in full_meta(None).items() if k not in ("case", "backend")}
    out = {}
    for s in reversed(specs):
        if not ahead.take(s.name):
            break
        out[s.name] = render_spec(s)
    for s in specs:
        if s.name not in out:
            r = ahead.result(s.name)
            ok = isinstance(r, Rendered) and r.name == s.name and set(META_KEYS) <= set(r.meta) and \
                all(r.meta[k] == v for k, v in here.items())
            out[s.name] = r if ok else render_spec(s)
    return out


def write_repro_figures(results, out_dir=None, table=None, overwrite: bool = False, ahead=None) -> list[Path]:
    """results: the list[RunResult] of repro.run_repro; table: its DataFrame (recomputed from
    the results' route tables when absent); out_dir: default export.figures_dir().
    -> paths written (3 per figure).

    Every figure is rendered before the first file is written. With `ahead` (draw_ahead's Relay for
    the results' backend: `qsa-lab repro` started a second process), that process renders INDEPENDENT and HANDED and
    this one the others, then those it has not been sent yet, from the last one back (collect).
    A figure identical to the one on disk keeps its files; a different one is numbered unless
    overwrite (`make demo` passes --force to refresh its own figures).
    """
    out_dir = Path(out_dir) if out_dir is not None else figures_dir()
    results = list(results)
    backend = results[0].backend if results else "none"
    specs = list(figure_specs(results, table, backend))
    theirs = []
    if ahead is not None:
        handed = [s for s in specs if s.name in HANDED]
        for s in handed:
            ahead.add(s.name, render_spec, s)
        theirs = [s for s in specs if s.name in INDEPENDENT] + handed
    names = {t.name for t in theirs}
    rendered = {s.name: render_spec(s) for s in specs if s.name not in names}
    if ahead is not None:
        rendered.update(collect(ahead, theirs))
    paths: list[Path] = []
    for s in specs:
        paths.extend(save_rendered(rendered[s.name], out_dir, overwrite))
    return paths


def _table_from_results(results):
    import pandas as pd

    from qsa_lab.analysis.fingerprints import route_table

    rows = []
    for r in results:
        t = route_table(r)
        row = {"case": r.case.describe(), "poisoned_dims": r.case.poison["poisoned_dims"]}
        row.update({f"nan[{k}]": int(v) for k, v in t["nan_count"].items()})
        row.update({f"max|{k}-xqa|": v for k, v in t["max_abs_diff_vs_xqa"].items() if k.startswith("grouped+")})
        rows.append(row)
    return pd.DataFrame(rows)

"""The poison playground: wiring only (mpl-interactions style).

    controls --(read_params)--> Params --(playground_data)--> data --(render_playground)--> Figure
                                                                                  \\-> Output widget

`playground_data` and `render_playground` are pure (the data function caches built
cases and route outputs, which changes only its speed) and usable without widgets;
`Playground` only wires ipywidgets controls to them. `Playground.last_data` is the
data the render function last received, so tests can observe each redraw.
"""
from __future__ import annotations

import io
import os
import time
from collections import OrderedDict
from dataclasses import dataclass

from .case import KV_DTYPES, Geometry, build_case
from .poison import DIM_SITES, PLANES, REPORT_DIMS, SITES, apply_poison
from .routes import BACKENDS, ROUTES, run_routes

#: geometry presets; the first is the default (the report's decode-like case at a shorter
#: context: same groups, M-tiles, padding and 480-NaN fingerprint, redraws in well under 0.5 s)
PRESETS = OrderedDict([
    ("decode-like, 19 rows, ctx 2048", Geometry(context=2048, topk=128)),
    ("decode-like, 19 rows, ctx 8192 (report)", Geometry()),
    ("3-req scatter causal, 24 rows, ctx 2048", Geometry(rows=24, requests=3, layout="scatter", context=2048, topk=128)),
    ("3-req scatter causal, 24 rows, ctx 8192 (report)", Geometry(rows=24, requests=3, layout="scatter")),
])
#: fix toggle label -> route it adds (reference, xqa and grouped always run)
FIX_TOGGLES = OrderedDict([("kernel_fix", "grouped+kernel_fix"), ("pad_fix", "grouped+pad_fix"),
                           ("both_fixes", "grouped+both_fixes"), ("masked_load", "grouped+masked_load")])
BASE_ROUTES = ("reference", "xqa", "grouped")
FIGURES_ENV = "QSA_LAB_FIGURES"


@dataclass(frozen=True)
class Params:
    """Everything the playground shows depends on these, and on nothing else."""
    site: str = "targeted"
    plane: str = "v"
    dims: tuple = tuple(REPORT_DIMS)
    seed: int = 0
    kv_dtype: str = "e4m3"
    preset: str = next(iter(PRESETS))
    fixes: tuple = tuple(FIX_TOGGLES)
    backend: str = "emulate"
    nan_map: str = "grouped"

    @property
    def geometry(self) -> Geometry:
        return PRESETS[self.preset].replace(kv_dtype=self.kv_dtype)  # seed is the poison's: the case stays

    @property
    def routes(self) -> tuple:
        return tuple(r for r in ROUTES if r in BASE_ROUTES or r in {FIX_TOGGLES[f] for f in self.fixes})


def parse_dims(text: str, head_dim: int) -> tuple:
    """'102, 152 168' -> (102, 152, 168); ValueError naming 'dims' otherwise."""
    parts = [p for p in str(text).replace(",", " ").split() if p]
    if not parts:
        raise ValueError(f"dims: give at least one head dim in [0, {head_dim}), e.g. 102,152")
    try:
        dims = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"dims: {text!r} is not a comma-separated list of integers") from None
    bad = [d for d in dims if not 0 <= d < head_dim]
    if bad:
        raise ValueError(f"dims: {bad} outside [0, {head_dim})")
    return tuple(sorted(set(dims)))


def check_params(p: Params) -> Params:
    """Raise ValueError naming the bad control."""
    for name, value, allowed in (("site", p.site, SITES), ("plane", p.plane, tuple(PLANES)),
                                 ("kv_dtype", p.kv_dtype, KV_DTYPES), ("geometry", p.preset, tuple(PRESETS)),
                                 ("backend", p.backend, BACKENDS)):
        if value not in allowed:
            raise ValueError(f"{name}: {value!r} is not one of {allowed}")
    if not isinstance(p.seed, int) or p.seed < 0:
        raise ValueError(f"seed: must be an int >= 0, got {p.seed!r}")
    if p.nan_map not in p.routes:
        raise ValueError(f"nan_map: route {p.nan_map!r} is not toggled on")
    return p


class RunCache:
    """Built cases per geometry, poisoned cases per poison, route outputs per (poison, backend).

    A redraw re-runs only what changed: a fix toggle runs one route, a new dims list
    re-poisons and re-runs the toggled routes, a new preset builds one case."""

    def __init__(self, size: int = 6):
        self.size = size
        self.cases, self.poisoned, self.results = OrderedDict(), OrderedDict(), OrderedDict()

    def _get(self, store, key, make):
        if key in store:
            store.move_to_end(key)
            return store[key]
        store[key] = value = make()
        while len(store) > self.size:
            store.popitem(last=False)
        return value

    def result(self, p: Params):
        g = p.geometry
        pkey = (g, p.site, p.plane, p.dims if p.site in DIM_SITES else None, p.seed)
        case = self._get(self.poisoned, pkey, lambda: apply_poison(
            self._get(self.cases, g, lambda: build_case(g)), p.site, plane=p.plane,
            dims=list(p.dims) if p.site in DIM_SITES else None, seed=p.seed))
        res = self._get(self.results, (pkey, p.backend), lambda: run_routes(case, routes=p.routes,
                                                                             backend=p.backend))
        missing = [r for r in p.routes if r not in res.outputs]
        if missing:  # a fix toggled on later: run just that route
            res.outputs.update(run_routes(case, routes=missing, backend=p.backend).outputs)
        return res


_CACHE = RunCache()


def playground_data(p: Params, cache: RunCache | None = None) -> dict:
    """Params -> everything render_playground draws: the chosen route's NaN map, the routes
    side by side, the route table, and the case/backend for titles and export metadata."""
    from dataclasses import replace as dc_replace

    from . import figdata

    check_params(p)
    res = (cache or _CACHE).result(p)
    view = dc_replace(res, outputs={r: res.outputs[r] for r in p.routes})  # only the toggled routes
    routes = figdata.route_nans(view, p.routes)
    return {"params": p, "backend": res.backend, "case": res.case.describe(), "poison": dict(res.case.poison),
            "nan_map": figdata.nan_map(view, p.nan_map), "routes": routes, "table": routes["table"]}


def render_playground(data: dict, fig=None):
    """data -> Figure (a new one unless `fig` is given, which is cleared): NaN map on top,
    routes side by side below. No pyplot state, so it draws the same inside and outside widgets."""
    from matplotlib.figure import Figure

    from . import plotting

    if fig is None:
        fig = Figure(figsize=(11, 7.8))
    else:
        fig.clear()
    # fixed margins, not constrained layout: layout solving was a third of the redraw time
    top, bottom = fig.subplots(2, 1, height_ratios=[2.6, 1.2],
                               gridspec_kw=dict(left=0.2, right=0.8, top=0.87, bottom=0.07, hspace=0.55))
    plotting.plot_nan_map(data["nan_map"], ax=top)
    plotting.plot_route_comparison(data["routes"], ax=bottom)
    return fig


def figure_png(fig, dpi: int = 72) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


class Playground:
    """ipywidgets controls -> playground_data -> render_playground -> Output.

    Controls (descriptions are stable: the browser test finds them by these labels):
    site, plane, dims, seed, kv_dtype, geometry, backend, nan_map, one checkbox per fix
    (kernel_fix, pad_fix, both_fixes, masked_load), and an Export button. `message` (HTML)
    shows errors and export paths; bad input leaves last_data and the figure unchanged.
    """

    def __init__(self, params: Params | None = None, cache: RunCache | None = None, out_dir: str | None = None):
        import ipywidgets as W

        p = params or Params()
        self.cache = cache or _CACHE
        self.out_dir = out_dir
        self.last_data = None
        self.figure = None
        self.last_export = []
        self.redraws = 0
        self.last_ok = False
        self.last_redraw_s = None
        style = {"description_width": "70px"}
        self.controls = {
            "site": W.Dropdown(options=SITES, value=p.site, description="site", style=style),
            "plane": W.Dropdown(options=tuple(PLANES), value=p.plane, description="plane", style=style),
            "dims": W.Text(value=",".join(map(str, p.dims)), description="dims", continuous_update=False,
                           placeholder="102,152,168,170,230", style=style),
            "seed": W.IntText(value=p.seed, description="seed", style=style),
            "kv_dtype": W.Dropdown(options=KV_DTYPES, value=p.kv_dtype, description="kv_dtype", style=style),
            "geometry": W.Dropdown(options=list(PRESETS), value=p.preset, description="geometry",
                                   layout=W.Layout(width="420px"), style=style),
            "backend": W.Dropdown(options=BACKENDS, value=p.backend, description="backend", style=style),
            "nan_map": W.Dropdown(options=list(p.routes), value=p.nan_map, description="nan_map",
                                  layout=W.Layout(width="320px"), style=style),
        }
        self.toggles = {name: W.Checkbox(value=name in p.fixes, description=name, indent=False,
                                         layout=W.Layout(width="130px")) for name in FIX_TOGGLES}
        self.export_button = W.Button(description="Export", icon="download", button_style="primary",
                                      tooltip="write PNG, SVG and PDF of the figure")
        self.message = W.HTML(value="")
        self.out = W.Output()
        for w in list(self.controls.values()) + list(self.toggles.values()):
            w.observe(self._on_change, names="value")
        self.export_button.on_click(lambda _: self.export())
        c = self.controls
        self.widget = W.VBox([
            W.HBox([c["site"], c["plane"], c["dims"], c["seed"]]),
            W.HBox([c["kv_dtype"], c["geometry"], c["backend"]]),
            W.HBox([W.Label("fixes:")] + list(self.toggles.values()) + [c["nan_map"], self.export_button]),
            self.message, self.out,
        ])
        self.params = None
        self.redraw()

    # -- wiring --------------------------------------------------------------------------------------
    def read_params(self) -> Params:
        """The controls' values as Params (ValueError naming the control when invalid)."""
        c = self.controls
        g = PRESETS.get(c["geometry"].value, Geometry())
        site = c["site"].value
        dims = parse_dims(c["dims"].value, g.head_dim) if site in DIM_SITES else \
            (self.params.dims if self.params else tuple(REPORT_DIMS))
        fixes = tuple(n for n, t in self.toggles.items() if t.value)
        nan_map = c["nan_map"].value
        p = Params(site=site, plane=c["plane"].value, dims=dims, seed=c["seed"].value,
                   kv_dtype=c["kv_dtype"].value, preset=c["geometry"].value, fixes=fixes,
                   backend=c["backend"].value, nan_map=nan_map if nan_map else "grouped")
        if p.nan_map not in p.routes:  # its route was toggled off: fall back to the unfixed route
            p = Params(**{**p.__dict__, "nan_map": "grouped"})
        return check_params(p)

    def _on_change(self, change):
        if getattr(self, "_syncing", False):
            return
        self.redraw()

    def _sync_nan_map(self, p: Params):
        self._syncing = True
        try:
            self.controls["nan_map"].options = list(p.routes)
            self.controls["nan_map"].value = p.nan_map
        finally:
            self._syncing = False

    def redraw(self) -> bool:
        """Read controls, compute, render into the Output. False (and a visible message, the
        previous figure and data kept) when the input is invalid or the run fails."""
        from IPython.display import HTML, Image, clear_output, display

        t0 = time.perf_counter()
        try:
            p = self.read_params()
            data = playground_data(p, self.cache)
        except Exception as e:  # noqa: BLE001 - any failure becomes a message, never a traceback
            self.message.value = (f"<span style='color:#c00;font-weight:bold'>&#9888; {_esc(e)}</span>"
                                  "<span style='color:#666'> (previous result kept)</span>")
            self.last_ok = False
            return False
        fig = render_playground(data)
        png = figure_png(fig)
        self.params, self.last_data, self.figure = p, data, fig
        self._sync_nan_map(p)
        with self.out:
            clear_output(wait=True)
            display(Image(data=png, format="png"))
            display(HTML(_table_html(data["table"])))
        self.redraws += 1
        self.last_ok = True
        self.last_redraw_s = time.perf_counter() - t0
        self.message.value = (f"<span style='color:#2b8a3e'>backend <b>{data['backend']}</b> | {_esc(data['case'])}"
                              f" | redraw {self.last_redraw_s:.2f} s</span>")
        return True

    def set(self, **values) -> bool:
        """Change controls programmatically (names as in `controls` or a fix toggle), as a user
        would: each change redraws. -> whether the last redraw succeeded."""
        for k, v in values.items():
            w = self.controls.get(k) or self.toggles.get(k)
            if w is None:
                raise KeyError(f"no control {k!r}; have {list(self.controls) + list(self.toggles)}")
            w.value = v
        return self.last_ok

    def export(self, name: str | None = None) -> list:
        """Write the current figure (PNG, SVG, PDF with metadata) to $QSA_LAB_FIGURES or figures/."""
        from .export import export_figure

        if self.figure is None or self.last_data is None:
            self.message.value = "<span style='color:#c00'>nothing to export yet</span>"
            return []
        p = self.last_data["params"]
        out_dir = self.out_dir or os.environ.get(FIGURES_ENV, "figures")
        name = name or f"playground_{p.site}_{p.plane}_{p.kv_dtype}"
        try:
            paths = export_figure(self.figure, name, {"case": self.last_data["case"],
                                                      "backend": self.last_data["backend"]}, out_dir=out_dir)
        except Exception as e:  # noqa: BLE001
            self.message.value = f"<span style='color:#c00;font-weight:bold'>&#9888; export: {_esc(e)}</span>"
            return []
        self.last_export = paths
        self.message.value = ("<span style='color:#2b8a3e'>exported: "
                              + ", ".join(_esc(str(x)) for x in paths) + "</span>")
        return paths

    def _repr_mimebundle_(self, **kw):
        return self.widget._repr_mimebundle_(**kw)


def _esc(x) -> str:
    import html

    return html.escape(str(x))


def _table_html(table) -> str:
    t = table.copy()
    t["nan_dims"] = t["nan_dims"].map(lambda d: ",".join(map(str, d[:12])) + ("..." if len(d) > 12 else ""))
    return t.to_html(float_format=lambda v: f"{v:.2e}", na_rep="NaN in output")


def playground(**params) -> Playground:
    """A Playground with Params(**params) as its starting controls."""
    return Playground(Params(**params))

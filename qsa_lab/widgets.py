"""The poison playground: wiring only (mpl-interactions style).

    controls --(read_params)--> Params --(playground_data)--> data --(render_playground)--> Figure
                                                                            \\-> PNG in an Image widget

The data function (qsa_lab.analysis.playground: Params, PRESETS, playground_data over a RunCache)
and the render function (qsa_lab.plotting.playground: render_playground, figure_png, export_view)
are pure and usable without widgets; `Playground` only wires ipywidgets controls to them.
`Playground.last_data` is the data the figure on screen was drawn from, so tests can observe
each redraw.

The first draw: with a core idle the routes are computed in a worker thread while ipywidgets and
matplotlib load and the figure is built and drawn for a blank case of the same layout
(compute_ahead, figure_ahead): the data then repaints only what it changes.
"""
from __future__ import annotations

import html
import time
from dataclasses import replace

from qsa_lab.analysis.playground import (CACHE, PRESETS, SEEDED_SITES, Params, RunCache, check_params, compute_ahead,
                                         parse_dims, parse_seed, playground_data, playground_params, with_table)
from qsa_lab.model.case import KV_DTYPES
from qsa_lab.model.poison import ATTENDED_SITES, DIM_SITES, PLANES, QUERY_SITE, REPORT_DIMS, SITES
from qsa_lab.plotting.playground import FIGSIZE, export_view, figure_ahead, figure_png, render_playground
from qsa_lab.routes.labels import FIXES, ROUTES, fix_label
from qsa_lab.routes.run import BACKENDS

COLUMN = "300px"          # the controls' column beside the figure
ROW_PX = 20               # one row of the route table (its CSS sets it, whatever the notebook's own CSS says)
#: the route table's box: its header and a row for every route (tests/e2e measures its content in JupyterLab)
TABLE_HEIGHT = f"{(len(ROUTES) + 1) * ROW_PX + 8}px"
CSS = """<style>
.qsa-playground .qsa-figure { width: 100%; height: auto; aspect-ratio: %ASPECT%; transition: opacity .15s; }
.qsa-playground.qsa-busy .qsa-figure, .qsa-playground.qsa-busy .qsa-table { opacity: .35; }
.qsa-playground .qsa-table table { border-collapse: collapse; font-size: 13px; margin: 0; }
.qsa-playground .qsa-table td, .qsa-playground .qsa-table th {
  padding: 0 8px; height: %ROW%px; line-height: %ROW%px; text-align: right; white-space: nowrap; border: 0; }
.qsa-playground .qsa-stacked { flex-wrap: wrap; height: auto; }
.qsa-playground .qsa-controls, .qsa-playground .qsa-figure-box { overflow: visible; }
.qsa-playground .qsa-stacked > label { text-align: left; }
.qsa-playground .qsa-stacked > select { flex: 1 1 100%; }
</style>""".replace("%ASPECT%", f"{FIGSIZE[0]} / {FIGSIZE[1]}").replace("%ROW%", str(ROW_PX))
# (the image keeps its height while a new one loads; the geometry dropdown sits under its label, the
# whole column wide, so that its longest preset reads whole: preset_label)
BUSY_HTML = "<span style='color:#1c6ed4'>&#8987; computing&hellip;</span>"




# -- wiring: pure text for the HTML widgets, then the controls ------------------------------------------

def status_html(data: dict, seconds: float, note: str = "") -> str:
    """The status line: the case on screen and nothing else (backend, case, poison, fixes), and
    `note` (the NaN map's route changed by a fix toggled off)."""
    note = f" | <b>{_esc(note)}</b>" if note else ""
    return (f"<span style='color:#2b8a3e'>backend <b>{data['backend']}</b> | {_esc(data['case'])}"
            f" | {_esc(_poison_words(data['params']))}{note} | redraw {seconds:.2f} s</span>")


def error_html(e) -> str:
    return (f"<span style='color:#c00;font-weight:bold'>&#9888; {_esc(e)}</span>"
            "<span style='color:#666'> (the figure shows the last good case)</span>")


def table_html(rows: list[dict]) -> str:
    """The route table (playground_data's rows) as HTML: counts as integers, differences as
    1.2e-03, and a difference that NaN makes undefined as 'NaN in output' (never None).
    Columns: route, NaN, NaN dims, finite where ref NaN, max |Δ ref|, max |Δ xqa|."""
    def diff(v):
        return "NaN in output" if v is None or v != v else f"{v:.2e}"

    def dims(d):
        return ",".join(map(str, d[:12])) + ("..." if len(d) > 12 else "") if len(d) else "-"

    body = "".join(
        f"<tr><th>{_esc(r['route'])}</th><td>{int(r['nan_count'])}</td><td>{_esc(dims(r['nan_dims']))}</td>"
        f"<td>{int(r.get('finite_where_ref_nan', 0))}</td>"
        f"<td>{diff(r['max_abs_diff_vs_reference'])}</td><td>{diff(r['max_abs_diff_vs_xqa'])}</td></tr>"
        for r in rows)
    head = ("<thead><tr><th>route</th><th>NaN</th><th>NaN dims</th><th>finite where ref NaN</th>"
            "<th>max |Δ ref|</th><th>max |Δ xqa|</th></tr></thead>")
    return f"<table>{head}<tbody>{body}</tbody></table>"


def export_html(paths: list, kept: bool) -> str:
    """The export message: the folder once (relative to the notebook's folder when near it, the
    absolute paths on hover) and the file names, whole, in a smaller font (a name with every fix
    runs to 150 characters); `kept`: a second click on an unchanged
    figure, which finds its files already there and writes nothing."""
    import os

    folder, stem = paths[0].parent, paths[0].stem
    rel = os.path.relpath(folder)
    shown = rel if not rel.startswith(os.path.join("..", "..", "..")) else str(folder)
    names = f"{stem}{paths[0].suffix}, " + ", ".join(p.suffix for p in paths[1:])
    what = "already exported, unchanged:" if kept else "exported:"
    return (f"<span style='color:#2b8a3e' title='{_esc(chr(10).join(map(str, paths)))}'>{what} "
            f"<span style='overflow-wrap:anywhere;font-size:80%'>{_esc(names)}</span> in {_esc(shown)}</span>")


def preset_label(name: str) -> str:
    """A geometry preset as the dropdown shows it, whole in the column (the preset's name, the
    dropdown's value, is unchanged): '3-req scatter causal' as '3-req', the report preset's
    geometry seed left to the status line."""
    return name.replace("3-req scatter causal", "3-req").replace("report, seed 63, ", "report, ")


def make_controls(p: Params) -> tuple[dict, dict]:
    """(controls, fix toggles) for `p`; descriptions are stable (the browser test finds them)."""
    import ipywidgets as W

    style = {"description_width": "64px"}

    def row():   # one control per row of the column beside the figure, as wide as the column
        return W.Layout(width="100%")

    def dd(name, options, **kw):
        return W.Dropdown(options=options, value=getattr(p, name) if name != "geometry" else p.preset,
                          description=name, style=style, layout=row(), **kw)

    controls = {
        "site": dd("site", SITES),
        "plane": dd("plane", tuple(PLANES)),
        "dims": W.Text(value=",".join(map(str, p.dims)), description="dims", continuous_update=False,
                       placeholder="102,152,168,170,230", style=style, layout=row()),
        "seed": W.Text(value=str(p.seed), description="seed", continuous_update=False, placeholder="0",
                       tooltip="poison seed (random, fp16-state)", style=style, layout=row()),
        "kv_dtype": dd("kv_dtype", KV_DTYPES),
        "geometry": dd("geometry", [(preset_label(k), k) for k in PRESETS]),
        "backend": dd("backend", BACKENDS),
        "nan_map": W.Dropdown(options=list(p.routes), value=p.nan_map, description="nan_map", style=style,
                              layout=row()),
    }
    # as wide as its label, growing to fill its row (two a row): at 48% 'request_groups (R)' was cut
    toggles = {name: W.Checkbox(value=name in p.fixes, description=fix_label(name), indent=False,
                                layout=W.Layout(width="auto", flex="1 1 auto")) for name in FIXES}
    controls["geometry"].style.description_width = "100%"    # its label above it: see CSS
    controls["geometry"].add_class("qsa-stacked")
    return controls, toggles


def _in_kernel() -> bool:
    """Inside a Jupyter kernel: widget messages arrive while a redraw runs in a thread."""
    try:
        from IPython import get_ipython

        return getattr(get_ipython(), "kernel", None) is not None
    except ImportError:
        return False


class Coalescer:
    """Runs `fn` once per request; requests made while it runs collapse into one more run, so the
    last request is always served and none is dropped. background: run in a worker thread (in a
    kernel, so that widget messages keep arriving), else in the caller."""

    def __init__(self, fn, background: bool):
        import threading

        self.fn, self.background = fn, background
        self._lock, self._pending, self._worker = threading.Lock(), False, None

    def request(self):
        import threading

        if not self.background:
            self.fn()
            return
        with self._lock:
            self._pending = True
            if self._worker is not None:
                return                       # the running worker runs once more, with the latest values
            self._worker = threading.Thread(target=self._work, daemon=True)
        self._worker.start()

    def _work(self):
        while True:
            with self._lock:
                if not self._pending:
                    self._worker = None
                    return
                self._pending = False
            self.fn()

    def wait(self, timeout: float = 600.0) -> bool:
        """Wait for the worker (and any coalesced run) to finish -> whether it did."""
        w = self._worker
        if w is not None:
            w.join(timeout)
        return self._worker is None


class Playground:
    """ipywidgets controls -> read_params -> playground_data -> render_playground -> Image widget.

    Controls (see make_controls): site, plane, dims, seed, kv_dtype, geometry, backend, nan_map,
    a checkbox per fix, and Export. `status` describes the case on screen and nothing else;
    `message` shows "computing...", errors and export paths. While a redraw runs the figure is
    dimmed and the controls stay live: changes made meanwhile are coalesced, and one redraw with
    the latest values follows (in a kernel the redraw runs in a worker thread, so the clicks
    reach the kernel; elsewhere, e.g. in tests, it runs in the caller). Bad input leaves
    last_data, the figure and the status unchanged. The plane control shows the plane the poison
    writes (attended-k / attended-v fix their own and disable it).
    """

    def __init__(self, params: Params | None = None, cache: RunCache | None = None, out_dir: str | None = None,
                 background: bool | None = None):
        import threading

        p = playground_params(params)  # a bad field: one ValueError naming it, before any control is built
        self.cache, self.out_dir = cache or CACHE, out_dir
        planned, computed = compute_ahead(p, self.cache)   # on an idle core, while the modules below load

        import ipywidgets as W

        self.params = self._data = self.figure = self.last_redraw_s = self._ahead = None
        self.nan_map_note = ""   # what read_params changed that the status line must say
        self.last_export, self.redraws, self.requests, self.last_ok = [], 0, 0, False
        self.busy, self.busy_seen = False, 0   # busy_seen: redraws that showed the busy state (tests)
        # _syncing: the thread now setting controls itself (its changes are not a user's)
        self._syncing, self._redraw = None, threading.RLock()
        self._redraws = Coalescer(self.redraw, _in_kernel() if background is None else background)
        self.controls, self.toggles = make_controls(p)
        self.export_button = W.Button(description="Export", icon="download", button_style="primary",
                                      tooltip="write PNG, SVG and PDF of the figure, with what it shows in their metadata")
        # fixed heights: a message coming and going must not move the figure below it
        self.status = W.HTML(layout=W.Layout(min_height="24px"))
        self.message = W.HTML(layout=W.Layout(min_height="24px"))
        self.image = W.Image(format="png", layout=W.Layout(width="100%", height="auto"))
        # as tall as the table of every route: a fix toggled off leaves a row blank, nothing moves;
        # content that does not fit after all scrolls rather than hides
        self.table = W.HTML(layout=W.Layout(height=TABLE_HEIGHT, overflow="auto"))
        for w, cls in ((self.status, "qsa-status"), (self.message, "qsa-message"), (self.image, "qsa-figure"),
                       (self.table, "qsa-table")):
            w.add_class(cls)
        for w in self._inputs():
            w.observe(self._on_change, names="value")
        self.export_button.on_click(lambda _: self.export())
        # Controls in a column beside the figure; the status, the message and a fixed-height route
        # table below them, the whole width: at 1440x900 every control and the figure it changes
        # are on screen together, nothing above the figure changes height (it never jumps), and
        # a long message (an export's file name, an error) reads on one line instead of
        # lengthening the column and pushing the table down.
        controls = W.VBox(list(self.controls.values())
                          + [W.Label("fixes:"), W.HBox(list(self.toggles.values()), layout=W.Layout(flex_flow="row wrap")),
                             self.export_button],
                          layout=W.Layout(width=COLUMN, flex=f"0 0 {COLUMN}"))
        figure = W.Box([self.image], layout=W.Layout(flex="1 1 0", min_width="0"))
        # a child 100% wide plus its 2 px margins overflowed each box: a 4 px scrollbar under it
        controls.add_class("qsa-controls")
        figure.add_class("qsa-figure-box")
        self.widget = W.VBox([W.HTML(CSS), W.HBox([controls, figure], layout=W.Layout(align_items="flex-start")),
                              self.status, self.message, self.table], layout=W.Layout(width="100%"))
        self.widget.add_class("qsa-playground")
        import matplotlib.figure  # noqa: F401 - render_playground's and figure_png's, loaded beside the compute
        from matplotlib.backends import backend_agg  # noqa: F401

        base = planned()   # the figure's layout is known before the routes are: build it meanwhile
        self._ahead = None if base is None else figure_ahead(p, base)
        computed()
        self.redraw()
        self._ahead = None

    @property
    def last_data(self) -> dict | None:
        """The data the figure on screen was drawn from (playground_data's dict, its DataFrame
        "table" built on the first look: pandas is no part of a redraw)."""
        data = self._data
        return None if data is None else with_table(data)

    def _inputs(self) -> list:
        return list(self.controls.values()) + list(self.toggles.values())

    def read_params(self) -> Params:
        """The controls' values as Params (ValueError naming the control when invalid)."""
        c = self.controls
        preset = c["geometry"].value
        if preset not in PRESETS:
            raise ValueError(f"geometry: {preset!r} is not one of {tuple(PRESETS)}")
        site = c["site"].value
        dims = parse_dims(c["dims"].value, PRESETS[preset].head_dim) if site in DIM_SITES else \
            (self.params.dims if self.params else tuple(REPORT_DIMS))
        p = Params(site=site, plane=ATTENDED_SITES.get(site, c["plane"].value), dims=dims,
                   seed=parse_seed(c["seed"].value), kv_dtype=c["kv_dtype"].value, preset=preset,
                   fixes=tuple(n for n, t in self.toggles.items() if t.value), backend=c["backend"].value,
                   nan_map=c["nan_map"].value or "grouped")
        self.nan_map_note = ""
        if p.nan_map not in p.routes:  # its route was toggled off: fall back to the unfixed route, and say so
            self.nan_map_note = f"NaN map of grouped: {p.nan_map} is off"
            p = replace(p, nan_map="grouped")
        return check_params(p)

    # -- events: a change asks for a redraw; changes during one are coalesced into the next -----------
    def _on_change(self, change):
        import threading

        if self._syncing == threading.get_ident():
            return
        self.requests += 1
        self._redraws.request()

    def wait(self, timeout: float = 600.0) -> bool:
        """Wait for a background redraw (and any coalesced one) to finish -> whether it did."""
        return self._redraws.wait(timeout)

    def _sync(self, p: Params):
        """Controls that follow the case drawn: nan_map's options, and the plane actually applied."""
        import threading

        self._syncing = threading.get_ident()
        try:
            self.controls["nan_map"].options = list(p.routes)
            self.controls["nan_map"].value = p.nan_map
            plane = self.controls["plane"]
            plane.value, plane.disabled = p.plane, p.site in ATTENDED_SITES or p.site == QUERY_SITE
            plane.tooltip = ("query writes q, not the cache" if p.site == QUERY_SITE else
                             f"{p.site} writes its own plane ({p.plane})" if plane.disabled else "plane(s) poisoned")
            dims = self.controls["dims"]     # only the sites that poison chosen dims read it
            dims.disabled = p.site not in DIM_SITES
            dims.tooltip = f"{p.site} does not take dims" if dims.disabled else "head dims to poison"
        finally:
            self._syncing = None

    def _set_busy(self, busy: bool):
        """Dim the figure and say 'computing' while a redraw runs (the controls stay live)."""
        self.busy = busy
        if busy:
            self.widget.add_class("qsa-busy")
            self.message.value = BUSY_HTML
            self.busy_seen += 1
        else:
            self.widget.remove_class("qsa-busy")

    def _error(self, e) -> bool:
        self.message.value, self.last_ok = error_html(e), False
        return False

    def redraw(self) -> bool:
        """Read controls, compute, render into the Image. False (and a visible message, the
        previous figure, data and status kept) when the input is invalid or the run fails."""
        with self._redraw:   # one redraw at a time: a worker's and set()'s
            t0 = time.perf_counter()
            try:
                p = self.read_params()
            except Exception as e:  # noqa: BLE001 - any failure becomes a message, never a traceback
                return self._error(e)
            self._set_busy(True)
            try:
                data = playground_data(p, self.cache, frame=False)
                fig = render_playground(data, self.figure or self._ahead)
                png = figure_png(fig)
            except Exception as e:  # noqa: BLE001
                if self._data is not None and self.figure is not None:
                    render_playground(self._data, self.figure)  # the figure object matches the screen again
                self._set_busy(False)
                return self._error(e)
            self.params, self._data, self.figure = data["params"], data, fig
            self._sync(data["params"])
            # image, table and status change together: the status always describes the figure shown
            self.image.value, self.table.value = png, table_html(data["rows"])
            self.redraws, self.last_ok, self.last_redraw_s = self.redraws + 1, True, time.perf_counter() - t0
            self.status.value, self.message.value = status_html(data, self.last_redraw_s, self.nan_map_note), ""
            self._set_busy(False)
            return True

    def set(self, **values) -> bool:
        """Change controls programmatically (names as in `controls` or a fix toggle), as a user
        would, then redraw once -> whether that redraw succeeded. A value a control cannot hold
        becomes a message naming the control, never a traceback."""
        import traitlets

        import threading

        self.wait()
        self._syncing = threading.get_ident()   # one redraw for all the values, below
        try:
            for k, v in values.items():
                w = self.controls.get(k) or self.toggles.get(k)
                if w is None:
                    raise KeyError(f"no control {k!r}; have {list(self.controls) + list(self.toggles)}")
                if k in ("seed", "dims") and not isinstance(v, str):
                    v = ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)
                try:
                    w.value = v
                except traitlets.TraitError:
                    allowed = f"one of {tuple(w.options)}" if hasattr(w, "options") else type(v).__name__
                    return self._error(f"{k}: {v!r} is not a valid value ({allowed})")
        finally:
            self._syncing = None
        return self.redraw()

    def export(self, name: str | None = None) -> list:
        """Write the figure on screen (PNG, SVG, PDF) to figures_dir() (or out_dir), its name and
        metadata saying what it shows. -> the absolute paths written."""
        self.wait()              # the figure of the last change, not one half redrawn by the worker
        with self._redraw:
            return self._export(name)

    def _export(self, name):
        if self.figure is None or self._data is None:
            self.message.value = "<span style='color:#c00'>nothing to export yet</span>"
            return []
        before = {p: _stamp(p) for p in self.last_export}
        try:
            paths = export_view(self.figure, self._data, self.out_dir, name)
        except Exception as e:  # noqa: BLE001
            self.message.value = f"<span style='color:#c00;font-weight:bold'>&#9888; export: {_esc(e)}</span>"
            return []
        # the same files, untouched since this playground wrote them: a second click wrote nothing
        kept = all(before.get(p) is not None and before[p] == _stamp(p) for p in paths)
        self.last_export = paths
        self.message.value = export_html(paths, kept)
        return paths

    def _repr_mimebundle_(self, **kw):
        return self.widget._repr_mimebundle_(**kw)


def _poison_words(p: Params) -> str:
    """What case.describe() leaves out: dims, poison seed, fixes shown."""
    s = f"dims {','.join(map(str, p.dims))}" if p.site in DIM_SITES else ""
    if p.site in SEEDED_SITES:
        s += f"seed {p.seed}"
    return (s + " | " if s else "") + f"fixes {','.join(p.fixes) or 'none'}"


def _stamp(path):
    """(inode, mtime) of a file, None when absent: a file replaced or rewritten changes it."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def _esc(x) -> str:
    return html.escape(str(x))


def playground(**params) -> Playground:
    """A Playground with Params(**params) as its starting controls."""
    return Playground(Params(**params))

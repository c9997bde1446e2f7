"""The poison playground: wiring only (mpl-interactions style).

    controls --(read_params)--> Params --(playground_data)--> data --(render_playground)--> Figure
                                                                            \\-> PNG in an Image widget

`playground_data` and `render_playground` are pure (the data function caches what it
computed, which changes only its speed) and usable without widgets; `Playground` only
wires ipywidgets controls to them. `Playground.last_data` is the data the figure on
screen was drawn from, so tests can observe each redraw.

Why a redraw is fast: `RunCache` keeps, per geometry, the clean case, its plans and the
set of KV tokens each route can read; a new poison re-runs only the routes that read a
byte the poison changed (usually the unfixed grouped route alone) and takes every other
route's output from the clean case, which is bit-identical because those routes never
read the changed bytes; the compute runs on one torch thread (one_cpu_thread). The new image
repaints only the parts of the figure that changed (the NaN map, its dims, the counts that
moved), pixel for pixel what a full draw gives (`_draw_changes`).

The first draw: pandas does not load (the route table is kept as rows; `last_data` builds its
DataFrame when looked at), and with a core idle the routes are computed in a worker thread
while ipywidgets and matplotlib load and the figure is built and drawn for a blank case of the
same layout (`compute_ahead`, `figure_ahead`): the data then repaints only what it changes.
"""
from __future__ import annotations

import contextlib
import html
import platform
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from qsa_lab.model.case import KV_DTYPES, Case, Geometry, build_case, decoded_once
from qsa_lab.model.plan import GroupedPlan, pad_fix, plan_groups, xqa_tokens
from qsa_lab.model.poison import (ATTENDED_SITES, DIM_SITES, PLANES, QUERY_SITE, REPORT_DIMS, SITES, apply_poison)
from qsa_lab.routes.run import (BACKENDS, GROUPED, ROUTES, RunResult, backend_module, emulated_remainder, emulated_routes, grouped_output, resolve_backend, xqa_output)
from qsa_lab.routes.reference import reference_forward

CAUSAL3_SEED = 63   # = qsa_lab.report.repro.CAUSAL3_SEED (not imported: repro pulls in the whole harness)

#: geometry presets; the first is the default (the report's decode-like case at a shorter
#: context: same groups, M-tiles, padding and 480-NaN fingerprint). Presets marked
#: "partial tail" have a request whose seq_len is not a multiple of 4: site stale-tail needs one.
PRESETS = OrderedDict([
    ("decode-like, 19 rows, ctx 2048", Geometry(context=2048, topk=128)),
    ("decode-like, 19 rows, ctx 8192 (report)", Geometry()),
    # 16 rows: the last group holds the last row, so the grouped route reads the partial microblock
    ("decode-like, 16 rows, ctx 2046 (partial tail)", Geometry(rows=16, context=2046, topk=128)),
    ("3-req scatter causal, 24 rows, ctx 2048 (partial tail)",
     Geometry(rows=24, requests=3, layout="scatter", context=2048, topk=128)),
    # the report's 3-request case: geometry seed 63 pads 8 of 9 M-tiles as the report's plan did (640 NaN;
    # most seeds pad all 9: 720), the seed `qsa-lab diff causal3` uses
    ("3-req scatter causal, 24 rows, ctx 8192 (report, seed 63, partial tail)",
     Geometry(rows=24, requests=3, layout="scatter", seed=CAUSAL3_SEED)),
])
#: fix toggle label -> route it adds (reference, xqa and grouped always run)
FIX_TOGGLES = OrderedDict([("kernel_fix", "grouped+kernel_fix"), ("pad_fix", "grouped+pad_fix"),
                           ("both_fixes", "grouped+both_fixes"), ("masked_load", "grouped+masked_load")])
BASE_ROUTES = ("reference", "xqa", "grouped")
FIGURES_ENV = "QSA_LAB_FIGURES"
REMAINDER = "xqa remainder"  # cache entry: the grouped routes' XQA rows, shared by all of them
SEED_MAX = 2**63 - 1          # torch.Generator.manual_seed takes at most a signed 64-bit seed
SEEDED_SITES = ("random", "fp16-state")  # the only sites whose bytes depend on the poison seed
# 1300 px wide, sharp at a cell's full width; 10 inches keep 9-10 pt text >= 11 px on a laptop screen
FIGSIZE, DPI = (10.0, 6.3), 130


def has_partial_tail(g: Geometry) -> bool:
    """Request r holds context - r tokens: some request ends inside a 4-token microblock."""
    return any((g.context - r) % 4 for r in range(g.requests))


#: the first preset stale-tail can use (notebook 03's experiment)
TAIL_PRESET = next(name for name, g in PRESETS.items() if has_partial_tail(g))


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
    def applied_plane(self) -> str:
        """The plane the poison writes: attended-k / attended-v write their own, whatever `plane` says."""
        return ATTENDED_SITES.get(self.site, self.plane)

    @property
    def geometry(self) -> Geometry:
        return PRESETS[self.preset].replace(kv_dtype=self.kv_dtype)  # seed is the poison's: the case stays

    @property
    def routes(self) -> tuple:
        return tuple(r for r in ROUTES if r in BASE_ROUTES or r in {FIX_TOGGLES[f] for f in self.fixes})

    @property
    def poison_key(self) -> tuple:
        """What the poisoned bytes depend on: dims only for dim sites, the seed only for seeded ones."""
        return (self.site, self.applied_plane, self.dims if self.site in DIM_SITES else None,
                self.seed if self.site in SEEDED_SITES else None)


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


def parse_seed(text) -> int:
    """'7' -> 7; ValueError naming 'seed' (and the value) otherwise."""
    s = str(text).strip()
    try:
        seed = int(s)
    except ValueError:
        raise ValueError(f"seed: {s[:40]!r} is not an integer") from None
    if not 0 <= seed <= SEED_MAX:
        shown = s if len(s) <= 24 else f"{s[:12]}...({len(s)} digits)"
        raise ValueError(f"seed: {shown} is outside [0, 2**63 - 1]")
    return seed


def check_params(p: Params) -> Params:
    """Raise ValueError naming the bad control."""
    for name, value, allowed in (("site", p.site, SITES), ("plane", p.plane, tuple(PLANES)),
                                 ("kv_dtype", p.kv_dtype, KV_DTYPES), ("geometry", p.preset, tuple(PRESETS)),
                                 ("backend", p.backend, BACKENDS)):
        if not isinstance(value, str) or value not in allowed:
            raise ValueError(f"{name}: {value!r} is not one of {allowed}")
    if isinstance(p.seed, bool) or not isinstance(p.seed, int) or not 0 <= p.seed <= SEED_MAX:
        raise ValueError(f"seed: must be an int in [0, 2**63 - 1], got {p.seed!r}")
    if p.site in DIM_SITES:
        if not p.dims or any(isinstance(d, bool) or not isinstance(d, int) for d in p.dims):
            raise ValueError(f"dims: must be a non-empty tuple of ints, got {p.dims!r}")
        parse_dims(",".join(map(str, p.dims)), p.geometry.head_dim)
    bad_fix = [f for f in p.fixes if f not in FIX_TOGGLES]
    if bad_fix:
        raise ValueError(f"fixes: {bad_fix} not among {tuple(FIX_TOGGLES)}")
    if p.nan_map not in p.routes:
        raise ValueError(f"nan_map: route {p.nan_map!r} is not toggled on")
    if p.site == "stale-tail" and not has_partial_tail(p.geometry):
        tails = [name for name, g in PRESETS.items() if has_partial_tail(g)]
        raise ValueError(f"site: 'stale-tail' writes the unwritten tokens of a partial last microblock, and "
                         f"geometry {p.preset!r} has none; pick a geometry marked 'partial tail' ({tails[0]!r}, ...)")
    return p


# -- what a redraw computes ------------------------------------------------------------------------

@dataclass
class _Base:
    """One geometry, unpoisoned: the case, both plans and what each route reads."""
    case: Case
    plan: GroupedPlan
    fixed_plan: GroupedPlan
    reads: dict = field(default_factory=dict)   # route -> [pages * page_size] bool
    memo: dict = field(default_factory=dict)    # token lists (bytes do not change them): emulated_routes' memo


def route_reads(case: Case, plan: GroupedPlan, fixed_plan: GroupedPlan) -> dict:
    """route -> [pages * page_size] bool: the physical tokens whose bytes can change its output.

    Every route uses the tokens some row attends. The unfixed grouped kernel also uses
    every token of every microblock in its plan, padding included: mask 0 gives such a
    token probability 0, but 0 * NaN = NaN. Fix A zeroes unattended panel rows and fix C
    never loads them, so those variants use attended tokens only."""
    n = case.kv_cache.shape[0] * case.geometry.page_size
    index, count = xqa_tokens(case)
    valid = torch.arange(index.shape[1]) < count.long().unsqueeze(1)
    attended = torch.zeros(n, dtype=torch.bool)
    attended[index[valid]] = True

    def loaded(pl: GroupedPlan) -> torch.Tensor:
        m = attended.clone()
        m[(pl.microblocks.long().unsqueeze(-1) * 4 + torch.arange(4)).flatten()] = True
        return m

    reads = {"reference": attended, "xqa": attended, REMAINDER: attended}
    for route, (variant, fixed) in GROUPED.items():
        reads[route] = loaded(fixed_plan if fixed else plan) if variant == "unfixed" else attended
    return reads


def changed_tokens(clean: Case, poisoned: Case) -> torch.Tensor:
    """[pages * page_size] bool: tokens where any byte of K or V differs."""
    a, b = clean.kv_cache.view(torch.uint8), poisoned.kv_cache.view(torch.uint8)
    if a.shape[-1] % 8 == 0 and a.is_contiguous() and b.is_contiguous():
        a, b = a.view(torch.int64), b.view(torch.int64)   # a word differs iff one of its 8 bytes does
    return (a != b).any(dim=-1).any(dim=-1).any(dim=1).flatten()


def compute_route(case: Case, base: _Base, route: str, backend: str) -> torch.Tensor:
    """One route of `case` with the geometry's cached plans; exactly what run_routes computes
    (reference: its float64 output; a grouped route: its groups only, see `remainder`)."""
    if route == "reference":
        return reference_forward(case)
    impl = backend_module(backend)
    dev = torch.device("cuda") if backend == "cuda" else torch.device("cpu")
    run_case = case.to(dev)
    if route == "xqa":
        return xqa_output(run_case, torch.arange(case.geometry.rows, device=dev), impl).cpu()
    if route == REMAINDER:  # rows outside every group go through XQA in every grouped route
        return xqa_output(run_case, base.plan.xqa_rows.to(dev), impl).cpu()
    variant, fixed = GROUPED[route]
    plan = (base.fixed_plan if fixed else base.plan).to(dev)
    # checked: the plan is plan_groups(this geometry's case), which a poison does not change
    out = grouped_output(run_case, replace(plan, xqa_rows=plan.xqa_rows[:0]), variant, impl, checked=True)
    return out.cpu()


def compute_routes(case: Case, base: _Base, routes, backend: str) -> dict:
    """compute_route for several routes of one case: on the emulation in one shared pass
    (qsa_lab.routes.run.emulated_routes: one decode of the cache, one gather for the reference and
    XQA, one grouped-kernel pass for every grouped variant), each output bit for bit the same."""
    if backend != "emulate":
        return {r: compute_route(case, base, r, backend) for r in routes}
    shown = [r for r in routes if r in ROUTES]
    # every row's tokens (reference, XQA) outnumber the cache's: decode it once; the grouped panels
    # alone read fewer tokens than it holds, and decode only those
    every_row = any(r in ("reference", "xqa", REMAINDER) for r in routes)
    with decoded_once(case.kv_cache, case.kv_format) if every_row else contextlib.nullcontext():
        outs, ref = emulated_routes(case, shown, base.plan, base.fixed_plan, reference="reference" in routes,
                                    remainder=False, memo=base.memo)
        if REMAINDER in routes:
            outs[REMAINDER] = emulated_remainder(case, base.plan, base.memo)
    if ref is not None:
        outs["reference"] = ref
    return outs


def _trim(store: OrderedDict, size: int) -> None:
    """Drop the least recently used entries of `store` beyond `size`."""
    while len(store) > size:
        store.popitem(last=False)


class RunCache:
    """Cases, plans and route outputs a redraw can reuse (least recently used first out).

    bases:    geometry -> clean case, plans, route read sets
    poisoned: (geometry, poison) -> poisoned case and the tokens the poison changed
    outputs:  (geometry, poison or None for clean, backend, route) -> output
    A route whose read set misses every changed token takes the clean output."""

    def __init__(self, size: int = 8):
        self.size = size
        self.bases, self.poisoned, self.outputs = OrderedDict(), OrderedDict(), OrderedDict()
        self.computed = []  # (geometry, poison key or None, backend, route) of each route actually run

    def _get(self, store, key, make, size=None):
        if key in store:
            store.move_to_end(key)
            return store[key]
        store[key] = value = make()
        _trim(store, size or self.size)
        return value

    def base(self, g: Geometry) -> _Base:
        def make():
            case = build_case(g)
            plan = plan_groups(case)
            fixed = pad_fix(plan)
            return _Base(case, plan, fixed, route_reads(case, plan, fixed))
        return self._get(self.bases, g, make)

    def poisoned_case(self, p: Params):
        g, base = p.geometry, self.base(p.geometry)

        def make():
            case = apply_poison(base.case, p.site, plane=p.applied_plane,
                                dims=list(p.dims) if p.site in DIM_SITES else None, seed=p.seed)
            return case, changed_tokens(base.case, case)
        return self._get(self.poisoned, (g, p.poison_key), make)

    def _key(self, p: Params, route: str, backend: str) -> tuple:
        """The output entry of `route`: the clean case's when the route reads no changed byte."""
        base = self.base(p.geometry)
        case, changed = self.poisoned_case(p)
        clean = not bool((changed & base.reads[route]).any()) and case.q is base.case.q  # site query writes q
        return (p.geometry, None if clean else p.poison_key, backend, route)

    def output(self, p: Params, route: str, backend: str) -> torch.Tensor:
        return self.outputs_of(p, [route], backend)[route]

    def outputs_of(self, p: Params, routes, backend: str) -> dict:
        """route -> output (see compute_route) for `routes` of the poisoned case; the ones not
        cached are computed together, one compute_routes call for the clean case and one for the
        poisoned one."""
        keys = {r: self._key(p, r, backend) for r in routes}
        found, missing = {}, {}  # missing: poison key or None -> routes to compute on that case
        for r, key in keys.items():
            if key in self.outputs:
                self.outputs.move_to_end(key)
                found[r] = self.outputs[key]
            else:
                missing.setdefault(key[1], []).append(r)
        base = self.base(p.geometry)
        for poison, todo in missing.items():
            case = base.case if poison is None else self.poisoned_case(p)[0]
            for r, out in compute_routes(case, base, todo, backend).items():
                self.computed.append(keys[r])
                found[r] = self.outputs[keys[r]] = out
        _trim(self.outputs, 8 * self.size * len(ROUTES))
        return found

    def result(self, p: Params) -> RunResult:
        """The poisoned case through the shown routes, as a RunResult (outputs fp16, reference64)."""
        backend = resolve_backend(p.backend, p.geometry)
        base = self.base(p.geometry)
        case, _ = self.poisoned_case(p)
        rest = base.plan.xqa_rows
        grouped = [r for r in p.routes if r in GROUPED]
        parts = ["reference"] + [r for r in p.routes if r != "reference"]
        got = self.outputs_of(p, parts + ([REMAINDER] if grouped and rest.numel() else []), backend)
        ref = got["reference"]
        outputs = {"reference": ref.to(torch.float16)}
        for r in p.routes:
            if r in GROUPED:  # grouped rows from the route, remainder rows from the shared XQA entry
                out = got[r].clone()
                if rest.numel():
                    out[rest] = got[REMAINDER]
                outputs[r] = out
            elif r != "reference":
                outputs[r] = got[r]
        return RunResult(case, backend, base.plan, outputs, ref)

    def clear(self):
        for store in (self.bases, self.poisoned, self.outputs):
            store.clear()


_CACHE = RunCache()


def playground_data(p: Params, cache: RunCache | None = None, frame: bool = True) -> dict:
    """Params -> everything render_playground draws: the chosen route's NaN map, the routes
    side by side, the route table (its rows, and as a DataFrame "table"; frame=False leaves the
    DataFrame to with_table, so that a first draw does not wait for pandas), and the case/backend
    for titles and export metadata."""
    from qsa_lab.analysis import figure_data as figdata

    check_params(p)
    p = replace(p, plane=p.applied_plane)   # what the figure shows is what was applied
    with one_cpu_thread():
        res = (cache or _CACHE).result(p)
        # the case is named once, in the NaN map's title: every line of text costs redraw time
        routes = dict(figdata.route_nans(res, p.routes, frame=False), title="the case above")
        nan_map = figdata.nan_map(res, p.nan_map)
    data = {"params": p, "backend": res.backend, "case": res.case.describe(), "poison": dict(res.case.poison),
            "geometry": p.geometry.to_dict(), "nan_map": nan_map, "routes": routes, "rows": routes["rows"]}
    return with_table(data) if frame else data


def with_table(data: dict) -> dict:
    """playground_data's dict with its route table as a DataFrame ("table", in it and in its
    routes), built from the rows once. The rows are every route the result holds (the shown
    ones), so the table is figdata.route_nans' own."""
    if "table" not in data:
        from qsa_lab.analysis.figure_data import route_nans_frame

        data["table"] = data["routes"]["table"] = route_nans_frame(data["rows"])
    return data


def compute_ahead(p: Params, cache: RunCache):
    """When a core is idle (procs.idle_core), start computing what playground_data(p, cache)
    needs in a worker thread -> (planned, computed): planned() waits for the clean case and its
    plans (the figure's layout, see figure_ahead) and returns the geometry's _Base, computed()
    waits for the routes; else two functions that do nothing (planned() gives None). Torch
    leaves the GIL inside its ops, so they run on the idle core while the caller imports the
    widget and figure modules and builds the figure; playground_data then finds every output in
    `cache`: the same entries, computed by the same code on one thread. On a busy machine the
    two threads would only queue for one core (a first draw took longer), so there it stays
    sequential. A failure is left for playground_data to meet again and show."""
    import threading

    from qsa_lab.support.processes import idle_core

    if not idle_core():
        return (lambda: None), (lambda: None)
    planned, base = threading.Event(), []

    def work():
        with contextlib.suppress(Exception), one_cpu_thread():
            try:
                base.append(cache.base(p.geometry))
            finally:
                planned.set()
            cache.result(replace(p, plane=p.applied_plane))

    worker = threading.Thread(target=work, name="qsa-lab playground compute", daemon=True)
    worker.start()

    def wait_planned():
        planned.wait()
        return base[0] if base else None
    return wait_planned, worker.join


def figure_ahead(p: Params, base: _Base):
    """The playground's figure for `p` before its routes are computed: every artist made for the
    layout (shapes, routes) the data will have, holding a blank case (no NaN, zero outputs), and
    drawn. render_playground then gives it the data as to a figure it drew before and
    figure_png repaints the parts that changed: the same pixels as a new figure's full draw
    (tests/test_widgets.py compares them). None for invalid Params."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    try:
        check_params(p)
    except ValueError:
        return None         # redraw shows the error
    plan, g = base.plan, p.geometry
    rows = ((plan.group_rows.numel() if plan.groups else 0) + plan.xqa_rows.numel()) * g.q_heads
    nan_map = {"values": np.zeros((rows, g.head_dim), np.float32), "dropped": np.zeros((rows, g.head_dim), bool),
               "groups": plan.groups, "q_heads": g.q_heads, "m_tiles": plan.m_tiles,
               "xqa_rows": plan.xqa_rows.tolist(), "route": p.nan_map, "nan_count": 0, "dropped_count": 0, "title": ""}
    shape = (len(p.routes), g.head_dim)
    routes = {"routes": list(p.routes), "per_dim": np.zeros(shape, np.int64),
              "dropped_per_dim": np.zeros(shape, np.int64),
              "rows": [{"route": r, "nan_count": 0, "max_abs_diff_vs_xqa": 0.0, "finite_where_ref_nan": 0}
                       for r in p.routes], "title": ""}
    fig = render_playground({"nan_map": nan_map, "routes": routes})
    _draw_changes(fig, FigureCanvasAgg(fig))   # drawn once: the first figure_png repaints what the data changes
    return fig


@contextlib.contextmanager
def one_cpu_thread():
    """Torch on one CPU thread inside (the previous count restored after). The playground's
    tensors are small: a second thread saves little, and on a busy machine every op waits for it
    (a redraw took over twice as long on a loaded 2-core machine). Outputs are bit for bit the
    same: no route splits a reduction by thread (tests/test_widgets.py compares with run_routes)."""
    from qsa_lab.support.processes import torch_threads

    with torch_threads(1):
        yield


def render_playground(data: dict, fig=None):
    """data -> Figure: NaN map on top, routes side by side below, head dims aligned. A new Figure
    unless `fig` is given; a `fig` this function drew before with the same layout (shapes, routes)
    gets only its data replaced, which draws exactly what a new one would at a fraction of the
    time. No pyplot state, so it draws the same inside and outside widgets."""
    from matplotlib.figure import Figure

    from qsa_lab.plotting import plots as plotting

    layout = (plotting.nan_map_layout(data["nan_map"]), plotting.route_comparison_layout(data["routes"]))
    if fig is not None and getattr(fig, "qsa_layout", None) == layout:
        top, bottom = fig.axes[:2]
        plotting.update_nan_map(top, data["nan_map"])
        plotting.update_route_comparison(bottom, data["routes"])
        return fig
    if fig is None:
        fig = Figure(figsize=FIGSIZE, dpi=DPI)
    else:
        fig.clear()
        fig.qsa_drawn = None   # what figure_png drew last is gone with the axes
    # fixed margins, not constrained layout (layout solving was a third of the redraw time); the
    # right quarter holds the NaN map's colour bar and legend and each route's counts
    top, bottom = fig.subplots(2, 1, height_ratios=[2.5, 1.3],
                               gridspec_kw=dict(left=0.16, right=0.74, top=0.8, bottom=0.075, hspace=0.32))
    # no minor ticks: each is an artist to build and draw, and the majors every 32 dims suffice here
    plotting.plot_nan_map(data["nan_map"], ax=top, minor=False)
    plotting.plot_route_comparison(data["routes"], ax=bottom, minor=False, mark_dims=False)
    fig.qsa_layout = layout
    return fig


def figure_png(fig) -> bytes:
    """The figure as PNG bytes at its own dpi: its pixels exactly as canvas.draw() makes them
    (a redraw of a figure drawn before repaints only what changed, see `_draw_changes`)."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    if getattr(fig, "qsa_layout", None) is None:   # not drawn by render_playground: nothing to compare with
        canvas.draw()
        return png_bytes(np.asarray(canvas.buffer_rgba())[..., :3])
    return png_bytes(_draw_changes(fig, canvas)[..., :3])


def png_bytes(rgb) -> bytes:
    """[h, w, 3] uint8 -> PNG (no row filter, fast zlib level: on screen the time matters more than
    the size, and plots compress well unfiltered)."""
    import struct
    import zlib

    import numpy as np

    h, w, _ = rgb.shape
    rows = np.empty((h, 1 + 3 * w), np.uint8)
    rows[:, 0] = 0                              # filter type 0 (none) on every row
    rows[:, 1:] = rgb.reshape(h, 3 * w)

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows.tobytes(), 1)) + chunk(b"IEND", b""))


# -- a redraw repaints only what changed -------------------------------------------------------------
# A same-layout redraw (render_playground's update path) changes only the "parts" below; the
# rest (tick labels, axis labels, legend) is static. The canvas is drawn with every static or
# unchanged artist hidden whose footprint stays clear of the changed parts' footprints (old and
# new), and only those footprints are copied from it onto the previous image: every pixel
# outside them is touched by unchanged artists alone, every pixel inside by artists drawn. A
# fully transparent image draws nothing and is always left out. Anything that breaks the rule
# (footprints that meet after the draw, a new canvas size) falls back to a full draw.
PAD_PX = 3  # antialiasing and glyph overhang reach a pixel or two past an extent


def _image_state(im) -> tuple:
    import numpy as np

    a = im.get_array()
    return (a.shape, a.dtype.str, np.asarray(a).tobytes(), np.ma.getmaskarray(a).tobytes(),
            im.get_clim() if a.ndim == 2 else None, im.get_visible())


def _text_state(t) -> tuple:
    return t.get_text(), str(t.get_color()), t.get_visible()


def _parts(fig) -> dict:
    """name -> (artists, state) for everything a same-layout redraw can change: equal states
    draw the same pixels in the same place (state None: never taken as unchanged)."""
    top, bottom = fig.axes[:2]
    parts = {"map": ([top.qsa_image], _image_state(top.qsa_image)),
             "map dropped": ([top.qsa_dropped], _image_state(top.qsa_dropped)),
             "nan dims": ([top.qsa_top[0]], (top.qsa_top[0].get_visible(), top.qsa_dims)),
             "colour bar": ([top.qsa_cax], top.qsa_image.get_clim()),
             "map title": ([top.title], None),    # None: moves with the NaN dims above it, always redrawn
             "routes": ([bottom.qsa_image], _image_state(bottom.qsa_image)),
             "routes dropped": ([bottom.qsa_dropped], _image_state(bottom.qsa_dropped)),
             "routes title": ([bottom.title], _text_state(bottom.title))}
    for i, t in enumerate(bottom.qsa_texts):
        parts[f"route {i}"] = ([t], _text_state(t))
    return parts


def _static(fig) -> list:
    """The artists a same-layout redraw never changes and that are worth not drawing."""
    top, bottom = fig.axes[:2]
    out = [top.get_legend()]
    for ax in (top, bottom):
        for axis in (ax.xaxis, ax.yaxis):
            out += [t.label1 for t in axis.get_major_ticks()] + [axis.label]
    return [a for a in out if a is not None and a.get_visible()]


def _box(artists, renderer):
    """Pixel rectangle (x0, y0, x1, y1), padded, around what the visible `artists` draw, or None."""
    boxes = [b for b in (a.get_tightbbox(renderer) for a in artists if a.get_visible()) if b is not None]
    if not boxes:
        return None
    return (min(b.x0 for b in boxes) - PAD_PX, min(b.y0 for b in boxes) - PAD_PX,
            max(b.x1 for b in boxes) + PAD_PX, max(b.y1 for b in boxes) + PAD_PX)


def _meets(a, b) -> bool:
    return a is not None and b is not None and a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _transparent(artist) -> bool:
    """An RGBA image with alpha 0 everywhere: drawing it leaves every pixel as it is."""
    a = artist.get_array()
    return a.ndim == 3 and a.shape[-1] == 4 and not a[..., 3].any()


def _draw_changes(fig, canvas):
    """Draw `fig` on `canvas` -> its RGBA pixels, exactly canvas.draw()'s, repainting only the
    changed parts when the figure was drawn here before with the same layout (see above)."""
    import numpy as np

    parts, size = _parts(fig), (canvas.get_width_height(), fig.dpi)
    blank = [a for artists, _ in parts.values() for a in artists if hasattr(a, "get_array") and _transparent(a)]
    last = getattr(fig, "qsa_drawn", None)

    def full():
        with _hidden(blank):
            canvas.draw()
        return _remember(fig, canvas, parts, size, np.asarray(canvas.buffer_rgba()).copy())

    if last is None or (last["size"], last["layout"], last["axes"]) != (size, fig.qsa_layout, fig.axes[:2]):
        return full()
    changed = [n for n, (_, state) in parts.items() if state is None or state != last["parts"][n][1]]
    old = [last["boxes"][n] for n in changed]
    # left out: unchanged parts and static artists clear of every changed part's old footprint
    out = [(artists, last["boxes"][n]) for n, (artists, _) in parts.items() if n not in changed]
    out = [(artists, box) for artists, box in out + [([a], b) for a, b in zip(last["static"], last["static boxes"])]
           if not any(_meets(box, o) for o in old)]
    with _hidden([a for artists, _ in out for a in artists] + blank):
        canvas.draw()
        new = [_box(parts[n][0], canvas.get_renderer()) for n in changed]
    if any(_meets(box, b) for _, box in out for b in new):
        return full()           # a part grew into something left out: draw it all
    image, fresh = last["image"], np.asarray(canvas.buffer_rgba())
    height, width = image.shape[:2]
    for box in [b for b in old + new if b is not None]:
        x0, x1 = max(int(box[0]), 0), min(int(np.ceil(box[2])), width)
        r0, r1 = max(height - int(np.ceil(box[3])), 0), min(height - int(box[1]), height)
        image[r0:r1, x0:x1] = fresh[r0:r1, x0:x1]
    last.update(parts=parts, boxes=dict(last["boxes"], **dict(zip(changed, new))), repainted=changed)
    return image


@contextlib.contextmanager
def _hidden(artists):
    """The visible ones of `artists` hidden inside."""
    hidden = [a for a in dict.fromkeys(artists) if a.get_visible()]
    try:
        for a in hidden:
            a.set_visible(False)
        yield
    finally:
        for a in hidden:
            a.set_visible(True)


def _remember(fig, canvas, parts, size, image):
    """After a full draw: what the next redraw compares with -> image."""
    renderer, static = canvas.get_renderer(), _static(fig)
    fig.qsa_drawn = {"size": size, "layout": fig.qsa_layout, "axes": fig.axes[:2], "image": image, "parts": parts,
                     "boxes": {n: _box(artists, renderer) for n, (artists, _) in parts.items()},
                     "static": static, "static boxes": [_box([a], renderer) for a in static],
                     "repainted": None}   # None: drawn whole; else the parts the last redraw repainted
    return image


def figures_dir() -> Path:
    """Where figures go (the one folder; see qsa_lab.plotting.export.figures_dir)."""
    from qsa_lab.plotting.export import figures_dir as where

    return where()


def export_meta(data: dict) -> dict:
    """Everything needed to redraw an exported figure: geometry with its seed, poison site,
    plane, dims and seed, the fixes shown, backend and versions (export adds the GPU)."""
    import matplotlib

    from qsa_lab import __version__

    p = data["params"]
    return {"case": data["case"], "backend": data["backend"], "preset": p.preset,
            "geometry": ", ".join(f"{k}={v}" for k, v in data["geometry"].items()),
            "geometry_seed": str(data["geometry"]["seed"]),
            "site": p.site, "plane": p.plane,
            "dims": ",".join(map(str, p.dims)) if p.site in DIM_SITES else "",
            "poison_seed": str(p.seed) if p.site in SEEDED_SITES else "", "fixes": ",".join(p.fixes) or "none", "routes": ",".join(p.routes),
            "nan_map_route": p.nan_map,
            "versions": f"qsa_lab {__version__}, torch {torch.__version__}, matplotlib {matplotlib.__version__}, "
                        f"python {platform.python_version()}"}


_FIX_CODES = {"kernel_fix": "A", "pad_fix": "B", "both_fixes": "AB", "masked_load": "C"}


def export_name(data: dict) -> str:
    """A file stem that says what the figure shows, e.g.
    playground_targeted-v_d102-152-168-170-230_r19x1-ctx2048-k128-e4m3-gs0_fixA+B+AB+C_emulate
    (a poison seed `_psN` only for the sites whose bytes depend on it: random, fp16-state)."""
    p, g = data["params"], data["geometry"]
    dims = ""
    if p.site in DIM_SITES:
        d = list(p.dims)
        dims = "_d" + ("-".join(map(str, d)) if len(d) <= 8 else f"{d[0]}-to-{d[-1]}-n{len(d)}")
    fixes = "+".join(_FIX_CODES[f] for f in p.fixes) or "none"
    seed = f"_ps{p.seed}" if p.site in SEEDED_SITES else ""
    return (f"playground_{p.site}-{p.plane}{dims}{seed}_r{g['rows']}x{g['requests']}-ctx{g['context']}"
            f"-k{g['topk']}-{g['kv_dtype']}-gs{g['seed']}_fix{fixes}_{data['backend']}")


CSS = """<style>
.qsa-playground .qsa-figure { width: 100%; height: auto; aspect-ratio: %ASPECT%; transition: opacity .15s; }
.qsa-playground.qsa-busy .qsa-figure, .qsa-playground.qsa-busy .qsa-table { opacity: .35; }
.qsa-playground .qsa-table table { border-collapse: collapse; font-size: 13px; }
.qsa-playground .qsa-table td, .qsa-playground .qsa-table th { padding: 1px 8px; text-align: right; }
</style>""".replace("%ASPECT%", f"{FIGSIZE[0]} / {FIGSIZE[1]}")  # the image keeps its height while a new one loads
BUSY_HTML = "<span style='color:#1c6ed4'>&#8987; computing&hellip;</span>"


# -- wiring: pure text for the HTML widgets, then the controls ------------------------------------------

def export_view(fig, data: dict, out_dir=None, name: str | None = None) -> list:
    """Write a playground figure (PNG, SVG, PDF) to out_dir (default figures_dir()), named and
    tagged with what it shows (export_name, export_meta) -> the absolute paths."""
    from qsa_lab.plotting.export import export_figure

    out = Path(out_dir).expanduser().resolve() if out_dir else figures_dir()
    return [Path(x).resolve() for x in export_figure(fig, name or export_name(data), export_meta(data), out_dir=out)]


def status_html(data: dict, seconds: float) -> str:
    """The status line: the case on screen and nothing else (backend, case, poison, fixes)."""
    return (f"<span style='color:#2b8a3e'>backend <b>{data['backend']}</b> | {_esc(data['case'])}"
            f" | {_esc(_poison_words(data['params']))} | redraw {seconds:.2f} s</span>")


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


def make_controls(p: Params) -> tuple[dict, dict]:
    """(controls, fix toggles) for `p`; descriptions are stable (the browser test finds them)."""
    import ipywidgets as W

    style = {"description_width": "64px"}

    def dd(name, options, width=None, **kw):
        return W.Dropdown(options=options, value=getattr(p, name) if name != "geometry" else p.preset,
                          description=name, style=style, layout=W.Layout(width=width) if width else W.Layout(), **kw)

    controls = {
        "site": dd("site", SITES),
        "plane": dd("plane", tuple(PLANES), "190px"),
        "dims": W.Text(value=",".join(map(str, p.dims)), description="dims", continuous_update=False,
                       placeholder="102,152,168,170,230", style=style),
        "seed": W.Text(value=str(p.seed), description="seed", continuous_update=False, placeholder="0",
                       tooltip="poison seed (random, fp16-state)", style=style, layout=W.Layout(width="190px")),
        "kv_dtype": dd("kv_dtype", KV_DTYPES, "190px"),
        "geometry": dd("geometry", list(PRESETS), "480px"),
        "backend": dd("backend", BACKENDS, "190px"),
        "nan_map": W.Dropdown(options=list(p.routes), value=p.nan_map, description="nan_map",
                              layout=W.Layout(width="300px"), style=style),
    }
    toggles = {name: W.Checkbox(value=name in p.fixes, description=name, indent=False,
                                layout=W.Layout(width="120px")) for name in FIX_TOGGLES}
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

        from qsa_lab.analysis.playground import playground_params

        p = playground_params(params)  # a bad field: one ValueError naming it, before any control is built
        self.cache, self.out_dir = cache or _CACHE, out_dir
        planned, computed = compute_ahead(p, self.cache)   # on an idle core, while the modules below load

        import ipywidgets as W

        self.params = self._data = self.figure = self.last_redraw_s = self._ahead = None
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
        self.table = W.HTML()
        for w, cls in ((self.status, "qsa-status"), (self.message, "qsa-message"), (self.image, "qsa-figure"),
                       (self.table, "qsa-table")):
            w.add_class(cls)
        for w in self._inputs():
            w.observe(self._on_change, names="value")
        self.export_button.on_click(lambda _: self.export())
        c = self.controls
        # the route table sits above the figure: on a laptop screen both are in view with the controls
        self.widget = W.VBox([
            W.HTML(CSS),
            W.HBox([c["site"], c["plane"], c["dims"], c["seed"]]),
            W.HBox([c["kv_dtype"], c["geometry"], c["backend"]]),
            W.HBox([W.Label("fixes:")] + list(self.toggles.values()) + [c["nan_map"], self.export_button]),
            self.status, self.message, self.table, self.image,
        ], layout=W.Layout(width="100%"))
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
        if p.nan_map not in p.routes:  # its route was toggled off: fall back to the unfixed route
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
            self.status.value, self.message.value = status_html(data, self.last_redraw_s), ""
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
        try:
            self.last_export = export_view(self.figure, self._data, self.out_dir, name)
        except Exception as e:  # noqa: BLE001
            self.message.value = f"<span style='color:#c00;font-weight:bold'>&#9888; export: {_esc(e)}</span>"
            return []
        self.message.value = ("<span style='color:#2b8a3e'>exported: "
                              + ", ".join(_esc(str(x)) for x in self.last_export) + "</span>")
        return self.last_export

    def _repr_mimebundle_(self, **kw):
        return self.widget._repr_mimebundle_(**kw)


def _poison_words(p: Params) -> str:
    """What case.describe() leaves out: dims, poison seed, fixes shown."""
    s = f"dims {','.join(map(str, p.dims))}" if p.site in DIM_SITES else ""
    if p.site in SEEDED_SITES:
        s += f"seed {p.seed}"
    return (s + " | " if s else "") + f"fixes {','.join(p.fixes) or 'none'}"


def _esc(x) -> str:
    return html.escape(str(x))


def playground(**params) -> Playground:
    """A Playground with Params(**params) as its starting controls."""
    return Playground(Params(**params))

"""The poison playground's data, no drawing: its parameters (Params, the geometry PRESETS,
check_params), what a redraw computes (playground_data over a RunCache) and the check of a
playground's parameters (playground_params). qsa_lab.plotting.playground draws it; qsa_lab.widgets wires controls to both.

    BACKEND = notebook_backend()            # qsa_lab.analysis.notebook: $QSA_LAB_BACKEND, checked
    data = playground_data(Params(site="random", backend=BACKEND))   # pure: a dict of what is shown

Why a redraw is fast: `RunCache` keeps, per geometry, the clean case, its plans and the set of
KV tokens each route can read; a new poison re-runs only the routes that read a byte the poison
changed (usually the unfixed grouped route alone) and takes every other route's output from the
clean case, which is bit-identical because those routes never read the changed bytes; the compute
runs on one torch thread (one_cpu_thread). pandas does not load for a redraw (the route table is
kept as rows; with_table builds its DataFrame when looked at), and with a core idle the first
draw's routes are computed in a worker thread while the caller loads its modules (compute_ahead).
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import torch

from qsa_lab.model.case import KV_DTYPES, Case, Geometry, build_case, decoded_once
from qsa_lab.model.geometry import CAUSAL3_SEED
from qsa_lab.model.plan import GroupedPlan, pad_fix, plan_groups, xqa_tokens
from qsa_lab.model.poison import ATTENDED_SITES, DIM_SITES, PLANES, REPORT_DIMS, SITES, apply_poison
from qsa_lab.routes.labels import FIXES, GROUPED, GROUPING, ROUTES, fix_of
from qsa_lab.routes.reference import reference_forward
from qsa_lab.routes.run import (BACKENDS, RunResult, backend_module, emulated_remainder, emulated_routes,
                                grouped_output, resolve_backend, route_plan, xqa_output)

def playground_params(params=None):
    """Params for a Playground (None: the defaults), checked before any control is built:
    ValueError naming the field (preset, site, plane, dims, seed, kv_dtype, backend, fixes,
    nan_map), TypeError for something that is not a Params."""
    if params is None:
        return Params()
    if not isinstance(params, Params):
        raise TypeError(f"params: expected qsa_lab.analysis.playground.Params, got {type(params).__name__}")
    if not isinstance(params.preset, str) or params.preset not in PRESETS:
        raise ValueError(f"preset: {params.preset!r} is not one of {tuple(PRESETS)}")
    return check_params(params)


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
#: the routes every view runs; each fix of labels.FIXES toggled on adds its route grouped+<fix>
BASE_ROUTES = ("reference", "xqa", "grouped")
REMAINDER = "xqa remainder"  # cache entry: the grouped routes' XQA rows, shared by all of them
SEED_MAX = 2**63 - 1          # torch.Generator.manual_seed takes at most a signed 64-bit seed
SEEDED_SITES = ("random", "fp16-state")  # the only sites whose bytes depend on the poison seed


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
    fixes: tuple = tuple(FIXES)
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
        return tuple(r for r in ROUTES if r in BASE_ROUTES or fix_of(r) in self.fixes)

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
    bad_fix = [f for f in p.fixes if f not in FIXES]
    if bad_fix:
        raise ValueError(f"fixes: {bad_fix} not among {tuple(FIXES)}")
    if p.nan_map not in p.routes:
        raise ValueError(f"nan_map: route {p.nan_map!r} is not toggled on")
    if p.site == "stale-tail" and not has_partial_tail(p.geometry):
        tails = [name for name, g in PRESETS.items() if has_partial_tail(g)]
        raise ValueError(f"site: 'stale-tail' writes the unwritten tokens of a partial last microblock, and "
                         f"geometry {p.preset!r} has none; pick a geometry marked 'partial tail' ({tails[0]!r}, ...)")
    return p


# -- what a redraw computes ------------------------------------------------------------------------

@dataclass
class Base:
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
    token probability 0, but 0 * NaN = NaN. kernel_fix (A) zeroes unattended panel rows and
    masked_load (C) never loads them, so those variants use attended tokens only. finite_pv (F)
    multiplies an unattended token's finite value by 0 and its non-finite value not at all:
    counted with the panel all the same (an unattended -0 * p = -0 is still a read)."""
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
        own = route_plan(route, plan, fixed_plan, case)
        reads[route] = loaded(own) if variant in ("unfixed", "finite_pv") else attended
    return reads


def changed_tokens(clean: Case, poisoned: Case) -> torch.Tensor:
    """[pages * page_size] bool: tokens where any byte of K or V differs."""
    a, b = clean.kv_cache.view(torch.uint8), poisoned.kv_cache.view(torch.uint8)
    if a.shape[-1] % 8 == 0 and a.is_contiguous() and b.is_contiguous():
        a, b = a.view(torch.int64), b.view(torch.int64)   # a word differs iff one of its 8 bytes does
    return (a != b).any(dim=-1).any(dim=-1).any(dim=1).flatten()


def compute_route(case: Case, base: Base, route: str, backend: str) -> torch.Tensor:
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
    plan = route_plan(route, base.plan, base.fixed_plan, base.case, base.memo).to(dev)
    # checked: the plan is plan_groups(this geometry's case), which a poison does not change; a route of
    # labels.GROUPING runs its own remainder rows (not the shared REMAINDER entry)
    own_rest = route in GROUPING
    out = grouped_output(run_case, plan if own_rest else replace(plan, xqa_rows=plan.xqa_rows[:0]), variant, impl,
                         checked=True)
    return out.cpu()


def compute_routes(case: Case, base: Base, routes, backend: str) -> dict:
    """compute_route for several routes of one case: on the emulation in one shared pass
    (qsa_lab.routes.run.emulated_routes: one decode of the cache, one gather for the reference and
    XQA, one grouped-kernel pass for every grouped variant), each output bit for bit the same."""
    if backend != "emulate":
        return {r: compute_route(case, base, r, backend) for r in routes}
    shown = [r for r in routes if r in ROUTES and r not in GROUPING]   # GROUPING routes: compute_route
    # every row's tokens (reference, XQA) outnumber the cache's: decode it once; the grouped panels
    # alone read fewer tokens than it holds, and decode only those
    every_row = any(r in ("reference", "xqa", REMAINDER) for r in routes)
    with decoded_once(case.kv_cache, case.kv_dtype) if every_row else contextlib.nullcontext():
        outs, ref = emulated_routes(case, shown, base.plan, base.fixed_plan, reference="reference" in routes,
                                    remainder=False, memo=base.memo)
        if REMAINDER in routes:
            outs[REMAINDER] = emulated_remainder(case, base.plan, base.memo)
    for r in routes:
        if r in GROUPING:
            outs[r] = compute_route(case, base, r, backend)
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

    def base(self, g: Geometry) -> Base:
        def make():
            case = build_case(g)
            plan = plan_groups(case)
            fixed = pad_fix(plan)
            return Base(case, plan, fixed, route_reads(case, plan, fixed))
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
            if r in GROUPED and r not in GROUPING:  # grouped rows from the route, remainder rows from the shared XQA entry
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


CACHE = RunCache()


def playground_data(p: Params, cache: RunCache | None = None, frame: bool = True) -> dict:
    """Params -> everything render_playground draws: the chosen route's NaN map, the routes
    side by side, the route table (its rows, and as a DataFrame "table"; frame=False leaves the
    DataFrame to with_table, so that a first draw does not wait for pandas), and the case/backend
    for titles and export metadata."""
    from qsa_lab.analysis import figure_data as figdata

    check_params(p)
    p = replace(p, plane=p.applied_plane)   # what the figure shows is what was applied
    with one_cpu_thread():
        res = (cache or CACHE).result(p)
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
    plans (the figure's layout, see figure_ahead) and returns the geometry's Base, computed()
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




@contextlib.contextmanager
def one_cpu_thread():
    """Torch on one CPU thread inside (the previous count restored after). The playground's
    tensors are small: a second thread saves little, and on a busy machine every op waits for it
    (a redraw took over twice as long on a loaded 2-core machine). Outputs are bit for bit the
    same: no route splits a reduction by thread (tests/widgets/test_widgets.py compares with run_routes)."""
    from qsa_lab.support.processes import torch_threads

    with torch_threads(1):
        yield



"""Data for figures: pure functions from cases and results to what plotting.py draws.

No drawing here (that is plotting.py) and no analysis the analysis module already
does: these only reshape a Case / RunResult / bench JSON into small dicts and
DataFrames, one per figure, so a figure can be redrawn from its data alone.
"""
from __future__ import annotations

import torch

# the timings' figure data needs no torch (notebook 05): it lives in bench_data, named here too
from qsa_lab.analysis.bench_data import (BENCH_JSON, FIX_VARIANTS, UPSTREAM_JSON, bench_data, bench_doc, bench_frame, fix_cost, fix_cost_table, load_bench, load_upstream)  # noqa: F401
from qsa_lab.model.case import Case, Geometry, build_case, kv_values
from qsa_lab.model.plan import GROUP, GroupedPlan
from qsa_lab.model.poison import DIM_SITES, SITES, apply_poison, stale_tokens
from qsa_lab.routes.labels import ROUTES, SHORT, short_key, short_routes
from qsa_lab.routes.run import RunResult

PLANE_INDEX = {"k": 0, "v": 1}


def case_title(case: Case, backend: str | None = None) -> str:
    """One line naming the case (and backend) for figure titles."""
    g = case.geometry
    p = case.poison
    s = (f"rows {g.rows}, {g.requests} req {g.layout}, ctx {g.context}, topk {g.topk}, {g.kv_dtype}"
         f" | poison {p['site']}/{p['plane']}")
    return s + (f" | backend {backend}" if backend else "")


def page_bytes(case: Case, plane: str = "v", page: int | None = None) -> dict:
    """The bytes of one page of one plane: codes [page_size, head_dim] uint8 (low byte for
    fp16 KV) and nan [page_size, head_dim] bool (element decodes to NaN).

    page None -> the page the site wrote: page 0 (the null block), or for 'stale-tail' the page
    holding the first stale token, or for attended-k / attended-v the page of the token they
    poison (those sites leave page 0 alone); `what` says which."""
    if plane not in PLANE_INDEX:
        raise ValueError(f"plane must be 'k' or 'v' for a byte map, got {plane!r}")
    site = case.poison["site"]
    what = "null block"
    if page is None:
        stale = stale_tokens(case) if site == "stale-tail" else []
        page = stale[0][0] if stale else 0
        if stale:
            what = "page holding stale tail tokens"
        elif case.poison.get("token"):
            page = int(case.poison["token"][0])
            what = f"holds the most-attended token, {int(case.poison['token'][1])}"
    elif page:
        what = "page"
    raw = case.kv_cache[page, PLANE_INDEX[plane], :, 0, :].cpu()           # [page_size, D]
    codes = raw.view(torch.uint8).view(raw.shape[0], raw.shape[1], -1)[..., 0]
    nan = torch.isnan(kv_values(raw, case.kv_dtype))
    return {"codes": codes.numpy(), "nan": nan.numpy(), "page": int(page), "plane": plane, "what": what,
            "site": site, "kv_dtype": case.kv_dtype, "nan_bytes": int(nan.sum()),
            "nan_dims": sorted(set(torch.nonzero(nan)[:, 1].tolist()))}


#: the sites that write NaN bytes into the cache (none and zeros write none, query writes q)
BYTE_MAP_SITES = tuple(s for s in SITES if s not in ("none", "zeros", "query"))


def page_byte_maps(geometry: Geometry | None = None, sites=BYTE_MAP_SITES, plane: str = "v", seed: int = 0,
                   dims=None) -> list[dict]:
    """page_bytes of the page and plane each site writes (attended-k: its K plane), on one small case."""
    from qsa_lab.model.poison import ATTENDED_SITES

    g = geometry or Geometry(rows=8, requests=2, context=256, topk=16)
    base = build_case(g)
    out = []
    for site in sites:
        case = apply_poison(base, site, plane=plane, dims=dims if site in DIM_SITES else None, seed=seed)
        shown = ATTENDED_SITES.get(site, "v" if plane == "kv" else plane)
        out.append(page_bytes(case, shown))
    return out


def fp16_state_rates(n: int = 1 << 20, seed: int = 0, fmt: str = "e4m3") -> dict:
    """Measured E4M3 NaN-code rates of the low, high and all bytes of fp16 recurrent-state-like
    values (N(0, 0.5) as poison 'fp16-state' writes them) and of uniform random bytes."""
    from qsa_lab.model import fp8

    gen = torch.Generator().manual_seed(seed)
    state = (torch.randn(n, generator=gen) * 0.5).to(torch.float16)
    uniform = torch.randint(0, 256, (n,), generator=gen, dtype=torch.int64).to(torch.uint8)
    u = uniform.reshape(-1, 2)
    return {
        "fp16 state N(0, 0.5)": fp8.fp16_byte_nan_rates(state, fmt),
        "uniform random bytes": {"low": fp8.nan_byte_fraction(u[:, 0], fmt),
                                 "high": fp8.nan_byte_fraction(u[:, 1], fmt),
                                 "all": fp8.nan_byte_fraction(uniform, fmt)},
    }


def plan_table(plan: GroupedPlan, case=None):
    """One row per (group, category): real and padded entries. -> DataFrame.

    attrs: m_tiles, tiles_per_group, and with `case` its selection ("indexer selection,
    overlap 0.8 (measured 0.79)"): neighbour overlap is what sets the tiles a group walks."""
    import pandas as pd

    inside, padding = plan.in_plan(), plan.padding()
    rows = []
    for gi in range(plan.groups):
        for c in range(1, 1 << plan.m_tiles):
            sel = inside[gi] & (plan.categories[gi] == c)
            rows.append({"group": gi, "category": c, "real": int((sel & ~padding[gi]).sum()),
                         "padded": int((sel & padding[gi]).sum())})
    df = pd.DataFrame(rows, columns=["group", "category", "real", "padded"])
    df.attrs["m_tiles"] = plan.m_tiles
    df.attrs["tiles_per_group"] = (plan.seq_len.long() // 32).tolist()
    if case is not None:
        df.attrs["selection"] = case.describe_selection()
    return df


def nan_map(result: RunResult, route: str = "grouped") -> dict:
    """Score rows x head dims of one route: values [groups*8*Hq + xqa_rows*Hq, D] float32 with NaN,
    and dropped (same shape, bool): finite here where the reference is NaN (a NaN the route
    silently lost, e.g. the grouped route's attended NaN key).

    Rows of group g are g's 8 queries x Hq heads in score-row order (query*Hq + head),
    so M-tile m of group g is rows g*8*Hq + 16m .. +15; the XQA remainder rows follow."""
    if route not in result.outputs:
        raise ValueError(f"route {route!r} was not run; have {list(result.outputs)}")
    out = result.outputs[route].float()
    plan = result.plan
    hq, D = out.shape[1], out.shape[2]

    def score_rows(t):
        parts = [t[plan.members.flatten()].reshape(-1, D)] if plan.groups else []
        if plan.xqa_rows.numel():
            parts.append(t[plan.xqa_rows].reshape(-1, D))
        return torch.cat(parts) if parts else torch.zeros(0, D, dtype=t.dtype)

    dropped = _dropped(result, route)
    return {"values": score_rows(out).numpy(), "dropped": score_rows(dropped).numpy(),
            "groups": plan.groups, "q_heads": hq, "m_tiles": plan.m_tiles,
            "xqa_rows": plan.xqa_rows.tolist(), "route": route,
            "nan_count": int(torch.isnan(out).sum()), "dropped_count": int(dropped.sum()),
            "title": f"{route}: {case_title(result.case, result.backend)}"}


def _dropped(result: RunResult, route: str) -> torch.Tensor:
    """[rows, q_heads, D] bool: the route's output finite where the float64 reference is NaN."""
    ref = result.reference64 if result.reference64 is not None else result.outputs.get("reference")
    if ref is None or route == "reference":
        return torch.zeros(result.outputs[route].shape, dtype=torch.bool)
    return torch.isnan(ref) & ~torch.isnan(result.outputs[route])


def route_nans(result: RunResult, routes=None, frame: bool = True) -> dict:
    """Per route: NaN elements per head dim [routes, D], elements finite where the reference is
    NaN per head dim [routes, D] (dropped), the route table's rows (analysis.route_rows, with
    finite_where_ref_nan) and, unless frame=False, the same table as a DataFrame ("table";
    route_nans_frame builds it later from the rows when `routes` are all of result's routes)."""
    from qsa_lab.analysis.fingerprints import route_rows

    routes = [r for r in (routes or ROUTES) if r in result.outputs]
    per_dim = torch.stack([torch.isnan(result.outputs[r]).flatten(0, 1).sum(0) for r in routes])
    dropped = torch.stack([_dropped(result, r).flatten(0, 1).sum(0) for r in routes])
    every = {row["route"]: row for row in route_rows(result)}
    rows = [dict(every[r], finite_where_ref_nan=n) for r, n in zip(routes, dropped.sum(1).tolist())]
    out = {"routes": routes, "per_dim": per_dim.numpy(), "dropped_per_dim": dropped.numpy(), "rows": rows,
           "title": case_title(result.case, result.backend)}
    if frame:   # from every route's row, as analysis.route_table: a subset's columns keep the whole table's types
        out["table"] = route_nans_frame(rows, every=list(every.values()))
    return out


def route_nans_frame(rows: list[dict], every: list[dict] | None = None):
    """route_nans' DataFrame from its rows: the route table of `every` route's row (route_rows;
    default `rows`, when they are all of the result's routes) cut to `rows`' routes in their
    order, with their finite_where_ref_nan column."""
    from qsa_lab.analysis.fingerprints import route_frame

    table = route_frame([{k: v for k, v in r.items() if k != "finite_where_ref_nan"} for r in every or rows])
    table = table.loc[[r["route"] for r in rows]].copy()
    table["finite_where_ref_nan"] = [r["finite_where_ref_nan"] for r in rows]
    return table


def attribution_map(result: RunResult, route: str = "grouped") -> dict:
    """page_bytes of the null block's V plane plus the route's NaN dims: which byte is behind
    which NaN dim (analysis.attribute has the record-level table)."""
    from qsa_lab.analysis.fingerprints import nan_dims

    d = page_bytes(result.case, "v", page=0)
    d["output_nan_dims"] = nan_dims(result.outputs[route])
    d["route"] = route
    return d


def group_row_labels(groups: int, q_heads: int, m_tiles: int, xqa_rows: list) -> list[tuple[float, str]]:
    """(y centre, label) of every group x M-tile block of a nan_map, plus the XQA block."""
    R = GROUP * q_heads
    out = []
    for g in range(groups):
        for m in range(m_tiles):
            lo, hi = g * R + 16 * m, min(g * R + 16 * (m + 1), (g + 1) * R)
            out.append(((lo + hi - 1) / 2, f"g{g} m{m}"))
    if xqa_rows:
        lo = groups * R
        rows = f"{xqa_rows[0]}-{xqa_rows[-1]}" if len(xqa_rows) > 1 else f"{xqa_rows[0]}"
        out.append((lo + len(xqa_rows) * q_heads / 2 - 0.5, f"XQA rows {rows}"))
    return out


#: repro table column -> header of repro_display: the NaN count of each route, headed by its
#: abbreviation (labels.SHORT: a notebook cell is narrow), the key in the table's caption
REPRO_NAN_COLUMNS = {f"nan[{route}]": SHORT[route] for route in ROUTES}
NOT_GIVEN = "—"


def _dims_text(dims, shown: int = 5) -> str:
    dims = list(dims)
    if not dims:
        return NOT_GIVEN
    return ", ".join(map(str, dims[:shown])) + (f", … ({len(dims)})" if len(dims) > shown else "")


def repro_frame(table):
    """repro.run_repro's table -> the columns a reader compares, short headers, one row per case:
    poisoned dims, NaN elements per route (the float64 reference first), which routes the
    mechanism predicts to differ from the reference and whether exactly those did, worst
    max |fix - xqa|, max |xqa - reference|, the report's own numbers (NOT_GIVEN where it has none)
    and the bit-identity of a repeat."""
    import math

    import pandas as pd

    def num(x):
        return None if x is None or (isinstance(x, float) and math.isnan(x)) else x

    diff_cols = [c for c in table.columns if c.startswith("max|grouped+")]
    out = pd.DataFrame({"case": table["case"], "poisoned dims": table["poisoned_dims"].map(_dims_text)})
    for col, name in REPRO_NAN_COLUMNS.items():
        if col in table.columns:
            out[name] = table[col].astype(int)
    if "expected_to_differ" in table.columns:
        out["expected ≠ ref"] = table["expected_to_differ"].map(lambda v: short_routes(str(v)))
        out["as expected"] = table["as_expected"].map(lambda v: "yes" if v else "NO")
    worst = []
    for _, r in table.iterrows():
        vals = [num(r[c]) for c in diff_cols]
        finite = [v for v in vals if v is not None]
        worst.append(f"{max(finite):.1e}" + (f" ({len(vals) - len(finite)} NaN)" if len(finite) < len(vals) else "")
                     if finite else "NaN in every fix")
    out["max|fix−xqa|"] = worst
    out["max|xqa−ref|"] = ["NaN in output" if num(v) is None else f"{v:.1e}" for v in table["max|xqa-reference|"]]
    for col, name in (("report_grouped_nan", "report: grouped NaN"),
                      ("report_max|grouped-xqa|", "report: max |grouped − xqa|")):
        vals = table[col] if col in table.columns else [None] * len(table)
        out[name] = [NOT_GIVEN if num(v) is None or str(v).strip() == "" else str(v) for v in vals]
    if "bit_identical_repeat" in table.columns:
        out["repeat identical"] = table["bit_identical_repeat"].map(lambda v: NOT_GIVEN if v is None else bool(v))
    return out.reset_index(drop=True)


def repro_display(table):
    """repro_frame as a styled table that fits a notebook cell: every column shown (the routes'
    abbreviations spelled out in the caption), headers and
    case names wrapped, a NaN count green when the route's NaN mask equals the reference's,
    yellow when it differs as predicted, red when it differs unexpectedly; NOT_GIVEN, never NaN."""
    frame = repro_frame(table)
    counts = [c for c in REPRO_NAN_COLUMNS.values() if c in frame.columns]
    route_of = {v: k[4:-1] for k, v in REPRO_NAN_COLUMNS.items()}
    colours = frame[counts].copy().astype(str)
    for i, (_, r) in enumerate(table.reset_index(drop=True).iterrows()):
        differ = set(str(r.get("differs_from_reference", "")).split(",")) - {""}
        expected = set(str(r.get("expected_to_differ", "")).split(",")) - {""}
        for c in counts:
            route = route_of[c]
            colours.iloc[i, colours.columns.get_loc(c)] = (
                "background-color:#d3f9d8" if route not in differ else
                "background-color:#fff3bf" if route in expected else "background-color:#ffd6e0;color:#a00")
    return (frame.style.hide(axis="index").apply(lambda _: colours, axis=None, subset=counts)
            .set_caption(f"NaN elements per route: {short_key(route_of[c] for c in counts)}")
            .set_properties(subset=["case"], **{"text-align": "left", "min-width": "10em", "white-space": "normal"})
            .set_properties(subset=["poisoned dims"], **{"max-width": "8em", "white-space": "normal"})
            .set_table_styles([{"selector": "", "props": "table-layout:auto; font-size:11px"},   # 9 routes in 1000 px
                               {"selector": "th", "props": "text-align:center; white-space:normal; max-width:6em"},
                               {"selector": "td", "props": "padding:2px 4px"}]))

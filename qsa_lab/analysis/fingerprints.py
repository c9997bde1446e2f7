"""Analysis: fingerprints, attribution, prediction and the differential table. Data only, no drawing."""
from __future__ import annotations

import math

import torch

from qsa_lab.model.case import Case, token_values, validate_case
from qsa_lab.model.selection import neighbour_overlap
from qsa_lab.routes.extensions import extensions_used
from qsa_lab.model.plan import (GROUP, TILE_ENTRIES, GroupedPlan, tile_active_m_tiles, unattended_tokens, xqa_tokens)
from qsa_lab.routes.labels import ROUTES
from qsa_lab.routes.run import RunResult

#: |route - reference| <= atol + rtol * |reference| (fp16 output, fp16 P, fp32 accumulation)
TOLERANCE = {"e4m3": (2e-3, 2e-2), "e5m2": (2e-3, 2e-2), "fp16": (2e-3, 2e-2)}


def _check_pair(a, b, names=("out", "ref")) -> None:
    """Two tensors compared element by element: both tensors, one shape (ValueError naming them)."""
    for name, t in zip(names, (a, b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if a.shape != b.shape:
        raise ValueError(f"{names[1]}: shape {list(b.shape)} differs from {names[0]}'s {list(a.shape)}")


def within_tolerance(out: torch.Tensor, ref: torch.Tensor, kv_dtype: str) -> bool:
    if not isinstance(kv_dtype, str) or kv_dtype not in TOLERANCE:
        raise ValueError(f"kv_dtype: must be one of {tuple(TOLERANCE)}, got {kv_dtype!r}")
    _check_pair(out, ref)
    atol, rtol = TOLERANCE[kv_dtype]
    o, r = out.double(), ref.double()
    return bool(torch.isfinite(o).all()) and bool(((o - r).abs() <= atol + rtol * r.abs()).all())


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Over all elements; None when either side holds a NaN."""
    _check_pair(a, b, ("a", "b"))
    if torch.isnan(a).any() or torch.isnan(b).any():
        return None
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def nan_dims(out: torch.Tensor) -> list[int]:
    """Head dims of [rows, Hq, D] with any NaN."""
    return torch.nonzero(torch.isnan(out).flatten(0, -2).any(dim=0)).flatten().tolist()


def _tile_fields(case: Case, plan: GroupedPlan):
    """Per tile: active M-tile bits [G, nt], V non-finite [G, nt, 32, D], unattended [G, nt, 32]."""
    G, cap = plan.microblocks.shape
    nt = cap // TILE_ENTRIES
    tok = (plan.microblocks.long().unsqueeze(-1) * 4 + torch.arange(4)).view(G, nt, 32)
    v = token_values(case.kv_cache, tok, 1, case.kv_dtype)
    bad = ~torch.isfinite(v)
    dead = unattended_tokens(plan.masks).view(G, nt, 32)
    return tok, tile_active_m_tiles(plan.masks, plan.seq_len, plan.q_heads), bad, dead


def xqa_nan(case: Case, rows: torch.Tensor) -> torch.Tensor:
    """Predicted NaN mask [n, Hq, D] of XQA on `rows`, from q and the attended K/V values: a
    non-finite q (every score NaN, or Inf - Inf) or a NaN attended key gives NaN on every dim
    of that row (and head); a NaN attended value at dim d gives NaN at d (p * NaN, even p = 0).
    An Inf key or value is not predicted (whether it gives Inf or NaN depends on the scores)."""
    g = case.geometry
    rows = rows.long()
    if rows.numel() == 0:
        return torch.zeros(0, g.q_heads, g.head_dim, dtype=torch.bool)
    index, count = xqa_tokens(case, rows)
    valid = torch.arange(index.shape[1]) < count.long().unsqueeze(1)
    tok = torch.where(valid, index, 0)
    k_nan = (torch.isnan(token_values(case.kv_cache, tok, 0, case.kv_dtype)).any(-1) & valid).any(-1)
    v_nan = (torch.isnan(token_values(case.kv_cache, tok, 1, case.kv_dtype)) & valid.unsqueeze(-1)).any(1)
    q_bad = ~torch.isfinite(case.q[rows].float()).all(dim=-1)
    return (q_bad | k_nan.unsqueeze(1)).unsqueeze(-1) | v_nan.unsqueeze(1)


def predict_nan(case: Case, plan: GroupedPlan, variant: str = "unfixed") -> torch.Tensor:
    """Predicted NaN mask [rows, Hq, D] of a grouped route, from the plan and the bytes alone.

    Grouped rows: every score row of an M-tile that a tile activates gets NaN at every dim
    where one of the tile's panel rows holds a non-finite V value (the fixes zero unattended
    rows first); a NaN score (a NaN query or key) gives NaN nowhere: the softmax drops it.
    Remainder rows go through XQA (xqa_nan). `plan` must be plan_groups(case) (or its pad_fix);
    `variant`: unfixed, kernel_fix or masked_load.
    """
    from qsa_lab.routes.run import check_plan, check_variant

    check_variant(variant)
    validate_case(case)
    g = case.geometry
    case = case.to("cpu")
    plan = check_plan(case, plan)
    pred = torch.zeros(g.rows, g.q_heads, g.head_dim, dtype=torch.bool)
    pred[plan.xqa_rows] = xqa_nan(case, plan.xqa_rows)
    if not plan.groups:
        return pred
    _, active, bad, dead = _tile_fields(case, plan)
    if variant != "unfixed":
        bad = bad & ~dead.unsqueeze(-1)
    tile_dims = bad.any(dim=2)                                            # [G, nt, D]
    nmt = plan.m_tiles
    hit = torch.stack([(tile_dims & ((active >> m) & 1).bool().unsqueeze(-1)).any(dim=1)
                       for m in range(nmt)], dim=1)                       # [G, m_tiles, D]
    rows = torch.arange(GROUP * g.q_heads)
    per_row = hit[:, rows // 16, :].view(plan.groups, GROUP, g.q_heads, g.head_dim)
    pred[plan.members.flatten()] = per_row.reshape(-1, g.q_heads, g.head_dim)
    return pred


def route_output(result: RunResult, route: str) -> torch.Tensor:
    """result.outputs[route]; ValueError naming `route` when it is unknown or was not run."""
    if not isinstance(result, RunResult):
        raise TypeError(f"result: expected a RunResult (from run_routes), got {type(result).__name__}")
    if not isinstance(route, str) or route not in ROUTES:
        raise ValueError(f"route: must be one of {ROUTES}, got {route!r}")
    if route not in result.outputs:
        raise ValueError(f"route: {route!r} was not run in this result (it has {list(result.outputs)}); "
                         f"run_routes(case, routes=[..., {route!r}])")
    return result.outputs[route]


def fingerprint(result: RunResult, route: str = "grouped"):
    """Per group x M-tile: NaN dims, whether identical across its score rows and heads,
    and whether its M-tile belongs to a category that received padding."""
    import pandas as pd

    out = route_output(result, route)
    case, plan = result.case, result.plan
    hq = case.geometry.q_heads
    records = []
    pad_bits = torch.zeros(plan.groups, dtype=torch.int64)
    for m in range(1 << plan.m_tiles):  # categories that got padding, as M-tile bits
        padded = (plan.padding() & (plan.categories == m)).any(dim=1)
        pad_bits |= torch.where(padded, m, 0)
    for gi in range(plan.groups):
        score = out[plan.members[gi]].reshape(GROUP * hq, -1)          # row = query*hq + head
        for m in range(plan.m_tiles):
            rows = score[m * 16:(m + 1) * 16]
            nan = torch.isnan(rows)
            dims = torch.nonzero(nan.any(dim=0)).flatten().tolist()
            records.append({
                "group": gi, "m_tile": m, "score_rows": f"{m * 16}-{m * 16 + rows.shape[0] - 1}",
                "nan_count": int(nan.sum()), "nan_dims": dims,
                "identical_across_rows": bool((nan == nan[:1]).all()),
                "padded_category": bool((int(pad_bits[gi]) >> m) & 1),
            })
    return pd.DataFrame(records)


def attribute(result: RunResult, route: str = "grouped"):
    """Every NaN dim of a grouped route traced to the bytes behind it: one record per
    (group, M-tile, dim, microblock, token) whose V byte decodes to non-finite and that the
    route read without any query attending it. NaN that comes from what rows do attend (sites
    query, attended-v) or that XQA gives the remainder rows has no such byte and no record:
    predict_nan covers those rows too."""
    import pandas as pd

    cols = ["group", "m_tile", "dim", "microblock", "page", "token", "byte", "padding"]
    out = route_output(result, route)
    case, plan = result.case.to("cpu"), result.plan
    if not plan.groups:
        return pd.DataFrame(columns=cols)
    tok, active, bad, dead = _tile_fields(case, plan)
    hq = case.geometry.q_heads
    ps = case.geometry.page_size
    source = bad & dead.unsqueeze(-1)                                     # [G, nt, 32, D]
    raw = case.kv_cache[:, 1, :, 0, :]
    raw_bytes = raw.view(torch.uint8).view(raw.shape[0], ps, case.geometry.head_dim, -1)[..., 0]
    # NaN per (group, M-tile, dim) of the route: a fixed route read the byte and zeroed it where none
    score = torch.isnan(out[plan.members].reshape(plan.groups, GROUP * hq, -1))   # row = query*hq + head
    tile_nan = torch.stack([score[:, m * 16:(m + 1) * 16].any(1) for m in range(plan.m_tiles)], 1)  # [G, M, D]
    g, t, j, d = torch.nonzero(source).unbind(1)
    m_bits = torch.arange(plan.m_tiles)
    hit = ((active[g, t].long().unsqueeze(1) >> m_bits) & 1).bool() & tile_nan[g, :, d]  # [n, M]
    i, m = torch.nonzero(hit).unbind(1)          # in (source entry, M-tile) order
    if not i.numel():
        return pd.DataFrame([], columns=cols)
    g, t, j, d = g[i], t[i], j[i], d[i]
    e = t * TILE_ENTRIES + j // 4
    tk = tok[g, t, j].long()
    df = pd.DataFrame({"group": g.numpy(), "m_tile": m.numpy(), "dim": d.numpy(),
                       "microblock": plan.microblocks[g, e].long().numpy(), "page": (tk // ps).numpy(),
                       "token": (tk % ps).numpy(), "byte": raw_bytes[tk // ps, tk % ps, d].long().numpy(),
                       "padding": (plan.masks[g, e] == 0).numpy()}, columns=cols)
    return df.drop_duplicates().reset_index(drop=True)


def group_summary(plan: GroupedPlan) -> list[dict]:
    """The diff document's `groups`: rows, tiles and real/padded entries per category."""
    out = []
    inside, padding = plan.in_plan(), plan.padding()
    for gi in range(plan.groups):
        cats = {}
        for c in sorted(set(plan.categories[gi][inside[gi]].tolist())):
            sel = inside[gi] & (plan.categories[gi] == c)
            cats[str(c)] = {"real": int((sel & ~padding[gi]).sum()), "padded": int((sel & padding[gi]).sum())}
        out.append({"group": gi, "rows": plan.members[gi].tolist(),
                    "tiles": int(plan.seq_len[gi]) // (4 * TILE_ENTRIES), "categories": cats})
    return out


def selection_summary(case: Case, plan: GroupedPlan) -> dict:
    """How the selections overlap and what that costs the grouped route: the generator, its
    target overlap (indexer only), the measured mean neighbour overlap and tiles per group."""
    g = case.geometry
    overlap = neighbour_overlap(case)
    tiles = (plan.seq_len.long() // (4 * TILE_ENTRIES)).tolist()
    return {"generator": g.selection, "overlap_target": float(g.overlap) if g.selection == "indexer" else None,
            "neighbour_overlap": None if overlap is None else round(overlap, 4),
            "tiles_per_group": tiles, "max_tiles_per_group": max(tiles, default=0)}


def route_rows(result: RunResult) -> list[dict]:
    """The differential table as records: route_table without pandas."""
    xqa = result.outputs.get("xqa")
    rows = []
    for route in [r for r in ROUTES if r in result.outputs]:
        out = result.outputs[route]
        nan = torch.isnan(out)
        rows.append({"route": route, "nan_count": int(nan.sum()),
                     "nan_dims": torch.nonzero(nan.flatten(0, -2).any(dim=0)).flatten().tolist(),
                     "max_abs_diff_vs_reference": max_abs_diff(out, result.reference64),
                     "max_abs_diff_vs_xqa": None if xqa is None else max_abs_diff(out, xqa)})
    return rows


def route_table_text(rows: list[dict], max_dims: int = 12, extra: dict | None = None) -> str:
    """route_rows as the CLI prints them, in the layout of pandas' DataFrame.to_string (route
    index, floats as {:.3g}, a missing float NaN, a column without any float None; a numeric
    column's header and every cell get one leading space, columns one space between them),
    without importing pandas. `extra`: more text columns {name: [cell per row]}, last."""
    def dims(d):
        return ",".join(map(str, d[:max_dims])) + (" ..." if len(d) > max_dims else "")

    def floats(values):
        if all(v is None for v in values):  # an object column
            return False, ["None"] * len(values)
        return True, ["NaN" if v is None or math.isnan(v) else f"{v:.3g}" for v in values]

    columns = {"nan_count": (True, [str(r["nan_count"]) for r in rows]),
               "nan_dims": (False, [dims(r["nan_dims"]) for r in rows])}
    for c in ("max_abs_diff_vs_reference", "max_abs_diff_vs_xqa"):
        columns[c] = floats([r[c] for r in rows])
    for name, cells in (extra or {}).items():
        columns[name] = (False, list(cells))
    index = [r["route"] for r in rows]
    wi = max([len("route")] + [len(i) for i in index])
    head, cells = [], []
    for name, (numeric, values) in columns.items():
        head.append(" " + name if numeric else name)
        cells.append([" " + v for v in values])
    width = [max([len(h)] + [len(v) for v in col]) for h, col in zip(head, cells)]
    lines = [" " * wi + "".join(" " + h.rjust(w) for h, w in zip(head, width)),
             "route".ljust(wi) + "".join(" " * (w + 1) for w in width)]
    lines += [index[i].ljust(wi) + "".join(" " + col[i].rjust(w) for col, w in zip(cells, width))
              for i in range(len(rows))]
    return "\n".join(lines)


def route_table(result: RunResult):
    """The differential table: one row per route."""
    return route_frame(route_rows(result))


def route_frame(rows: list[dict]):
    """route_rows -> the differential table as a DataFrame, indexed by route."""
    import pandas as pd

    return pd.DataFrame(rows).set_index("route")


def diff_json(result: RunResult, rows: list[dict] | None = None) -> dict:
    """The `qsa_lab.diff/1` document (README: `--json` output of `diff`); rows: route_rows(result)
    when the caller has them already."""
    g = result.case.geometry
    table = route_rows(result) if rows is None else rows
    p = result.case.poison

    def num(x):
        return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)

    return {
        "schema": "qsa_lab.diff/1",
        "backend": result.backend,
        "geometry": {**{k: getattr(g, k) for k in ("rows", "requests", "layout", "context", "topk", "page_size",
                                                   "q_heads", "head_dim", "kv_dtype", "group_rows", "seed",
                                                   "selection", "overlap")},
                     **({"request_rows": list(g.request_rows)} if g.request_rows else {})},
        "poison": {"site": p["site"], "plane": p["plane"], "nan_bytes": p["nan_bytes"],
                   "poisoned_dims": p["poisoned_dims"]},
        "groups": group_summary(result.plan),
        "routes": {row["route"]: {"nan_count": row["nan_count"], "nan_dims": list(row["nan_dims"]),
                                  "max_abs_diff_vs_reference": num(row["max_abs_diff_vs_reference"]),
                                  "max_abs_diff_vs_xqa": num(row["max_abs_diff_vs_xqa"])}
                   for row in table},
        "selection": selection_summary(result.case, result.plan),
        "extensions": extensions_used(g, result.outputs),
    }

"""Which rows of which request one request's non-finite V reaches, per route: the mixed-request
case (issue 37), a probe judged in the one leak vocabulary (qsa_lab.analysis.leaks). Data only, no
drawing (qsa_lab.plotting.plots.plot_cross_request draws it).

A batch can mix requests in one group of 8 consecutive rows (upstream's host route hands the
grouped kernel the first rows // 8 * 8 rows as they come; its own regression test has rows 40-47
holding requests 0, 1 and 2). Each request's attended V is poisoned in turn (every slot its rows
attend, at `dims`, model.poison.poison_request) with NaN, Inf or a finite control ('max'), and every
route's output is judged request by request, one record each:

    nan-leak, inf-leak  a row of ANOTHER request holds a NaN (else an Inf); the reference never
                        does: that request's rows attend none of the poisoned slots
    clean               no row of that other request is non-finite
    n/a                 the poisoned request's own rows: they attend the poison, so no leak check;
                        `as_reference` says whether they are non-finite exactly where the
                        reference's are (False: e.g. NaN where the reference gives Inf). Also a
                        payload the cache dtype has no code for (route None, a note says so)

    records = cross_request(MIXES["upstream-mix"], payloads=("nan", "max"))
    leak_records(records)              # the leaking (route, payload, poisoned, request, rows)
    CrossRequestReport("emulate", "upstream-mix", [], records).exit_code()   # 1 when a MUST_BE_CLEAN route leaked
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from qsa_lab.analysis.leaks import LEAKS, NA, LeakReport, spans, verdict_of
from qsa_lab.model.case import Geometry, build_case, validate_case
from qsa_lab.model.geometry import PAYLOADS
from qsa_lab.model.plan import plan_groups
from qsa_lab.model.poison import PAYLOAD_BITS, poison_request
from qsa_lab.routes.labels import COMPLETE_FIXES, ROUTES
from qsa_lab.routes.reuse import CleanUnits
from qsa_lab.routes.run import check_routes, resolve_backend, run_routes_planned, warn_nonfinite_query

SCHEMA = "qsa_lab.cross_request/2"    # /1 named its verdicts own / leak / clean / n/a
OWN_ROWS = "the poisoned request's own rows: no leak check (as_reference compares them with the reference)"
DEFAULT_PAYLOADS = ("nan", "inf", "max")
#: routes that must never give another request's rows a non-finite value
MUST_BE_CLEAN = ("reference", "xqa") + COMPLETE_FIXES


def nonfinite_rows(out: torch.Tensor) -> torch.Tensor:
    """[rows, Hq, D] -> [rows] bool: the row holds a NaN or an Inf."""
    return ~torch.isfinite(out.float()).flatten(1).all(dim=1)


def judge(result, request: int, payload: str) -> list[dict]:
    """One poisoned run (run_routes' result; `request`'s attended V poisoned with `payload`) judged
    per route and request -> records (route, request, rows, elements, nan, inf, verdict, as_reference):
    rows the request's rows holding a NaN or Inf, elements / nan / inf the non-finite elements of its rows."""
    case = result.case
    req = case.token_to_req.cpu().long()
    n_req = case.geometry.requests
    ref = result.reference64
    own = req == request
    ref_nan, ref_inf = torch.isnan(ref[own]), torch.isinf(ref[own])
    routes = list(result.outputs)
    if not routes:
        return []
    outs = torch.stack([result.outputs[r] for r in routes]).float()     # [routes, rows, Hq, D]: one pass for all
    nans, infs = torch.isnan(outs), torch.isinf(outs)
    per_row = torch.stack([nans.flatten(2).sum(dim=2), infs.flatten(2).sum(dim=2)], dim=2)   # [routes, rows, 2]
    per_reqs = torch.zeros(len(routes), n_req, 2, dtype=torch.int64).index_add_(1, req, per_row).tolist()
    bads = (per_row.sum(dim=2) > 0).tolist()
    req_of_row = req.tolist()
    out = []
    for i, route in enumerate(routes):
        per_req, bad, nan, inf = per_reqs[i], bads[i], nans[i], infs[i]
        rows_of = [[] for _ in range(n_req)]
        for row, (k, b) in enumerate(zip(req_of_row, bad)):
            if b:
                rows_of[k].append(row)
        for k in range(n_req):
            got = {"nan": per_req[k][0], "inf": per_req[k][1]}
            rec = {"route": route, "payload": payload, "poisoned_request": request, "request": k, "rows": rows_of[k],
                   "elements": got["nan"] + got["inf"], **got}
            if k == request:
                same = torch.equal(nan[own], ref_nan) and torch.equal(inf[own], ref_inf)
                rec.update(verdict=NA, as_reference=same, note=OWN_ROWS)
            else:
                rec.update(verdict=verdict_of(got), as_reference=not rows_of[k])
            out.append(rec)
    return out


def cross_request(geometry: Geometry, payloads=DEFAULT_PAYLOADS, requests=None, routes=None,
                  backend: str = "auto", dims=None, progress=None) -> list[dict]:
    """Each request of `geometry`'s case (or of `requests`) poisoned in turn with each payload, every
    route judged per request (judge). A payload the cache dtype has no code for (Inf in E4M3) gives
    one record with verdict 'n/a'. Records carry q_heads and kv_dtype. progress: a callable
    fn(text) told about each run."""
    if not isinstance(geometry, Geometry):
        raise TypeError(f"geometry: expected a Geometry, got {type(geometry).__name__}")
    payloads = (payloads,) if isinstance(payloads, str) else tuple(payloads)
    bad = [p for p in payloads if p not in PAYLOADS]
    if not payloads or bad:
        raise ValueError(f"payloads: each one of {PAYLOADS}, got {list(payloads)}")
    try:
        requests = range(geometry.requests) if requests is None else tuple(requests)
    except TypeError:
        raise TypeError(f"requests: expected request numbers (a list of ints), got {type(requests).__name__}") from None
    if not requests:
        raise ValueError(f"requests: empty: nothing would be checked; give request numbers in [0, {geometry.requests}) "
                         "or None for every request")
    bad = [r for r in requests if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < geometry.requests]
    if bad:
        raise ValueError(f"requests: each an int in [0, {geometry.requests}), got {bad}")
    routes = check_routes(ROUTES if routes is None else routes)
    if "reference" not in routes:
        routes = ("reference",) + routes   # the judge compares a poisoned request's own rows with it
    base = _built(geometry)
    validate_case(base)
    warn_nonfinite_query(base)
    backend = resolve_backend(backend, geometry)
    dev = torch.device("cuda") if backend == "cuda" else torch.device("cpu")
    plan = plan_groups(base.to(dev))   # a plan reads no cache byte: one for every poisoned run
    # what the runs share (token lists, request_groups' plan) and, emulated, every unit of the
    # emulation that reads no poisoned byte (routes.reuse): computed once per geometry
    memo = {"units": CleanUnits(base)} if backend == "emulate" else {}
    meta = {"q_heads": geometry.q_heads, "kv_dtype": geometry.kv_dtype}
    records = []
    for payload in payloads:
        if (geometry.kv_dtype, payload) not in PAYLOAD_BITS:
            records.append({**meta, "route": None, "payload": payload, "poisoned_request": None, "request": None,
                            "rows": [], "elements": 0, "nan": 0, "inf": 0, "verdict": NA, "as_reference": None,
                            "note": f"{geometry.kv_dtype} has no {payload} code"})
            continue
        for r in requests:
            if progress:
                progress(f"q_heads {geometry.q_heads}, {payload} in request {r}")
            case = poison_request(base, r, payload, dims)
            validate_case(case)
            result = run_routes_planned(case, routes, backend, plan, memo=memo)
            records += [{**meta, **rec} for rec in judge(result, r, payload)]
    return records


@functools.lru_cache(maxsize=1)
def _built(geometry: Geometry):
    """build_case(geometry), kept for groups_of after cross_request of the same geometry (both only
    read it: poison_request writes a copy)."""
    return build_case(geometry)


def leak_records(records, routes=None) -> list[dict]:
    """The records where a request other than the poisoned one got a non-finite row (of `routes`)."""
    _check_records(records)
    return [r for r in records if r["verdict"] in LEAKS and (routes is None or r["route"] in routes)]


def _check_records(records) -> None:
    if not isinstance(records, (list, tuple)) or not all(isinstance(r, dict) for r in records):
        raise TypeError(f"records: expected cross_request's records (a list of dicts), got {type(records).__name__}")


@dataclass
class CrossRequestReport(LeakReport):
    """One `qsa-lab cross-request` run: its records (cross_request) of every geometry it ran (`runs`:
    [{"geometry", "groups"}]). Counts and "nothing checked" over every record; the exit code over
    the routes that must stay clean only (MUST_BE_CLEAN): 1 when one of them leaked."""
    backend: str
    mix: str
    runs: list
    records: list
    SCHEMA = SCHEMA            # the JSON's (LeakReport.header)

    def verdicts(self) -> list:
        return [r["verdict"] for r in self.records]

    def exit_verdicts(self) -> list:
        return [r["verdict"] for r in self.records if r["route"] in MUST_BE_CLEAN]

    def leaks(self, routes=None) -> list:
        return leak_records(self.records, routes)

    def unavailable(self) -> list:
        """Why a payload was not run (a note per payload the cache dtype has no code for)."""
        return sorted({r["note"] for r in self.records if r["route"] is None})

    def to_json(self) -> dict:
        return {**self.header(), "backend": self.backend, "mix": self.mix, "runs": self.runs,
                "must_be_clean": list(MUST_BE_CLEAN), "must_be_clean_leaks": len(self.leaks(MUST_BE_CLEAN)),
                "counts": self.counts(), "exit_code": self.exit_code(), "records": self.records}


def groups_of(geometry: Geometry) -> list[dict]:
    """The consecutive groups of 8 rows upstream's host route forms, each with the requests it holds
    and whether it mixes requests: [{"group", "rows", "requests", "mixed"}]."""
    case = _built(geometry.replace(group_rows="consecutive"))
    plan = plan_groups(case, "consecutive")
    req = case.token_to_req.cpu()
    out = []
    for g, rows in enumerate(plan.members.cpu().tolist()):
        held = sorted(set(req[rows].tolist()))
        out.append({"group": g, "rows": [rows[0], rows[-1]], "requests": held, "mixed": len(held) > 1})
    return out


def row_map(records, geometry: Geometry, payload: str, poisoned_request: int) -> dict:
    """What plot_cross_request draws for one poisoned run of `geometry` (its q_heads and kv_dtype):
    {"routes", "nonfinite": {route: [row, ...]}, "request_of_row", "grouped_rows" (the rows upstream's
    consecutive groups take), "payload", "poisoned_request", "q_heads"}."""
    nonfinite, routes = {}, []
    for r in records:
        if (r["payload"], r["poisoned_request"], r["q_heads"], r["kv_dtype"]) != \
                (payload, poisoned_request, geometry.q_heads, geometry.kv_dtype) or r["route"] is None:
            continue
        if r["route"] not in nonfinite:
            routes.append(r["route"])
            nonfinite[r["route"]] = []
        nonfinite[r["route"]] += r["rows"]
    if not routes:
        raise ValueError(f"payload, poisoned_request: no run of {payload!r} in request {poisoned_request} at "
                         f"q_heads {geometry.q_heads}, {geometry.kv_dtype}")
    owner = [k for k, n in enumerate(geometry.rows_of_requests()) for _ in range(n)]
    return {"routes": routes, "nonfinite": {k: sorted(v) for k, v in nonfinite.items()}, "request_of_row": owner,
            "grouped_rows": geometry.rows // 8 * 8, "payload": payload, "poisoned_request": poisoned_request,
            "q_heads": geometry.q_heads}


def pivot_frame(records, q_heads: int):
    """One q_heads as a table to read: a route per line, a column per (payload, poisoned request);
    a cell lists the other requests' rows that went non-finite ('r1:46 r2:47'; '-' for none), with
    '*' when the poisoned request's own rows are not non-finite exactly where the reference's are."""
    import pandas as pd

    return pd.DataFrame.from_dict(_pivot(records, q_heads), orient="index")


def pivot_text(records, q_heads: int) -> str:
    """pivot_frame(records, q_heads).to_string(), without pandas (the command's terminal table):
    route names left-aligned, each column right-aligned to its widest cell or header (cells with
    pandas' leading space), one space apart."""
    table = _pivot(records, q_heads)
    cols = list(dict.fromkeys(c for row in table.values() for c in row))
    if any(len(row) != len(cols) for row in table.values()):   # a missing cell: pandas writes NaN
        return pivot_frame(records, q_heads).to_string()
    left = max(len(r) for r in table)
    width = {c: max(len(c), *(1 + len(row[c]) for row in table.values())) for c in cols}
    lines = [" " * left + "".join(" " + c.rjust(width[c]) for c in cols)]
    lines += [route.ljust(left) + "".join(" " + (" " + row[c]).rjust(width[c]) for c in cols)
              for route, row in table.items()]
    return "\n".join(lines)


def _pivot(records, q_heads: int) -> dict:
    """{route: {column: cell}} of pivot_frame."""
    _check_records(records)
    present = sorted({r.get("q_heads") for r in records}, key=str)
    if q_heads not in present:
        raise ValueError(f"q_heads: no record has q_heads {q_heads!r}; the records have {present}")
    cells, routes, cols = {}, [], []
    for r in records:
        if r["route"] is None or r["q_heads"] != q_heads:
            continue
        col = f"{r['payload']} in r{r['poisoned_request']}"
        if r["route"] not in routes:
            routes.append(r["route"])
        if col not in cols:
            cols.append(col)
        cell = cells.setdefault((r["route"], col), {"leaks": [], "own": True})
        if r["request"] == r["poisoned_request"]:
            cell["own"] = r["as_reference"]
        elif r["rows"]:
            cell["leaks"].append(f"r{r['request']}:{spans(r['rows'])}")
    return {route: {col: (" ".join(c["leaks"]) or "-") + ("" if c["own"] else " *")
                    for col in cols if (c := cells.get((route, col)))} for route in routes}

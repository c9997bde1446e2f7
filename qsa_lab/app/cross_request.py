"""`qsa-lab cross-request`: argv -> the mixed-request case (qsa_lab.analysis.cross_request): each
request's attended V poisoned in turn, every route judged per request, per query-head count. No
torch until the arguments are good.

Verdicts and exit codes are the leak check's (qsa_lab.analysis.leaks, through CrossRequestReport):
0 no route that must stay clean (the reference, xqa and the complete fixes) gave another request's
row a non-finite value; 1 one did; 2 bad input, one line `qsa-lab: error: <argument>: <problem>`;
3 no check ran (every payload without a code in the cache's dtype: one line says so) or any other
failure (one line).
"""
from __future__ import annotations

import contextlib
import json
import sys

from qsa_lab.app.args import UsageError, blame, check_outputs, int_list, integer
from qsa_lab.model.geometry import BACKENDS, KV_DTYPES, MIXES, PAYLOADS

DEFAULT_Q_HEADS = (2, 6, 8)   # 16 score rows (one M-tile for the whole group), the report's 6, 8 (half an M-tile each)


def add_parser(sub, parents=()):
    p = sub.add_parser(
        "cross-request", parents=list(parents),
        help="the mixed-request case: one request's NaN/Inf in V, which rows of which request go non-finite",
        description="Build a batch whose groups of 8 consecutive rows mix requests (upstream's host route forms "
                    "them so), poison each request's attended V in turn (NaN, Inf, and a finite control: max) and "
                    "judge every route per request: the poisoned request's own rows against the float64 "
                    "reference, every other request's rows must stay finite. Exit 1 when the reference, xqa or a "
                    "complete fix (grouped+request_groups, grouped+finite_pv) gives another request's row a "
                    "non-finite value.")
    p.add_argument("mix", nargs="?", choices=tuple(MIXES), default="upstream-mix",
                   help="the batch: upstream-mix = upstream's regression test shape, 46 + 1 + 1 + 1 rows (rows 40-47 "
                        "form one group of requests 0, 1, 2); prefill-mix = 20 + 13 + 7 rows; decode-mix = 4 + 19 x 3 "
                        "rows (default upstream-mix)")
    p.add_argument("--q-heads", type=int_list, default=list(DEFAULT_Q_HEADS), metavar="N,..",
                   help="query heads per KV head, one run each (default 2,6,8)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="e4m3", help="KV cache element type (default e4m3)")
    p.add_argument("--payloads", default="nan,inf,max", metavar="P,..",
                   help=f"comma list of {', '.join(PAYLOADS)}; max is the finite control (default nan,inf,max; "
                        "e4m3 has no inf: listed as n/a)")
    p.add_argument("--requests", type=int_list, metavar="R,..", help="the requests poisoned, one at a time (default all)")
    p.add_argument("--routes", metavar="ROUTE,..", help="routes to run (default all; the reference always runs)")
    p.add_argument("--dims", type=int_list, metavar="D,..", help="head dims poisoned (default 102,152,168,170,230 "
                                                                  "modulo --head-dim)")
    g = p.add_argument_group("a smaller case (default: the preset's; context 2051, head dim 256, topk 512)")
    g.add_argument("--context", type=integer, help="tokens of request 0 (default 2051, the preset's)")
    g.add_argument("--head-dim", type=integer, help="head dimension, a multiple of 16 (default 256)")
    g.add_argument("--topk", type=integer, help="selected 4-token blocks per row (default 512)")
    g.add_argument("--seed", type=integer, help="seed of q, K/V and the selections (default 0)")
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="(default auto)")
    p.add_argument("--json", metavar="PATH|-", help=f"write the records (schema qsa_lab.cross_request/2) to PATH, or - "
                                                    "for stdout (default: none)")
    p.add_argument("--force", action="store_true", help="let --json replace a file (default: never)")
    p.set_defaults(func=run)
    return p


def check_args(args) -> dict:
    """Torch-free checks -> the settings (geometries per q_heads, payloads, routes); UsageError naming
    the argument."""
    from qsa_lab.model import memory as resources
    from qsa_lab.routes.labels import ROUTES, check_renamed

    payloads = [x.strip() for x in args.payloads.split(",") if x.strip()]
    bad = [x for x in payloads if x not in PAYLOADS]
    if not payloads or bad:
        raise UsageError(f"--payloads: each one of {', '.join(PAYLOADS)}, got {args.payloads!r}")
    routes = None
    if args.routes is not None:
        routes = [x.strip() for x in args.routes.split(",") if x.strip()]
        for r in routes:
            with blame({}, "--routes"):
                check_renamed(r, "--routes")
        unknown = [r for r in routes if r not in ROUTES]
        if not routes or unknown:
            raise UsageError(f"--routes: each one of {', '.join(ROUTES)}, got {args.routes!r}")
    for flag, items in (("--payloads", payloads), ("--routes", routes or ()), ("--requests", args.requests or ())):
        twice = sorted({str(x) for x in items if list(items).count(x) > 1})
        if twice:     # each item is one run: twice would run it again and double every count
            raise UsageError(f"{flag}: {', '.join(twice)} named more than once")
    over = {k: getattr(args, k) for k in ("context", "head_dim", "topk", "seed") if getattr(args, k) is not None}
    geometries = []
    for hq in args.q_heads:
        with blame({"q_heads": "--q-heads", "context": "--context", "head_dim": "--head-dim", "topk": "--topk",
                    "seed": "--seed"}, "--q-heads"):
            geometries.append(MIXES[args.mix].replace(q_heads=hq, kv_dtype=args.kv_dtype, **over))
    if not geometries:
        raise UsageError("--q-heads: empty list")
    requests = args.requests
    if requests is not None:
        bad = [r for r in requests if not 0 <= r < geometries[0].requests]
        if bad:
            raise UsageError(f"--requests: each in [0, {geometries[0].requests}), got {bad}")
    if args.dims is not None:
        bad = [d for d in args.dims if not 0 <= d < geometries[0].head_dim]
        if bad:
            raise UsageError(f"--dims: head dims must lie in [0, {geometries[0].head_dim}), got {bad}")
    budget = resources.default_budget()
    for g in geometries:
        with blame({}, "--context"):
            resources.require(g, budget)
    outs = check_outputs(args, {"--json": None if args.json == "-" else args.json})
    return {"geometries": geometries, "payloads": payloads, "routes": routes, "requests": requests,
            "json": outs.get("--json")}


def _checked(settings, g) -> list:
    """Geometry g's payloads with a code in its cache's dtype (a poisoned run each per request)."""
    from qsa_lab.model.poison import PAYLOAD_BITS

    return [p for p in settings["payloads"] if (g.kv_dtype, p) in PAYLOAD_BITS]


def _runs(settings, g, payloads=None) -> int:
    """Geometry g's poisoned runs (of `payloads`, default all): its requests x payloads with a code
    in its cache's dtype."""
    requests = g.requests if settings["requests"] is None else len(settings["requests"])
    checked = _checked(settings, g)
    return requests * len([p for p in (settings["payloads"] if payloads is None else payloads) if p in checked])


def _jobs(settings, apart):
    """-> (jobs here, jobs in the second process), each a list of (geometry index, payloads), in the
    order their records go. Without a second process (apart None) every geometry runs here. With
    one it takes geometry `apart`; where this process would still have more runs than it, the
    last checked payloads of the geometry here with the fewest query heads go there too, when the
    two ends come closer (each part of a geometry computes its clean units again: about two runs)."""
    geometries, payloads = settings["geometries"], tuple(settings["payloads"])
    here = [(i, payloads) for i in range(len(geometries)) if i != apart]
    if apart is None:
        return here, []
    there = [(apart, payloads)]
    if not here:
        return here, there
    mine, theirs = sum(_runs(settings, geometries[i]) for i, _ in here), _runs(settings, geometries[apart])
    k = min(range(len(here)), key=lambda j: geometries[here[j][0]].q_heads)
    i = here[k][0]
    checked = _checked(settings, geometries[i])
    if len(checked) < 2:
        return here, there
    cut = payloads.index(checked[len(checked) - len(checked) // 2])   # the last half of its checked payloads
    moved = _runs(settings, geometries[i], payloads[cut:])
    if max(mine - moved, theirs + moved + 2) < mine:
        here[k] = (i, payloads[:cut])
        there.append((i, payloads[cut:]))
    return here, there


def _steps(settings, here):
    """The progress of the poisoned runs made here (jobs `here`, _jobs) on stderr (cross_request runs
    and tells one per run)."""
    from qsa_lab.support.progress import Steps

    total = sum(_runs(settings, g) for g in settings["geometries"])
    print(f"# cross-request: {total} poisoned runs ({len(settings['geometries'])} query-head counts x requests x "
          "payloads), every route each", file=sys.stderr)
    return Steps(sum(_runs(settings, settings["geometries"][i], payloads) for i, payloads in here))


def _one(cross_request, g, payloads, given, steps) -> list:
    """cross_request on geometry g's `payloads` here, its bad input named by option."""
    with blame({"dims": "--dims", "requests": "--requests", "routes": "--routes", "payloads": "--payloads"},
               "--q-heads"):
        return cross_request(g, payloads, *given, progress=steps and steps.step)


def run(args) -> int:
    s = check_args(args)
    second = _second(s["geometries"])    # before torch: its import runs beside this one's
    try:
        return _run(args, s, second)
    finally:
        if second is not None:
            second.close()


def _second(geometries):
    """A second process for one geometry's runs when there are two or more and a core is idle
    (support.executor); None otherwise."""
    from qsa_lab.support.processes import idle_core

    if len(geometries) < 2 or not idle_core():
        return None
    from qsa_lab.support.executor import start_second

    return start_second("qsa_lab.app.cross_request", "qsa_lab.analysis.cross_request")


def one_thread(fn, *args):
    """fn(*args) with torch on one thread (in the second process: each process keeps to its core)."""
    from qsa_lab.support.processes import torch_threads

    with torch_threads(1):
        return fn(*args)


def _run(args, s, second) -> int:
    from qsa_lab.analysis.cross_request import (MUST_BE_CLEAN, CrossRequestReport, cross_request, groups_of,
                                                pivot_text)
    from qsa_lab.routes.run import resolve_backend
    from qsa_lab.support.outputs import write_text
    from qsa_lab.support.processes import torch_threads

    with blame({}, "--backend"):
        backend = resolve_backend(args.backend, s["geometries"][0])
    quiet = args.json == "-"
    geometries = s["geometries"]
    given = (s["requests"], s["routes"], backend, args.dims)
    # with a core to spare, the geometry with the most query heads (and, where that evens the two out,
    # part of the one with the fewest) runs in the second process beside the others here, one torch
    # thread each (the cores are taken); alone, torch keeps the program's threads
    apart = None
    if second is not None and backend == "emulate":
        apart = max(range(len(geometries)), key=lambda i: geometries[i].q_heads)
    here, there = _jobs(s, apart)
    try:
        remote = [second.submit(one_thread, cross_request, geometries[i], p, *given) for i, p in there]
    except Exception:  # noqa: BLE001 - gone: every geometry runs here
        here, there, remote = _jobs(s, None)[0], [], []
    steps = None if quiet else _steps(s, here)
    if there and steps:
        told = [f"q_heads {geometries[i].q_heads}" + ("" if p == tuple(s["payloads"]) else f" ({','.join(p)})")
                for i, p in there]
        print(f"# {' and '.join(told)}: in a second process, beside these", file=sys.stderr)
    got = {}
    with torch_threads(1) if there else contextlib.nullcontext():
        for i, p in here:
            got[i, p] = _one(cross_request, geometries[i], p, given, steps)
        for (i, p), future in zip(there, remote):
            try:
                got[i, p] = future.result()
            except Exception:  # noqa: BLE001 - it failed (bad input included): run here, which says why
                if steps:
                    steps.add(_runs(s, geometries[i], p))
                got[i, p] = _one(cross_request, geometries[i], p, given, steps)
    order = tuple(s["payloads"])     # a geometry's parts hold its payloads in order: prefix, then the rest
    records = [r for key in sorted(got, key=lambda k: (k[0], order.index(k[1][0]))) for r in got[key]]
    runs = [{"geometry": {**g.to_dict(), "request_rows": list(g.request_rows)}, "groups": groups_of(g)}
            for g in geometries]
    report = CrossRequestReport(backend, args.mix, runs, records)
    bad = report.leaks(MUST_BE_CLEAN)
    text = dump(report.to_json())
    if quiet:
        sys.stdout.write(text)
    else:
        g0 = s["geometries"][0]
        print(f"# {args.mix}: {g0.rows} rows of {g0.requests} requests {g0.rows_of_requests()}, ctx {g0.context}, "
              f"topk {g0.topk}, D {g0.head_dim}, {g0.kv_dtype}  [backend: {backend}]")
        mixed = [f"{x['rows'][0]}-{x['rows'][1]} (requests {','.join(map(str, x['requests']))})"
                 for x in runs[0]["groups"] if x["mixed"]]
        print(f"# groups of 8 consecutive rows that mix requests: {'; '.join(mixed) or 'none'}")
        for note in report.unavailable():
            print(f"# n/a: {note}")
        for g in s["geometries"]:
            if report.nothing_checked():
                break
            print(f"\n# {g.q_heads} query heads: other requests' rows that went non-finite, per poisoned request "
                  "(* = the poisoned request's own rows are not non-finite exactly as the reference's)")
            print(pivot_text(records, g.q_heads))
        print()
        leaky = sorted({r["route"] for r in report.leaks()})
        print(f"# routes that gave another request's row a non-finite value: {', '.join(leaky) or 'none'}")
        print("# must stay clean (reference, xqa, the complete fixes): "
              + ("none leaks" if not bad else f"LEAK in {', '.join(sorted({r['route'] for r in bad}))}"))
    if s["json"] is not None:
        with blame({}, "--json"):
            write_text(s["json"], text, "--json", force=args.force)
        if not quiet:
            print(f"# wrote {s['json']}")
    if report.nothing_checked():
        print("qsa-lab: cross-request: no check ran: the cache's dtype has a code for none of the payloads",
              file=sys.stderr)
    return report.exit_code()


def dump(doc: dict) -> str:
    """The document as JSON, one record per line (a run of every route, request and payload is thousands)."""
    head = json.dumps({k: v for k, v in doc.items() if k != "records"}, indent=1)
    records = ",\n".join("  " + json.dumps(r, separators=(",", ":")) for r in doc["records"])
    return head[:-2] + ',\n "records": [\n' + records + "\n ]\n}\n"

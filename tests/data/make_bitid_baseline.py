"""Write tests/data/bitid_*.npz, the records the bit-identity test compares with (tests/bitid_cases.py
says what a record holds): run it from the code whose outputs are the reference,

    .venv/bin/python tests/data/make_bitid_baseline.py

and only to move the reference deliberately (a change of behaviour); the test then checks later
code against the new files. The files name the commit, torch and the CPU they were written on.

A region added to the canary later has no earlier records; its cells are appended to the canary's
file by the change that introduces it, every recorded cell left as it is (the script refuses if a
recorded cell's verdict, counts or leaking rows, heads and dims changed):

    .venv/bin/python tests/data/make_bitid_baseline.py --add-region other-requests

A route added later likewise (the complete fixes of issue 37): its values (outputs, lse, its qsa:
kernel's canary cells) are appended to every record, after each record was computed again and its
recorded parts found as the test wants them (exact parts equal, values within its bounds); the
recorded values are kept as they are:

    .venv/bin/python tests/data/make_bitid_baseline.py --add-routes grouped+request_groups,grouped+finite_pv
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bitid_cases import (CANARY_KV, Baseline, canary_record, first_difference, machine, record,  # noqa: E402
                         report_record, save, small_record, small_specs, value_stats)

REPORT, SMALL, CANARY = (HERE / f"bitid_{name}.npz" for name in ("report", "small", "canary"))


def add_region(region: str) -> None:
    """Append one new region's cells to bitid_canary.npz."""
    old = Baseline(CANARY)
    records = {}
    for kv in CANARY_KV:
        exact, values = canary_record(kv)
        recorded = old.exact(kv)["cells"]
        moved = [k for k, cell in exact["cells"].items() if k in recorded and cell != recorded[k]]
        if moved:
            raise SystemExit(f"{kv}: {len(moved)} recorded cells changed, e.g. {moved[0]}: not appending")
        new = [k for k in exact["cells"] if k.split("/")[1] == region and k not in recorded]
        kept = old.values(kv)
        records[kv] = ({**old.exact(kv), "cells": {**recorded, **{k: exact["cells"][k] for k in new}}},
                       {**kept, **{k: values[k] for k in new}})
        print("canary", kv, f"+{len(new)} cells of {region}", flush=True)
    meta = {k: v for k, v in old.meta.items() if k != "records"}
    meta["added_regions"] = meta.get("added_regions", []) + [region]
    save(CANARY, meta, records)


def add_routes(routes: list[str]) -> None:
    """Append the values of new routes to every record of the three files (refusing if a recorded
    part moved beyond the test's bounds, or if anything but the new routes' values would be added)."""
    from qsa_lab.routes.run import GROUPED
    from test_bit_identity import ULPS

    unknown = [r for r in routes if r not in GROUPED]
    if unknown:
        raise SystemExit(f"--add-routes: {unknown} are not grouped routes")
    ours = {*routes, *(f"lse/{r}" for r in routes)}
    for kind, path in (("report", REPORT), ("small", SMALL), ("canary", CANARY)):
        old = Baseline(path)
        records = {}
        for name in old.names():
            exact, values = record(kind, name, old.meta.get("specs"))
            want, kept = old.exact(name), old.values(name)
            for key, recorded in want.items():
                got = exact[key]
                if key == "poison":   # as the test: fields added later are not compared
                    got = {k: got.get(k) for k in recorded}
                if key == "cells":
                    got = {k: c for k, c in got.items() if k in recorded}
                if got != recorded:
                    raise SystemExit(f"{kind} {name}: {key} is not as recorded: not appending")
            for v, a in kept.items():
                bound = ULPS["canary" if kind == "canary" else "lse" if v.startswith("lse/") else
                             "reference64" if v == "reference64" else "outputs"]
                s = value_stats(values[v], a)
                if not (s["nan"] and s["inf"] and s["max_ulps"] <= bound):
                    raise SystemExit(f"{kind} {name} {v}: {first_difference(values[v], a)}: not appending")
            new = {v: a for v, a in values.items() if v not in kept}
            cells = {}
            if kind == "canary":
                cells = {k: c for k, c in exact["cells"].items() if k not in want["cells"]}
                ours = set(cells)
                if any(k.split("/")[0].removeprefix("qsa:") not in routes for k in cells):
                    raise SystemExit(f"canary {name}: new cells of other kernels: not appending")
                want = {**want, "cells": {**want["cells"], **cells}}
            if not set(new) <= ours:
                raise SystemExit(f"{kind} {name}: new values {sorted(set(new) - ours)[:3]} not of {routes}: "
                                 "not appending")
            records[name] = (want, {**kept, **new})
            print(kind, name, f"+{len(new)} values" + (f", +{len(cells)} cells" if kind == "canary" else ""),
                  flush=True)
        meta = {k: v for k, v in old.meta.items() if k != "records"}
        meta["added_routes"] = meta.get("added_routes", []) + list(routes)
        save(path, meta, records)


def main():
    if sys.argv[1:2] == ["--add-region"]:
        return add_region(sys.argv[2])
    if sys.argv[1:2] == ["--add-routes"]:
        return add_routes(sys.argv[2].split(","))
    from qsa_lab.report.repro import REPRO_CASES

    meta = machine()
    print("records of", meta, flush=True)
    save(REPORT, meta, {rc.name: report_record(rc.name) for rc in REPRO_CASES})
    print("report:", len(REPRO_CASES), "cases", flush=True)
    specs = small_specs()
    save(SMALL, {**meta, "specs": specs}, {str(i): small_record(spec) for i, spec in enumerate(specs)})
    print("small:", len(specs), "cases", flush=True)
    save(CANARY, meta, {kv: canary_record(kv) for kv in CANARY_KV})
    print("canary:", ", ".join(CANARY_KV), flush=True)


if __name__ == "__main__":
    main()

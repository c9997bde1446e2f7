"""Write tests/data/bitid_*.npz, the records the bit-identity test compares with (tests/bitid_cases.py
says what a record holds): run it from the code whose outputs are the reference,

    .venv/bin/python tests/data/make_bitid_baseline.py

and only to move the reference deliberately (a change of behaviour); the test then checks later
code against the new files. The files name the commit, torch and the CPU they were written on.

A region added to the canary later has no earlier records; its cells are appended to the canary's
file by the change that introduces it, every recorded cell left as it is (the script refuses if a
recorded cell's verdict, counts or leaking rows, heads and dims changed):

    .venv/bin/python tests/data/make_bitid_baseline.py --add-region other-requests
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bitid_cases import (CANARY_KV, Baseline, canary_record, machine, report_record, save,  # noqa: E402
                         small_record, small_specs)

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


def main():
    if sys.argv[1:2] == ["--add-region"]:
        return add_region(sys.argv[2])
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

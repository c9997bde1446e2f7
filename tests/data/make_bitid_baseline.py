"""Write tests/data/bitid_*.npz: every route's output bits and NaN masks as the emulation gives
them now (see tests/bitid_cases.py for what is recorded). Run once, from the code whose
outputs are the reference (it was run at commit d412ef2, before the speed-ups):

    .venv/bin/python tests/data/make_bitid_baseline.py

Run it again only to deliberately move the reference; the bit-identity test then checks the
new code against the new files.

A region added to the canary later has no earlier outputs; its cells are appended to the canary
baseline by the code that introduced it, every recorded cell left as it is (the test checks the
recorded cells before it accepts the file):

    .venv/bin/python tests/data/make_bitid_baseline.py --add-region other-requests
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bitid_cases import bits, digest, make_case, nan_bits, small_specs  # noqa: E402

from qsa_lab.canary import run_canary  # noqa: E402
from qsa_lab.model.plan import pad_fix  # noqa: E402
from qsa_lab.report.repro import REPRO_CASES, run_case  # noqa: E402
from qsa_lab.routes.run import GROUPED, run_routes  # noqa: E402
from qsa_lab.routes import emulate


def lse_of(case, plan, variant):
    _, lse = emulate.grouped_forward(case.q, case.kv_cache, case.k_scale, case.v_scale, plan.group_rows,
                                     plan.microblocks, plan.masks, plan.seq_len, kv_dtype=case.kv_dtype,
                                     sm_scale=case.sm_scale, variant=variant, return_lse=True)
    return lse


def canary_cells(rep) -> list:
    return [{"kernel": r.kernel, "region": r.region, "plane": r.plane, "payload": r.payload,
             "verdict": r.verdict, "nan": r.nan, "inf": r.inf, "finite_changed": r.finite_changed,
             "output": digest(r.output), "leak": digest(r.leak)} for r in rep.results]


def add_region(region: str) -> None:
    """Append one new region's cells to bitid_canary.npz; refuse if any recorded cell's bits moved."""
    path = HERE / "bitid_canary.npz"
    doc = json.loads(str(np.load(path)["canary"]))
    key = ("kernel", "region", "plane", "payload")
    for kv in ("fp16", "e4m3"):
        recorded = {tuple(r[k] for k in key): r for r in doc[kv]["results"]}
        now = canary_cells(run_canary(backend="emulate", kv_dtype=kv))
        moved = [c for c in now if tuple(c[k] for k in key) in recorded         # the bits the test compares
                 and any(c[f] != recorded[tuple(c[k] for k in key)][f] for f in ("output", "leak"))]
        if moved:
            raise SystemExit(f"{kv}: {len(moved)} recorded cells changed, e.g. {moved[0]}: not appending")
        new = [c for c in now if c["region"] == region and tuple(c[k] for k in key) not in recorded]
        doc[kv]["results"] += new
        print("canary", kv, f"+{len(new)} cells of {region}", flush=True)
    doc.setdefault("added_regions", []).append(region)
    np.savez_compressed(path, canary=np.array(json.dumps(doc)))


def main():
    if sys.argv[1:2] == ["--add-region"]:
        return add_region(sys.argv[2])
    import qsa_lab

    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "qsa_lab": qsa_lab.__file__}
    print("outputs of", qsa_lab.__file__, flush=True)
    # report cases: hashes + NaN masks
    arrays, report = {}, []
    for i, rc in enumerate(REPRO_CASES):
        res = run_case(rc, "emulate")
        entry = {"name": rc.name, "kv_cache": digest(res.case.kv_cache), "q": digest(res.case.q),
                 "poison": res.case.poison, "reference64": digest(res.reference64),
                 "plan": {k: digest(getattr(res.plan, k)) for k in ("microblocks", "masks", "seq_len")},
                 "routes": {r: digest(o) for r, o in res.outputs.items()}}
        for r, o in res.outputs.items():
            arrays[f"report/{i}/{r}/nan"] = nan_bits(o)
        arrays[f"report/{i}/reference64/nan"] = nan_bits(res.reference64)
        report.append(entry)
        print("report", i, rc.name, flush=True)
    arrays["report/meta"] = np.array(json.dumps({**meta, "cases": report}))
    np.savez_compressed(HERE / "bitid_report.npz", **arrays)

    # small geometries: everything in full
    specs = small_specs()
    arrays, digests = {}, []
    for i, spec in enumerate(specs):
        case = make_case(spec)
        res = run_routes(case, backend="emulate")
        digests.append({"kv_cache": digest(case.kv_cache), "reference64": digest(res.reference64)})
        for r, o in res.outputs.items():
            arrays[f"small/{i}/{r}"] = bits(o)
        fixed = pad_fix(res.plan)
        for route, (variant, fix) in GROUPED.items():
            if res.plan.groups:
                arrays[f"small/{i}/lse/{route}"] = bits(lse_of(case, fixed if fix else res.plan, variant))
        print("small", i, spec, flush=True)
    arrays["small/specs"] = np.array(json.dumps({**meta, "specs": specs, "digests": digests}))
    np.savez_compressed(HERE / "bitid_small.npz", **arrays)

    # the canary on the emulation: every built-in kernel, fp16 and e4m3 pools
    canary = {}
    for kv in ("fp16", "e4m3"):
        rep = run_canary(backend="emulate", kv_dtype=kv)
        canary[kv] = {"skipped": rep.skipped, "results": canary_cells(rep)}
        print("canary", kv, len(rep.results), flush=True)
    np.savez_compressed(HERE / "bitid_canary.npz", canary=np.array(json.dumps({**meta, **canary})))


if __name__ == "__main__":
    main()

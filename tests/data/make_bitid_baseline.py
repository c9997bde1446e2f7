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

A route added later (the complete fixes of issue 37) likewise: its outputs on every recorded case
(report, small, and its qsa: kernel's canary cells) are appended, after every recorded route's bits
were checked unchanged:

    .venv/bin/python tests/data/make_bitid_baseline.py --add-routes grouped+request_groups,grouped+finite_pv
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
from qsa_lab.routes.run import GROUPED, route_plan, run_routes  # noqa: E402
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


def add_routes(routes: list) -> None:
    """Append new routes' records to all three files; refuse if a recorded route's bits moved."""
    unknown = [r for r in routes if r not in GROUPED]
    if unknown:
        raise SystemExit(f"--add-routes: {unknown} are not grouped routes")
    path = HERE / "bitid_report.npz"
    arrays = dict(np.load(path))
    meta = json.loads(str(arrays["report/meta"]))
    by_name = {rc.name: rc for rc in REPRO_CASES}
    for i, entry in enumerate(meta["cases"]):
        res = run_case(by_name[entry["name"]], "emulate")
        moved = [r for r, d in entry["routes"].items() if digest(res.outputs[r]) != d]
        if moved:
            raise SystemExit(f"report case {i} ({entry['name']}): recorded routes {moved} moved: not appending")
        for r in routes:
            entry["routes"][r] = digest(res.outputs[r])
            arrays[f"report/{i}/{r}/nan"] = nan_bits(res.outputs[r])
        print("report", i, entry["name"], flush=True)
    arrays["report/meta"] = np.array(json.dumps(meta))
    np.savez_compressed(path, **arrays)

    path = HERE / "bitid_small.npz"
    arrays = dict(np.load(path))
    specs = json.loads(str(arrays["small/specs"]))["specs"]
    for i, spec in enumerate(specs):
        case = make_case(spec)
        res = run_routes(case, backend="emulate")
        moved = [r for r in res.outputs if f"small/{i}/{r}" in arrays
                 and not np.array_equal(bits(res.outputs[r]), arrays[f"small/{i}/{r}"])]
        if moved:
            raise SystemExit(f"small case {i}: recorded routes {moved} moved: not appending")
        fixed = pad_fix(res.plan)
        for r in routes:
            arrays[f"small/{i}/{r}"] = bits(res.outputs[r])
            plan = route_plan(r, res.plan, fixed, case)
            if plan.groups:
                arrays[f"small/{i}/lse/{r}"] = bits(lse_of(case, plan, GROUPED[r][0]))
        print("small", i, flush=True)
    np.savez_compressed(path, **arrays)

    path = HERE / "bitid_canary.npz"
    doc = json.loads(str(np.load(path)["canary"]))
    key = ("kernel", "region", "plane", "payload")
    for kv in ("fp16", "e4m3"):
        recorded = {tuple(r[k] for k in key): r for r in doc[kv]["results"]}
        now = canary_cells(run_canary([f"qsa:{r}" for r in routes] + sorted({r["kernel"] for r in recorded.values()
                                                                             if r["kernel"].startswith("qsa:")}),
                                      backend="emulate", kv_dtype=kv))
        moved = [c for c in now if tuple(c[k] for k in key) in recorded
                 and any(c[f] != recorded[tuple(c[k] for k in key)][f] for f in ("output", "leak"))]
        if moved:
            raise SystemExit(f"canary {kv}: {len(moved)} recorded cells changed, e.g. {moved[0]}: not appending")
        new = [c for c in now if c["kernel"] in {f"qsa:{r}" for r in routes} and tuple(c[k] for k in key) not in recorded]
        for c in new:   # recorded as the baseline records them: it predates the verdict n/a (a clean result there)
            c["verdict"] = "clean" if c["verdict"] == "n/a" else c["verdict"]
        doc[kv]["results"] += new
        print("canary", kv, f"+{len(new)} cells", flush=True)
    doc.setdefault("added_routes", []).extend(routes)
    np.savez_compressed(path, canary=np.array(json.dumps(doc)))


def main():
    if sys.argv[1:2] == ["--add-region"]:
        return add_region(sys.argv[2])
    if sys.argv[1:2] == ["--add-routes"]:
        return add_routes(sys.argv[2].split(","))
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

"""The emulation's every route, bit for bit as before the speed-ups.

tests/data/bitid_*.npz hold the outputs (bits) and NaN masks of every route, written by
tests/data/make_bitid_baseline.py from the code at commit d412ef2 (see tests/bitid_cases.py for
the cases). Any change to an output bit, a NaN mask, the fp8 encoder's cache bytes, the plan,
a poison record or a canary verdict fails here.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bitid_cases import bits, digest, make_case, nan_bits

from qsa_lab.canary import run_canary
from qsa_lab.model.plan import pad_fix
from qsa_lab.report.repro import REPRO_CASES, run_case
from qsa_lab.routes.run import GROUPED, ROUTES, route_plan, run_routes
from qsa_lab.routes import emulate

DATA = Path(__file__).resolve().parent / "data"
REPORT = np.load(DATA / "bitid_report.npz")
SMALL = np.load(DATA / "bitid_small.npz")
CANARY = json.loads(str(np.load(DATA / "bitid_canary.npz")["canary"]))
REPORT_META = json.loads(str(REPORT["report/meta"]))
SMALL_META = json.loads(str(SMALL["small/specs"]))
SPECS = SMALL_META["specs"]


REPRO_BY_NAME = {rc.name: rc for rc in REPRO_CASES}
REPORT_NAMES = [c["name"] for c in REPORT_META["cases"]]


def test_baseline_covers_the_spread():
    """The saved cases are what the test claims: every route, kv dtype and poison site; every
    repro case of the baseline still exists (cases added since have no earlier outputs)."""
    assert len(REPORT_NAMES) == 12 and set(REPORT_NAMES) <= set(REPRO_BY_NAME)
    assert all(set(c["routes"]) == set(ROUTES) for c in REPORT_META["cases"])
    assert {s["geometry"]["kv_dtype"] for s in SPECS} == {"e4m3", "e5m2", "fp16"}
    assert {s["poison"]["site"] for s in SPECS} >= {"none", "zeros", "targeted", "random", "fp16-state",
                                                     "stale-tail", "attended-k", "attended-v"}
    for key in ("q_heads", "head_dim", "page_size", "requests"):
        assert len({s["geometry"][key] for s in SPECS}) >= 3, key


@pytest.mark.parametrize("i", range(len(REPORT_NAMES)), ids=REPORT_NAMES)
def test_report_case_bit_identical(i):
    want = REPORT_META["cases"][i]
    rc = REPRO_BY_NAME[want["name"]]
    res = run_case(rc, "emulate")
    assert digest(res.case.kv_cache) == want["kv_cache"]
    assert digest(res.case.q) == want["q"]
    poison = json.loads(json.dumps(res.case.poison))  # the baseline's fields (later ones may be added)
    assert {k: poison.get(k) for k in want["poison"]} == want["poison"]
    assert {k: digest(getattr(res.plan, k)) for k in want["plan"]} == want["plan"]
    for r in ROUTES:
        np.testing.assert_array_equal(nan_bits(res.outputs[r]), REPORT[f"report/{i}/{r}/nan"], err_msg=r)
    np.testing.assert_array_equal(nan_bits(res.reference64), REPORT[f"report/{i}/reference64/nan"])
    assert {r: digest(o) for r, o in res.outputs.items()} == want["routes"]
    assert digest(res.reference64) == want["reference64"]


@pytest.mark.parametrize("i", range(len(SPECS)))
def test_small_case_bit_identical(i):
    spec = SPECS[i]
    case = make_case(spec)
    assert digest(case.kv_cache) == SMALL_META["digests"][i]["kv_cache"]
    res = run_routes(case, backend="emulate")
    assert set(res.outputs) == set(ROUTES)
    for r, o in res.outputs.items():
        want = SMALL[f"small/{i}/{r}"]
        np.testing.assert_array_equal(torch.isnan(o).numpy(), np.isnan(want.view(np.float16)), err_msg=f"{r} NaN")
        np.testing.assert_array_equal(bits(o), want, err_msg=r)
    assert digest(res.reference64) == SMALL_META["digests"][i]["reference64"]
    fixed = pad_fix(res.plan)
    for route, (variant, _) in GROUPED.items():
        key = f"small/{i}/lse/{route}"
        plan = route_plan(route, res.plan, fixed, case)   # request_groups: its own groups
        assert (key in SMALL) == bool(plan.groups), route
        if plan.groups:
            _, lse = emulate.grouped_forward(case.q, case.kv_cache, case.k_scale, case.v_scale, plan.group_rows,
                                             plan.microblocks, plan.masks, plan.seq_len, kv_dtype=case.kv_dtype,
                                             sm_scale=case.sm_scale, variant=variant, return_lse=True)
            np.testing.assert_array_equal(bits(lse), SMALL[key], err_msg=f"{route} lse")


@pytest.mark.parametrize("kv_dtype", ["fp16", "e4m3"])
def test_canary_bit_identical(kv_dtype):
    """The canary's qsa routes: each poisoned output, bit for bit (the canary's verdicts are
    drawn from these)."""
    key = ("kernel", "region", "plane", "payload")
    want = {tuple(r[k] for k in key): r for r in CANARY[kv_dtype]["results"] if r["kernel"].startswith("qsa:")}
    assert len(want) >= 100
    rep = run_canary([f"qsa:{r}" for r in ROUTES], backend="emulate", kv_dtype=kv_dtype)
    got = {(r.kernel, r.region, r.plane, r.payload): r for r in rep.results}
    assert set(got) == set(want)
    for k, r in got.items():
        assert digest(r.output) == want[k]["output"], k
        assert digest(r.leak) == want[k]["leak"], k
        # n/a is a clean result in a region no input references (the baseline predates the name)
        verdict = "clean" if r.verdict == "n/a" else r.verdict
        assert (verdict, r.nan, r.inf, r.finite_changed) == tuple(want[k][f] for f in
                                                                  ("verdict", "nan", "inf", "finite_changed")), k

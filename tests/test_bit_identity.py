"""The emulation's every route, the plans and the canary's verdicts, as recorded.

tests/data/bitid_*.npz hold records of the cases of tests/bitid_cases.py, written by
tests/data/make_bitid_baseline.py (each file names the commit, torch and CPU it was written on).
What does not depend on the order of a float sum must be equal: the fp8 encoder's cache bytes, q,
the selections, the plan, the poison record, each canary cell's verdict, its NaN / Inf /
finite-changed counts and the rows, heads and dims that leaked, and every NaN and Inf mask (which
elements, which sign). Finite values must lie within ULPS of the record, in units in the last place
of the largest value of the element's vector, for the reasons written beside each bound.

The selections are compared exactly although the indexer ranks float32 scores, each a sum whose
order a BLAS chooses: a selection could flip only where the last selected and the first unselected
block's scores lie closer than their errors. Over these cases the closest such pair is 34 units of
u * M apart (M: the score's sum of |terms|, u = 2**-24), while a score moved at most 1.7 units
(measure_bitid_paths.indexer_margins); the cuts that fall on a tie are ties of exact ReLU zeros,
every dot of those blocks far below 0.

A bound in ulps lets a refactor move a value by that much unseen: for a change that must keep
every bit, compare the two commits on one machine with tools/compare_commits.py.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

import torch

from bitid_cases import INPUTS, Baseline, draws, first_difference, record, value_stats

from qsa_lab.report.repro import REPRO_CASES
from qsa_lab.routes.run import GROUPED, GROUPING, ROUTES

DATA = Path(__file__).resolve().parent / "data"
REPORT, SMALL, CANARY = (Baseline(DATA / f"bitid_{name}.npz") for name in ("report", "small", "canary"))

# The values move with the order of float sums, which is not this project's to fix: MKL picks its
# GEMM kernels (and so the order in which a dot product's terms are added) by CPU vendor and
# instruction set, ATen its vectorised exp, max and sum kernels by instruction set (default, AVX2,
# AVX-512), and both split work by thread count. tests/data/measure_bitid_paths.py ran every case
# below on one Intel Xeon (AVX-512) under every path it can be forced onto: ATen default / AVX2 /
# AVX-512, MKL on AVX2 or SSE4.2 code, MKL's reproducibility modes COMPATIBLE / AVX2 / AVX512, oneDNN
# on AVX2, 1 and 2 threads, and AVX2 everywhere at once (evidence/bitid_cpu_paths.json). The largest
# differences it saw are below; an AMD EPYC with AVX2 only was seen at most 1 ulp off in the fp16
# outputs (17 of 278,486 values), every NaN mask and canary verdict equal.
# A bound is in ulps of the largest value of the element's vector (bitid_cases.ulps: an output's
# head dims, a row's heads): each element sums terms of that size, and its error with them.
ULPS = {
    # fp16 outputs, computed in float32 and rounded once to fp16. Another order moves the float32
    # value by a small part of an fp16 ulp (a float32 ulp is 2**-13 of an fp16 one; the sums have at
    # most a few thousand terms), so the rounding can land on the neighbouring fp16 value and no
    # further: 1 ulp. Measured: 1 (1521 of 3,701,152 values with MKL on AVX2 code, 44,096 in
    # MKL's COMPATIBLE mode). The bound allows one more.
    "outputs": 2,
    # the grouped routes' float32 log-sum-exp, max + log(sum of up to 2048 probabilities), both the
    # row's max score (a float32 dot of up to 256 fp16 products) and the sum in an order of MKL's and
    # ATen's choosing: a few ulps of the sum's terms. Measured: 1 (605 of 22,240 values). The bound
    # allows the larger sums of another BLAS.
    "lse": 8,
    # the float64 reference: float64 dots and an exp, whose rounding depends on the order as the
    # float32 one does; an error of a score is multiplied into its probability by exp, so the
    # reference moves by more ulps than one sum would. Measured: 37 (MKL's COMPATIBLE mode; 301,872
    # of 528,736 values differ somewhere). The bound is 7x that: still 2**-44 of the vector's size.
    "reference64": 256,
    # the canary's poisoned outputs: the fp16 outputs of the qsa routes, as above. Measured: 0.02
    # (1 ulp of a value 64 times smaller than its vector's largest).
    "canary": 2,
}


def other_draws(base: Baseline) -> None:
    """Called when a case's inputs (kv cache, q, scales) are not the recorded ones. The cases are built from
    torch's float32 normal draws, and on a CPU without AVX2 (ATen's default path) torch draws other
    numbers (bitid_cases.draws): there the case is another case, and nothing recorded of it applies
    (skip, saying so). Anywhere else the inputs must be equal (fail)."""
    if draws() != base.meta["draws"] and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("on ATen's default CPU path (no AVX2) torch draws other float32 normal numbers than on the "
                    f"AVX2 / AVX-512 path the records were written with ({base.meta['cpu_capability']}): this "
                    "case's inputs differ, it is another case")
    if draws() != base.meta["draws"]:
        pytest.fail(f"torch {torch.__version__} draws other float32 normal numbers than torch {base.meta['torch']} "
                    f"did where the records were written: the cases differ; write new records "
                    "(tests/data/make_bitid_baseline.py)")


def check(base: Baseline, kind: str, name: str) -> dict:
    """Compute record `name` of `base` now and compare it: exact parts equal, values within ULPS.
    -> the values computed."""
    exact, values = record(kind, name, base.meta.get("specs"))
    want = base.exact(name)
    if any(exact[k] != want[k] for k in INPUTS):
        other_draws(base)
    for key, recorded in want.items():
        got = exact.get(key)
        if key == "poison":   # the record's fields (fields added later are not compared)
            got = {k: got.get(k) for k in recorded}
        if key == "cells":
            assert set(got) == set(recorded), f"canary cells: {sorted(set(got) ^ set(recorded))[:4]}"
            moved = [k for k in recorded if got[k] != recorded[k]]
            assert not moved, f"{moved[0]}: {got[moved[0]]}, recorded {recorded[moved[0]]} ({len(moved)} cells)"
        assert got == recorded, f"{key}: {got}, recorded {recorded}"
    recorded = base.values(name)
    assert set(values) == set(recorded)
    for v, got in values.items():
        bound = ULPS["canary" if kind == "canary" else "lse" if v.startswith("lse/") else
                     "reference64" if v == "reference64" else "outputs"]
        s = value_stats(got, recorded[v])
        assert s["nan"] and s["inf"] and s["max_ulps"] <= bound, f"{v}: {first_difference(got, recorded[v])}"
    return values


def test_the_records_cover_the_spread():
    """The records are what the test claims: every repro case (cases added since the records were
    written have none), every route with the float64 reference, each grouped route's lse where the
    case has groups; every kv dtype, poison site and several of each geometry knob; both canary pools."""
    names = {rc.name for rc in REPRO_CASES}
    assert len(REPORT.names()) >= 13 and set(REPORT.names()) <= names
    for base in (REPORT, SMALL):
        for name in base.names():
            keys = set(base.records[name]["values"])
            assert set(ROUTES) | {"reference64"} <= keys <= set(ROUTES) | {"reference64"} | {f"lse/{r}" for r in GROUPED}
            groups = base.exact(name)["plan"]["seq_len"] != hashlib.sha256(b"").hexdigest()
            # a route of GROUPING plans its own groups: its lse is there where its own plan has groups
            assert (keys >= {f"lse/{r}" for r in GROUPED if r not in GROUPING}) == groups, name
    specs = SMALL.meta["specs"]
    assert len(specs) == len(SMALL.names()) == 64
    assert {s["geometry"]["kv_dtype"] for s in specs} == {"e4m3", "e5m2", "fp16"}
    assert {s["poison"]["site"] for s in specs} >= {"none", "zeros", "targeted", "random", "fp16-state",
                                                     "stale-tail", "attended-k", "attended-v"}
    for key in ("q_heads", "head_dim", "page_size", "requests"):
        assert len({s["geometry"][key] for s in specs}) >= 3, key
    assert CANARY.names() == ["fp16", "e4m3"]
    assert sum(len(CANARY.exact(kv)["cells"]) for kv in CANARY.names()) == 450


@pytest.mark.parametrize("name", REPORT.names())
def test_report_case(name):
    check(REPORT, "report", name)


@pytest.mark.parametrize("i", SMALL.names())
def test_small_case(i):
    check(SMALL, "small", i)


@pytest.mark.parametrize("kv_dtype", CANARY.names())
def test_canary(kv_dtype):
    """The canary of every qsa route: each cell's verdict, counts and leaking rows/heads/dims as
    recorded, its poisoned output's NaN mask bit for bit and its values within the bound."""
    check(CANARY, "canary", kv_dtype)

"""The cases of the bit-identity test (tests/test_bit_identity.py), what is recorded of each, and
how a run is compared with the record: shared by that test, by tests/data/make_bitid_baseline.py
(which writes the records under tests/data/) and by tests/data/measure_bitid_paths.py (which
measures how far the values move between the CPU paths of one machine).

Each case gives two things:
- exact: what does not depend on the order of a float sum, compared for equality: hashes of the
  kv cache (the fp8 encoder's bytes), q and the selections, the plan, the poison record; for the
  canary each cell's verdict, its NaN / Inf / finite-changed counts and the rows, heads and dims
  that leaked.
- values: float arrays (every route's fp16 output, each grouped route's float32 log-sum-exp, the
  float64 reference, the canary's poisoned outputs), compared by value_stats: NaN and Inf masks
  bit for bit, finite values within a bound in ulps that the test states.

The cases:
- report: every case of `qsa-lab repro` (the report's decode-like and 3-request causal cases with
  their seed, their random / stale / control / attended variants).
- small: a spread of small geometries (kv dtypes, poison sites and planes and payloads, head
  dims, q_heads, page sizes, requests, layouts, groupings, selections).
- canary: the default canary of every qsa route on the emulation, fp16 and e4m3 pools.
"""
from __future__ import annotations

import hashlib
import json
import os
import random

import numpy as np
import torch

from qsa_lab.model.case import Geometry, build_case
from qsa_lab.model.poison import apply_poison

CANARY_KV = ("fp16", "e4m3")
PLAN_FIELDS = ("microblocks", "masks", "seq_len")


def bits(t: torch.Tensor) -> np.ndarray:
    """A tensor's raw bits as an integer numpy array of the same shape."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().cpu().contiguous().view(ints[t.element_size()]).numpy()


def digest(t) -> str:
    return hashlib.sha256((bits(t) if torch.is_tensor(t) else np.ascontiguousarray(t)).tobytes()).hexdigest()


# --------------------------------------------------------------------------- comparing values

def ulps(got: np.ndarray, want: np.ndarray, own: bool = False) -> np.ndarray:
    """|got - want| in units in the last place of the largest magnitude of the element's vector
    along the last axis (an output's head dims, a row's heads), in the arrays' dtype, where both
    are finite (0 elsewhere). The vector's scale, not the element's own: an element is a sum of
    terms of that scale, and its rounding error is too, however small the sum (a float64 output
    near 0 would otherwise count a 1-ulp error of its terms as 2**20 of its own ulps). own: in
    units of each element's own ulp (the larger of the two)."""
    both = np.isfinite(got) & np.isfinite(want)
    a, b = np.where(both, got, 0), np.where(both, want, 0)
    size = np.maximum(np.abs(a), np.abs(b))
    if not own and size.ndim:
        size = np.broadcast_to(size.max(axis=-1, keepdims=True), size.shape)
    unit = np.spacing(size).astype(np.float64)
    # in float64 the difference of two values within a factor 2 of each other is exact (Sterbenz)
    return np.abs(a.astype(np.float64) - b.astype(np.float64)) / unit


def infs(a: np.ndarray) -> np.ndarray:
    """+1 at +Inf, -1 at -Inf, 0 elsewhere."""
    return np.where(np.isinf(a), np.sign(a), 0).astype(np.int8)


def value_stats(got: np.ndarray, want: np.ndarray) -> dict:
    """How `got` differs from the recorded `want`: nan / inf (the masks, with the Inf signs, are
    equal), max_ulps (the largest finite difference, ulps()), differ (finite elements whose bits
    differ), values (elements compared), max_own_ulps (the largest in each element's own ulps)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"shape/dtype {got.shape} {got.dtype}, recorded {want.shape} {want.dtype}")
    d = ulps(got, want)
    finite = np.isfinite(got) & np.isfinite(want)
    return {"nan": bool(np.array_equal(np.isnan(got), np.isnan(want))),
            "inf": bool(np.array_equal(infs(got), infs(want))),
            "max_ulps": float(d.max()) if d.size else 0.0, "differ": int((finite & (got != want)).sum()),
            "values": int(got.size), "max_own_ulps": float(ulps(got, want, own=True).max()) if d.size else 0.0}


def first_difference(got: np.ndarray, want: np.ndarray) -> str:
    """Where got and want first disagree (NaN mask, Inf, then the largest ulp difference)."""
    for what, g, w in (("NaN", np.isnan(got), np.isnan(want)), ("Inf", infs(got), infs(want))):
        if not np.array_equal(g, w):
            i = np.unravel_index(np.argmax(g != w), got.shape)
            return f"{what} mask differs first at {tuple(map(int, i))}: {got[i]} (recorded {want[i]})"
    d = ulps(got, want)
    i = np.unravel_index(np.argmax(d), got.shape)
    return f"largest difference {d[i]:.0f} ulps at {tuple(map(int, i))}: {got[i]!r} (recorded {want[i]!r})"


# --------------------------------------------------------------------------- the cases

def draws() -> str:
    """A hash of torch's float32 normal draws (seed 0): the cases are built from such draws, and
    torch draws other numbers on a CPU without AVX2 (ATen's default path computes the Box-Muller
    transform with other log / cos routines than its AVX2 and AVX-512 paths, which agree)."""
    return digest(torch.randn(1024, generator=torch.Generator().manual_seed(0)))



def small_specs(n: int = 64, seed: int = 20) -> list[dict]:
    """Geometry + poison keyword sets drawn from the spread (a fixed draw: the same list every time)."""
    rng = random.Random(seed)
    sites = ["none", "zeros", "targeted", "random", "fp16-state", "stale-tail", "attended-k", "attended-v"]
    specs = []
    # hand-picked corners first: multi-partition XQA (fp8 256 / fp16 1024 tokens), 16 heads, page 4
    specs.append(dict(geometry=dict(rows=9, requests=1, context=1300, topk=300, page_size=16, q_heads=2,
                                    head_dim=32, kv_dtype="fp16"), poison=dict(site="targeted", payload="nan")))
    specs.append(dict(geometry=dict(rows=9, requests=2, context=700, topk=120, page_size=32, q_heads=3,
                                    head_dim=32, kv_dtype="e4m3"), poison=dict(site="random")))
    specs.append(dict(geometry=dict(rows=16, requests=2, context=200, topk=24, page_size=4, q_heads=16,
                                    head_dim=16, kv_dtype="e5m2"), poison=dict(site="targeted", plane="kv")))
    specs.append(dict(geometry=dict(rows=17, requests=3, context=150, topk=16, page_size=8, q_heads=6,
                                    head_dim=48, kv_dtype="e4m3", layout="scatter", group_rows="request"),
                      poison=dict(site="stale-tail")))
    while len(specs) < n:
        kv = rng.choice(["e4m3", "e5m2", "fp16"])
        requests = rng.choice([1, 1, 2, 3])
        rows = rng.choice([8, 9, 12, 16, 17, 24])
        rows = max(rows, requests)
        g = dict(rows=rows, requests=requests, context=rng.choice([64, 90, 131, 200, 333]),
                 topk=rng.choice([4, 8, 16, 32]), page_size=rng.choice([4, 8, 16, 32]),
                 q_heads=rng.choice([1, 2, 3, 4, 6, 8]), head_dim=rng.choice([16, 32, 64]), kv_dtype=kv,
                 seed=rng.randrange(1000), layout=rng.choice(["contiguous", "scatter"]),
                 group_rows=rng.choice(["consecutive", "request"]), selection=rng.choice(["indexer", "random"]))
        site = rng.choice(sites)
        p = dict(site=site, plane=rng.choice(["v", "v", "k", "kv"]), seed=rng.randrange(100))
        if site in ("targeted", "stale-tail", "attended-k", "attended-v"):
            payload = rng.choice([None, None, "nan", "inf", "max", "zero"])
            if payload == "inf" and kv == "e4m3":
                payload = None
            p["payload"] = payload
            if rng.random() < 0.5:
                p["dims"] = sorted(rng.sample(range(g["head_dim"]), 3))
        spec = dict(geometry=g, poison=p)
        try:
            make_case(spec)
        except ValueError:  # e.g. stale-tail without a partial microblock, a context too short
            continue
        specs.append(spec)
    return specs


def make_case(spec: dict):
    return apply_poison(build_case(Geometry(**spec["geometry"])), **spec["poison"])


# --------------------------------------------------------------------------- what is recorded

def lse_of(case, plan, variant) -> torch.Tensor:
    """The grouped route's log-sum-exp per score row (variant of routes.labels.GROUPED)."""
    from qsa_lab.routes import emulate

    _, lse = emulate.grouped_forward(case.q, case.kv_cache, case.k_scale, case.v_scale, plan.members,
                                     plan.microblocks, plan.masks, plan.seq_len, kv_dtype=case.kv_dtype,
                                     sm_scale=case.sm_scale, variant=variant, return_lse=True)
    return lse


#: the exact parts that are a case's inputs (the kv cache holds the fp8 encoder's bytes)
INPUTS = ("kv_cache", "q", "scales")


def inputs(case) -> dict:
    """Hashes of a case's kv cache, q and selections; its K and V scales."""
    return {"kv_cache": digest(case.kv_cache), "q": digest(case.q), "selected": digest(case.selected),
            "scales": [float(case.k_scale), float(case.v_scale)]}


def _routes_record(res) -> tuple[dict, dict]:
    """exact and values of one run_routes result (qsa_lab.routes.run.RunResult)."""
    from qsa_lab.model.plan import pad_fix
    from qsa_lab.routes.run import GROUPED, route_plan

    case = res.case
    exact = {**inputs(case), "plan": {k: digest(getattr(res.plan, k)) for k in PLAN_FIELDS},
             "poison": json.loads(json.dumps(case.poison))}
    values = {r: o.numpy() for r, o in res.outputs.items()}
    values["reference64"] = res.reference64.numpy()
    fixed, memo = pad_fix(res.plan), {}
    for route, (variant, _) in GROUPED.items():
        plan = route_plan(route, res.plan, fixed, case, memo)   # request_groups: its own groups
        if plan.groups:
            values[f"lse/{route}"] = lse_of(case, plan, variant).numpy()
    return exact, values


def report_record(name: str) -> tuple[dict, dict]:
    """The repro case called `name`, on the emulation."""
    from qsa_lab.report.repro import REPRO_CASES, run_case

    rc = next(c for c in REPRO_CASES if c.name == name)
    return _routes_record(run_case(rc, "emulate"))


def small_record(spec: dict) -> tuple[dict, dict]:
    from qsa_lab.routes.run import run_routes

    return _routes_record(run_routes(make_case(spec), backend="emulate"))


def canary_record(kv_dtype: str) -> tuple[dict, dict]:
    """The canary of every qsa route on the emulation. exact: hashes of the case's kv cache, q and
    selections, and per cell (kernel, region, plane, payload) its verdict, counts and where it
    leaked; values: each cell's poisoned output (the qsa routes return fp16, which the canary hands
    back as float32: recorded as fp16)."""
    from qsa_lab.canary import run_canary
    from qsa_lab.routes.run import ROUTES

    rep = run_canary([f"qsa:{r}" for r in ROUTES], backend="emulate", kv_dtype=kv_dtype)
    cells, values = {}, {}
    for r in rep.results:
        key = cell_key(r)
        cells[key] = {"verdict": r.verdict, "nan": r.nan, "inf": r.inf, "finite_changed": r.finite_changed,
                      **r.where(), "leak": None if r.leak is None else digest(r.leak)}
        if r.output is None:
            continue
        half = r.output.half()
        if not bool((torch.isnan(half) | (half.float() == r.output)).all()):
            raise AssertionError(f"{key}: the output holds values fp16 cannot")
        values[key] = half.numpy()
    return {**inputs(rep.case), "cells": cells, "skipped": rep.skipped}, values


def cell_key(r) -> str:
    return "/".join((r.kernel, r.region, r.plane, r.payload))


def record(kind: str, name: str, specs: list | None = None) -> tuple[dict, dict]:
    """The record called `name` of file `kind` (report, small, canary), computed now; specs: the
    small file's list of cases."""
    if kind == "report":
        return report_record(name)
    if kind == "small":
        return small_record(specs[int(name)])
    return canary_record(name)


def machine() -> dict:
    """Where records were written or compared: the commit, torch, its CPU paths, the CPU model."""
    import subprocess
    from pathlib import Path

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                            capture_output=True, text=True)
    info = Path("/proc/cpuinfo")
    cpu = next((line.split(":", 1)[1].strip() for line in info.read_text().splitlines()
                if line.startswith("model name")), "unknown") if info.exists() else "unknown"
    return {"commit": commit.stdout.strip() or "unknown", "torch": torch.__version__,
            "threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu": cpu, "draws": draws()}


# --------------------------------------------------------------------------- the files

def save(path, meta: dict, records: dict) -> None:
    """records: name -> (exact, values). One .npz: `meta` (JSON: meta, and per record its exact
    part and the key of each value array) and each distinct array once (many routes and cases give
    the same output), compressed. A record's fp16 outputs beside its xqa output are stored as the
    difference of their bits from xqa's (mostly 0 or 1: it compresses to little)."""
    arrays, index = {}, {}
    for name, (exact, values) in records.items():
        base = values.get(BASE)
        keys = {}
        for v, a in values.items():
            kind = a.dtype.name
            if v != BASE and base is not None and a.dtype == np.float16 and a.shape == base.shape:
                kind, a = DELTA, a.view(np.uint16) - base.view(np.uint16)     # wraps around: exact
            key = f"{kind}/{hashlib.sha256(a.tobytes() + str(a.shape).encode()).hexdigest()[:20]}"
            arrays[key] = a
            keys[v] = key
        index[name] = {"exact": exact, "values": keys}
    tmp = f"{path}.part"   # written beside, then moved over: a reader of the old file keeps it whole
    with open(tmp, "wb") as f:
        np.savez_compressed(f, meta=np.array(json.dumps({**meta, "records": index})), **arrays)
    os.replace(tmp, path)


BASE, DELTA = "xqa", "delta16"


class Baseline:
    """A file written by save(): names, exact(name), values(name) -> {value name: array}."""

    def __init__(self, path):
        self.npz = np.load(path)
        self.meta = json.loads(str(self.npz["meta"]))
        self.records = self.meta["records"]

    def names(self) -> list[str]:
        return list(self.records)

    def exact(self, name: str) -> dict:
        return self.records[name]["exact"]

    def values(self, name: str) -> dict:
        keys = self.records[name]["values"]
        out = {v: self.npz[key] for v, key in keys.items()}
        for v, key in keys.items():
            if key.startswith(DELTA + "/"):
                out[v] = (out[v] + out[BASE].view(np.uint16)).view(np.float16)
        return out

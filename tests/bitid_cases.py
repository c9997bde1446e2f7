"""The cases of the bit-identity test (tests/test_bit_identity.py) and how their outputs are
recorded, shared by that test and by tests/data/make_bitid_baseline.py, which wrote the files
under tests/data/ from the emulation as it was before the speed-ups (commit d412ef2).

What is recorded, every route's output bits (int16 view of the fp16 output) and NaN mask:
- report: the twelve cases of `qsa-lab repro` (the report's decode-like and 3-request causal
  cases with their seed, their random / stale / control / attended variants): a sha256 of each
  route's output bits and of the float64 reference, the NaN masks in full (packed bits), the
  poison record and a hash of the case's kv cache (the fp8 encoder's output).
- small: a spread of small geometries (kv dtypes, poison sites and planes and payloads, head
  dims, q_heads, page sizes, requests, layouts, groupings, selections): every route's output
  in full and each grouped route's log-sum-exp; hashes of the float64 reference and the cache.
- canary: the default canary on the emulation, per result its verdict, counts and a hash of
  the poisoned output's bits.
"""
from __future__ import annotations

import hashlib
import random

import numpy as np
import torch

from qsa_lab.model.case import Geometry, build_case
from qsa_lab.model.poison import apply_poison

VARIANTS = ("unfixed", "kernel_fix", "masked_load")


def bits(t: torch.Tensor) -> np.ndarray:
    """A tensor's raw bits as an integer numpy array of the same shape."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().cpu().contiguous().view(ints[t.element_size()]).numpy()


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(bits(t).tobytes()).hexdigest()


def nan_bits(t: torch.Tensor) -> np.ndarray:
    return np.packbits(torch.isnan(t).cpu().numpy().reshape(-1))


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

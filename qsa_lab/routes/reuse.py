"""Clean units: the emulation's outputs of a base case, kept for cases that differ from it only in
some of the cache's bytes (cross-request's poisoned runs: one request's V written, the rest as
built), so that a part of the work that reads none of those bytes is computed once, not per run.

A unit is a piece of the emulation computed on its own, always the same way: one chunk of groups of
the grouped kernel (emulate.grouped_forward_many), one batch of the reference and XQA rows
(reference.every_row: a row, or every row where the batch is small), the remainder rows' XQA run.
Its output is a function of the tokens it reads, q, the scales and its plan; when a case's cache
equals the base's at every token the unit reads (both planes, every byte), q and the scales equal
the base's and the unit's plan tensors (its `signature`) are those it was first computed with, the
unit gives the base's output bit for bit, and it is taken from here. Else it is computed again.

    units = CleanUnits(base)                       # kept in run_routes_planned's memo["units"]
    units.bind(poisoned)                           # which tokens differ from the base
    out = units(key, tokens, compute, signature)   # compute() unless kept and reading no changed token
                                                   # (planes=(0,): a part that reads K only)
"""
from __future__ import annotations

import torch


class CleanUnits:
    """Unit outputs of `base`'s cache (see the module): bind a case, then call with each unit."""

    def __init__(self, base):
        self.base = base
        self.kept = {}            # key -> (signature, output)
        self.changed = None       # planes -> [tokens + 1] bool: the token's bytes differ from the base's there
        self.computed = self.reused = 0

    def bind(self, case) -> "CleanUnits":
        """Compare `case`'s cache with the base's: the tokens whose bytes differ. ValueError when the
        case differs in anything else a unit reads (q, the scales, the cache's shape or dtype)."""
        base = self.base
        if (case.kv_cache.shape != base.kv_cache.shape or case.kv_cache.dtype != base.kv_cache.dtype
                or case.k_scale != base.k_scale or case.v_scale != base.v_scale or case.kv_dtype != base.kv_dtype
                or case.q.shape != base.q.shape or not torch.equal(case.q.view(torch.int16), base.q.view(torch.int16))):
            raise ValueError("case: differs from the clean units' base in more than the cache's bytes")
        pages, _, ps = case.kv_cache.shape[:3]
        a = case.kv_cache.view(torch.uint8).reshape(pages, 2, ps, -1)
        b = base.kv_cache.view(torch.uint8).reshape(pages, 2, ps, -1)
        differ = (a != b).any(dim=-1).transpose(1, 2).reshape(-1, 2).cpu()   # [pages * ps, 2]
        differ = torch.cat([differ, differ.new_zeros(1, 2)])                # the decode's zero row: never written
        self.changed = {(0, 1): differ.any(dim=1), (0,): differ[:, 0].contiguous(), (1,): differ[:, 1].contiguous()}
        return self

    def __call__(self, key, tokens: torch.Tensor, compute, signature=(), planes=(0, 1)):
        """The unit's output: the kept one when the bound case's bytes equal the base's at every
        token in `tokens` (physical token ids) on `planes` (0 K, 1 V: those the unit reads) and
        `signature` (tensors) equals the kept unit's; else compute(), kept when it read no changed
        token."""
        if self.changed is None:
            raise RuntimeError("CleanUnits: bind(case) before running a unit")
        changed = self.changed[tuple(sorted(set(planes)))]
        if bool(changed.any()) and bool(changed.index_select(0, tokens.reshape(-1).cpu().long()).any()):
            self.computed += 1
            return compute()
        hit = self.kept.get(key)
        if hit is not None and len(hit[0]) == len(signature) and all(
                x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(hit[0], signature)):
            self.reused += 1
            return hit[1]
        self.computed += 1
        out = compute()
        self.kept[key] = (tuple(s.clone() for s in signature), out)
        return out

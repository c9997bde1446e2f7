"""Where a paged-attention call's unattended bytes are.

A call reads the pool through each request's block table; a query row attends only the
tokens of its selected blocks and its tail (`plan.xqa_tokens`). Every other byte of the
pool is unattended, and whatever a kernel reads there must not reach its output. The
regions below split the unattended bytes by why they exist; each is a set of token slots
`[pages, page_size]` bool, the same on the K and V planes:

    null-block        page 0: padding entries of plans and block tables point here
    stale-tail        slots at or past seq_len in a request's last page (never written)
    stale-microblock  the stale slots inside a request's last partial 4-token microblock:
                      the part of stale-tail that a microblock-granular route reads
    free-pages        pages (not page 0) that no request's block table references
    unselected        written slots of a request (before seq_len) that no row attends
    attended          the complement: slots some row attends (not a canary region)

Poison sites (qsa_lab.poison) and the canary (qsa_lab.canary) both write through this
one model.
"""
from __future__ import annotations

import dataclasses

import torch

from .case import Case
from .plan import INT64_MAX, xqa_tokens

REGIONS = ("null-block", "stale-tail", "stale-microblock", "free-pages", "unselected")
ALL_REGIONS = REGIONS + ("attended",)


def check_region(region: str) -> None:
    if region not in ALL_REGIONS:
        raise ValueError(f"region must be one of {ALL_REGIONS}, got {region!r}")


def _pool(case: Case) -> tuple[int, int]:
    return case.kv_cache.shape[0], case.geometry.page_size


def attended_slots(case: Case) -> torch.Tensor:
    """[pages, page_size] bool: slots that at least one query row attends."""
    pages, ps = _pool(case)
    tok, _ = xqa_tokens(case.to("cpu"))
    out = torch.zeros(pages * ps, dtype=torch.bool)
    out[tok[tok != INT64_MAX]] = True
    return out.view(pages, ps)


def _request_slots(case: Case, r: int, start: int, stop: int) -> list[tuple[int, int]]:
    """(physical page, slot) of logical positions start..stop-1 of request r."""
    ps = case.geometry.page_size
    bt = case.block_table.cpu()
    return [(int(bt[r, pos // ps]), pos % ps) for pos in range(start, stop)]


def _written(case: Case) -> torch.Tensor:
    """[pages, page_size] bool: slots holding a request's tokens (positions < seq_len)."""
    out = torch.zeros(_pool(case), dtype=torch.bool)
    for r, s in enumerate(case.seq_lens.tolist()):
        for page, slot in _request_slots(case, r, 0, s):
            out[page, slot] = True
    return out


def stale_slots(case: Case, region: str = "stale-tail") -> list[tuple[int, int]]:
    """(physical page, slot) of the never-written slots, request by request: positions
    seq_len .. the end of the last page ("stale-tail") or of the last microblock ("stale-microblock")."""
    ps = case.geometry.page_size
    out = []
    for r, s in enumerate(case.seq_lens.tolist()):
        stop = -(-s // ps) * ps if region == "stale-tail" else -(-s // 4) * 4
        out += _request_slots(case, r, s, stop)
    return out


def referenced_pages(case: Case) -> torch.Tensor:
    """[pages] bool: pages some request's block table maps (its first ceil(seq_len / page_size))."""
    pages, ps = _pool(case)
    out = torch.zeros(pages, dtype=torch.bool)
    for r, s in enumerate(case.seq_lens.tolist()):
        out[case.block_table[r, :-(-s // ps)].long().cpu()] = True
    return out


def region_slots(case: Case, region: str) -> torch.Tensor:
    """[pages, page_size] bool: the token slots of `region` in this case's pool."""
    check_region(region)
    pages, ps = _pool(case)
    out = torch.zeros(pages, ps, dtype=torch.bool)
    if region == "null-block":
        out[0] = True
    elif region in ("stale-tail", "stale-microblock"):
        for page, slot in stale_slots(case, region):
            out[page, slot] = True
    elif region == "free-pages":
        free = ~referenced_pages(case)
        free[0] = False  # page 0 is its own region
        out[free] = True
    elif region == "unselected":
        out = _written(case) & ~attended_slots(case)
    else:  # attended
        out = attended_slots(case)
    return out


def region_sizes(case: Case, regions=REGIONS) -> dict:
    """Slots per region (a region may be empty in a given case)."""
    return {r: int(region_slots(case, r).sum()) for r in regions}


def with_free_pages(case: Case, n: int) -> Case:
    """A copy of `case` whose pool has `n` more pages that no block table references
    (freed pages, or pages a hybrid model's other state owns), zero-filled."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"free_pages must be an int >= 0, got {n!r}")
    kv = case.kv_cache
    spare = torch.zeros((n,) + tuple(kv.shape[1:]), dtype=kv.dtype, device=kv.device)
    return dataclasses.replace(case, kv_cache=torch.cat([kv, spare]).contiguous(), poison=dict(case.poison))

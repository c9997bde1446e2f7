"""The grouped page4 planner, its pad_fix (B), and XQA's token lists.

Everything is torch ops on the case's device. Shapes:
    attended microblocks per row: microblock [rows, topk+1] int64 (-1 unused),
                                  nibble [rows, topk+1] int64 (token bits 0..3)
    GroupedPlan.microblocks [groups, cap] int32, masks [groups, cap] int32,
                categories [groups, cap] int32, seq_len [groups] int32,
                members [groups, 8] int64: the row of each query slot (EMPTY_ROW: an empty
                query slot of a padded group), xqa_rows [n] int64
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from qsa_lab.model.case import Case
from qsa_lab.model.geometry import Geometry
from qsa_lab.model.paged import visible_tokens

GROUP = 8            # query rows per CTA
TILE_ENTRIES = 8     # microblocks per 32-token tile
INT64_MAX = torch.iinfo(torch.int64).max
TOKEN_BITS = 0x11111111  # token t of every query is TOKEN_BITS << t
OWNER_NONE = 1 << 32     # above every (query << 29) | logical block
EMPTY_ROW = -1           # a query slot of a padded group that holds no row (upstream: token_to_req < 0)
#: request-aligned groups: a request's remainder of at least this many rows (fewer than 8) runs as one
#: padded group (its empty query slots EMPTY_ROW), a shorter one through XQA. GROUP = never: every
#: remainder goes to XQA, as upstream's request-aligned split does. Chosen by measured cost
#: (the complete-fix stage of benchmarks/gpu_check.sh, `remainder` in its JSON: XQA or a padded group per remainder size).
REMAINDER_GROUP_MIN = GROUP


@dataclass
class GroupedPlan:
    members: torch.Tensor      # [groups, 8] the rows each group holds (the kernels' group_rows argument)
    xqa_rows: torch.Tensor
    microblocks: torch.Tensor
    masks: torch.Tensor
    categories: torch.Tensor
    seq_len: torch.Tensor
    q_heads: int

    def to(self, device) -> "GroupedPlan":
        return replace(self, **{k: v.to(device) for k, v in vars(self).items() if torch.is_tensor(v)})

    @property
    def groups(self) -> int:
        return self.members.shape[0]

    @property
    def cap(self) -> int:
        return self.microblocks.shape[1]

    @property
    def m_tiles(self) -> int:
        return m_tiles(self.q_heads)

    @property
    def entries(self) -> torch.Tensor:
        """[groups] int64 entries incl. padding (seq_len // 4)."""
        return self.seq_len.long() // 4

    def in_plan(self) -> torch.Tensor:
        """[groups, cap] bool: slot lies inside the group's seq_len."""
        return torch.arange(self.cap, device=self.seq_len.device) < self.entries.unsqueeze(1)

    def padding(self) -> torch.Tensor:
        """[groups, cap] bool: a padding entry (mask 0) inside seq_len."""
        return self.in_plan() & (self.masks == 0)


def m_tiles(q_heads: int) -> int:
    return -(-GROUP * q_heads // 16)


def query_m_tile_bits(q_heads: int, device=None) -> torch.Tensor:
    """[8] int64: M-tiles query q touches, as bits: (6q)//16 and (6q+5)//16 for q_heads 6."""
    q = torch.arange(GROUP, device=device)
    return (1 << (q * q_heads // 16)) | (1 << ((q * q_heads + q_heads - 1) // 16))


def mask_m_tile_bits(masks: torch.Tensor, q_heads: int) -> torch.Tensor:
    """OR of the M-tiles touched by the queries present in each 32-bit mask (any shape)."""
    m = masks.long() & 0xFFFFFFFF
    present = ((m.unsqueeze(-1) >> (4 * torch.arange(GROUP, device=m.device))) & 0xF) != 0
    bits = query_m_tile_bits(q_heads, m.device)
    out = torch.zeros_like(m)
    for q in range(GROUP):  # 8 vector ops: OR has no scatter-reduce in torch
        out = out | torch.where(present[..., q], bits[q], 0)
    return out


def attended_microblocks(case: Case, rows: torch.Tensor | None = None):
    """What each row attends, as (microblock [n, topk+1], nibble [n, topk+1]), -1/0 where unused.

    Columns 0..topk-1 are the first `complete` selected blocks (all 4 tokens);
    column topk is the tail: tokens 4*(visible//4) .. visible-1 of the block the row sits in.
    """
    mb, nibble, _ = _attended(case, rows)
    return mb, nibble


def _attended(case: Case, rows: torch.Tensor | None = None):
    """attended_microblocks plus each column's logical 4-token block id [n, topk+1]."""
    g = case.geometry
    rows = torch.arange(g.rows, device=case.device) if rows is None else rows.to(case.device)
    visible = visible_tokens(case)[rows]
    complete = torch.clamp(visible // 4, max=g.topk)
    sel = case.selected[rows].long()
    used = (torch.arange(g.topk, device=case.device) < complete.unsqueeze(1)) & (sel >= 0)
    tail_block = visible // 4
    tail_bits = (1 << (visible % 4)) - 1
    blocks = torch.cat([torch.where(used, sel, 0), tail_block.unsqueeze(1)], dim=1)
    nibble = torch.cat([used.long() * 0xF, tail_bits.unsqueeze(1)], dim=1)
    req = case.token_to_req[rows].long()
    tok = blocks * 4
    page = case.block_table.long()[req.unsqueeze(1), (tok // g.page_size).clamp(max=case.block_table.shape[1] - 1)]
    mb = page * (g.page_size // 4) + (tok % g.page_size) // 4
    mb = torch.where(nibble != 0, mb, -1)
    return mb, nibble, blocks


def _check_case(case) -> None:
    if not isinstance(getattr(case, "geometry", None), Geometry):
        raise TypeError(f"case: expected a qsa_lab Case (qsa_lab.build_case), got {type(case).__name__}")


def form_groups(case: Case, group_rows: str | None = None, remainder_group_min: int = REMAINDER_GROUP_MIN):
    """Split rows into grouped (groups of 8) and XQA remainder rows, as `group_rows` says (default the
    geometry's).

    consecutive: the first rows//8*8 rows in order, as upstream's host route hands them to the
    grouped kernel (a group may hold rows of several requests); request: 8 consecutive rows of
    one request, so no group spans requests; each request's remainder (fewer than 8 rows) to
    XQA, or, when it has at least `remainder_group_min` rows, to one padded group whose empty
    query slots are EMPTY_ROW. Groups in row order.
    Returns (members [groups, 8] int64, xqa_rows [n] int64).
    """
    _check_case(case)
    group_rows = group_rows or case.geometry.group_rows
    n = case.geometry.rows
    if group_rows == "consecutive":
        idx = torch.arange(n // GROUP * GROUP).view(-1, GROUP)
        rest = torch.arange(n // GROUP * GROUP, n)
    elif group_rows == "request":
        if not isinstance(remainder_group_min, int) or not 1 <= remainder_group_min <= GROUP:
            raise ValueError(f"remainder_group_min: must be an int in 1..{GROUP}, got {remainder_group_min!r}")
        req = case.token_to_req.cpu().long()    # non-decreasing: each request's rows together
        start = torch.searchsorted(req, torch.arange(case.geometry.requests))
        rank = torch.arange(n) - start[req]
        count = torch.bincount(req, minlength=case.geometry.requests)
        rem = count % GROUP
        grouped = (rank < (count - rem)[req]) | (rem >= remainder_group_min)[req]
        slot = rank % GROUP
        first = grouped & (slot == 0)                       # the first row of each group
        gid = torch.cumsum(first.long(), 0) - 1
        idx = torch.full((int(first.sum()), GROUP), EMPTY_ROW, dtype=torch.long)
        idx[gid[grouped], slot[grouped]] = torch.nonzero(grouped).flatten()
        rest = torch.nonzero(~grouped).flatten()
    else:
        raise ValueError(f"group_rows: must be 'consecutive' or 'request', got {group_rows!r}")
    return idx.to(case.device), rest.to(case.device)


def plan_groups(case: Case, group_rows: str | None = None, remainder_group_min: int = REMAINDER_GROUP_MIN
                ) -> GroupedPlan:
    """The grouped planner: union, masks, categories, sort, per-category null padding.
    group_rows ('consecutive' | 'request'; default the geometry's), remainder_group_min: how rows
    form groups (form_groups)."""
    _check_case(case)
    g = case.geometry
    dev = case.device
    grows, xrows = form_groups(case, group_rows, remainder_group_min)
    G = grows.shape[0]
    nmt = m_tiles(g.q_heads)
    if G == 0:
        empty = torch.zeros((0, 0), dtype=torch.int32, device=dev)
        return GroupedPlan(grows, xrows, empty, empty, empty, torch.zeros(0, dtype=torch.int32, device=dev),
                           g.q_heads)
    mb, nib, logical = _attended(case, grows.flatten().clamp(min=0))  # [G*8, K]
    empty = (grows.flatten() == EMPTY_ROW).unsqueeze(1)                  # an empty slot attends nothing
    mb = mb.masked_fill(empty, -1)
    K = mb.shape[1]
    gid = torch.arange(G, device=dev).repeat_interleave(GROUP * K)
    query = torch.arange(GROUP, device=dev).repeat_interleave(K).repeat(G)
    mb, nib, logical = mb.flatten(), nib.flatten(), logical.flatten()
    keep = mb >= 0
    gid, query, mb, nib, logical = gid[keep], query[keep], mb[keep], nib[keep], logical[keep]
    # 1-2. union per group, one 32-bit mask per microblock (bits of distinct queries never overlap)
    n_mb = case.kv_cache.shape[0] * (g.page_size // 4)
    keys, inv = torch.unique(gid * n_mb + mb, return_inverse=True)
    masks = torch.zeros(keys.numel(), dtype=torch.int64, device=dev).scatter_add_(0, inv, nib << (4 * query))
    # owner as upstream: the smallest (query << 29) | logical block among the contributors, so
    # the order depends on who attends a microblock, never on where its page was allocated
    owner = torch.full((keys.numel(),), OWNER_NONE, dtype=torch.int64, device=dev).scatter_reduce_(
        0, inv, (query << 29) | logical, reduce="amin")
    egroup, emb = keys // n_mb, keys % n_mb
    # 3. category: OR of the M-tiles its queries touch
    cat = mask_m_tile_bits(masks, g.q_heads)
    # 4. sort by (group, category, owner), categories ascending; owners are unique in a group
    # (one query's logical block names one microblock), so the order is total
    order = torch.argsort((egroup << 40) | (cat << 32) | owner)
    egroup, emb, masks, cat = egroup[order], emb[order], masks[order], cat[order]
    # pad each (group, category) up to a multiple of 8 entries with the null entry (0, 0)
    n_cat = 1 << nmt
    seg = egroup * n_cat + cat
    counts = torch.bincount(seg, minlength=G * n_cat).view(G, n_cat)
    padded = (counts + TILE_ENTRIES - 1) // TILE_ENTRIES * TILE_ENTRIES
    offsets = torch.cumsum(padded, dim=1) - padded                    # exclusive, per group
    seg_start = torch.cumsum(counts.flatten(), 0) - counts.flatten()
    rank = torch.arange(seg.numel(), device=dev) - seg_start[seg]
    slot = offsets.flatten()[seg] + rank
    entries = padded.sum(dim=1)
    cap = int(entries.max())
    out_mb = torch.zeros((G, cap), dtype=torch.int64, device=dev)
    out_mask = torch.zeros((G, cap), dtype=torch.int64, device=dev)
    out_mb[egroup, slot] = emb
    out_mask[egroup, slot] = masks
    # category of every slot, padding included (0 past the group's entries)
    col = torch.arange(cap, device=dev)
    ends = torch.cumsum(padded, dim=1)                                  # [G, n_cat]
    slot_cat = torch.searchsorted(ends, col.expand(G, cap).contiguous(), right=True)
    slot_cat = torch.where(col < entries.unsqueeze(1), slot_cat, 0)
    return GroupedPlan(grows, xrows, out_mb.to(torch.int32), as_int32_mask(out_mask), slot_cat.to(torch.int32),
                       (entries * 4).to(torch.int32), g.q_heads)


def pad_fix(plan: GroupedPlan) -> GroupedPlan:
    """pad_fix (B): repoint every mask == 0 entry at the group's first real microblock (column 0).

    torch.where + copy_ only: no host synchronisation, so it can be captured in a CUDA graph.
    Real entries always carry a nonzero mask, so they are untouched.
    """
    if not isinstance(plan, GroupedPlan):
        raise TypeError(f"plan: expected a GroupedPlan (qsa_lab.plan_groups(case)), got {type(plan).__name__}")
    fixed = plan.microblocks.clone()
    fixed.copy_(torch.where(plan.masks == 0, plan.microblocks[:, :1], plan.microblocks))
    return replace(plan, microblocks=fixed)


def xqa_tokens(case: Case, rows: torch.Tensor | None = None):
    """XQA's view of rows: token_index [n, T] int64 physical tokens (page*page_size + token)
    in logical token order (so the tail comes last), unused slots INT64_MAX (sorted last);
    token_count [n] int32.

    Upstream sorts by logical token, not by physical page, so the row's reduction order does
    not depend on where its pages were allocated.
    """
    mb, nib, blocks = _attended(case, rows)
    t = torch.arange(4, device=mb.device)
    tok = (mb.unsqueeze(-1) * 4 + t).flatten(1)
    logical = (blocks.unsqueeze(-1) * 4 + t).flatten(1)
    valid = (((nib.unsqueeze(-1) >> t) & 1) != 0).flatten(1)
    order = torch.where(valid, logical, INT64_MAX).sort(dim=1).indices
    tok = torch.where(valid, tok, INT64_MAX).gather(1, order)
    count = valid.sum(dim=1)
    width = max(int(count.max()) if count.numel() else 0, 1)
    return tok[:, :width].contiguous(), count.to(torch.int32)


def as_int32_mask(mask: torch.Tensor) -> torch.Tensor:
    """32-bit mask words held in int64 (0..2^32-1) -> their int32 view."""
    return torch.where(mask >= 2**31, mask - 2**32, mask).to(torch.int32)


def tile_active_m_tiles(masks: torch.Tensor, seq_len: torch.Tensor, q_heads: int) -> torch.Tensor:
    """[groups, cap] masks -> [groups, tiles] int64 bits of the M-tiles each 32-token tile
    activates: those touched by any query in the OR of its 8 masks; 0 past seq_len (never walked)."""
    G, cap = masks.shape
    m = masks.long().view(G, cap // TILE_ENTRIES, TILE_ENTRIES) & 0xFFFFFFFF
    tile_or = m[:, :, 0]
    for e in range(1, TILE_ENTRIES):
        tile_or = tile_or | m[:, :, e]
    walked = torch.arange(cap // TILE_ENTRIES, device=masks.device) < (seq_len.long() // 32).unsqueeze(1)
    return torch.where(walked, mask_m_tile_bits(tile_or, q_heads), 0)


def unattended_tokens(masks: torch.Tensor) -> torch.Tensor:
    """[..., entries] int32 masks -> [..., entries, 4] bool: token no query attends."""
    t = torch.arange(4, device=masks.device)
    return ((masks.long().unsqueeze(-1) & 0xFFFFFFFF) & (TOKEN_BITS << t)) == 0

"""What a paged-attention call attends, and where its unattended bytes are.

A call reads the pool through each request's block table. Which tokens each query row
attends is the case's attention spec (`AttentionSpec`):

    dense            causal by position: every token of the row's request up to its position
    window:W         the last W tokens up to the row's position (itself included)
    window:W,sink:S  ... plus the request's first S tokens
    sparse           the row's selected 4-token blocks plus its tail (the partial block it
                     sits in): qsa_lab's QSA semantics, the default of the qsa routes
    mask             an explicit bool mask [rows, tokens] over the logical positions of the
                     row's request (Python API only)

`attended_tokens(case)` is the one definition of "attended"; every region below is derived
from it as bytes the call can reach but no row attends, each a set of token slots
`[pages, page_size]` bool, the same on the K and V planes:

    null-block        page 0: padding entries of plans and block tables point here
    stale-tail        slots at or past seq_len in a request's last page (never written)
    stale-microblock  the stale slots inside a request's last partial 4-token microblock:
                      the part of stale-tail that a microblock-granular route reads
    free-pages        pages (not page 0) that no request's block table references
    other-requests    for each request, the pages the block table gives to OTHER requests:
                      reachable (a wrong block-table row, an off-by-one in a request's page
                      offset, reading past its last page) but never attended by its rows.
                      Judged part by part (`region_parts`): poison other requests' pages and
                      compare only the rows of the requests under test; `region_slots` gives
                      the union of the parts (every page a request uses, when there are two)
    other-rows        (opt-in: run only when named) the per-row rule: for each row, the slots that
                      OTHER rows attend and it does not, poisoned and judged on that row alone. The
                      other regions hold bytes no row (or no row of a request) attends; this one finds
                      a kernel that lets one row's legitimate value reach a neighbour row: within a
                      request (row p multiplying a V that only row p+1 attends) and across requests.
                      One part per row (`region_parts`), so it costs a call per row
    unselected        sparse: written slots (before seq_len) that no row's selection covers
    out-of-window     window: written slots outside every row's window and sink
    masked            mask: written slots that no row's mask attends
    attended          the complement: slots some row attends (not a canary region)

A dense spec has no in-range unattended token: every written slot is attended by the
request's last row. Poison sites (qsa_lab.model.poison), the analysis and the canary
(qsa_lab.canary) all use this one model. A case is a view of the paged record
(qsa_lab.model.paged: Case, CanaryCase, PagedCall) and optionally has a `spec` (default sparse).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

import torch

from qsa_lab.model.paged import visible_tokens

KINDS = ("dense", "window", "sparse", "mask")
#: spec kind -> its in-range unattended region (dense has none)
IN_RANGE = {"dense": None, "window": "out-of-window", "sparse": "unselected", "mask": "masked"}
OUT_OF_RANGE = ("null-block", "stale-tail", "stale-microblock", "free-pages", "other-requests")
#: regions a run includes only when they are named (not among a spec's default regions)
OPT_IN = ("other-rows",)
REGIONS = OUT_OF_RANGE + OPT_IN + ("unselected", "out-of-window", "masked")
ALL_REGIONS = REGIONS + ("attended",)
MICROBLOCK = 4


@dataclass(frozen=True)
class AttentionSpec:
    """What each query row attends. kind: dense | window | sparse | mask. window: tokens a
    row sees back from its own position, itself included (kind window). sink: the request's
    first tokens, always attended (kind window). mask: [rows, tokens] bool over the logical
    positions of the row's request (kind mask)."""

    kind: str = "sparse"
    window: int | None = None
    sink: int = 0
    mask: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"attend: kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("window", "sink"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"attend: {name} must be an int >= 0, got {v!r}")
        if self.kind == "window":
            if self.window is None or self.window < 1:
                raise ValueError(f"attend: a window spec needs window >= 1, got {self.window!r}")
        elif self.window is not None or self.sink:
            raise ValueError(f"attend: window and sink belong to kind 'window', not {self.kind!r}")
        if self.kind == "mask":
            m = self.mask
            if not isinstance(m, torch.Tensor) or m.dtype != torch.bool or m.dim() != 2:
                raise ValueError("attend: a mask spec needs mask = a [rows, tokens] bool tensor, got "
                                 + (f"{list(m.shape)} {m.dtype}" if isinstance(m, torch.Tensor) else repr(m)))
        elif self.mask is not None:
            raise ValueError(f"attend: mask belongs to kind 'mask', not {self.kind!r}")

    @classmethod
    def parse(cls, text) -> "AttentionSpec":
        """'dense' | 'sparse' | 'window:W' | 'window:W,sink:S' (an AttentionSpec passes through)."""
        if isinstance(text, AttentionSpec):
            return text
        if not isinstance(text, str):
            raise TypeError(f"attend: expected 'dense', 'sparse', 'window:W[,sink:S]' or an AttentionSpec, "
                            f"got {type(text).__name__}")
        t = text.strip().replace(" ", "")
        if t in ("dense", "sparse"):
            return cls(t)
        m = re.fullmatch(r"window:([0-9]{1,9})(?:,sink:([0-9]{1,9}))?", t)
        if not m:
            raise ValueError(f"attend: expected dense, sparse, window:W or window:W,sink:S, got {text!r}")
        return cls("window", window=int(m.group(1)), sink=int(m.group(2) or 0))

    def __str__(self) -> str:
        if self.kind == "window":
            return f"window:{self.window}" + (f",sink:{self.sink}" if self.sink else "")
        if self.kind == "mask":
            return f"mask[{self.mask.shape[0]}x{self.mask.shape[1]}]"
        return self.kind

    @property
    def in_range_region(self) -> str | None:
        """The region of written tokens this spec leaves unattended (None for dense)."""
        return IN_RANGE[self.kind]


SPARSE = AttentionSpec("sparse")


def spec_of(case) -> AttentionSpec:
    return getattr(case, "spec", None) or SPARSE


def regions_of(spec: AttentionSpec) -> tuple:
    """The canary regions of a spec (a run's default): those outside any request's range plus its
    in-range one. The OPT_IN regions join when named."""
    return OUT_OF_RANGE + ((spec.in_range_region,) if spec.in_range_region else ())


def check_region(region: str, spec: AttentionSpec | None = None) -> None:
    if region not in ALL_REGIONS:
        raise ValueError(f"region must be one of {ALL_REGIONS}, got {region!r}")
    if spec is not None and region in REGIONS and region not in regions_of(spec) + OPT_IN:
        owner = next(k for k, r in IN_RANGE.items() if r == region)
        raise ValueError(f"region {region!r} belongs to a {owner} spec; this case attends {spec} "
                         f"(its regions: {', '.join(regions_of(spec))})")


def _page_size(case) -> int:
    return int(case.kv_cache.shape[2])


def _pool(case) -> tuple[int, int]:
    return int(case.kv_cache.shape[0]), _page_size(case)


def max_tokens(case) -> int:
    """Logical positions a row's block table can address: max_pages * page_size."""
    return int(case.block_table.shape[1]) * _page_size(case)


def physical_tokens(case) -> torch.Tensor:
    """[requests, max_tokens] int64 (CPU): physical token id (page * page_size + slot) of each
    logical position of each request, through its block table (padding entries: page 0)."""
    ps = _page_size(case)
    bt = case.block_table.detach().cpu().long()
    return (bt.unsqueeze(-1) * ps + torch.arange(ps)).flatten(1)


def attended_tokens(case) -> torch.Tensor:
    """[rows, max_tokens] bool (CPU) over the logical positions of each row's request: what
    the row attends under the case's spec (`case.spec`, default sparse). The single
    definition of "attended": the regions and the canary's reference kernels derive from it."""
    spec = spec_of(case)
    T = max_tokens(case)
    req = case.token_to_req.detach().cpu().long()
    pos = case.positions.detach().cpu().long().unsqueeze(1)
    seq = case.seq_lens.detach().cpu().long()[req].unsqueeze(1)
    t = torch.arange(T).unsqueeze(0)
    written = t < seq
    if spec.kind == "dense":
        return written & (t <= pos)
    if spec.kind == "window":
        return written & (t <= pos) & ((t > pos - spec.window) | (t < spec.sink))
    if spec.kind == "mask":
        m = spec.mask.detach().cpu()
        rows = req.numel()
        if m.shape[0] != rows:
            raise ValueError(f"attend: mask has {m.shape[0]} rows, the case has {rows}")
        if m.shape[1] > T and m[:, T:].any():
            raise ValueError(f"attend: mask attends positions >= max_pages * page_size ({T})")
        out = torch.zeros(rows, T, dtype=torch.bool)
        out[:, :min(T, m.shape[1])] = m[:, :T]
        beyond = out & ~written
        if beyond.any():
            r, p = torch.nonzero(beyond)[0].tolist()
            raise ValueError(f"attend: mask row {r} attends position {p}, at or past its request's seq_len "
                             f"{int(seq[r])}")
        return out
    # sparse: selected complete 4-token blocks plus the tail, as qsa_lab.model.plan's XQA token lists
    visible = visible_tokens(case).cpu().unsqueeze(1)
    sel = case.selected.detach().cpu().long()
    blocks = -(-T // MICROBLOCK) + 1
    chosen = torch.zeros(req.numel(), blocks, dtype=torch.bool)
    if sel.numel():
        ok = (sel >= 0) & (torch.arange(sel.shape[1]) < (visible // MICROBLOCK).clamp(max=sel.shape[1]))
        chosen.scatter_(1, torch.where(ok, sel, blocks - 1), ok)
    chosen[:, -1] = False
    by_block = chosen[:, :blocks - 1].repeat_interleave(MICROBLOCK, dim=1)[:, :T]
    tail = (t >= visible // MICROBLOCK * MICROBLOCK) & (t < visible)
    return (by_block | tail) & written


def _slots(case, tokens: torch.Tensor) -> torch.Tensor:
    """Physical token ids (any shape, -1 ignored) -> [pages, page_size] bool."""
    pages, ps = _pool(case)
    out = torch.zeros(pages * ps, dtype=torch.bool)
    tokens = tokens[tokens >= 0]
    out[tokens] = True
    return out.view(pages, ps)


def attended_slots(case, rows: torch.Tensor | None = None) -> torch.Tensor:
    """[pages, page_size] bool: slots that at least one query row attends (of `rows`, a [rows]
    bool mask, when given)."""
    phys = physical_tokens(case)[case.token_to_req.detach().cpu().long()]
    att = attended_tokens(case)
    if rows is not None:
        att = att & rows.cpu().view(-1, 1)
    return _slots(case, torch.where(att, phys, -1))


def _request_positions(case, start: torch.Tensor, stop: torch.Tensor) -> torch.Tensor:
    """[pages, page_size] bool: the slots of logical positions start[r] .. stop[r]-1 of each request."""
    t = torch.arange(max_tokens(case)).unsqueeze(0)
    keep = (t >= start.unsqueeze(1)) & (t < stop.unsqueeze(1))
    return _slots(case, torch.where(keep, physical_tokens(case), -1))


def _seq(case) -> torch.Tensor:
    return case.seq_lens.detach().cpu().long()


def _written(case) -> torch.Tensor:
    """[pages, page_size] bool: slots holding a request's tokens (positions < seq_len)."""
    seq = _seq(case)
    return _request_positions(case, torch.zeros_like(seq), seq)


def _stale_stop(case, region: str) -> torch.Tensor:
    ps, seq = _page_size(case), _seq(case)
    page_end = -(-seq // ps) * ps
    return page_end if region == "stale-tail" else torch.minimum(-(-seq // MICROBLOCK) * MICROBLOCK, page_end)


def stale_slots(case, region: str = "stale-tail") -> list[tuple[int, int]]:
    """(physical page, slot) of the never-written slots, request by request: positions
    seq_len .. the end of the last page ("stale-tail") or of the last microblock ("stale-microblock")."""
    ps = _page_size(case)
    phys = physical_tokens(case)
    out = []
    for r, (s, stop) in enumerate(zip(_seq(case).tolist(), _stale_stop(case, region).tolist())):
        out += [(int(phys[r, p]) // ps, int(phys[r, p]) % ps) for p in range(s, stop)]
    return out


def used_pages(case) -> torch.Tensor:
    """[requests] int64: pages each request uses, ceil(seq_len / page_size)."""
    return -(-_seq(case) // _page_size(case))


def referenced_pages(case) -> torch.Tensor:
    """[pages] bool: pages some request's block table maps (its first ceil(seq_len / page_size))."""
    pages, _ = _pool(case)
    bt = case.block_table.detach().cpu().long()
    used = torch.arange(bt.shape[1]).unsqueeze(0) < used_pages(case).unsqueeze(1)
    out = torch.zeros(pages, dtype=torch.bool)
    out[bt[used]] = True
    return out


def has_padding_entries(case) -> bool:
    """Whether some block-table entry lies past its request's last page (and so points at page 0)."""
    return bool((used_pages(case) < case.block_table.shape[1]).any())


def region_slots(case, region: str) -> torch.Tensor:
    """[pages, page_size] bool: the token slots of `region` in this case's pool."""
    spec = spec_of(case)
    check_region(region, spec)
    pages, ps = _pool(case)
    out = torch.zeros(pages, ps, dtype=torch.bool)
    if region == "null-block":
        out[0] = True
    elif region in ("stale-tail", "stale-microblock"):
        out = _request_positions(case, _seq(case), _stale_stop(case, region))
    elif region == "free-pages":
        free = ~referenced_pages(case)
        free[0] = False  # page 0 is its own region
        out[free] = True
    elif region in ("other-requests", "other-rows"):
        for slots, _ in region_parts(case, region):
            out |= slots
    elif region == "attended":
        out = attended_slots(case)
    else:  # the spec's in-range unattended tokens
        out = _written(case) & ~attended_slots(case)
    return out


def request_pages(case) -> torch.Tensor:
    """[requests, pages] bool: the pages each request's block table maps (its used entries)."""
    pages, _ = _pool(case)
    bt = case.block_table.detach().cpu().long()
    used = torch.arange(bt.shape[1]).unsqueeze(0) < used_pages(case).unsqueeze(1)
    out = torch.zeros(bt.shape[0], pages, dtype=torch.bool)
    out.scatter_(1, torch.where(used, bt, 0), used)   # padding entries scatter False onto page 0
    return out


def _request_splits(n: int) -> list:
    """Pairs (judged, poisoned) of request-id sets such that every ordered pair r != s has a
    split judging r while poisoning s: one split per request up to 4 requests, else two per
    bit of the request id (2 * ceil(log2 n) splits instead of n)."""
    ids = range(n)
    if n <= 4:
        return [({r}, set(ids) - {r}) for r in ids]
    out = []
    for b in range((n - 1).bit_length()):
        side = {r for r in ids if r >> b & 1}
        out += [(side, set(ids) - side), (set(ids) - side, side)]
    return out


def region_parts(case, region: str) -> list:
    """[(slots [pages, page_size] bool, rows [rows] bool or None)]: how the canary poisons and
    judges `region`. Every region is one part judged on every row (rows None) except
    other-requests: per split, the pages of the poisoned requests (none a judged request also
    maps, never page 0) judged on the rows of the judged requests only; and other-rows: per row,
    the slots other rows attend and it does not, judged on that row only (rows with no such
    slot have no part)."""
    if region == "other-rows":
        check_region(region, spec_of(case))
        rows = case.token_to_req.shape[0]
        everyone = attended_slots(case)
        out = []
        for r in range(rows):
            me = torch.arange(rows) == r
            slots = everyone & ~attended_slots(case, me)
            if slots.any():
                out.append((slots, me))
        return out
    if region != "other-requests":
        return [(region_slots(case, region), None)]
    check_region(region, spec_of(case))
    pages, ps = _pool(case)
    maps = request_pages(case)
    req = case.token_to_req.detach().cpu().long()
    out = []
    for judged, poisoned in _request_splits(maps.shape[0]):
        page = maps[sorted(poisoned)].any(0) & ~maps[sorted(judged)].any(0)
        page[0] = False
        if page.any():
            rows = torch.isin(req, torch.tensor(sorted(judged)))
            out.append((page.unsqueeze(1).expand(pages, ps).clone(), rows))
    return out


def region_referenced(case, region: str, reads: str = "block_table") -> bool:
    """Whether the call's inputs reference any byte of `region`, for a kernel that reads the
    pool through `reads`: "block_table" (page 0 through its padding entries), "page_table"
    (only each request's used pages: never page 0) or "padded_plan" (tables of its own padded
    with page 0, as qsa_lab's grouped plan: always page 0). The stale slots are referenced
    through a request's last page, in-range tokens through its pages; free pages never.
    A region the inputs do not reference gets 'n/a' rather than 'clean'."""
    if region == "null-block":
        return reads == "padded_plan" or (reads == "block_table" and has_padding_entries(case))
    if region == "free-pages":
        return False
    return bool(region_slots(case, region).any())


def region_sizes(case, regions=None) -> dict:
    """Slots per region of the case's spec (a region may be empty in a given case)."""
    regions = regions_of(spec_of(case)) if regions is None else regions
    return {r: int(region_slots(case, r).sum()) for r in regions}


def with_free_pages(case, n: int):
    """A copy of `case` whose pool has `n` more pages that no block table references
    (freed pages, or pages a hybrid model's other state owns), zero-filled."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"free_pages must be an int >= 0, got {n!r}")
    kv = case.kv_cache
    spare = torch.zeros((n,) + tuple(kv.shape[1:]), dtype=kv.dtype, device=kv.device)
    extra = {"poison": dict(case.poison)} if hasattr(case, "poison") else {}
    return dataclasses.replace(case, kv_cache=torch.cat([kv, spare]).contiguous(), **extra)

"""Poison sites: write foreign bytes where the grouped route reads but nobody attends,
or (attended-k, attended-v) into tokens that rows do attend.

Every site is one place in qsa_lab.model.regions (where a call's unattended bytes are) times
one payload (what is written there), so the sites and the canary share one model:

    site          region                                      payload (default)
    none          -                                           -
    zeros         null-block                                  zero elements
    targeted      null-block, first microblock (tokens 0-3:   NaN byte 0x7F at `dims`
                  what padding entries point at)
    random        null-block                                  uniform random bytes
    fp16-state    null-block                                  fp16 state-like values, byte by byte
    stale-tail    stale-microblock (never-written tokens      NaN byte 0x7F at `dims`
                  inside a request's last partial microblock;
                  the canary's stale-tail region is the whole
                  rest of the last page)
    attended-k/v  the one token most rows attend              NaN element at `dims`, own plane
    query         q itself: every head of every query row     NaN element (fp16 0x7E00) at `dims`

A NaN byte works on the raw bytes: for an fp8 cache one element is one byte, so it is a
NaN element; for an fp16 cache it lands in the low byte of an element and reads back as
a finite value: that is why the bug hides with fp16 KV. A `payload` ('nan', 'inf', 'max',
'zero') instead writes whole elements in the cache's storage dtype (E4M3 NaN 0x7F, E5M2
NaN 0x7F / Inf 0x7C, fp16 NaN 0x7E00 / Inf 0x7C00), so the value is what it says in every
dtype.

attended-k / attended-v: the grouped route's softmax drops a NaN key silently (its running
max ignores NaN and the token's probability becomes e^-80, 0 in fp16), where XQA and the
reference give NaN.
"""
from __future__ import annotations

import operator

import torch

from qsa_lab.model.case import Case, kv_values
from qsa_lab.model.geometry import PAYLOADS, PLANES, SITES  # noqa: F401 - part of this module's API
from qsa_lab.model.regions import region_slots, stale_slots

REPORT_DIMS = (102, 152, 168, 170, 230)
ATTENDED_SITES = {"attended-k": "k", "attended-v": "v"}  # site -> the plane it writes (its own)
QUERY_SITE = "query"  # writes q, not the cache; its elements are fp16 whatever the cache holds
DIM_SITES = ("targeted", "stale-tail") + tuple(ATTENDED_SITES) + (QUERY_SITE,)  # sites that write chosen dims only
#: site -> the region of qsa_lab.model.regions it writes (attended-k / attended-v: one attended token)
SITE_REGIONS = {"zeros": "null-block", "targeted": "null-block", "random": "null-block",
                "fp16-state": "null-block", "stale-tail": "stale-microblock"}
NAN_BYTE = 0x7F  # NaN in both e4m3 and e5m2
#: (kv_dtype, payload) -> one element's bit pattern in the storage dtype. E4M3 (fn) has no Inf
#: code; "max" is the largest finite value (a kernel that gives an unattended slot any weight
#: at all changes its output with it)
PAYLOAD_BITS = {("e4m3", "nan"): 0x7F, ("e5m2", "nan"): 0x7F, ("e5m2", "inf"): 0x7C,
                ("fp16", "nan"): 0x7E00, ("fp16", "inf"): 0x7C00,
                ("e4m3", "max"): 0x7E, ("e5m2", "max"): 0x7B, ("fp16", "max"): 0x7BFF,
                ("e4m3", "zero"): 0x00, ("e5m2", "zero"): 0x00, ("fp16", "zero"): 0x0000}


def payload_bits(kv_dtype: str, payload: str) -> int:
    """The storage bits of one payload element; ValueError naming `payload` when the dtype has none."""
    if payload not in PAYLOADS:
        raise ValueError(f"payload must be one of {PAYLOADS}, got {payload!r}")
    if (kv_dtype, payload) not in PAYLOAD_BITS:
        raise ValueError(f"payload: {kv_dtype} has no {payload} encoding")
    return PAYLOAD_BITS[(kv_dtype, payload)]


def write_payload(kv_cache: torch.Tensor, slots: torch.Tensor, planes, kv_dtype: str, payload: str,
                  dims=None) -> torch.Tensor:
    """Write `payload` as whole elements into `slots` ([pages, page_size] bool) on `planes`
    (0 = K, 1 = V), at every head dim or only `dims`, in place.
    -> [pages, 2, page_size, head_dim] bool: the elements written."""
    bits = payload_bits(kv_dtype, payload)
    written = _elements(kv_cache, slots, planes, dims)
    elems = kv_cache.view(torch.int16 if kv_dtype == "fp16" else torch.uint8)[:, :, :, 0, :]
    elems[written.to(kv_cache.device)] = bits - 0x10000 if bits >= 0x8000 and kv_dtype == "fp16" else bits
    return written


def _elements(kv_cache: torch.Tensor, slots: torch.Tensor, planes, dims=None) -> torch.Tensor:
    """[pages, 2, page_size, head_dim] bool: `slots` on `planes` at `dims` (default all)."""
    pages, _, ps, _, D = kv_cache.shape
    cols = torch.zeros(D, dtype=torch.bool)
    cols[list(range(D)) if dims is None else list(dims)] = True
    out = torch.zeros((pages, 2, ps, D), dtype=torch.bool)
    for p in planes:
        out[:, p] = slots.cpu().unsqueeze(-1) & cols
    return out


def attended_token(case: Case) -> tuple[int, int]:
    """(physical page, token in page) of the token attended by the most rows (ties: lowest)."""
    from qsa_lab.model.plan import attended_microblocks

    mb, nib = attended_microblocks(case)
    t = torch.arange(4, device=mb.device)
    tok = (mb.unsqueeze(-1) * 4 + t)[((nib.unsqueeze(-1) >> t) & 1).bool()]
    best = int(torch.bincount(tok.cpu()).argmax())   # argmax returns the first maximum
    ps = case.geometry.page_size
    return best // ps, best % ps


def site_slots(case: Case, site: str) -> torch.Tensor:
    """[pages, page_size] bool: the token slots a site writes."""
    pages, ps = case.kv_cache.shape[0], case.geometry.page_size
    slots = torch.zeros(pages, ps, dtype=torch.bool)
    if site in ATTENDED_SITES:
        slots[attended_token(case)] = True
    elif site in SITE_REGIONS:
        slots = region_slots(case, SITE_REGIONS[site])
        if site == "targeted":
            slots[:, 4:] = False  # the null block's first microblock: padding entries point at it
    return slots


def check_site(site: str, plane: str) -> None:
    if site not in SITES:
        raise ValueError(f"site must be one of {SITES}, got {site!r}")
    if plane not in PLANES:
        raise ValueError(f"plane must be one of {tuple(PLANES)}, got {plane!r}")


def default_dims(head_dim: int) -> list[int]:
    return sorted({d % head_dim for d in REPORT_DIMS})


def stale_tokens(case: Case) -> list[tuple[int, int]]:
    """(physical page, token in page) of every never-written token inside a request's
    last partial microblock (positions seq_len .. round_up(seq_len, 4) - 1): the slots of
    the stale-microblock region, which site 'stale-tail' writes."""
    return stale_slots(case, "stale-microblock")


def int_list(values, arg: str) -> list[int]:
    """Integers only: a string is refused (iterating '102' would give dims 1, 0, 2) and so is
    1.5 (int() would silently truncate it)."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{arg}: must be a list of ints, got {type(values).__name__} {values!r}")
    out = []
    for v in values:
        try:
            if isinstance(v, bool):
                raise TypeError
            out.append(operator.index(v))  # ints, numpy / torch integers; never floats or strings
        except TypeError:
            raise TypeError(f"{arg}: must be a list of ints, got {v!r} in it") from None
    return out


def apply_poison(case: Case, site: str = "targeted", plane: str = "v", dims=None, seed: int = 0,
                 payload: str | None = None) -> Case:
    """Return a copy of `case` with the site written; `case.poison` records what it wrote:
    site, plane, payload, bytes_written, nan_bytes (written elements that decode to NaN on
    the poisoned planes) and poisoned_dims (head dims holding one).

    payload: None writes the site's own bytes (the NaN byte 0x7F for targeted / stale-tail,
    a NaN element for attended-k / attended-v); 'nan' or 'inf' writes whole elements of
    that value in the storage dtype (dim sites only). attended-k / attended-v write their
    own plane and ignore `plane`. query writes q's fp16 elements (payload nan, inf, max or zero)
    at `dims` of every head of every row, and ignores `plane` (recorded as 'q').
    """
    from qsa_lab.model.case import validate_case

    check_site(site, plane)
    validate_case(case)  # a meta-device or malformed case is refused here, naming the field
    if site in ATTENDED_SITES:
        plane = ATTENDED_SITES[site]
        payload = payload or "nan"
    if site == QUERY_SITE:
        plane, payload = "q", payload or "nan"
    g = case.geometry
    if payload is not None:
        if site not in DIM_SITES:
            raise ValueError(f"payload only applies to sites {DIM_SITES}, not {site!r}")
        payload_bits("fp16" if site == QUERY_SITE else g.kv_dtype, payload)  # a payload with no code: refused
    if site in DIM_SITES:
        dims = default_dims(g.head_dim) if dims is None else int_list(dims, "dims")
        if not dims or any(not 0 <= d < g.head_dim for d in dims):
            raise ValueError(f"dims must be a non-empty list of head dims in [0, {g.head_dim}), got {dims}")
    elif dims is not None:
        raise ValueError(f"dims only applies to sites {DIM_SITES}, not {site!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed: must be an int, got {type(seed).__name__} {seed!r}")
    if not 0 <= seed < 1 << 63:  # torch.Generator.manual_seed takes 64 bits
        raise ValueError(f"seed: must be in 0..{(1 << 63) - 1}, got {seed!r}")

    if site == QUERY_SITE:
        return _poison_query(case, dims, seed, payload)
    out = case.clone()
    kv = out.kv_cache  # [pages, 2, page_size, 1, D]
    slots = site_slots(out, site)
    if site == "stale-tail" and not slots.any():
        raise ValueError("site 'stale-tail' needs a request whose seq_len is not a multiple of 4 "
                         f"(seq_lens {out.seq_lens.tolist()}): use requests >= 2 or a context not divisible by 4")
    planes = PLANES[plane]
    region = _elements(kv, slots, planes, dims if site in DIM_SITES else None)  # [pages, 2, ps, D] written
    cells = kv.view(torch.uint8).view(kv.shape[0], 2, g.page_size, g.head_dim, -1)  # [..., D, bytes/elem]
    nbytes = cells.shape[-1]
    payload_written = "zero" if site == "zeros" else payload
    if site == "none":
        pass
    elif payload_written is not None:  # whole elements in the storage dtype
        write_payload(kv, slots, planes, g.kv_dtype, payload_written, dims if site in DIM_SITES else None)
    elif site in ("targeted", "stale-tail"):
        cells[..., 0][region.to(kv.device)] = NAN_BYTE
    else:  # random / fp16-state: a page of foreign bytes per plane, from the seeded generator
        gen = torch.Generator().manual_seed(seed)
        n = int(slots.sum()) * g.head_dim * nbytes
        for p in planes:
            if site == "random":
                data = torch.randint(0, 256, (n,), generator=gen, dtype=torch.int64).to(torch.uint8)
            else:  # recurrent state: fp16 activations of unit-ish scale, laid byte by byte
                data = (torch.randn(n // 2 + 1, generator=gen) * 0.5).to(torch.float16).view(torch.uint8)[:n]
            cells[:, p][slots.to(kv.device)] = data.view(-1, g.head_dim, nbytes).to(kv.device)
    extra = {"token": list(torch.nonzero(slots)[0].tolist())} if site in ATTENDED_SITES else {}
    pages = torch.nonzero(slots.any(dim=1)).flatten()  # decode only the pages written: a long cache
    region = region[pages]                              # has thousands of pages and few are poisoned
    values = kv_values(kv[pages.to(kv.device), :, :, 0, :], g.kv_dtype).cpu()
    nan_here = torch.isnan(values) & region          # region is empty for 'none'
    inf_here = torch.isinf(values) & region          # E5M2 Inf: 0 * Inf = NaN leaks the same way
    out.poison = {
        "site": site, "plane": plane, "seed": seed, "payload": payload,
        "dims": list(dims) if site in DIM_SITES else [],
        "bytes_written": int(region.sum()) * nbytes,
        "nan_bytes": int(nan_here.sum()),
        "poisoned_dims": sorted(set(torch.nonzero(nan_here)[:, 3].tolist())),
        "inf_bytes": int(inf_here.sum()),
        "nonfinite_dims": sorted(set(torch.nonzero(nan_here | inf_here)[:, 3].tolist())),
        **extra,
    }
    return out


REQUEST_SITE = "request"  # poison_request's record: every slot one request's rows attend


def poison_request(case: Case, request: int, payload: str = "nan", dims=None, plane: str = "v") -> Case:
    """A copy of `case` with `payload` ('nan', 'inf', 'max', 'zero') written as whole elements at
    `dims` (default the report's dims) of every slot that `request`'s rows attend, on `plane`:
    the value a request's own KV can hold (an fp16 overflow, a corrupted write) and that only
    its rows may see. case.poison records site 'request', the request and what was written."""
    from qsa_lab.model.case import validate_case
    from qsa_lab.model.regions import attended_slots

    validate_case(case)
    g = case.geometry
    if not isinstance(request, int) or isinstance(request, bool) or not 0 <= request < g.requests:
        raise ValueError(f"request: must be an int in [0, {g.requests}), got {request!r}")
    if plane not in ("k", "v"):
        raise ValueError(f"plane: must be 'k' or 'v', got {plane!r}")
    payload_bits(g.kv_dtype, payload)
    dims = default_dims(g.head_dim) if dims is None else int_list(dims, "dims")
    if not dims or any(not 0 <= d < g.head_dim for d in dims):
        raise ValueError(f"dims: must be a non-empty list of head dims in [0, {g.head_dim}), got {dims}")
    out = case.clone()
    slots = attended_slots(out, out.token_to_req.cpu() == request)
    written = write_payload(out.kv_cache, slots, PLANES[plane], g.kv_dtype, payload, dims)
    pages = torch.nonzero(slots.any(dim=1)).flatten()
    values = kv_values(out.kv_cache[pages.to(out.device), :, :, 0, :], g.kv_dtype).cpu()
    here = written[pages]
    nan_here, inf_here = torch.isnan(values) & here, torch.isinf(values) & here
    out.poison = {"site": REQUEST_SITE, "request": request, "plane": plane, "seed": 0, "payload": payload,
                  "dims": list(dims), "slots": int(slots.sum()),
                  "bytes_written": int(here.sum()) * out.kv_cache.element_size(),
                  "nan_bytes": int(nan_here.sum()), "poisoned_dims": sorted(set(torch.nonzero(nan_here)[:, 3].tolist())),
                  "inf_bytes": int(inf_here.sum()),
                  "nonfinite_dims": sorted(set(torch.nonzero(nan_here | inf_here)[:, 3].tolist()))}
    return out


def _poison_query(case: Case, dims: list, seed: int, payload: str) -> Case:
    """Site 'query': `payload` as fp16 elements at `dims` of every head of every row of q."""
    out = case.clone()
    q = case.q.clone()
    bits = payload_bits("fp16", payload)
    q.view(torch.int16)[:, :, list(dims)] = bits - 0x10000 if bits >= 0x8000 else bits
    out.q = q
    written = q[:, :, list(dims)].float()
    nan, inf = torch.isnan(written), torch.isinf(written)
    hit = lambda m: sorted(dims[i] for i in torch.nonzero(m.flatten(0, 1).any(dim=0)).flatten().tolist())  # noqa: E731
    out.poison = {"site": QUERY_SITE, "plane": "q", "seed": seed, "payload": payload, "dims": list(dims),
                  "bytes_written": written.numel() * 2, "nan_bytes": int(nan.sum()), "poisoned_dims": hit(nan),
                  "inf_bytes": int(inf.sum()), "nonfinite_dims": hit(nan | inf)}
    return out

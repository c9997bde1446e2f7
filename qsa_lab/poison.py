"""Poison sites: write foreign bytes where the grouped route reads but nobody attends,
or (attended-k, attended-v) into tokens that rows do attend.

The null-block and stale-tail sites work on the raw bytes of the cache. For an fp8
cache one element is one byte, so a NaN code is a NaN element. For an fp16 cache the
same byte lands in the low byte of an fp16 element and reads back as a finite value:
that is why the bug hides with fp16 KV. A `payload` ('nan' or 'inf') instead writes
whole elements in the cache's storage dtype (E4M3 NaN 0x7F, E5M2 NaN 0x7F / Inf 0x7C,
fp16 NaN 0x7E00 / Inf 0x7C00), so the value is non-finite in every dtype.

attended-k / attended-v write the chosen dims of the one token that the most rows
attend (ties: the lowest physical token), on the K or V plane: the grouped route's
softmax drops a NaN key silently (its running max ignores NaN and the token's
probability becomes e^-80, 0 in fp16), where XQA and the reference give NaN.
"""
from __future__ import annotations

import torch

from .case import Case, kv_values

SITES = ("none", "zeros", "targeted", "random", "fp16-state", "stale-tail", "attended-k", "attended-v")
PLANES = {"k": (0,), "v": (1,), "kv": (0, 1)}
REPORT_DIMS = (102, 152, 168, 170, 230)
ATTENDED_SITES = {"attended-k": "k", "attended-v": "v"}  # site -> the plane it writes (its own)
DIM_SITES = ("targeted", "stale-tail") + tuple(ATTENDED_SITES)  # sites that write chosen head dims only
NAN_BYTE = 0x7F  # NaN in both e4m3 and e5m2
PAYLOADS = ("nan", "inf")
#: (kv_dtype, payload) -> the element's bit pattern in the storage dtype; E4M3 (fn) has no Inf code
PAYLOAD_BITS = {("e4m3", "nan"): 0x7F, ("e5m2", "nan"): 0x7F, ("e5m2", "inf"): 0x7C,
                ("fp16", "nan"): 0x7E00, ("fp16", "inf"): 0x7C00}


def payload_bits(kv_dtype: str, payload: str) -> int:
    """The storage bits of one non-finite element; ValueError naming `payload` when the dtype has none."""
    if payload not in PAYLOADS:
        raise ValueError(f"payload must be one of {PAYLOADS}, got {payload!r}")
    if (kv_dtype, payload) not in PAYLOAD_BITS:
        raise ValueError(f"payload: {kv_dtype} has no {payload} encoding")
    return PAYLOAD_BITS[(kv_dtype, payload)]


def attended_token(case: Case) -> tuple[int, int]:
    """(physical page, token in page) of the token attended by the most rows (ties: lowest)."""
    from .plan import attended_microblocks

    mb, nib = attended_microblocks(case)
    t = torch.arange(4, device=mb.device)
    tok = (mb.unsqueeze(-1) * 4 + t)[((nib.unsqueeze(-1) >> t) & 1).bool()]
    best = int(torch.bincount(tok.cpu()).argmax())   # argmax returns the first maximum
    ps = case.geometry.page_size
    return best // ps, best % ps


def check_site(site: str, plane: str) -> None:
    if site not in SITES:
        raise ValueError(f"site must be one of {SITES}, got {site!r}")
    if plane not in PLANES:
        raise ValueError(f"plane must be one of {tuple(PLANES)}, got {plane!r}")


def default_dims(head_dim: int) -> list[int]:
    return sorted({d % head_dim for d in REPORT_DIMS})


def stale_tokens(case: Case) -> list[tuple[int, int]]:
    """(physical page, token in page) of every never-written token inside a request's
    last partial microblock: positions seq_len .. round_up(seq_len, 4) - 1."""
    ps = case.geometry.page_size
    out = []
    for r, s in enumerate(case.seq_lens.tolist()):
        for pos in range(s, -(-s // 4) * 4):
            out.append((int(case.block_table[r, pos // ps]), pos % ps))
    return out


def apply_poison(case: Case, site: str = "targeted", plane: str = "v", dims=None, seed: int = 0,
                 payload: str | None = None) -> Case:
    """Return a copy of `case` with the site written; `case.poison` records what it wrote:
    site, plane, payload, bytes_written, nan_bytes (written elements that decode to NaN on
    the poisoned planes) and poisoned_dims (head dims holding one).

    payload: None writes the site's own bytes (the NaN byte 0x7F for targeted / stale-tail,
    a NaN element for attended-k / attended-v); 'nan' or 'inf' writes whole elements of
    that value in the storage dtype (dim sites only). attended-k / attended-v write their
    own plane and ignore `plane`.
    """
    check_site(site, plane)
    if site in ATTENDED_SITES:
        plane = ATTENDED_SITES[site]
        payload = payload or "nan"
    g = case.geometry
    if payload is not None:
        if site not in DIM_SITES:
            raise ValueError(f"payload only applies to sites {DIM_SITES}, not {site!r}")
        bits = payload_bits(g.kv_dtype, payload)
    if site in DIM_SITES:
        dims = default_dims(g.head_dim) if dims is None else [int(d) for d in dims]
        if not dims or any(not 0 <= d < g.head_dim for d in dims):
            raise ValueError(f"dims must be a non-empty list of head dims in [0, {g.head_dim}), got {dims}")
    elif dims is not None:
        raise ValueError(f"dims only applies to sites {DIM_SITES}, not {site!r}")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")

    out = case.clone()
    extra = {}
    kv = out.kv_cache  # [pages, 2, page_size, 1, D]
    gen = torch.Generator().manual_seed(seed)
    planes = PLANES[plane]
    region = torch.zeros(kv.shape[:3] + (g.head_dim,), dtype=torch.bool)  # [pages, 2, ps, D] elements written
    cells = kv.view(torch.uint8).view(kv.shape[0], 2, g.page_size, g.head_dim, -1)  # [..., D, bytes/elem]
    nbytes = cells.shape[-1]
    if site == "zeros":
        for p in planes:
            cells[0, p] = 0
            region[0, p] = True
    elif site == "targeted":
        for p in planes:  # page 0 tokens 0..3 = the null block's microblock
            region[0, p, :4, dims] = True
    elif site in ATTENDED_SITES:
        page, tok = attended_token(out)
        region[page, PLANES[plane][0], tok, dims] = True
        extra = {"token": [page, tok]}
    elif site == "stale-tail":
        if not stale_tokens(out):
            raise ValueError("site 'stale-tail' needs a request whose seq_len is not a multiple of 4 "
                             f"(seq_lens {out.seq_lens.tolist()}): use requests >= 2 or a context not divisible by 4")
        for page, tok in stale_tokens(out):
            for p in planes:
                region[page, p, tok, dims] = True
    elif site in ("random", "fp16-state"):
        for p in planes:
            region[0, p] = True
    if payload is not None:  # whole elements in the storage dtype
        elems = kv.view(kv.shape[0], 2, g.page_size, g.head_dim)
        value = torch.tensor([bits], dtype=torch.int16).view(torch.float16) if kv.dtype == torch.float16 \
            else torch.tensor([bits], dtype=torch.uint8)
        elems[region.to(kv.device)] = value.to(kv.device)
    elif site in ("targeted", "stale-tail"):
        low = cells[..., 0]
        low[region.to(kv.device)] = NAN_BYTE
    elif site in ("random", "fp16-state"):
        for p in planes:
            n = g.page_size * g.head_dim * nbytes
            if site == "random":
                data = torch.randint(0, 256, (n,), generator=gen, dtype=torch.int64).to(torch.uint8)
            else:  # recurrent state: fp16 activations of unit-ish scale, laid byte by byte
                data = (torch.randn(n // 2 + 1, generator=gen) * 0.5).to(torch.float16).view(torch.uint8)[:n]
            cells[0, p] = data.view(g.page_size, g.head_dim, nbytes).to(kv.device)
    values = kv_values(kv[:, :, :, 0, :], g.kv_dtype).cpu()
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

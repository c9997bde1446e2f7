"""A case: the paged record the routes read (qsa_lab.model.paged), built from a Geometry.

One KV head: kv_cache is [pages, 2, page_size, 1, head_dim], uint8 codes (e4m3/e5m2) or fp16.
Page 0 is the null block: never mapped, left all zero by the builder (poison.py writes to it).
Scales are per-tensor: value = decode(code) * scale. The rows' block selections come from
qsa_lab.model.selection.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from dataclasses import dataclass, field

import torch

from qsa_lab.model import fp8
from qsa_lab.model.geometry import (DEFAULT_OVERLAP, GROUPINGS, KV_DTYPES, LAYOUTS, RANGES, SELECTIONS, Geometry)  # noqa: F401
from qsa_lab.model.paged import PagedTensors, check_pages, check_selection, check_tensors, check_token_to_req, need
from qsa_lab.model.selection import neighbour_overlap, selections



def no_poison() -> dict:
    """The poison record of a case nothing was written into."""
    return {"site": "none", "plane": "v", "nan_bytes": 0, "poisoned_dims": []}


@dataclass
class Case(PagedTensors):
    """The paged record (qsa_lab.model.paged) of one KV head, with the Geometry that describes it
    and the record of the poison written into it (qsa_lab.model.poison)."""

    geometry: Geometry = field(kw_only=True)
    poison: dict = field(default_factory=no_poison, kw_only=True)

    @property
    def kv_dtype(self) -> str:
        return self.geometry.kv_dtype

    @property
    def sm_scale(self) -> float:
        return self.geometry.sm_scale

    def clone(self) -> "Case":
        """A copy whose pool (what poison writes) and poison record are fresh; the other tensors
        are shared (a poisoned query gets a new q: the playground tells it by `q is`)."""
        return dataclasses.replace(self, kv_cache=self.kv_cache.clone(), poison=dict(self.poison))

    def decoded_plane(self, plane: int) -> torch.Tensor:
        """[pages, page_size, head_dim] float32 values (scale applied) of plane 0=K or 1=V."""
        scale = self.k_scale if plane == 0 else self.v_scale
        return kv_values(self.kv_cache[:, plane, :, 0, :], self.kv_dtype) * scale

    def describe(self) -> str:
        g = self.geometry
        return (f"rows {g.rows}, {g.requests} req, {g.layout}, ctx {g.context}, topk {g.topk}, "
                f"page {g.page_size}, Hq {g.q_heads}, D {g.head_dim}, {g.kv_dtype}, seed {g.seed}, "
                f"{self.describe_selection()}; poison {self.poison['site']}/{self.poison['plane']}")

    def describe_selection(self) -> str:
        """'indexer selection, overlap 0.8 (measured 0.79)' or 'random selection, overlap 0.40'."""
        measured = neighbour_overlap(self)
        got = "n/a" if measured is None else f"{measured:.2f}"
        if self.geometry.selection == "indexer":
            return f"indexer selection, overlap {self.geometry.overlap:g} (measured {got})"
        return f"random selection, overlap {got}"


def kv_values(raw: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """Cache elements (fp8 codes or fp16) -> float32 values as the kernel's fp16 panel holds them (no scale)."""
    return raw.float() if kv_dtype == "fp16" else fp8.decode(raw, kv_dtype)


def token_values(kv_cache: torch.Tensor, tokens: torch.Tensor, plane: int, kv_dtype: str) -> torch.Tensor:
    """Physical token ids (page * page_size + token, any shape) -> [..., head_dim] float32 of one plane.

    Inside `decoded_once(kv_cache, ...)` the values are read from one decode of the whole cache
    (the same float32 values, each token decoded once instead of at every read)."""
    planes = _decoded(kv_cache, kv_dtype)
    if planes is not None:
        flat = planes[plane]
        return flat.index_select(0, tokens.reshape(-1)).view(*tokens.shape, flat.shape[-1])
    pages, _, ps, _, d = kv_cache.shape
    if tokens.numel() > pages * ps:  # more reads than the plane has tokens: decode the plane, then gather
        flat = kv_values(kv_cache[:, plane, :, 0, :].reshape(pages * ps, d), kv_dtype)
        return flat.index_select(0, tokens.reshape(-1)).view(*tokens.shape, d)
    return kv_values(kv_cache[tokens // ps, plane, tokens % ps, 0, :], kv_dtype)


def slot_values(kv_cache: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, plane: int,
                kv_dtype: str) -> torch.Tensor:
    """token_values where `valid` (bool, the shape of `tokens`), 0.0 elsewhere; a slot not valid is
    never read from the cache (inside decoded_once it reads the decode's extra zero row)."""
    planes = _decoded(kv_cache, kv_dtype)
    if planes is not None:
        flat = planes[plane]
        tok = torch.where(valid, tokens, flat.shape[0] - 1)
        return flat.index_select(0, tok.reshape(-1)).view(*tokens.shape, flat.shape[-1])
    tok = torch.where(valid, tokens, 0)
    return token_values(kv_cache, tok, plane, kv_dtype).masked_fill_(~valid.unsqueeze(-1), 0.0)


#: id(kv_cache) -> (kv_cache, kv_dtype, [K, V] decoded [pages * page_size + 1, head_dim] float32, the last
#: row zero), while a decoded_once block on that cache runs
_DECODED: dict = {}


def _decoded(kv_cache: torch.Tensor, kv_dtype: str):
    planes = _DECODED.get(id(kv_cache))
    return planes[2] if planes is not None and planes[0] is kv_cache and planes[1] == kv_dtype else None


@contextlib.contextmanager
def decoded_once(kv_cache: torch.Tensor, kv_dtype: str):
    """Decode the cache once for the block: token_values on it reads that decode. The block must
    not write the cache (run_routes reads it only)."""
    if id(kv_cache) in _DECODED:  # nested: the outer block's decode serves
        yield
        return
    pages, _, ps, _, d = kv_cache.shape
    zero = kv_cache.new_zeros((1, d))  # code 0 and fp16 0 are +0.0: the row slot_values reads for unused slots
    planes = [kv_values(torch.cat([kv_cache[:, p, :, 0, :].reshape(pages * ps, d), zero]), kv_dtype) for p in (0, 1)]
    _DECODED[id(kv_cache)] = (kv_cache, kv_dtype, planes)
    try:
        yield
    finally:
        del _DECODED[id(kv_cache)]


def build_case(geometry: Geometry | None = None, device: str | torch.device = "cpu", *,
               max_memory: int | None = None, **overrides) -> Case:
    """Build a case from a Geometry (or keyword overrides of the defaults).

    Each request r holds seq_len = context - r tokens (so requests differ in their
    partial last microblock); its rows are its last positions (decode-like, causal
    among themselves). K/V ~ N(0, 1) written through the saturating encoder with
    scale amax / max_finite; page 0 (the null block) stays zero.

    Before allocating anything, the case's peak memory is estimated (qsa_lab.model.memory) and a
    case above `max_memory` bytes (default: half the memory available now) is refused.
    """
    from qsa_lab.model import memory as resources

    device = check_device(device)
    g = geometry if geometry is not None else Geometry()
    if not isinstance(g, Geometry):
        raise TypeError(f"geometry: expected a Geometry, got {type(g).__name__}")
    if overrides:
        g = g.replace(**overrides)
    resources.require(g, max_memory, api=True)
    gen = torch.Generator().manual_seed(g.seed)

    seq_lens = torch.tensor([g.context - r for r in range(g.requests)], dtype=torch.int32)
    per_req = g.rows_of_requests()
    token_to_req = torch.cat([torch.full((n,), r, dtype=torch.int32) for r, n in enumerate(per_req)])
    positions = torch.cat([torch.arange(int(seq_lens[r]) - n, int(seq_lens[r]), dtype=torch.int64)
                           for r, n in enumerate(per_req)])

    pages_per_req = [-(-int(s) // g.page_size) for s in seq_lens]
    max_pages = max(pages_per_req)
    total = sum(pages_per_req)
    physical = torch.arange(1, total + 1, dtype=torch.int32)  # page 0 is the null block
    if g.layout == "scatter":
        physical = physical[torch.randperm(total, generator=gen)]
    block_table = torch.zeros((g.requests, max_pages), dtype=torch.int32)
    start = 0
    for r, n in enumerate(pages_per_req):
        block_table[r, :n] = physical[start:start + n]
        start += n

    q = torch.randn((g.rows, g.q_heads, g.head_dim), generator=gen).to(torch.float16)
    kv = torch.randn((total + 1, 2, g.page_size, 1, g.head_dim), generator=gen)
    kv[0] = 0.0
    # tokens at or past seq_len were never written: leave them zero (poison may write them)
    tok = torch.arange(g.page_size)
    for r, n in enumerate(pages_per_req):
        last = int(block_table[r, n - 1])
        written = int(seq_lens[r]) - (n - 1) * g.page_size
        kv[last, :, tok >= written] = 0.0
    if g.kv_dtype == "fp16":
        k_scale = v_scale = 1.0
        kv_cache = kv.to(torch.float16)
    else:
        mx = fp8.MAX_FINITE[g.kv_dtype]
        k_scale = float(kv[:, 0].abs().max()) / mx
        v_scale = float(kv[:, 1].abs().max()) / mx
        kv_cache = torch.stack([fp8.encode(kv[:, 0] / k_scale, g.kv_dtype),
                                fp8.encode(kv[:, 1] / v_scale, g.kv_dtype)], dim=1)

    visible = torch.minimum(positions + 1, seq_lens.long()[token_to_req.long()])
    selected = selections(g, positions, token_to_req, visible, gen)
    case = Case(q, kv_cache.contiguous(), k_scale, v_scale, block_table, seq_lens, token_to_req, positions, selected,
                geometry=g)
    return case.to(device) if str(device) != "cpu" else case


def check_device(device) -> torch.device:
    """'cpu', 'cuda', 'cuda:N' or a torch.device the routes can use; ValueError naming `device`."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device: expected a str or torch.device, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device: {device!r} is not a device name (use 'cpu' or 'cuda')") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device: qsa_lab runs on 'cpu' or 'cuda', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} asked for, but no CUDA GPU is visible (use 'cpu')")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device: {device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return dev


def relocate_pages(case: Case, seed: int = 1, spare: int = 3) -> Case:
    """The same case with every request page moved to another physical page.

    Page 0 stays the null block; the pool grows by `spare` unused pages so pages can land
    anywhere. block_table is remapped and the kv_cache pages move with it: every logical
    token keeps its bytes, only the allocation differs (upstream's planner promises the
    same result for any allocation).
    """
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    if not isinstance(spare, int) or spare < 0:
        raise ValueError(f"spare must be an int >= 0, got {spare!r}")
    pages = case.kv_cache.shape[0]
    gen = torch.Generator().manual_seed(seed)
    new_of_old = torch.zeros(pages, dtype=torch.int64)
    new_of_old[1:] = 1 + torch.randperm(pages - 1 + spare, generator=gen)[:pages - 1]
    dev = case.kv_cache.device
    kv = case.kv_cache.new_zeros((pages + spare,) + tuple(case.kv_cache.shape[1:]))
    kv[new_of_old.to(dev)] = case.kv_cache
    table = new_of_old.to(dev)[case.block_table.long()].to(torch.int32)
    return dataclasses.replace(case, kv_cache=kv, block_table=table, poison=dict(case.poison))


def geometry_from_json(text: str) -> Geometry:
    """A geometry as a file wrote it (JSON of Geometry.to_dict(); old field names read too)."""
    return Geometry.from_dict(json.loads(text))


FP16_MAX = 65504.0
FP32_MAX = 3.4028234663852886e38


#: the bits below which a magnitude (sign bit cleared) is finite: fp16 0x7C00, E4M3 0x7F, E5M2 0x7C; the
#: magnitudes of each format grow with their bits, so the largest finite value is the table value
#: of the largest finite magnitude bits
_FINITE_BELOW = {"fp16": 0x7C00, "e4m3": 0x7F, "e5m2": 0x7C}


def _largest_finite(raw: torch.Tensor, kv_dtype: str) -> float:
    """max |value| over the finite elements of fp8 codes or fp16 values (0.0 if none), from their
    bits: one pass over the raw elements, nothing decoded."""
    if raw.dtype not in (torch.float16, torch.uint8):  # any other float: by value
        t = raw.float().abs()
        t = t[torch.isfinite(t)]
        return float(t.max()) if t.numel() else 0.0
    kind = "fp16" if raw.dtype == torch.float16 else kv_dtype
    bits, sign = (raw.view(torch.int16), 0x8000) if kind == "fp16" else (raw, 0x80)
    # (bits + off) mod sign: a finite magnitude m becomes m + off, a non-finite one wraps below off
    off = sign - _FINITE_BELOW[kind]
    top = max(int(((bits + off) & (sign - 1)).max()) - off, 0) if bits.numel() else 0
    if kind == "fp16":
        return float(torch.tensor(top, dtype=torch.int16).view(torch.float16))
    return float(fp8.decode(torch.tensor([top], dtype=torch.uint8), kind)[0])


def _check_scales(case: Case) -> None:
    """Scales the kernels' arithmetic can hold: sm_scale * k_scale and v_scale are fp32 numbers
    (0 or Inf there would silently change every score), the largest possible score |q| |K| D
    sm_scale k_scale stays inside fp32, and the largest V value times v_scale inside the fp16
    output (beyond it outputs overflow to Inf)."""
    g = case.geometry

    for name, s in (("k_scale", case.k_scale * g.sm_scale), ("v_scale", case.v_scale)):
        s32 = float(torch.tensor(s, dtype=torch.float32))
        if not (math.isfinite(s32) and s32 >= torch.finfo(torch.float32).tiny):
            raise ValueError(f"{name}: {getattr(case, name)!r} does not fit the kernels' fp32 arithmetic "
                             "(it becomes 0 or Inf there)")
    v_max = _largest_finite(case.kv_cache[:, 1, :, 0, :], g.kv_dtype)
    if v_max * case.v_scale > FP16_MAX:
        raise ValueError(f"v_scale: {case.v_scale!r} times the largest V value ({v_max:g}) exceeds fp16's "
                         f"{FP16_MAX:g}: outputs would overflow to Inf")
    k_max = _largest_finite(case.kv_cache[:, 0, :, 0, :], g.kv_dtype)
    if _largest_finite(case.q, "fp16") * k_max * g.head_dim * g.sm_scale * case.k_scale > FP32_MAX:
        raise ValueError(f"k_scale: {case.k_scale!r} lets a score |q . K| * sm_scale * k_scale exceed fp32's "
                         f"{FP32_MAX:.3g}: scores would overflow to Inf")


def validate_case(case: Case) -> Case:
    """Raise ValueError naming the argument when a tensor has the wrong shape, dtype or range."""
    if not isinstance(case, Case):
        raise TypeError(f"case: expected a qsa_lab Case, got {type(case).__name__}")
    if not isinstance(case.geometry, Geometry):
        raise TypeError(f"geometry: expected a Geometry, got {type(case.geometry).__name__}")
    g = case.geometry
    rows, hq, d = g.rows, g.q_heads, g.head_dim

    dev = check_tensors(case)
    need(dev.type in ("cpu", "cuda"), "device", f"cpu or cuda, got {dev}")
    need(dev.type != "cuda" or (torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()),
         "device", f"a visible CUDA device, got {dev}")

    need(tuple(case.q.shape) == (rows, hq, d) and case.q.dtype == torch.float16,
         "q", f"[rows={rows}, q_heads={hq}, head_dim={d}] float16, got {list(case.q.shape)} {case.q.dtype}")
    kv_dt = torch.float16 if g.kv_dtype == "fp16" else torch.uint8
    kv = case.kv_cache
    need(kv.dim() == 5 and tuple(kv.shape[1:]) == (2, g.page_size, 1, d) and kv.dtype == kv_dt,
         "kv_cache", f"[pages, 2, page_size={g.page_size}, 1, head_dim={d}] {kv_dt}, "
         f"got {list(kv.shape)} {kv.dtype}")
    for name in ("k_scale", "v_scale"):
        s = getattr(case, name)
        need(isinstance(s, float) and math.isfinite(s) and s > 0, name, f"a finite float > 0, got {s!r}")
    _check_scales(case)
    reqs = g.requests
    need(tuple(case.seq_lens.shape) == (reqs,) and case.seq_lens.dtype == torch.int32, "seq_lens",
         f"[requests={reqs}] int32")
    need(case.block_table.dim() == 2 and case.block_table.shape[0] == reqs
         and case.block_table.dtype == torch.int32, "block_table", f"[requests={reqs}, max_pages] int32")
    check_pages(case)
    check_token_to_req(case)
    need(tuple(case.positions.shape) == (rows,) and case.positions.dtype == torch.int64
         and int(case.positions.min()) >= 0, "positions", f"[rows={rows}] int64 >= 0")
    sel = case.selected
    need(tuple(sel.shape) == (rows, g.topk) and sel.dtype == torch.int32, "selected",
         f"[rows={rows}, topk={g.topk}] int32")
    beyond = case.positions >= case.seq_lens.long()[case.token_to_req.long()]
    if bool(beyond.any()):
        r = int(torch.nonzero(beyond)[0])
        need(False, "positions", f"each row's position < its request's seq_len (a row attends tokens <= its "
             f"position, and only written tokens exist); row {r} is at {int(case.positions[r])}, seq_len "
             f"{int(case.seq_lens[case.token_to_req[r]])}")
    check_selection(case)
    real = sel >= 0
    need(not bool((real[:, 1:] & ~real[:, :-1]).any()), "selected",
         "each row's block ids first, then -1 padding (a -1 before a real id)")
    srt = sel.sort(dim=1).values
    need(not bool(((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any()), "selected",
         "no block id twice in one row")
    return case

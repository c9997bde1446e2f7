"""The canary's case: one paged-attention call at the kernel's own geometry.

A `CanaryCase` is the paged record (qsa_lab.model.paged: q, kv_cache, scales, block_table,
seq_lens, token_to_req, positions, selected) of what a kernel is given (see `PagedCall`), plus
the attention spec that says what each row attends and how to read the pool:

    kv_dtype     fp16, or e4m3 / e5m2 for a uint8 pool of fp8 codes
    spec         qsa_lab.model.regions.AttentionSpec (parsed here, once, when the case is made);
                 the sparse spec reads `selected`
    kv_heads     GQA: query head h reads KV head h // (q_heads // kv_heads)
    mla          plane 0 holds the latent (read as K, head_dim = latent + rope) and V is its
                 first `v_head_dim` dims; plane 1 is unused (zero), kv_heads is 1

block_table entries past a request's last page are 0 (the null block). Layout: rows are
grouped by request in request order, and a request's query rows are its LAST positions (row i
of a request with n rows and seq_len s sits at position s - n + i): decode is one row per
request, a prefill chunk `query_len` rows per request.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from qsa_lab.model import fp8
from qsa_lab.model.case import KV_DTYPES, Case, Geometry, build_case, no_poison, validate_case
from qsa_lab.model.geometry import CANARY_RANGES, RANGES
from qsa_lab.model.memory import require_canary
from qsa_lab.model.paged import (SCALES, PagedTensors, check_pages, check_selection, check_tensors, check_token_to_req,
                                 need)
from qsa_lab.model.regions import SPARSE, AttentionSpec, attended_tokens, with_free_pages

#: small enough that every CPU kernel runs the whole matrix in seconds; three requests of
#: 33, 32 and 31 tokens on 16-token pages: the shorter two have a padded (null) block-table
#: entry, the first and last a stale tail; every row attends its whole prefix (topk covers it)
CANARY_GEOMETRY = Geometry(rows=10, requests=3, context=33, topk=16, page_size=16, q_heads=2, head_dim=16,
                           kv_dtype="fp16")
FREE_PAGES = 2
NO_LIMIT = 1 << 62     # build_case's budget here: the canary estimates the build itself (canary_case)


@dataclass
class CanaryCase(PagedTensors):
    """The paged record of one call, and how a kernel reads it (the fields below)."""

    kv_dtype: str = "fp16"
    spec: AttentionSpec = SPARSE        # or its text ('dense', 'window:W[,sink:S]', ...); None: sparse
    sm_scale: float | None = None       # default 1 / sqrt(head_dim)
    mla: bool = False
    v_head_dim: int | None = None       # MLA: V is the first v_head_dim dims of the latent
    geometry: Geometry | None = None    # the qsa_lab Geometry it was built from (None for a user's dump)
    source: str = "built"
    poison: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.sm_scale is None:
            self.sm_scale = 1.0 / math.sqrt(self.head_dim)
        # the one place a spec is parsed: every door (canary_case, load_case, with_spec,
        # as_canary_case, from_case, dataclasses.replace) makes the case through here
        self.spec = SPARSE if self.spec is None else AttentionSpec.parse(self.spec)


    @property
    def out_dim(self) -> int:
        """Head dim of the output: v_head_dim in MLA mode, head_dim otherwise."""
        return self.v_head_dim if self.mla else self.head_dim

    def query_lens(self) -> torch.Tensor:
        return torch.bincount(self.token_to_req.cpu().long(), minlength=self.requests).to(torch.int32)

    def clone(self) -> "CanaryCase":
        return dataclasses.replace(super().clone(), poison=dict(self.poison))

    def with_spec(self, spec) -> "CanaryCase":
        return validate(dataclasses.replace(self, spec=spec))

    def attended(self) -> torch.Tensor:
        return attended_tokens(self)

    def qsa_unsupported(self) -> str | None:
        """Why the qsa routes cannot give a true verdict on this case (None when they can):
        they read one KV head, no MLA latent, and attend the sparse selection."""
        if self.mla:
            return "the qsa routes do not read an MLA latent pool"
        lo, hi = RANGES["q_heads"]
        if not lo <= self.q_heads <= hi:
            return f"the qsa routes take {lo}..{hi} query heads; this case has {self.q_heads} (--q-heads)"
        if self.kv_heads != 1:
            return f"the qsa routes read one KV head; this case has {self.kv_heads} (--kv-heads 1)"
        if self.geometry is None:
            return "the qsa routes need a qsa_lab geometry; this case was loaded without one"
        if self.spec.kind != "sparse" and not torch.equal(attended_tokens(self),
                                                          attended_tokens(dataclasses.replace(self, spec=SPARSE))):
            return (f"the qsa routes attend the sparse selection; this case attends {self.spec}, "
                    "a different set (--attend sparse)")
        return None

    def to_case(self) -> Case:
        """The qsa_lab Case of this call (one KV head, a qsa_lab geometry): what the qsa routes run."""
        why = self.qsa_unsupported()
        if why:
            raise ValueError(f"case: {why}")
        g = self.geometry.replace(rows=self.rows, requests=self.requests, page_size=self.page_size,
                                  q_heads=self.q_heads, head_dim=self.head_dim, kv_dtype=self.kv_dtype,
                                  topk=int(self.selected.shape[1]))
        return self.view(Case, k_scale=float(self.k_scale), v_scale=float(self.v_scale), geometry=g,
                         poison=no_poison())

    @classmethod
    def from_case(cls, case: Case, spec=None) -> "CanaryCase":
        """A qsa_lab Case (one KV head) as a canary case, the same tensors; spec default sparse."""
        return case.view(cls, kv_dtype=case.kv_dtype, spec=spec, sm_scale=case.sm_scale)

    def geometry_dict(self) -> dict:
        base = self.geometry.to_dict() if self.geometry is not None else {}
        q = self.query_lens()
        return {**base, "rows": self.rows, "requests": self.requests, "page_size": self.page_size,
                "q_heads": self.q_heads, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "kv_dtype": self.kv_dtype, "context": int(self.seq_lens.max()),
                "topk": int(self.selected.shape[1]), "attend": str(self.spec),
                "query_len": int(q[0]) if bool((q == q[0]).all()) else None, "mla": self.mla,
                "v_head_dim": self.v_head_dim, "sm_scale": self.sm_scale, "source": self.source}

    def describe(self) -> str:
        q = self.query_lens()
        ql = f"query_len {int(q[0])}" if bool((q == q[0]).all()) else f"query_lens {q.tolist()}"
        mla = f", MLA v_head_dim {self.v_head_dim}" if self.mla else ""
        return (f"rows {self.rows}, {self.requests} req ({ql}), seq_lens {self.seq_lens.tolist()[:6]}"
                f"{' ...' if self.requests > 6 else ''}, page {self.page_size}, Hq {self.q_heads}, "
                f"Hkv {self.kv_heads}, D {self.head_dim}{mla}, {self.kv_dtype}, attend {self.spec}"
                + (f", seed {self.geometry.seed}" if self.geometry is not None else f", from {self.source}"))


def as_canary_case(case, spec=None) -> CanaryCase:
    """A CanaryCase (checked) from a CanaryCase or a qsa_lab Case; `spec` replaces its spec."""
    if isinstance(case, Case):
        validate_case(case)
        case = CanaryCase.from_case(case, spec)
    elif isinstance(case, CanaryCase):
        if spec is not None:
            case = dataclasses.replace(case, spec=spec)
    else:
        raise TypeError(f"case must be a qsa_lab Case or CanaryCase, got {type(case).__name__}")
    return validate(case)


def validate(case: CanaryCase) -> CanaryCase:
    """Raise ValueError naming the tensor when a shape, dtype or range is wrong."""
    check_tensors(case)
    need(case.kv_dtype in KV_DTYPES, "kv_dtype", f"one of {KV_DTYPES}, got {case.kv_dtype!r}")
    kv, q = case.kv_cache, case.q
    kv_dt = torch.float16 if case.kv_dtype == "fp16" else torch.uint8
    need(kv.dim() == 5 and kv.shape[1] == 2 and kv.dtype == kv_dt and kv.shape[0] >= 1, "kv_cache",
         f"[pages, 2, page_size, kv_heads, head_dim] {kv_dt}, got {list(kv.shape)} {kv.dtype}")
    need(q.dim() == 3 and q.dtype == torch.float16 and q.shape[2] == case.head_dim and q.shape[0] >= 1, "q",
         f"[rows, q_heads, head_dim={case.head_dim}] float16, got {list(q.shape)} {q.dtype}")
    need(case.q_heads % case.kv_heads == 0, "kv_heads",
         f"a divisor of q_heads ({case.q_heads}), got {case.kv_heads}")
    if case.mla:
        need(case.kv_heads == 1, "kv_heads", f"1 in MLA mode (one latent), got {case.kv_heads}")
        need(isinstance(case.v_head_dim, int) and 0 < case.v_head_dim <= case.head_dim, "v_head_dim",
             f"an int in 1..head_dim ({case.head_dim}) in MLA mode, got {case.v_head_dim!r}")
    for name in ("k_scale", "v_scale", "sm_scale"):
        s = getattr(case, name)
        need(isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) and s > 0, name,
             f"a finite number > 0, got {s!r}")
    R, rows = case.requests, case.rows
    bt, seq, t2r = case.block_table, case.seq_lens, case.token_to_req
    need(seq.dim() == 1 and seq.dtype == torch.int32 and R >= 1, "seq_lens", "[requests] int32, at least one")
    need(bt.dim() == 2 and bt.shape[0] == R and bt.dtype == torch.int32, "block_table",
         f"[requests={R}, max_pages] int32, got {list(bt.shape)} {bt.dtype}")
    check_pages(case)
    check_token_to_req(case)
    need(tuple(case.positions.shape) == (rows,) and case.positions.dtype == torch.int64, "positions",
         f"[rows={rows}] int64")
    ql = case.query_lens().to(seq.device).long()
    need(bool((ql >= 1).all()), "token_to_req", "at least one row per request")
    start = torch.cumsum(ql, 0) - ql
    want = seq.long()[t2r.long()] - ql[t2r.long()] + (torch.arange(rows, device=seq.device) - start[t2r.long()])
    need(torch.equal(case.positions, want), "positions",
         "each request's query rows at its last positions (row i of n: seq_len - n + i)")
    sel = case.selected
    need(sel.dim() == 2 and sel.shape[0] == rows and sel.dtype == torch.int32, "selected",
         f"[rows={rows}, topk] int32, got {list(sel.shape)} {sel.dtype}")
    if case.spec.kind == "sparse":
        need(sel.shape[1] >= 1, "selected", "block selections for a sparse spec (or --attend dense / window:W)")
        check_selection(case)
    attended_tokens(case)  # a mask spec is checked against the case here
    return case


def _pool(shape, kv_heads: int, kv_dtype: str, written: torch.Tensor, gen: torch.Generator):
    """A fresh K/V pool [pages, 2, page_size, kv_heads, head_dim] ~ N(0, 1) on `written` slots
    ([pages, page_size] bool), zero elsewhere, stored as kv_dtype. -> (pool, k_scale, v_scale)."""
    pages, _, ps, _, d = shape
    kv = torch.randn((pages, 2, ps, kv_heads, d), generator=gen) * written.view(pages, 1, ps, 1, 1)
    if kv_dtype == "fp16":
        return kv.to(torch.float16), 1.0, 1.0
    mx = fp8.MAX_FINITE[kv_dtype]
    scales = [float(kv[:, p].abs().max()) / mx for p in (0, 1)]
    return torch.stack([fp8.encode(kv[:, p] / scales[p], kv_dtype) for p in (0, 1)], dim=1), *scales


def _count(name: str, value, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}: must be an int, got {type(value).__name__} {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name}: must be in {lo}..{hi}, got {value}")
    return value


def canary_case(kv_dtype: str = "fp16", free_pages: int = FREE_PAGES, *, kv_heads: int = 1, attend="sparse",
                query_len: int | None = None, mla: bool = False, v_head_dim: int | None = None,
                max_memory=None, **geometry) -> CanaryCase:
    """The canary's case: CANARY_GEOMETRY with `geometry` overrides (rows, requests, context,
    topk, page_size, q_heads, head_dim, seed, layout, selection, overlap), `free_pages` spare
    pages, `kv_heads` KV heads (GQA; q_heads a multiple of it), the attention spec `attend`
    ('dense', 'sparse', 'window:W[,sink:S]' or an AttentionSpec), `query_len` rows per request
    (1 = decode; sets rows = requests * query_len). MLA: `mla=True`, head_dim = latent + rope
    (e.g. 576), `v_head_dim` (e.g. 512): one latent pool read as K and as V. Ranges:
    qsa_lab.model.geometry.CANARY_RANGES (q_heads 1..256, kv_heads a divisor of it, head_dim a
    multiple of 16 up to 1024), the others Geometry's.

    Before anything is allocated the memory the case takes in a canary run is estimated
    (qsa_lab.model.memory.canary_estimate) and a case above `max_memory` (bytes or text such as
    '8G'; default half the memory available now) is refused, naming the argument that drives it;
    run_canary checks each kernel's working set on top of it.

    With one KV head, at most 16 query heads and no MLA the pool is qsa_lab.model.case.build_case's,
    byte for byte (so the qsa routes give the verdicts of their own case); otherwise a fresh N(0, 1)
    pool (and, past 16 query heads, fresh queries)."""
    if query_len is not None:
        if not isinstance(query_len, int) or isinstance(query_len, bool) or query_len < 1:
            raise ValueError(f"query_len: must be an int >= 1, got {query_len!r}")
        requests = geometry.get("requests", CANARY_GEOMETRY.requests)
        if "rows" in geometry and geometry["rows"] != requests * query_len:
            raise ValueError(f"query_len: rows ({geometry['rows']}) must be requests x query_len "
                             f"({requests} x {query_len}); give one of --rows / --query-len")
        geometry["rows"] = requests * query_len
        geometry.setdefault("context", max(CANARY_GEOMETRY.context, query_len + requests + 3))
    kv_heads = _count("kv_heads", kv_heads, *CANARY_RANGES["kv_heads"])
    q_heads = _count("q_heads", geometry.get("q_heads", CANARY_GEOMETRY.q_heads), *CANARY_RANGES["q_heads"])
    _count("free_pages", free_pages, 0, 1 << 40)
    if mla and kv_heads != 1:
        raise ValueError(f"kv_heads: MLA reads one latent head, got {kv_heads}")
    fresh_q = q_heads > RANGES["q_heads"][1]          # past the qsa routes' range: built with one head
    g = CANARY_GEOMETRY.replace(kv_dtype=kv_dtype, **{**geometry, "q_heads": 1 if fresh_q else q_heads})
    if q_heads % kv_heads:
        raise ValueError(f"kv_heads: must divide q_heads ({q_heads}), got {kv_heads}")
    require_canary(max_memory, rows=g.rows, requests=g.requests, context=g.context, page_size=g.page_size,
                   kv_heads=kv_heads, head_dim=g.head_dim, kv_dtype=g.kv_dtype, free_pages=free_pages)
    # build_case's own estimate is the qsa routes' run, not this build: the run checks it per kernel
    base = with_free_pages(build_case(g, max_memory=NO_LIMIT), free_pages)
    case = CanaryCase.from_case(base, attend)
    if fresh_q:
        q = torch.randn((g.rows, q_heads, g.head_dim), generator=torch.Generator().manual_seed(g.seed + 2))
        case = dataclasses.replace(case, q=q.to(torch.float16))
    if kv_heads != 1 or mla:
        from qsa_lab.model.regions import _written

        written = _written(base)
        kv, ks, vs = _pool(base.kv_cache.shape, kv_heads, g.kv_dtype, written,
                           torch.Generator().manual_seed(g.seed + 1))
        if mla:
            kv[:, 1] = 0
            vs = 1.0
        case = dataclasses.replace(case, kv_cache=kv.contiguous(), k_scale=ks, v_scale=vs, mla=mla,
                                   v_head_dim=v_head_dim if mla else None)
    return validate(case)


# -- a saved case or a user's own dump --------------------------------------------------------------

CASE_FORMAT = """\
A case file (--case FILE) is a safetensors file (or a torch.save dict, .pt) holding:
  kv_cache     [pages, 2, page_size, kv_heads, head_dim] (or [pages, 2, page_size, head_dim]: one KV head)
               float16, or uint8 fp8 codes with metadata kv_dtype e4m3 / e5m2; plane 0 K, 1 V
  block_table  [requests, max_pages] int32, page 0 is the null block (entries past a request's
               last page are read as padding and set to 0)
  seq_lens     [requests] int32
  q            [rows, q_heads, head_dim] float16, rows grouped by request, each request's rows
               its last positions
optional:
  query_lens   [requests] int32 rows per request (default: rows / requests each)
  token_to_req [rows] int32, positions [rows] int64 (derived from query_lens when absent)
  selected     [rows, topk] int32 4-token block ids, -1 unused (needed for --attend sparse)
  k_scale, v_scale  0-d float32 (default 1); metadata kv_dtype, sm_scale, geometry (JSON)
A `qsa-lab diff --save` file is one of these.
"""


def _read_tensors(path) -> tuple[dict, dict]:
    import os
    from pathlib import Path

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected the path of a case file (str or Path), got {type(path).__name__}")
    if not str(path).strip():
        raise ValueError("path: empty")
    p = Path(path)
    if not p.is_file():
        if p.exists():   # a FIFO or a device would block the read
            raise ValueError(f"case: {p} is not a regular file")
        raise FileNotFoundError(f"case: no file {p}")
    if p.suffix in (".pt", ".pth"):
        try:   # weights_only: a pickle that names code to run is refused, never run
            obj = torch.load(p, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - UnpicklingError, a truncated file ...: bad input
            raise ValueError(f"case: {p} is not a tensor file torch loads safely (weights_only): "
                             f"{type(e).__name__}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"case: {p} holds a {type(obj).__name__}, expected a dict of tensors")
        meta = {k: v for k, v in obj.items() if isinstance(v, (str, int, float)) and not isinstance(v, bool)}
        return {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}, meta
    from safetensors import safe_open

    try:
        with safe_open(str(p), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except Exception as e:  # noqa: BLE001 - any unreadable file is bad input
        raise ValueError(f"case: {p} is not a safetensors file ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None


def _check_shapes(path, t: dict) -> None:
    """The ranks and lengths load_case relies on, before it indexes anything (ValueError naming
    the tensor, never an IndexError)."""
    def integral(x):
        return not x.is_floating_point() and not x.is_complex() and x.dtype != torch.bool

    kv, q, seq, bt = t["kv_cache"], t["q"], t["seq_lens"], t["block_table"]
    need(kv.dim() in (4, 5) and kv.numel() > 0, "kv_cache",
         f"[pages, 2, page_size, kv_heads, head_dim] (or without kv_heads) in {path}, got {list(kv.shape)}")
    need(q.dim() == 3 and q.shape[0] >= 1, "q", f"[rows, q_heads, head_dim] in {path}, got {list(q.shape)}")
    need(seq.dim() == 1 and seq.numel() >= 1 and integral(seq), "seq_lens",
         f"[requests] integers, at least one, in {path}, got {list(seq.shape)} {seq.dtype}")
    need(bt.dim() == 2 and bt.shape[0] == seq.numel() and integral(bt), "block_table",
         f"[requests={seq.numel()}, max_pages] integers in {path}, got {list(bt.shape)} {bt.dtype}")
    R, rows = seq.numel(), q.shape[0]
    if "query_lens" in t:
        ql = t["query_lens"]
        need(ql.dim() == 1 and ql.numel() == R and integral(ql) and bool((ql >= 0).all()), "query_lens",
             f"[requests={R}] integers >= 0 in {path}, got {list(ql.shape)} {ql.dtype}")
    elif "token_to_req" in t:
        t2r = t["token_to_req"]
        need(t2r.dim() == 1 and t2r.numel() == rows and integral(t2r) and bool(((t2r >= 0) & (t2r < R)).all()),
             "token_to_req", f"[rows={rows}] request ids in 0..{R - 1} in {path}, got {list(t2r.shape)} {t2r.dtype}")


def load_case(path, attend=None) -> CanaryCase:
    """A case file (CASE_FORMAT: a `diff --save` file or your engine's own dump) as a CanaryCase.
    attend: its spec (default sparse when it has selections, else dense)."""
    t, meta = _read_tensors(path)
    missing = [k for k in ("kv_cache", "block_table", "seq_lens", "q") if k not in t]
    if missing:
        raise ValueError(f"case: {path} lacks tensor(s) {missing} (see the case format in the README)")
    kv = t["kv_cache"]
    if kv.dim() == 4:
        kv = kv.unsqueeze(3)
    kv_dtype = str(meta.get("kv_dtype", "fp16" if kv.dtype == torch.float16 else ""))
    if kv.dtype == torch.uint8 and kv_dtype not in ("e4m3", "e5m2"):
        raise ValueError(f"case: {path}: a uint8 kv_cache needs metadata kv_dtype e4m3 or e5m2")
    _check_shapes(path, t)
    q, seq, bt = t["q"], t["seq_lens"].to(torch.int32), t["block_table"].to(torch.int32).clone()
    R, rows = seq.numel(), q.shape[0]
    if "query_lens" in t:
        ql = t["query_lens"].long()
    elif "token_to_req" in t:
        ql = torch.bincount(t["token_to_req"].long(), minlength=R)
    else:
        if rows % R:
            raise ValueError(f"case: {path}: {rows} query rows for {R} requests; add query_lens")
        ql = torch.full((R,), rows // R, dtype=torch.long)
    if int(ql.sum()) != rows:
        raise ValueError(f"case: {path}: query_lens sum to {int(ql.sum())}, q has {rows} rows")
    t2r = torch.repeat_interleave(torch.arange(R), ql).to(torch.int32)
    start = torch.cumsum(ql, 0) - ql
    positions = (seq.long()[t2r.long()] - ql[t2r.long()] + torch.arange(rows) - start[t2r.long()])
    ps = kv.shape[2]
    past = torch.arange(bt.shape[1]).unsqueeze(0) >= (-(-seq.long() // ps)).unsqueeze(1)
    bt[past] = 0
    sel = t.get("selected", torch.full((rows, 0), -1, dtype=torch.int32))
    if sel.dim() != 2 or sel.shape[0] != rows or sel.is_floating_point():
        raise ValueError(f"selected: expected [rows={rows}, topk] integers in {path}, got {list(sel.shape)} {sel.dtype}")
    sel = sel.to(torch.int32)
    geometry = None
    if "geometry" in meta:
        from qsa_lab.model.case import geometry_from_json

        try:
            geometry = geometry_from_json(meta["geometry"])
        except (TypeError, ValueError):
            geometry = None
    def number(key, default):
        try:
            return float(meta.get(key, default))
        except ValueError:     # the header is text: say which entry, not Python's float() words
            raise ValueError(f"{key}: expected a number in {path}'s header, got {meta[key]!r}") from None

    scale = {k: float(t[k]) if k in t else number(k, 1.0) for k in SCALES}
    sm = number("sm_scale", None) if "sm_scale" in meta else None
    spec = attend if attend is not None else ("sparse" if sel.shape[1] else "dense")
    case = CanaryCase(q, kv.contiguous(), scale["k_scale"], scale["v_scale"], bt, seq, t2r, positions, sel,
                      kv_dtype=kv_dtype, spec=spec, sm_scale=sm, geometry=geometry,
                      source=str(path))
    return validate(case)

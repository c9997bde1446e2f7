"""One paged-attention call's tensors, declared once: the record every view of a call is made of.

    q            [rows, q_heads, head_dim] fp16
    kv_cache     [pages, 2, page_size, kv_heads, head_dim] uint8 fp8 codes (e4m3/e5m2) or fp16;
                 plane 0 = K, 1 = V; value = decode(element) * scale
    k_scale, v_scale  per-tensor dequant scales (numbers, not tensors)
    block_table  [requests, max_pages] int32   logical page -> physical page; page 0 is the null block
    seq_lens     [requests] int32              tokens written per request
    token_to_req [rows] int32                  request of each query row, non-decreasing
    positions    [rows] int64                  logical position of each row (it sees tokens <= it)
    selected     [rows, topk] int32            logical 4-token block ids, -1 = unused

The views add what their use needs and never declare these fields again:

    qsa_lab.model.case.Case          + geometry, poison: what the qsa routes run (one KV head)
    qsa_lab.canary.case.CanaryCase   + kv_dtype, spec, sm_scale, mla, ...: a kernel's own call
    qsa_lab.canary.call.PagedCall    a CanaryCase on the run's device, + the run's memo

They subclass the record rather than hold one: `case.q`, `dataclasses.replace(case, kv_cache=...)`
and the region model (qsa_lab.model.regions) then read every view alike, and `view()` turns one
view into another that shares the same tensors, not copies of them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass
class PagedTensors:
    q: torch.Tensor
    kv_cache: torch.Tensor
    k_scale: float
    v_scale: float
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    token_to_req: torch.Tensor
    positions: torch.Tensor
    selected: torch.Tensor

    # -- shape ----------------------------------------------------------------------------------
    rows = property(lambda self: int(self.q.shape[0]))
    q_heads = property(lambda self: int(self.q.shape[1]))
    requests = property(lambda self: int(self.seq_lens.shape[0]))
    page_size = property(lambda self: int(self.kv_cache.shape[2]))
    kv_heads = property(lambda self: int(self.kv_cache.shape[3]))
    head_dim = property(lambda self: int(self.kv_cache.shape[4]))
    device = property(lambda self: self.q.device)

    def tensors(self) -> dict:
        """{name: tensor} of the record's tensor fields (TENSORS), the same objects."""
        return {k: getattr(self, k) for k in TENSORS}

    def to(self, device):
        """The same view with every tensor on `device` (a tensor already there is not copied)."""
        return dataclasses.replace(self, **{k: t.to(device) for k, t in self.tensors().items()})

    def clone(self):
        """The same view with fresh copies of every tensor."""
        return dataclasses.replace(self, **{k: t.clone() for k, t in self.tensors().items()})

    def view(self, cls, **changes):
        """This call as the view `cls` (a PagedTensors subclass): every field both views have is
        carried over as the same object; `changes` set or replace the others."""
        mine = {f.name for f in dataclasses.fields(self)}
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)
                      if f.init and f.name in mine and f.name not in changes}, **changes)


#: the record's fields, in order; its tensors (what a kernel is handed, and a case file holds
#: by name); its scales (numbers)
FIELDS = tuple(f.name for f in dataclasses.fields(PagedTensors))
TENSORS = tuple(f.name for f in dataclasses.fields(PagedTensors) if f.type == "torch.Tensor")
SCALES = tuple(name for name in FIELDS if name not in TENSORS)


def visible_tokens(record: PagedTensors) -> torch.Tensor:
    """[rows] int64 on the record's device: tokens each row may see, min(position + 1, seq_len)."""
    return torch.minimum(record.positions + 1, record.seq_lens.long()[record.token_to_req.long()])


# -- what every view checks: ValueError / TypeError naming the argument --------------------------

def need(ok, arg: str, what: str) -> None:
    if not ok:
        raise ValueError(f"{arg}: expected {what}")


def check_tensors(record: PagedTensors) -> torch.device:
    """Every tensor field a torch.Tensor, all on one device; -> that device."""
    for name, t in record.tensors().items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    devices = {t.device for t in record.tensors().values()}
    need(len(devices) == 1, "case", f"every tensor on one device, got {sorted(map(str, devices))}")
    return devices.pop()


def check_pages(record: PagedTensors) -> None:
    """The block table against the pool (block_table and seq_lens of the right shapes already):
    physical pages that exist, seq_lens the table can hold, no null block (page 0) inside a
    request's seq_len, and no physical page twice inside seq_lens (shared pages are not modelled)."""
    bt, seq, pages, ps = record.block_table, record.seq_lens, int(record.kv_cache.shape[0]), record.page_size
    need(bt.numel() == 0 or (int(bt.min()) >= 0 and int(bt.max()) < pages), "block_table",
         f"physical pages in [0, {pages})")
    need(int(seq.min()) >= 1 and int(seq.max()) <= bt.shape[1] * ps, "seq_lens",
         f"in [1, max_pages * page_size = {bt.shape[1] * ps}]")
    used = (torch.arange(bt.shape[1], device=bt.device) * ps).unsqueeze(0) < seq.long().unsqueeze(1)
    bad = (bt == 0) & used
    if bool(bad.any()):
        r, p = torch.nonzero(bad)[0].tolist()
        need(False, "block_table", f"no page 0 (the null block) inside seq_len; request {r}, logical page {p} is 0")
    flat = bt[used].long()
    twice = torch.bincount(flat, minlength=pages) > 1 if flat.numel() else flat.bool()
    if bool(twice.any()):
        page = int(torch.nonzero(twice)[0])
        where = torch.nonzero((bt == page) & used).tolist()
        need(False, "block_table", f"each physical page at most once inside seq_len (shared pages are not "
             f"modelled); page {page} is mapped at (request, logical page) {where[:4]}")


def check_token_to_req(record: PagedTensors) -> None:
    """token_to_req: [rows] int32, requests in range, each request's rows together and in order."""
    t2r, rows, reqs = record.token_to_req, record.rows, record.requests
    need(tuple(t2r.shape) == (rows,) and t2r.dtype == torch.int32 and int(t2r.min()) >= 0
         and int(t2r.max()) < reqs, "token_to_req", f"[rows={rows}] int32 in [0, {reqs})")
    need(bool((t2r[1:] >= t2r[:-1]).all()), "token_to_req", "non-decreasing (each request's rows together, in order)")


def check_selection(record: PagedTensors) -> None:
    """selected names only fully visible blocks of its row (or -1)."""
    sel = record.selected
    complete = (visible_tokens(record) // 4).unsqueeze(1)
    need(bool(((sel == -1) | ((sel >= 0) & (sel < complete))).all()), "selected",
         "-1 or a fully visible logical block id (< visible // 4)")

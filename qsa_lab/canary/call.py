"""One paged-attention call: the contract a kernel under test implements (`fn(call) -> out`),
and `KernelSkipped`, which a kernel raises when it cannot run here. Built-in kernels
(qsa_lab.canary.kernels) and the third-party adapters (qsa_lab.canary.adapters) both build on it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

from qsa_lab.canary.case import CanaryCase, as_canary_case, validate
from qsa_lab.model import fp8
from qsa_lab.model.regions import attended_tokens


class KernelSkipped(Exception):
    """Raised by a kernel that cannot run here (no GPU, shapes refused): the reason is reported."""


PLANE_INDEX = {"k": 0, "v": 1, 0: 0, 1: 1}


def plane_index(plane) -> int:
    """'k' | 'v' | 0 | 1 -> 0 (K) or 1 (V)."""
    if isinstance(plane, bool) or plane not in PLANE_INDEX:
        raise ValueError(f"plane: must be 'k', 'v', 0 or 1, got {plane!r}")
    return PLANE_INDEX[plane]


@dataclass
class PagedCall(CanaryCase):
    """One paged-attention call, tensors on `device` (each call gets its own fresh copies).

    q            [rows, q_heads, head_dim] fp16
    kv_cache     [pages, 2, page_size, kv_heads, head_dim] fp16, or uint8 fp8 codes (kv_dtype
                 e4m3 / e5m2); index 0 of dim 1 is K, 1 is V; value = decode(element) * scale.
                 GQA: query head h reads KV head h // (q_heads // kv_heads)
    k_scale, v_scale  float per-tensor scales; sm_scale the softmax scale
    block_table  [requests, max_pages] int32: logical page -> physical page; entries past a
                 request's last page are 0 (the null block)
    seq_lens     [requests] int32 tokens written per request
    token_to_req [rows] int32, positions [rows] int64
    selected     [rows, topk] int32 logical 4-token block ids, -1 unused (sparse selection)
    spec         qsa_lab.model.regions.AttentionSpec: what each row attends (attend_mask() is it)
    mla          MLA mode: plane 0 holds the latent (read as K, head_dim = latent + rope) and
                 V is its first `v_head_dim` dims; plane 1 unused. Output [rows, q_heads, v_head_dim]
    memo         a dict shared by every call of one kernel in one canary run: they differ only
                 in the pool's bytes, so anything derived from the rest (masks, tables) can be
                 cached here (`cached`)

    Layout: rows are grouped by request in request order; a request's query rows are its
    LAST positions (row i of a request with n rows: position seq_len - n + i). Decode is one
    row per request; a prefill chunk is several (query_lens(), qo_indptr()).
    The kernel returns [rows, q_heads, head_dim] (v_head_dim in MLA mode), any float dtype,
    on `device`: it is compared bit for bit against the same kernel's control run.

    It is the canary's case (qsa_lab.canary.case.CanaryCase, the paged record of
    qsa_lab.model.paged) on the run's device, plus the run's memo.
    """

    memo: dict = field(default_factory=dict, repr=False, kw_only=True)

    @classmethod
    def from_case(cls, case, device="cpu", memo: dict | None = None) -> "PagedCall":
        """From a CanaryCase or a qsa_lab Case (its tensors, moved to `device`; not copied)."""
        c = as_canary_case(case)
        c = c.to(device) if str(device) != str(c.device) else c
        return c.view(cls, k_scale=float(c.k_scale), v_scale=float(c.v_scale), sm_scale=float(c.sm_scale),
                      memo={} if memo is None else memo)

    def cached(self, key: str, make: Callable):
        """memo[key], computed by make() on first use."""
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    def with_spec(self, spec) -> "PagedCall":
        """The call under another spec, with a memo of its own (the cached masks would be stale)."""
        return validate(dataclasses.replace(self, spec=spec, memo={}))

    @property
    def case(self) -> CanaryCase:
        """This call as a CanaryCase (CPU; the same tensors when the call is on the CPU)."""
        return self.view(CanaryCase).to("cpu")

    def to_case(self):
        """The qsa_lab Case of this call (what the qsa routes run; one KV head only)."""
        return self.case.to_case()

    # -- tables adapters rebuild ----------------------------------------------------------------------
    def query_lens(self) -> torch.Tensor:
        """[requests] int32: query rows per request."""
        return self.cached("query_lens", lambda: torch.bincount(
            self.token_to_req.long(), minlength=self.requests).to(torch.int32))

    def qo_indptr(self) -> torch.Tensor:
        """[requests + 1] int32: cumulative query rows (request r's rows are qo_indptr[r]:qo_indptr[r+1])."""
        return self.cached("qo_indptr", lambda: _indptr(self.query_lens()))

    def kv_indptr(self) -> torch.Tensor:
        """[requests + 1] int32: cumulative seq_lens."""
        return self.cached("kv_indptr", lambda: _indptr(self.seq_lens))

    def page_table(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """FlashInfer's paged layout, only each request's used pages (never a padding entry):
        (indptr [requests + 1] int32, indices [nnz] int32 physical pages, last_page_len [requests] int32)."""
        def make():
            ps, seq = self.page_size, self.seq_lens.long()
            used = -(-seq // ps)
            keep = torch.arange(self.block_table.shape[1], device=seq.device).unsqueeze(0) < used.unsqueeze(1)
            return _indptr(used), self.block_table[keep].to(torch.int32), (seq - (used - 1) * ps).to(torch.int32)
        return self.cached("page_table", make)

    def row_slots(self) -> torch.Tensor:
        """[rows, max_pages * page_size] int64 (CPU): physical token ids (page * page_size + slot)
        of the whole pages of each row's block table, in logical order (what a paged kernel walks)."""
        def make():
            ps = self.page_size
            pages = self.block_table.cpu().long()[self.token_to_req.cpu().long()]        # [rows, max_pages]
            return (pages.unsqueeze(-1) * ps + torch.arange(ps)).flatten(1)
        return self.cached("row_slots", make)

    def attend(self) -> torch.Tensor:
        """[rows, max_pages * page_size] bool (CPU): which of row_slots() the row attends,
        i.e. qsa_lab.model.regions.attended_tokens of this call (the spec's definition)."""
        return self.cached("attend", lambda: attended_tokens(self))

    def attend_mask(self) -> torch.Tensor:
        """attend() on `device`: [rows, max_tokens] bool over each row's logical positions."""
        return self.cached("attend_mask", lambda: self.attend().to(self.device))

    def pages(self, plane, heads: str = "kv") -> torch.Tensor:
        """[rows, max_pages * page_size, H, head_dim] fp16 on `device`: decoded values (scale
        applied) of row_slots() on plane "k" / 0 or "v" / 1; H = kv_heads, or q_heads with
        heads="q" (each KV head repeated for its query heads). MLA: both planes read the
        latent, "v" its first v_head_dim dims."""
        p = plane_index(plane)
        vals = self.pool(p)[self.row_slots().to(self.device)]
        if self.mla and p == 1:
            vals = vals[..., :self.v_head_dim]
        if heads == "q":
            vals = vals.repeat_interleave(self.q_heads // self.kv_heads, dim=2)
        elif heads != "kv":
            raise ValueError(f"heads: must be 'kv' or 'q', got {heads!r}")
        return vals

    def pool(self, plane) -> torch.Tensor:
        """[pages * page_size, kv_heads, head_dim] fp16 on `device`: the whole pool's decoded
        values of one plane (MLA: plane 0 for both K and V)."""
        p = plane_index(plane)
        src = 0 if self.mla else p
        scale = self.k_scale if src == 0 else self.v_scale
        raw = self.kv_cache[:, src]
        vals = raw.float() if self.kv_dtype == "fp16" else fp8.decode(raw, self.kv_dtype)
        return (vals * scale).to(torch.float16).flatten(0, 1)


def _indptr(counts: torch.Tensor) -> torch.Tensor:
    return torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]).to(torch.int32)

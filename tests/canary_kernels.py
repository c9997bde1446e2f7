"""Kernels of known behaviour for the canary's tests, importable by name (`canary_kernels:fn`)
so that the CLI runs them in its worker process too. Each takes a PagedCall at any geometry
(GQA, prefill chunks) and returns [rows, q_heads, head_dim]."""
import sys
import threading

import torch

from qsa_lab.canary.examples import dense_kernel


def _kv(call, plane):
    return call.pages(plane, heads="q").float()                                      # [rows, S, q_heads, D]


def _attention(call, keep, k, v):
    """softmax over `keep` [rows, S] of q.k, then P @ V."""
    s = torch.einsum("rhd,rshd->rhs", call.q.float(), k) * call.sm_scale
    p = torch.softmax(torch.where(keep.unsqueeze(1), s, -torch.inf), dim=-1)
    return torch.einsum("rhs,rshd->rhd", p, v)


def reference(call):
    """The correct masked kernel: reads whole pages, drops every unattended slot (select, never
    multiply) before any arithmetic. Clean for every spec by construction."""
    keep = call.attend_mask()
    drop = ~keep.view(*keep.shape, 1, 1)
    k = _kv(call, "k").masked_fill(drop, 0.0)
    v = _kv(call, "v").masked_fill(drop, 0.0)
    return _attention(call, keep, k, v).to(torch.float16)


def zero_times_v(call):
    """Masks scores, then P @ V over every reachable slot: 0 * NaN = NaN leaks from V only."""
    keep = call.attend_mask()
    k = _kv(call, "k").masked_fill(~keep.view(*keep.shape, 1, 1), 0.0)
    return _attention(call, keep, k, _kv(call, "v")).to(torch.float16)


def extra_token(call):
    """The reference kernel that also attends position seq_len of each row's request (an
    off-by-one end): a slot of the stale tail when the last page has room."""
    keep = call.attend_mask().clone()
    seq = call.seq_lens.long()[call.token_to_req.long()]
    rows = torch.arange(call.rows, device=keep.device)
    ok = seq < keep.shape[1]
    keep[rows[ok], seq[ok]] = True
    drop = ~keep.view(*keep.shape, 1, 1)
    k = _kv(call, "k").masked_fill(drop, 0.0)
    v = _kv(call, "v").masked_fill(drop, 0.0)
    return _attention(call, keep, k, v).to(torch.float16)


def dense(call):
    """A dense causal kernel that ignores the canary's spec: each row attends its request's
    tokens up to its own position, and reads only those (like FlashInfer, vLLM, FA). The package's
    example (notebook 06's), named here so the tests' kernel names stay canary_kernels:*."""
    return dense_kernel(call)


dense.paged_inputs = dense_kernel.paged_inputs   # "page_table": it never looks at block-table padding


# -- hostile kernels -------------------------------------------------------------------------------

def raises(call):
    raise RuntimeError("no kernel image for this device")


def exits(call):
    sys.exit(0)


def interrupts(call):
    raise KeyboardInterrupt


_forever = threading.Event()


def hangs(call):
    print("hanging", file=sys.stderr, flush=True)
    _forever.wait(3600)
    return reference(call)


def nan_everywhere(call):
    return torch.full(call.q.shape, float("nan"), dtype=torch.float16)


def nan_control(call):
    """zero_times_v (which leaks) with one NaN output always: the control holds NaN."""
    out = zero_times_v(call)
    out[0, 0, 0] = float("nan")
    return out


def noisy(call):
    return (reference(call).float() + 1e-3 * torch.rand(call.q.shape)).to(torch.float16)


def alternating(call):
    n = call.memo["n"] = call.memo.get("n", 0) + 1
    return (reference(call).float() + (n % 2) * 1e-2).to(torch.float16)


def prints(call):
    print("hello from the kernel")
    return reference(call)


def _editor(name):
    def edit(call):
        out = reference(call)
        t = getattr(call, name)
        t.view(torch.uint8).zero_() if t.dtype == torch.float16 else t.zero_()
        return out
    edit.__name__ = edit.__qualname__ = f"edits_{name}"
    return edit


EDITED = ("q", "kv_cache", "block_table", "seq_lens", "token_to_req", "positions", "selected")
for _name in EDITED:
    globals()[f"edits_{_name}"] = _editor(_name)


def returns_list(call):
    return [0.0]


def returns_ints(call):
    return torch.zeros(call.q.shape, dtype=torch.int32)


def returns_meta(call):
    return torch.empty(call.q.shape, dtype=torch.float16, device="meta")


def _plus_zero_weight_page(call, page_of_request):
    """reference() plus 0 x (K and V of one extra page per row, summed over its slots): the
    P@V of a page the row reads with zero weight, where 0 * NaN = NaN.
    page_of_request(indptr, indices) -> [requests] physical page (-1: none)."""
    indptr, indices, _ = call.page_table()
    extra = page_of_request(indptr.long(), indices.long())[call.token_to_req.long()]      # [rows]
    ps = call.page_size
    slots = extra.clamp(min=0).unsqueeze(1) * ps + torch.arange(ps, device=extra.device)  # [rows, ps]
    kv = (call.pool("k")[slots].float() + call.pool("v")[slots].float()).sum(1)           # [rows, Hkv, D]
    kv = kv.repeat_interleave(call.q_heads // call.kv_heads, dim=1)[..., :call.out_dim]
    leak = torch.where((extra >= 0).view(-1, 1, 1), 0.0 * kv, 0.0)
    return (reference(call).float() + leak).to(torch.float16)


def reads_past_last_page(call):
    """An off-by-one in a request's page count: each request also reads the entry after its
    last one in the packed page list (FlashInfer's kv_indices), i.e. the next request's first page."""
    return _plus_zero_weight_page(call, lambda indptr, indices: torch.where(
        indptr[1:] < indices.numel(), indices[indptr[1:].clamp(max=indices.numel() - 1)], -1))


def reads_other_request_page(call):
    """A wrong block-table row: each request also reads the first page of the previous request
    (request 0 the last one's)."""
    return _plus_zero_weight_page(call, lambda indptr, indices: indices[indptr[:-1].roll(1)])


def request0_reads_request1(call):
    """A wrong block-table row for request 0 only: its rows also read request 1's first page
    (every other request reads only its own pages)."""
    def page(indptr, indices):
        out = torch.full((indptr.numel() - 1,), -1, dtype=indices.dtype, device=indices.device)
        if out.numel() > 1:
            out[0] = indices[indptr[1]]
        return out
    return _plus_zero_weight_page(call, page)

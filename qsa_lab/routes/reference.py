"""The reference: dense float64 attention over each row's attended tokens, same scales."""
from __future__ import annotations

import torch

from ..case import Case
from ..plan import xqa_tokens
from ..procs import torch_threads
from .emulate import gather_tokens


def reference_forward(case: Case) -> torch.Tensor:
    """-> [rows, q_heads, head_dim] float64."""
    token_index, token_count = xqa_tokens(case)
    return reference_from_tokens(case, *gather_tokens(case.kv_cache, token_index, token_count, case.kv_format))


def reference_from_tokens(case: Case, K, V, valid, tokens: int | None = None) -> torch.Tensor:
    """reference_forward on every row's tokens as gather_tokens gives them (shared with XQA).
    tokens: the slots to use, when K, V and valid hold more (XQA's partition padding).

    One row at a time, on one torch thread: a row's float64 copy of K and V is a few MB that
    the allocator hands back for the next row, where the whole batch's was hundreds of MB of
    fresh pages (faulting them in took longer than the arithmetic). The batched products ran
    each row's on one thread, so on one thread each row's are bit for bit the same (a row's
    product on two threads is not: tests/test_bit_identity.py); the softmax is row by row."""
    T = K.shape[1] if tokens is None else tokens
    q, out = case.q.double(), torch.empty(case.q.shape, dtype=torch.float64)
    with torch_threads(1):
        for n in range(K.shape[0]):   # in place on the row's copy: no second one
            k, v = K[n].double().mul_(case.k_scale)[:T], V[n].double().mul_(case.v_scale)[:T]
            s = torch.einsum("hd,td->ht", q[n], k).mul_(case.sm_scale)
            s = torch.where(valid[n, :T], s, -torch.inf)
            out[n] = torch.einsum("ht,td->hd", torch.softmax(s, dim=-1), v)
    return out

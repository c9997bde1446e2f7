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

    On the CPU one row at a time, on one torch thread: a row's float64 copy of K and V is a few
    MB that the allocator hands back for the next row, where the whole batch's was hundreds of
    MB of fresh pages (faulting them in took longer than the arithmetic). The batched products
    ran each row's on one thread, so on one thread each row's are bit for bit the same (a row's
    product on two threads is not: tests/test_bit_identity.py); the softmax is row by row."""
    T = K.shape[1] if tokens is None else tokens
    q = case.q.double()
    if K.device.type != "cpu":
        return reference_rows(case, q, K, V, valid, T)
    out = torch.empty_like(q)
    with torch_threads(1):
        for n in range(K.shape[0]):
            out[n:n + 1] = reference_rows(case, q[n:n + 1], K[n:n + 1], V[n:n + 1], valid[n:n + 1], T)
    return out


def reference_rows(case: Case, q, K, V, valid, T: int) -> torch.Tensor:
    """The reference of the rows of q [n, Hq, D] float64 from their first T token slots."""
    K, V = K.double().mul_(case.k_scale)[:, :T], V.double().mul_(case.v_scale)[:, :T]  # in place: no second copy
    s = torch.einsum("nhd,ntd->nht", q, K).mul_(case.sm_scale)
    s = torch.where(valid[:, :T].unsqueeze(1), s, -torch.inf)
    return torch.einsum("nht,ntd->nhd", torch.softmax(s, dim=-1), V)

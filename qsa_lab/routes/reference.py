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


#: above this many bytes of float64 K and V for all rows together, the reference and XQA run a
#: row at a time (by_rows); below it, the whole batch at once (the ops' own threads)
BATCH_BYTES = 16 << 20


def by_rows(device, elements: int) -> bool:
    """Run the reference / XQA one row at a time, on one torch thread, for gathered K [n, T, D]
    of `elements` elements on `device`? On the CPU, when the batch's float64 copies of K and V
    exceed BATCH_BYTES: a row's are a few MB that the allocator hands back for the next row,
    where the whole batch's were hundreds of MB of fresh pages (faulting them in took longer
    than the arithmetic). A small case stays batched: a loop over its rows only adds per-op
    overhead (the canary's in-process qsa routes took 1.4x as long). Both ways give the same
    bits: the batched products ran each row's on one thread, and on one thread each row's are
    those (a row's product on two threads is not: tests/test_bit_identity.py); the softmax is
    row by row."""
    return torch.device(device).type == "cpu" and 2 * 8 * elements > BATCH_BYTES


def reference_from_tokens(case: Case, K, V, valid, tokens: int | None = None) -> torch.Tensor:
    """reference_forward on every row's tokens as gather_tokens gives them (shared with XQA).
    tokens: the slots to use, when K, V and valid hold more (XQA's partition padding); rows one
    at a time where by_rows says so."""
    T = K.shape[1] if tokens is None else tokens
    q = case.q.double()
    if not by_rows(K.device, K.numel()):
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

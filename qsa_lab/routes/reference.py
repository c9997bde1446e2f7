"""The reference: dense float64 attention over each row's attended tokens, same scales."""
from __future__ import annotations

import torch

from ..case import Case
from ..plan import xqa_tokens
from .emulate import gather_tokens


def reference_forward(case: Case) -> torch.Tensor:
    """-> [rows, q_heads, head_dim] float64."""
    token_index, token_count = xqa_tokens(case)
    return reference_from_tokens(case, *gather_tokens(case.kv_cache, token_index, token_count, case.kv_format))


def reference_from_tokens(case: Case, K, V, valid, tokens: int | None = None) -> torch.Tensor:
    """reference_forward on every row's tokens as gather_tokens gives them (shared with XQA).
    tokens: the slots to use, when K, V and valid hold more (XQA's partition padding): the
    whole tensors are converted to float64 (a contiguous copy is much faster than one of a
    slice) and the first `tokens` slots of that copy used."""
    T = K.shape[1] if tokens is None else tokens
    K, V = K.double().mul_(case.k_scale)[:, :T], V.double().mul_(case.v_scale)[:, :T]  # in place: no second copy
    s = torch.einsum("nhd,ntd->nht", case.q.double(), K).mul_(case.sm_scale)
    s = torch.where(valid[:, :T].unsqueeze(1), s, -torch.inf)
    return torch.einsum("nht,ntd->nhd", torch.softmax(s, dim=-1), V)

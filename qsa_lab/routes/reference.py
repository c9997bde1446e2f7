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


def reference_from_tokens(case: Case, K, V, valid) -> torch.Tensor:
    """reference_forward on every row's tokens as gather_tokens gives them (shared with XQA)."""
    K, V = K.double().mul_(case.k_scale), V.double().mul_(case.v_scale)  # in place: no second copy
    s = torch.einsum("nhd,ntd->nht", case.q.double(), K).mul_(case.sm_scale)
    s = torch.where(valid.unsqueeze(1), s, -torch.inf)
    return torch.einsum("nht,ntd->nhd", torch.softmax(s, dim=-1), V)

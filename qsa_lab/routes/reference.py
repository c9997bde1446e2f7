"""The reference: dense float64 attention over each row's attended tokens, same scales."""
from __future__ import annotations

import contextlib
import functools

import torch

from qsa_lab.model.case import Case, slot_values
from qsa_lab.model.plan import xqa_tokens
from qsa_lab.support.processes import torch_threads
from qsa_lab.routes.emulate import token_slots, xqa_values, xqa_weights


def reference_forward(case: Case) -> torch.Tensor:
    """-> [rows, q_heads, head_dim] float64."""
    token_index, token_count = xqa_tokens(case)
    return every_row(case, token_index, token_count, token_index.shape[1], reference=True)[0]


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
    those (a row's product on two threads is not, in the last bit); the softmax is row by row."""
    return torch.device(device).type == "cpu" and 2 * 8 * elements > BATCH_BYTES


def every_row(case: Case, index, count, width: int, *, reference: bool = True, xqa: bool = False,
              units=None) -> tuple:
    """-> (reference64 or None, XQA output or None) of every row from its token lists (index,
    count: plan.xqa_tokens), gathered once for both over `width` slots (XQA's partition padding
    included; the reference reads the first index.shape[1]): the whole batch at once, or one
    row at a time on one torch thread where by_rows says so (the same bits either way:
    tests/routes/test_reference_batching.py). Each batch computes its K side (the softmax
    weights) and then its V side. units: a routes.reuse.CleanUnits bound to this case: a batch (a
    row, or all of them) that reads none of the tokens where the cache differs from its base's is
    taken from it, and so is its K side where only V differs there (cross-request's runs poison V)."""
    T, rows = index.shape[1], case.q.shape[0]
    one_by_one = by_rows(case.q.device, rows * width * case.q.shape[-1])
    q64 = case.q.double() if reference else None
    ref = torch.empty_like(q64) if reference else None
    out = torch.empty_like(case.q) if xqa else None
    values = functools.partial(slot_values, case.kv_cache, kv_dtype=case.kv_dtype)

    def weights(part, slots, valid):
        K = values(slots, valid, 0)
        return (reference_weights(case, q64[part], K, valid, T) if reference else None,
                xqa_weights(case.q[part], K, valid, case.k_scale, kv_dtype=case.kv_dtype, sm_scale=case.sm_scale)
                if xqa else None)

    def batch(part, unit=None):
        """unit: (key, tokens, signature) of the batch's unit, whose K side is a unit of its own"""
        slots, valid = token_slots(index[part], count[part], width)
        w = weights(part, slots, valid) if unit is None else units(
            (*unit[0], "K"), unit[1], lambda: weights(part, slots, valid), unit[2], planes=(0,))
        V = values(slots, valid, 1)
        return (reference_values(case, w[0], V, T) if reference else None,
                xqa_values(w[1], V, case.v_scale, kv_dtype=case.kv_dtype) if xqa else None)

    in_list = torch.arange(T, device=index.device)
    with torch_threads(1) if one_by_one else contextlib.nullcontext():
        for part in [slice(n, n + 1) for n in range(rows)] if one_by_one else [slice(None)]:
            if units is None:
                r, x = batch(part)
            else:
                key, signature = ("rows", part.start, part.stop, width, reference, xqa), (index[part], count[part])
                tokens = index[part][in_list < count[part].long().unsqueeze(1)]   # the slots it reads
                unit = (key, tokens, signature)
                r, x = units(key, tokens, lambda part=part, unit=unit: batch(part, unit), signature)
            if reference:
                ref[part] = r
            if xqa:
                out[part] = x
    return ref, out


def reference_weights(case: Case, q, K, valid, T: int) -> torch.Tensor:
    """The reference's K side: the softmax over the rows' first T token slots -> [n, Hq, T] float64."""
    K = K.double().mul_(case.k_scale)[:, :T]  # in place: no second copy
    s = torch.einsum("nhd,ntd->nht", q, K).mul_(case.sm_scale)
    return torch.softmax(torch.where(valid[:, :T].unsqueeze(1), s, -torch.inf), dim=-1)


def reference_values(case: Case, P, V, T: int) -> torch.Tensor:
    """The reference's V side: P [n, Hq, T] (reference_weights) times the scaled V -> [n, Hq, D] float64."""
    return torch.einsum("nht,ntd->nhd", P, V.double().mul_(case.v_scale)[:, :T])

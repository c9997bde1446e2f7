"""A user's own paged attention kernel, to try `qsa-lab canary --kernel` on (README, Canary guide).

    qsa-lab canary --kernel examples/mykernels.py:paged_decode --attend dense \
        --q-heads 32 --kv-heads 8 --head-dim 128

`paged_decode` is written the way many first versions are: gather each request's whole pages
through the block table, mask the scores of the tokens a row does not attend, softmax, `P @ V`.
The mask gives those tokens probability 0, but their V rows are still multiplied in, and
`0 * NaN = NaN`: the canary finds NaN leaking from the null block (the block table's padding
entries point at page 0) and from the stale tail of each request's last page. `paged_decode_fixed`
zeroes the V rows no query attends before `P @ V` and is clean.

A kernel takes a `qsa_lab.canary.PagedCall` and returns `[rows, q_heads, head_dim]`.
"""
from __future__ import annotations

import torch

from qsa_lab.canary import KernelSkipped


def _attention(call, zero_unattended_v: bool) -> torch.Tensor:
    if call.kv_cache.dtype != torch.float16:
        raise KernelSkipped("this example reads fp16 KV caches only")
    req = call.token_to_req.long()
    pages = call.block_table.long()[req]                                   # [rows, max_pages] physical pages
    kv = call.kv_cache[pages]                                              # [rows, max_pages, 2, page_size, kv_heads, D]
    rows, max_pages, _, page_size, kv_heads, dim = kv.shape
    group = call.q.shape[1] // kv_heads                                    # GQA: query heads per KV head
    k = kv[:, :, 0].reshape(rows, max_pages * page_size, kv_heads, dim).repeat_interleave(group, dim=2)
    v = kv[:, :, 1].reshape(rows, max_pages * page_size, kv_heads, dim).repeat_interleave(group, dim=2)
    token = torch.arange(max_pages * page_size, device=kv.device)
    seq_len = call.seq_lens.long()[req]
    attend = (token[None, :] <= call.positions[:, None]) & (token[None, :] < seq_len[:, None])   # causal
    scores = torch.einsum("rhd,rthd->rht", call.q.float(), k.float() * call.k_scale) * call.sm_scale
    p = torch.softmax(scores.masked_fill(~attend[:, None, :], float("-inf")), dim=-1)
    v = v.float() * call.v_scale
    if zero_unattended_v:
        v = v.masked_fill(~attend[:, :, None, None], 0.0)                 # the fix: no byte it ignores reaches P @ V
    return torch.einsum("rht,rthd->rhd", p, v).to(torch.float16)


def paged_decode(call) -> torch.Tensor:
    """Leaks: unattended V rows get probability 0, and 0 * NaN = NaN."""
    return _attention(call, zero_unattended_v=False)


def paged_decode_fixed(call) -> torch.Tensor:
    """The same with every V row no query attends zeroed before P @ V: clean."""
    return _attention(call, zero_unattended_v=True)


# what `qsa-lab canary --search` may draw for these kernels (qsa_lab.canary.leak_search.Limits): fp16 pools only
paged_decode.canary_limits = paged_decode_fixed.canary_limits = {"kv_dtypes": ("fp16",)}

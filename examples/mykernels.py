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
    rows, q_heads, dim = call.q.shape
    kv_heads = call.kv_cache.shape[-2]
    group = q_heads // kv_heads                                            # GQA: query heads per KV head
    req = call.token_to_req.long()
    out = torch.empty(rows, q_heads, dim, dtype=torch.float16, device=call.q.device)
    for r in req.unique().tolist():                                        # one request at a time
        mine = (req == r).nonzero().squeeze(1)                             # its query rows
        kv = call.kv_cache[call.block_table[r].long()]                     # [max_pages, 2, page_size, kv_heads, D]
        k = kv[:, 0].reshape(-1, kv_heads, dim).float() * call.k_scale    # [tokens, kv_heads, D]
        v = kv[:, 1].reshape(-1, kv_heads, dim).float() * call.v_scale
        token = torch.arange(k.shape[0], device=kv.device)
        attend = (token[None, :] <= call.positions[mine, None]) & (token[None, :] < call.seq_lens[r])  # causal
        q = call.q[mine].float().view(len(mine), kv_heads, group, dim)     # each KV head's group of query heads
        scores = torch.einsum("nhgd,thd->nhgt", q, k) * call.sm_scale
        p = torch.softmax(scores.masked_fill(~attend[:, None, None, :], float("-inf")), dim=-1)
        if zero_unattended_v:     # the fix: no byte a row ignores reaches its P @ V
            o = torch.einsum("nhgt,nthd->nhgd", p, v.masked_fill(~attend[:, :, None, None], 0.0))
        else:
            o = torch.einsum("nhgt,thd->nhgd", p, v)
        out[mine] = o.reshape(len(mine), q_heads, dim).to(torch.float16)
    return out


def paged_decode(call) -> torch.Tensor:
    """Leaks: unattended V rows get probability 0, and 0 * NaN = NaN."""
    return _attention(call, zero_unattended_v=False)


def paged_decode_fixed(call) -> torch.Tensor:
    """The same with every V row no query attends zeroed before P @ V: clean."""
    return _attention(call, zero_unattended_v=True)


# what `qsa-lab canary --search` may draw for these kernels (qsa_lab.canary.leak_search.Limits): fp16 pools only
paged_decode.canary_limits = paged_decode_fixed.canary_limits = {"kv_dtypes": ("fp16",)}

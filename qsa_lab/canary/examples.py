"""Small kernels to canary, written as a user would write theirs (notebook 06, README).

    dense_kernel   causal attention over each row's own request, reading only the tokens it
                   attends: clean when the canary is told `attend="dense"`, and "leaking" the
                   tokens a sparse spec leaves out when it is told `attend="sparse"` (the
                   spec, not the kernel, is wrong there: the `max` payload's note says so)
"""
from __future__ import annotations

import torch


def dense_kernel(call):
    """Causal attention over each row's own request, reading only the tokens it attends.
    call: qsa_lab.canary.PagedCall -> [rows, q_heads, head_dim] fp16."""
    pos = call.positions.unsqueeze(1).cpu()
    seq = call.seq_lens.long()[call.token_to_req.long()].unsqueeze(1).cpu()
    t = torch.arange(call.row_slots().shape[1]).unsqueeze(0)
    keep = ((t <= pos) & (t < seq)).to(call.device)                      # [rows, tokens]
    drop = ~keep[:, :, None, None]
    k = call.pages("k", heads="q").float().masked_fill(drop, 0.0)       # [rows, tokens, q_heads, head_dim]
    v = call.pages("v", heads="q").float().masked_fill(drop, 0.0)
    s = torch.einsum("rhd,rshd->rhs", call.q.float(), k) * call.sm_scale
    p = torch.softmax(s.masked_fill(~keep[:, None, :], -torch.inf), dim=-1)
    return torch.einsum("rhs,rshd->rhd", p, v).to(torch.float16)


dense_kernel.paged_inputs = "page_table"   # it walks each request's used pages only

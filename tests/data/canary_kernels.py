"""Two hand-written canary kernels for the report, replay and pytest-plugin tests (loaded as
tests/data/canary_kernels.py:leaky / :masked). Both compute softmax(q k^T) v over every slot of
each row's block table with the unattended slots' scores at -inf; `leaky` then multiplies the
zero weights into every slot's V (0 * NaN = NaN: a V leak wherever the spec leaves reachable
tokens unattended), `masked` zeroes those V first (clean)."""
import torch


def _attention(call, zero_unattended_v: bool) -> torch.Tensor:
    mask = call.attend_mask()                                  # [rows, slots] bool
    k = call.pages("k", heads="q").float()                     # [rows, slots, q_heads, head_dim]
    v = call.pages("v", heads="q").float()
    s = torch.einsum("rhd,rshd->rhs", call.q.float(), k) * call.sm_scale
    p = torch.softmax(s.masked_fill(~mask[:, None, :], float("-inf")), dim=-1)
    if zero_unattended_v:
        v = v.masked_fill(~mask[:, :, None, None], 0.0)
    return torch.einsum("rhs,rshd->rhd", p, v)


def leaky(call):
    return _attention(call, zero_unattended_v=False)


def masked(call):
    return _attention(call, zero_unattended_v=True)

"""Attention functions written as a user would write theirs, for the scribble's tests (`--attn
tests/scribble/user_attention.py:one_more_key`). Each takes paged|eager's place for a run."""
import time

import torch
from transformers.integrations.eager_paged import eager_paged_attention_forward


def one_more_key(module, query, key, value, attention_mask, scaling, **kwargs):
    """paged|eager one request at a time, but each request also meets the first key row of the next
    request in the batch, masked: a read of another live request's KV with weight exactly 0."""
    print("one_more_key runs")             # a user's print: stderr in a worker, never the report's stdout
    cu_q, cu_k = kwargs["cu_seq_lens_q"].tolist(), kwargs["cu_seq_lens_k"].tolist()
    out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])
    n = len(cu_q) - 1
    for i, (qs, qe, ks, ke) in enumerate(zip(cu_q, cu_q[1:], cu_k, cu_k[1:])):
        j = cu_k[(i + 1) % n]
        k = torch.cat([key[:, :, ks:ke], key[:, :, j:j + 1]], dim=2)
        v = torch.cat([value[:, :, ks:ke], value[:, :, j:j + 1]], dim=2)
        mask = attention_mask[..., qs:qe, ks:ke]
        mask = torch.cat([mask, torch.full_like(mask[..., :1], torch.finfo(mask.dtype).min)], dim=-1)
        out[:, qs:qe], _ = eager_paged_attention_forward(module, query[:, :, qs:qe], k, v, mask, scaling, **kwargs)
    return out, None


def stuck(module, query, key, value, attention_mask, scaling, **kwargs):
    """Never returns."""
    time.sleep(3600)


def heads_first(module, query, key, value, attention_mask, scaling, **kwargs):
    """paged|eager's output in the wrong layout: [batch, heads, query rows, head dim]."""
    out, weights = eager_paged_attention_forward(module, query, key, value, attention_mask, scaling, **kwargs)
    return out.transpose(1, 2), weights


def nan_everywhere(module, query, key, value, attention_mask, scaling, **kwargs):
    """paged|eager's layout and dtype, NaN everywhere."""
    out, weights = eager_paged_attention_forward(module, query, key, value, attention_mask, scaling, **kwargs)
    return torch.full_like(out, float("nan")), weights


def mistaken(module, query, key, value, attention_mask, scaling, **kwargs):
    """A user's mistake: reads an argument that paged|eager is never given (KeyError on its first call)."""
    return kwargs["max_seqlen_x"], None

"""Attention functions to scribble, written as a user would write theirs (notebook 07, docs).

A function here takes the place of transformers' paged|eager for a run and receives what it
receives: query [1, heads, q_rows, head_dim], the gathered key and value [1, kv_heads, k_rows,
head_dim] of the WHOLE batch (every request's rows, one after another), the mask [1, 1, q_rows,
k_rows] (0 where a row may attend, the dtype's minimum elsewhere), the scaling, and keyword arguments
among which `cu_seq_lens_q` / `cu_seq_lens_k`: where each request's query and key rows start.

    per_request_attention   paged|eager one request at a time: a request's queries meet only its
                            own keys, so nothing another request holds can reach it (clean at
                            other-requests, where paged|eager itself multiplies the other requests'
                            V rows by an exact 0, and 0 * NaN = NaN)
"""
from __future__ import annotations


def per_request_attention(module, query, key, value, attention_mask, scaling, **kwargs):
    """paged|eager over each request's own rows; padded query rows (past the last request) get zeros.
    -> (output [1, q_rows, heads, head_dim], None)."""
    from transformers.integrations.eager_paged import eager_paged_attention_forward

    cu_q, cu_k = kwargs["cu_seq_lens_q"].tolist(), kwargs["cu_seq_lens_k"].tolist()
    out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])
    for qs, qe, ks, ke in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
        if qe == qs:
            continue
        mask = None if attention_mask is None else attention_mask[..., qs:qe, ks:ke]
        out[:, qs:qe], _ = eager_paged_attention_forward(module, query[:, :, qs:qe], key[:, :, ks:ke],
                                                         value[:, :, ks:ke], mask, scaling, **kwargs)
    return out, None

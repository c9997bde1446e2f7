"""A shim with the signature of upstream's qsa_sparse_paged_attention that runs one of qsa_lab's
grouped page4 routes instead: the compiled kernels for CUDA tensors, the PyTorch emulation for CPU
tensors. It lets cross_request_nan.py (which imports no qsa_lab) check this project's kernels:

    python scripts/upstream/cross_request_nan.py --op scripts/upstream/qsa_lab_shim.py:kernel_fix  # exit 1
    python scripts/upstream/cross_request_nan.py --op scripts/upstream/qsa_lab_shim.py:finite_pv   # exit 0

One function per route, named by its fix (routes.labels): grouped (unfixed), kernel_fix, pad_fix,
both_fixes, masked_load, request_groups, finite_pv; and xqa. Each takes upstream's inputs: q [rows,
heads, dim] fp16, key_cache / value_cache [pages, page_size, 1, dim] (uint8 E4M3 codes with
kv_cache_dtype "fp8_e4m3", else fp16), logical_indices [rows, width] int32 token ids, whole 4-token
blocks first and the row's partial block last (the page4 routes' selections), block_table
[requests, pages] int32, token_to_req [rows] int32, query_positions, sequence_lengths.

What the shim changes on the way (none of it changes which tokens a row attends): the pool gets an
all-zero page in front (qsa_lab's null block: upstream's page p becomes page p + 1), and pages
longer than qsa_lab's 1024 tokens are split into equal pages of a size that divides them. Rows are
grouped in 8 consecutive rows (upstream's host route without query_start_loc_cpu), except by
request_groups, which never lets a group span requests.
"""
from __future__ import annotations

import torch

from qsa_lab.model.case import Case
from qsa_lab.model.geometry import RANGES, Geometry
from qsa_lab.routes.run import run_routes

MAX_PAGE = RANGES["page_size"][1]


def _page_size(upstream: int) -> int:
    """The largest multiple of 4 that divides `upstream` and fits qsa_lab's page range."""
    return max(p for p in range(4, min(upstream, MAX_PAGE) + 1, 4) if upstream % p == 0)


def _selected(logical_indices, visible, topk):
    """Upstream's token ids -> qsa_lab's block ids [rows, topk] (-1 padded): the row's first
    visible // 4 entries in fours, each four the 4 tokens of one block."""
    idx = logical_indices.long().cpu()
    out = torch.full((idx.shape[0], topk), -1, dtype=torch.int32)
    for r, n in enumerate((visible // 4).clamp(max=topk).tolist()):
        four = idx[r, :4 * n].view(n, 4)
        first = four[:, 0]
        if not (bool((first % 4 == 0).all()) and torch.equal(four, first.unsqueeze(1) + torch.arange(4))):
            raise ValueError("logical_indices: the shim takes page4 selections (whole 4-token blocks, in fours)")
        out[r, :n] = (first // 4).to(torch.int32)
    return out


def _case(q, k_cache, v_cache, logical_indices, block_table, token_to_req, query_positions, sequence_lengths,
          kv_cache_dtype, k_scale, v_scale) -> Case:
    kv_dtype = "e4m3" if kv_cache_dtype in ("fp8", "fp8_e4m3") else "fp16"
    pages, upstream_ps, _, dim = k_cache.shape
    ps = _page_size(upstream_ps)
    split = upstream_ps // ps
    kv = torch.stack([k_cache, v_cache], dim=1).cpu()                        # [pages, 2, ps_up, 1, dim]
    kv = kv.view(pages, 2, split, ps, 1, dim).transpose(1, 2).reshape(pages * split, 2, ps, 1, dim)
    kv = torch.cat([torch.zeros_like(kv[:1]), kv]).contiguous()              # page 0: the null block
    bt = block_table.long().cpu()
    table = (1 + bt.unsqueeze(-1) * split + torch.arange(split)).flatten(1).to(torch.int32)
    req = token_to_req.cpu()
    seq = sequence_lengths.cpu().to(torch.int32)
    pos = query_positions.cpu().long()
    visible = torch.minimum(pos + 1, seq.long()[req.long()])
    topk = logical_indices.shape[1] // 4
    counts = torch.bincount(req.long(), minlength=bt.shape[0]).tolist()
    g = Geometry(rows=q.shape[0], requests=bt.shape[0], request_rows=tuple(counts), context=int(seq.max()),
                 topk=topk, page_size=ps, q_heads=q.shape[1], head_dim=dim, kv_dtype=kv_dtype)
    return Case(q.cpu(), kv, float(k_scale), float(v_scale), table, seq, req, pos,
                _selected(logical_indices, visible, topk), geometry=g)


def _route(route: str):
    def op(q, k_cache, v_cache, logical_indices, block_table, token_to_req, out=None, output_gate=None,
           query_positions=None, sequence_lengths=None, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0, *,
           query_start_loc_cpu=None, sx_mtp_lane=None):
        if query_positions is None or sequence_lengths is None or output_gate is not None:
            raise ValueError("the shim needs query_positions and sequence_lengths, and takes no output_gate")
        case = _case(q, k_cache, v_cache, logical_indices, block_table, token_to_req, query_positions,
                     sequence_lengths, kv_cache_dtype, k_scale, v_scale)
        result = run_routes(case, [route], backend="cuda" if q.is_cuda else "emulate", reference=False)
        got = result.outputs[route].to(q.device)
        if out is None:
            return got
        out.copy_(got)
        return out
    op.__name__ = route.replace("+", "_")
    op.__doc__ = f"qsa_lab's {route} with upstream's qsa_sparse_paged_attention signature."
    return op


grouped = _route("grouped")
kernel_fix = _route("grouped+kernel_fix")
pad_fix = _route("grouped+pad_fix")
both_fixes = _route("grouped+both_fixes")
masked_load = _route("grouped+masked_load")
request_groups = _route("grouped+request_groups")
finite_pv = _route("grouped+finite_pv")
xqa = _route("xqa")

#!/usr/bin/env python3
"""Does one request's NaN reach ANOTHER request's rows through the SM70 grouped page4 route?

Torch only. The batch is the one upstream's regression test of the grouped/XQA split builds
(tests/models/qwen4_exp/test_qsa_e4m3.py, test_qsa_e4m3_mixed_batch_split_matches_triton): 49 query
rows of 6 heads x 256 dims, a 46-row catch-up chunk of request 0 followed by one decode row from
each of requests 1, 2 and 3, one 2052-token E4M3 page per request, every row selecting all 2051
written tokens. The grouped route takes the first 49 // 8 * 8 = 48 rows in groups of 8 consecutive
rows, so rows 40-47 form one group holding requests 0, 1 and 2 (row 48 goes to XQA).

For each request P in turn, every value of P's written tokens at a few head dims is set to the
E4M3 NaN code (a value only P's rows attend: an fp16 overflow in P's KV, say), the op runs, and
the rows of every OTHER request are checked against a float64 reference: they attend none of the
poisoned bytes, so the reference is finite there and the op's output must be too (and close to
it). The poisoned request's own rows are reported but not judged (they attend the NaN).

Unlike upstream's test, page 0 is left as an all-zero null block and the requests' pages start at
page 1 (in the test request 0 owns page 0, which the planner's padding also points at: that would
mix the null-block leak of PR #647 into this one).

    python cross_request_nan.py                       # upstream's op (vllm.models.qwen4_exp...qsa)
    python cross_request_nan.py --op MODULE:FUNCTION  # or FILE.py:FUNCTION, with the op's signature
    python cross_request_nan.py --requests 0 --dims 7 --small --device cpu --op ...   # a smaller batch

The op is called as upstream's test calls qsa_sparse_paged_attention:
    op(query, key_cache, value_cache, logical_indices, block_table, token_to_req,
       query_positions=..., sequence_lengths=..., kv_cache_dtype="fp8_e4m3", k_scale=..., v_scale=...)
with key_cache / value_cache [pages, page_size, 1, 256] uint8 E4M3 codes, logical_indices
[rows, 2051] int32 token ids, block_table [requests, 1] int32; it returns [rows, 6, 256] fp16.
With upstream's module, the route flags are set as that test sets them (XQA page4 on, its row
threshold 4096, the grouped page4 route on); the pad fix and the kernel fix are left as built.

Exit codes: 0 clean (every other request's row finite and within tolerance of the reference),
1 a leak (some other request's row non-finite, or beyond tolerance), 3 cannot run (no op, no
CUDA GPU for a CUDA op, or the op refused the inputs).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

import torch

UPSTREAM = "vllm.models.qwen4_exp.nvidia.ops.qsa:qsa_sparse_paged_attention"
# the flags upstream's test sets on its module before the mixed-batch call
UPSTREAM_FLAGS = {"_SM70_QSA_XQA_PAGE4": True, "_SM70_QSA_XQA_PAGE4_MIN_ROWS": 4096, "_SM70_QSA_GROUPED_PAGE4": True}
ROWS_PER_REQUEST = (46, 1, 1, 1)
HEADS, HEAD_DIM, PAGE_SIZE, TOPK = 6, 256, 2052, 2051
SMALL = dict(head_dim=64, page_size=404, topk=403)    # --small: same rows and groups, a shorter context
E4M3_NAN = 0x7F
ATOL = RTOL = 3e-2                                    # upstream's test tolerance
EXIT_CLEAN, EXIT_LEAK, EXIT_CANNOT_RUN = 0, 1, 3


def load_op(spec: str):
    """'module:function' or 'path/to/file.py:function' -> (the callable, its module)."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"--op: expected MODULE:FUNCTION or FILE.py:FUNCTION, got {spec!r}")
    if where.endswith(".py"):
        path = Path(where).resolve()
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        if module_spec is None or not path.is_file():
            raise FileNotFoundError(f"--op: no file {where}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[path.stem] = module
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name), module


def build_batch(device, head_dim, page_size, topk, seed=23):
    """Upstream's test shape: q, E4M3 K/V codes and scales, selections, tables, positions."""
    gen = torch.Generator().manual_seed(seed)
    rows, requests = sum(ROWS_PER_REQUEST), len(ROWS_PER_REQUEST)
    q = (torch.randn((rows, HEADS, head_dim), generator=gen) * 0.2).to(torch.float16)
    key = torch.randn((requests, page_size, 1, head_dim), generator=gen) * 0.35
    value = torch.randn((requests, page_size, 1, head_dim), generator=gen) * 0.3
    k_scale, v_scale = float(key.abs().max()) / 448.0, float(value.abs().max()) / 448.0
    # page 0: the null block, all zero; request r owns page r + 1
    codes = lambda x, s: torch.cat([torch.zeros_like(x[:1]), x / s]).to(torch.float8_e4m3fn).view(torch.uint8)  # noqa: E731
    key_cache, value_cache = codes(key, k_scale), codes(value, v_scale)
    logical_indices = torch.arange(topk, dtype=torch.int32).repeat(rows, 1)
    block_table = torch.arange(1, requests + 1, dtype=torch.int32).view(requests, 1)
    token_to_req = torch.tensor([r for r, n in enumerate(ROWS_PER_REQUEST) for _ in range(n)], dtype=torch.int32)
    query_positions = torch.full((rows,), topk - 1, dtype=torch.int64)
    sequence_lengths = torch.full((requests,), topk, dtype=torch.int32)
    batch = dict(q=q, key_cache=key_cache, value_cache=value_cache, logical_indices=logical_indices,
                 block_table=block_table, token_to_req=token_to_req, query_positions=query_positions,
                 sequence_lengths=sequence_lengths)
    return {k: v.to(device) for k, v in batch.items()}, k_scale, v_scale


def poison(value_cache, block_table, sequence_lengths, request: int, dims) -> torch.Tensor:
    """A copy of the value cache with E4M3 NaN at `dims` of every written token of `request`."""
    out = value_cache.clone()
    page = int(block_table[request, 0])
    out[page, :int(sequence_lengths[request]), 0, list(dims)] = E4M3_NAN
    return out


def reference(b, value_cache, k_scale, v_scale) -> torch.Tensor:
    """Float64 attention of each row over its selected written tokens (<= its position)."""
    q = b["q"].double().cpu()
    rows, heads, d = q.shape
    k = b["key_cache"].cpu().view(torch.float8_e4m3fn).double() * k_scale
    v = value_cache.cpu().view(torch.float8_e4m3fn).double() * v_scale
    page_size = k.shape[1]
    out = torch.empty(rows, heads, d, dtype=torch.float64)
    for r in range(rows):
        req = int(b["token_to_req"][r])
        tok = b["logical_indices"][r].cpu().long()
        tok = tok[(tok >= 0) & (tok < int(b["sequence_lengths"][req])) & (tok <= int(b["query_positions"][r]))]
        page = b["block_table"][req].cpu().long()[tok // page_size]
        kk, vv = k[page, tok % page_size, 0], v[page, tok % page_size, 0]            # [T, d]
        p = torch.softmax(q[r] @ kk.T / d ** 0.5, dim=-1)                             # [heads, T]
        out[r] = p @ vv
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", default=UPSTREAM, help=f"the op, MODULE:FUNCTION or FILE.py:FUNCTION (default {UPSTREAM})")
    ap.add_argument("--requests", default="0,1,2,3", help="requests poisoned, one at a time (default 0,1,2,3)")
    ap.add_argument("--dims", default="102,152,168,170,230", help="head dims poisoned (default 102,152,168,170,230, "
                                                                  "modulo the head dim)")
    ap.add_argument("--device", default="cuda", help="where the tensors live (default cuda; cpu for a CPU op)")
    ap.add_argument("--small", action="store_true", help="head dim 64, 404-token pages, 403 selected tokens "
                                                         "(the same rows and groups; default: upstream's sizes)")
    a = ap.parse_args(argv)
    sizes = SMALL if a.small else dict(head_dim=HEAD_DIM, page_size=PAGE_SIZE, topk=TOPK)
    try:
        requests = [int(x) for x in a.requests.split(",") if x.strip()]
        dims = sorted({int(x) % sizes["head_dim"] for x in a.dims.split(",") if x.strip()})
        if not requests or any(not 0 <= r < len(ROWS_PER_REQUEST) for r in requests) or not dims:
            raise ValueError
    except ValueError:
        print(f"cannot run: --requests takes ids in 0..{len(ROWS_PER_REQUEST) - 1}, --dims integers", file=sys.stderr)
        return EXIT_CANNOT_RUN
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("cannot run: no CUDA GPU visible (--device cpu for an op that runs on the CPU)", file=sys.stderr)
        return EXIT_CANNOT_RUN
    try:
        op, module = load_op(a.op)
    except Exception as e:  # noqa: BLE001 - any import failure means the op is not here
        print(f"cannot run: {a.op}: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    for flag, value in UPSTREAM_FLAGS.items():   # as upstream's test sets them (only where the module has them)
        if hasattr(module, flag):
            setattr(module, flag, value)
    b, k_scale, v_scale = build_batch(a.device, **sizes)
    req = b["token_to_req"].cpu()
    print(f"op {a.op}; {req.numel()} rows, rows per request {list(ROWS_PER_REQUEST)}; groups of 8 consecutive rows: "
          f"rows 40-47 hold requests {sorted(set(req[40:48].tolist()))}; poisoned dims {dims}")
    verdict = EXIT_CLEAN
    for p in requests:
        vc = poison(b["value_cache"], b["block_table"], b["sequence_lengths"], p, dims)
        try:
            out = op(b["q"], b["key_cache"], vc, b["logical_indices"], b["block_table"], b["token_to_req"],
                     query_positions=b["query_positions"], sequence_lengths=b["sequence_lengths"],
                     kv_cache_dtype="fp8_e4m3", k_scale=k_scale, v_scale=v_scale)
        except Exception as e:  # noqa: BLE001 - the op refused the inputs: no verdict
            print(f"cannot run: the op raised {type(e).__name__}: {e}", file=sys.stderr)
            return EXIT_CANNOT_RUN
        out = out.detach().float().cpu()
        ref = reference(b, vc, k_scale, v_scale)
        bad = ~torch.isfinite(out).flatten(1).all(dim=1)
        far = ((out.double() - ref).abs() > ATOL + RTOL * ref.abs()).flatten(1).any(dim=1) & ~bad
        others = req != p
        leak = torch.nonzero(bad & others).flatten().tolist()
        wrong = torch.nonzero(far & others & torch.isfinite(ref).flatten(1).all(dim=1)).flatten().tolist()
        own = torch.nonzero(bad & ~others).flatten().tolist()
        line = f"NaN in request {p}'s V: own rows non-finite {len(own)}/{int((~others).sum())}; "
        if leak or wrong:
            verdict = EXIT_LEAK
            line += (f"LEAK: other requests' rows non-finite {[(r, int(req[r])) for r in leak]} (row, request)"
                     + (f", beyond tolerance {wrong}" if wrong else ""))
        else:
            line += "other requests' rows clean (finite, within tolerance of the float64 reference)"
        print(line)
    print("verdict:", {EXIT_CLEAN: "clean", EXIT_LEAK: "LEAK: one request's NaN reaches another request's rows"}[verdict])
    return verdict


if __name__ == "__main__":
    sys.exit(main())

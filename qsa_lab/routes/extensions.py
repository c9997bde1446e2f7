"""What qsa_lab runs beyond the upstream route, so nobody mistakes it for upstream behaviour.

Upstream here means the SM70 page4 routes of 1Cat-vLLM as the public PR
(https://github.com/1CatAI/1Cat-vLLM/pull/647) and its host code leave them: the grouped kernel
takes 6 query heads of dim 256 per KV head, a selection of 4*512+3 token slots, E4M3 or fp16
caches; the Python pad-fix runs for E4M3 caches only; rows are grouped per request only for fp16
caches. Each id below is stable: scripts may test for it in the `extensions` list of
`qsa-lab diff --json`.
"""
from __future__ import annotations

from qsa_lab.routes.labels import GROUPED, GROUPING

#: the routes that run the planner's pad-fix, and the one that runs this project's masked load
PAD_FIXED = {route for route, (_, pad_fixed) in GROUPED.items() if pad_fixed}
MASKED_LOAD = next(route for route, (variant, _) in GROUPED.items() if variant == "masked_load")
#: the route that runs the finite P@V kernel, and those that group per request whatever the geometry says
FINITE_PV = next(route for route, (variant, _) in GROUPED.items() if variant == "finite_pv")
REQUEST_GROUPED = {route for route, group_rows in GROUPING.items() if group_rows == "request"}

#: id -> one line saying what goes beyond upstream
EXTENSIONS = {
    "e5m2-cache": "E5M2 KV cache on the page4 routes (upstream takes E4M3 or fp16 caches only)",
    "pad-fix-non-e4m3": "pad_fix (B) on an fp16 or E5M2 cache "
                        "(upstream repoints padding for E4M3 caches only)",
    "request-grouping-fp8": "request-aligned groups with an fp8 cache (upstream groups per request for fp16 caches only)",
    "masked-load": "masked_load (C), the masked panel load, is this project's own (upstream has kernel_fix (A) "
                   "and pad_fix (B))",
    "finite-pv": "finite_pv (F), the finite P@V kernel (each row the non-finite result of what it attends), is this "
                 "project's own",
    "q-heads": "query heads per KV head other than 6 (upstream's grouped kernel is built for 6)",
    "head-dim": "head dim other than 256 (upstream's page4 routes take 256 only)",
    "topk": "selections other than 512 blocks (upstream's selection holds 4*512+3 token slots)",
    "random-selection": "independent random selections (sink + window + random), not indexer-like top-k",
}


def extensions_used(geometry, routes) -> list[dict]:
    """[{"id", "description"}] of the extensions a run of `routes` on `geometry` exercises."""
    g, routes = geometry, set(routes)
    used = {
        "e5m2-cache": g.kv_dtype == "e5m2",
        "pad-fix-non-e4m3": g.kv_dtype != "e4m3" and bool(routes & PAD_FIXED),
        "request-grouping-fp8": (g.group_rows == "request" or bool(routes & REQUEST_GROUPED)) and g.kv_dtype != "fp16",
        "masked-load": MASKED_LOAD in routes,
        "finite-pv": FINITE_PV in routes,
        "q-heads": g.q_heads != 6,
        "head-dim": g.head_dim != 256,
        "topk": g.topk != 512,
        "random-selection": g.selection == "random",
    }
    return [{"id": k, "description": EXTENSIONS[k]} for k, on in used.items() if on]

"""Fidelity to the upstream route: planner order, indexer-like selections, the report's counts."""
import pytest
import torch

from qsa_lab.case import Geometry, build_case, relocate_pages
from qsa_lab.poison import apply_poison
from qsa_lab.routes import GROUPED, run_routes

ROUTES = ["xqa", *GROUPED]


def _bits(out):
    return out.view(torch.int16)


@pytest.mark.parametrize("layout", ["contiguous", "scatter"])
def test_relocating_pages_leaves_every_route_bit_identical(layout):
    """Upstream orders plan entries by (category, query << 29 | logical block): where pages
    were allocated must not change the reduction order, hence not one output bit."""
    g = Geometry(rows=19, requests=2, layout=layout, context=1200, topk=96, head_dim=64)
    case = apply_poison(build_case(g), "random", plane="kv")
    moved = relocate_pages(case, seed=5)
    assert not torch.equal(moved.block_table, case.block_table)
    a = run_routes(case, routes=ROUTES, backend="emulate")
    b = run_routes(moved, routes=ROUTES, backend="emulate")
    changed = [r for r in ROUTES if not torch.equal(_bits(a.outputs[r]), _bits(b.outputs[r]))]
    assert changed == []


def _upstream_plan(case, group_rows, q_heads):
    """An independent, loop-by-loop planner after upstream's grouped_sparse_page4_plan_kernel:
    union with masks and owners, sort by (category, owner), pad each category to 8."""
    from qsa_lab.case import visible_tokens
    from qsa_lab.plan import m_tiles, query_m_tile_bits

    g = case.geometry
    bits = query_m_tile_bits(q_heads).tolist()
    vis = visible_tokens(case).tolist()
    entries = {}  # physical microblock -> [mask, owner]
    for query, row in enumerate(group_rows.tolist()):
        req = int(case.token_to_req[row])
        complete = min(vis[row] // 4, g.topk)
        blocks = [(b, 0xF) for b in case.selected[row, :complete].tolist() if b >= 0]
        if vis[row] % 4:
            blocks.append((vis[row] // 4, (1 << (vis[row] % 4)) - 1))
        for block, nib in blocks:
            tok = 4 * block
            mb = int(case.block_table[req, tok // g.page_size]) * (g.page_size // 4) + tok % g.page_size // 4
            e = entries.setdefault(mb, [0, 1 << 40])
            e[0] |= nib << (4 * query)
            e[1] = min(e[1], (query << 29) | block)
    cat = {mb: 0 for mb in entries}
    for mb, (mask, _) in entries.items():
        for q in range(8):
            if (mask >> (4 * q)) & 0xF:
                cat[mb] |= bits[q]
    out_mb, out_mask = [], []
    for c in range(1, 1 << m_tiles(q_heads)):
        run = sorted((entries[mb][1], mb) for mb in entries if cat[mb] == c)
        run = [(mb, entries[mb][0]) for _, mb in run]
        run += [(0, 0)] * (-len(run) % 8)
        out_mb += [mb for mb, _ in run]
        out_mask += [m for _, m in run]
    return out_mb, out_mask


@pytest.mark.parametrize("kw", [dict(rows=16, requests=2, layout="scatter"),
                                dict(rows=17, requests=3, layout="contiguous", q_heads=3),
                                dict(rows=24, requests=3, layout="scatter", group_rows="request")])
def test_plan_order_is_upstreams_category_then_logical_owner(kw):
    from qsa_lab.plan import as_int32_mask, plan_groups

    g = Geometry(context=700, topk=40, head_dim=32, **kw)
    case = build_case(g)
    plan = plan_groups(case)
    for gi in range(plan.groups):
        mbs, masks = _upstream_plan(case, plan.group_rows[gi], g.q_heads)
        n = int(plan.seq_len[gi]) // 4
        assert n == len(mbs)
        assert plan.microblocks[gi, :n].tolist() == mbs
        assert plan.masks[gi, :n].tolist() == as_int32_mask(torch.tensor(masks)).tolist()

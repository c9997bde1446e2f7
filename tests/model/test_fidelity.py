"""Fidelity to the upstream route: planner order, indexer-like selections, the report's counts."""
import pytest
import torch

from qsa_lab.model.case import Geometry, build_case, relocate_pages
from qsa_lab.model.poison import apply_poison
from qsa_lab.routes.run import GROUPED, run_routes

ROUTES = ["xqa", *GROUPED]


def _bits(out):
    return out.view(torch.int16)


@pytest.mark.parametrize("kv_dtype", ["e4m3", "e5m2", "fp16"])
@pytest.mark.parametrize("layout", ["contiguous", "scatter"])
def test_relocating_pages_leaves_every_route_bit_identical(layout, kv_dtype):
    """Upstream orders plan entries by (category, query << 29 | logical block) and XQA's tokens
    logically: where pages were allocated must not change a reduction order, hence not one bit.
    (Group 1 holds rows of both requests, so owners from two requests meet in one plan.)"""
    g = Geometry(rows=19, requests=2, layout=layout, context=1200, topk=96, head_dim=64, kv_dtype=kv_dtype)
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
    from qsa_lab.model.paged import visible_tokens
    from qsa_lab.model.plan import m_tiles, query_m_tile_bits

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
    from qsa_lab.model.plan import as_int32_mask, plan_groups

    g = Geometry(context=700, topk=40, head_dim=32, **kw)
    case = build_case(g)
    plan = plan_groups(case)
    for gi in range(plan.groups):
        mbs, masks = _upstream_plan(case, plan.members[gi], g.q_heads)
        n = int(plan.seq_len[gi]) // 4
        assert n == len(mbs)
        assert plan.microblocks[gi, :n].tolist() == mbs
        assert plan.masks[gi, :n].tolist() == as_int32_mask(torch.tensor(masks)).tolist()


# ---- indexer-like selections -------------------------------------------------------------

def test_indexer_score_is_the_sum_over_heads_of_relu_dot_over_sqrt_128():
    from qsa_lab.model.selection import indexer_scores

    gen = torch.Generator().manual_seed(3)
    q, keys = torch.randn((2, 4, 128), generator=gen), torch.randn((5, 128), generator=gen)
    want = [[sum(max(float(q[r, h] @ keys[b]), 0.0) for h in range(4)) / 128 ** 0.5 for b in range(5)]
            for r in range(2)]
    assert torch.allclose(indexer_scores(q, keys), torch.tensor(want), atol=1e-5)


def test_top_blocks_is_lexicographic_over_fully_visible_blocks_only():
    from qsa_lab.model.selection import top_blocks

    scores = torch.tensor([[0.0, 2.0, 0.0, 2.0, 0.0, 9.0, 0.0],     # ties: lower block id first
                           [5.0, 1.0, 3.0, 0.0, 0.0, 9.0, 9.0]])    # 9s are past `complete`
    out = top_blocks(scores, torch.tensor([7, 4]), topk=4)
    assert out.tolist() == [[0, 1, 3, 5], [0, 1, 2, 3]]
    # fewer candidates than topk: all of them, then -1
    assert top_blocks(scores, torch.tensor([3, 2]), topk=4).tolist() == [[0, 1, 2, -1], [0, 1, -1, -1]]


def test_short_rows_select_every_fully_visible_block():
    case = build_case(Geometry(rows=8, context=300, topk=128, head_dim=32))
    complete = (case.positions + 1) // 4
    for r in range(8):
        n = int(complete[r])
        assert case.selected[r, :n].tolist() == list(range(n)) and (case.selected[r, n:] == -1).all()


@pytest.mark.parametrize("target", [0.6, 0.8, 0.9])
def test_measured_neighbour_overlap_follows_the_knob(target):
    from qsa_lab.model.selection import neighbour_overlap

    measured = [neighbour_overlap(build_case(Geometry(rows=16, seed=s, overlap=target))) for s in range(3)]
    assert abs(sum(measured) / 3 - target) < 0.03, measured


def test_default_selection_at_16_rows_8k_walks_at_most_160_tiles_and_reports_overlap(capsys):
    import json

    from qsa_lab.app.cli import main

    assert main(["diff", "--rows", "16", "--context", "8192", "--backend", "emulate", "--json", "-"]) == 0
    sel = json.loads(capsys.readouterr().out)["selection"]
    assert sel["generator"] == "indexer" and sel["overlap_target"] == 0.8
    assert abs(sel["neighbour_overlap"] - 0.8) < 0.05
    assert len(sel["tiles_per_group"]) == 2 and sel["max_tiles_per_group"] <= 160


def test_random_selection_reproduces_the_earlier_generator():
    """--selection random is the generator qsa_lab had before indexer-like selections; these are
    the numbers it gave then (rows 16, ctx 8192, seed 0): neighbour overlap 0.402, tiles 221 / 219."""
    from qsa_lab.model.selection import neighbour_overlap
    from qsa_lab.model.plan import plan_groups

    g = Geometry(rows=16, context=8192, selection="random")
    case = build_case(g)
    assert round(neighbour_overlap(case), 3) == 0.402
    assert (plan_groups(case).seq_len // 32).tolist() == [221, 219]
    # the selection is all that differs: same q, same cache bytes
    other = build_case(g.replace(selection="indexer"))
    assert torch.equal(other.q, case.q) and torch.equal(other.kv_cache, case.kv_cache)
    assert not torch.equal(other.selected, case.selected)


@pytest.mark.parametrize("kw", [dict(selection="topk"), dict(overlap=1.5), dict(overlap=-0.1),
                                dict(overlap=float("nan")), dict(overlap="0.8"), dict(overlap=True)])
def test_selection_arguments_are_validated(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        Geometry(**kw)


@pytest.mark.parametrize("argv,arg", [(["--overlap", "2"], "--overlap"), (["--overlap", "x"], "--overlap"),
                                      (["--selection", "random", "--overlap", "0.5"], "--overlap"),
                                      (["--selection", "top"], "--selection")])
def test_cli_refuses_bad_selection_options(argv, arg, capsys):
    from qsa_lab.app.cli import main

    assert main(["diff", "--rows", "8", "--context", "64", "--topk", "8", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"qsa-lab: error: {arg}: ") and "\n" not in err


def test_plan_figure_title_reports_tiles_and_overlap():
    import matplotlib

    matplotlib.use("Agg")
    from qsa_lab.analysis import figure_data as figdata
    from qsa_lab.plotting import plots as plotting
    from qsa_lab.model.plan import plan_groups

    case = build_case(Geometry(rows=16, context=2048, topk=128, head_dim=32))
    plan = plan_groups(case)
    title = plotting.plot_plan(figdata.plan_table(plan, case)).get_title()
    assert f"tiles per group {(plan.seq_len // 32).tolist()}" in title
    assert "indexer selection, overlap 0.8 (measured 0." in title


# ---- the report's counts -----------------------------------------------------------------

def test_causal3_gives_the_reports_640_with_8_of_9_m_tiles_padded():
    from qsa_lab.analysis.fingerprints import fingerprint
    from qsa_lab.model.poison import REPORT_DIMS
    from qsa_lab.report.repro import CAUSAL3

    r = run_routes(apply_poison(build_case(CAUSAL3), "targeted", dims=list(REPORT_DIMS)), backend="emulate")
    nan = {route: int(torch.isnan(o).sum()) for route, o in r.outputs.items()}
    assert nan.pop("grouped") == 640 and set(nan.values()) == {0}
    fp = fingerprint(r)
    assert int(fp.padded_category.sum()) == 8 and (fp.nan_count > 0).tolist() == fp.padded_category.tolist()


# ---- beyond upstream ---------------------------------------------------------------------

OURS = {"masked-load", "finite-pv"}   # what every run of all routes exercises: this project's own kernels


@pytest.mark.parametrize("kw,want", [
    (dict(), OURS | {"request-grouping-fp8"}),          # grouped+request_groups on an E4M3 cache
    (dict(kv_dtype="e5m2"), OURS | {"e5m2-cache", "pad-fix-non-e4m3", "request-grouping-fp8"}),
    (dict(kv_dtype="fp16", group_rows="request"), OURS | {"pad-fix-non-e4m3"}),
    (dict(group_rows="request"), OURS | {"request-grouping-fp8"}),
    (dict(q_heads=4, head_dim=128, topk=64, selection="random"),
     OURS | {"request-grouping-fp8", "q-heads", "head-dim", "topk", "random-selection"}),
])
def test_extensions_name_what_goes_beyond_upstream(kw, want):
    from qsa_lab.routes.extensions import EXTENSIONS, extensions_used
    from qsa_lab.routes.run import ROUTES

    used = extensions_used(Geometry(**kw), ROUTES)
    assert {e["id"] for e in used} == want
    assert all(e["description"] == EXTENSIONS[e["id"]] for e in used)
    only_geometry = want - OURS - {"pad-fix-non-e4m3"} - ({"request-grouping-fp8"} if "group_rows" not in kw else set())
    assert {e["id"] for e in extensions_used(Geometry(**kw), ["reference", "xqa", "grouped"])} == only_geometry


def test_diff_json_lists_extensions_and_keeps_its_fields(capsys):
    import json

    from qsa_lab.app.cli import main

    assert main(["diff", "--rows", "8", "--context", "256", "--topk", "16", "--kv-dtype", "e5m2",
                 "--backend", "emulate", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"schema", "backend", "geometry", "poison", "groups", "routes"} <= set(doc)
    assert {e["id"] for e in doc["extensions"]} == {"masked-load", "finite-pv", "request-grouping-fp8", "e5m2-cache",
                                                    "pad-fix-non-e4m3", "topk"}


# ---- beyond the report: non-finite codes in attended tokens -------------------------------

ATTENDED = Geometry(rows=19, context=1024, topk=64, head_dim=64)
DIMS = [3, 40, 41]


@pytest.mark.parametrize("kv_dtype", ["e4m3", "e5m2"])
def test_grouped_silently_drops_an_attended_nan_key_where_xqa_and_reference_are_nan(kv_dtype):
    case = apply_poison(build_case(ATTENDED.replace(kv_dtype=kv_dtype)), "attended-k", dims=DIMS)
    r = run_routes(case, backend="emulate")
    grouped_rows, rest = r.plan.members.flatten(), r.plan.xqa_rows
    # the poisoned key is attended by every row: its NaN score poisons every dim of XQA and the reference
    assert torch.isnan(r.outputs["xqa"]).all() and torch.isnan(r.reference64).all()
    for route in GROUPED:
        out = r.outputs[route]
        assert torch.isfinite(out[grouped_rows]).all(), route   # dropped: finite, and wrong
        assert torch.isnan(out[rest]).all(), route              # remainder rows go through XQA


def test_an_attended_nan_value_is_nan_in_every_route_on_the_poisoned_dims():
    case = apply_poison(build_case(ATTENDED), "attended-v", dims=DIMS)
    r = run_routes(case, backend="emulate")
    want = torch.zeros_like(r.outputs["xqa"], dtype=torch.bool)
    want[:, :, DIMS] = True                                    # every row attends the token
    assert torch.equal(torch.isnan(r.reference64), want)
    for route, out in r.outputs.items():
        assert torch.equal(torch.isnan(out), want), route


def test_repro_rows_beyond_the_report_show_the_divergence():
    from qsa_lab.report.repro import REPRO_CASES, run_repro

    cases = [c for c in REPRO_CASES if c.poison.get("site") in ("attended-k", "attended-v")]
    assert len(cases) == 2 and all(c.expect and c.report_key is None for c in cases)
    table, _ = run_repro(backend="emulate", cases=cases, progress=False, repeat=False,
                         geometry_overrides=dict(context=1024, topk=64))
    k, v = table.iloc[0], table.iloc[1]
    rows, hq, d = 19, 6, 256
    assert k["nan[xqa]"] == k["nan[reference]"] == rows * hq * d
    assert k["nan[grouped]"] == 3 * hq * d                      # only the 3 XQA remainder rows
    assert k["grouped_finite_where_xqa_nan"] == 16 * hq * d
    assert v["nan[xqa]"] == v["nan[grouped]"] == v["nan[grouped+kernel_fix]"] == rows * hq * 5
    assert v["grouped_finite_where_xqa_nan"] == 0

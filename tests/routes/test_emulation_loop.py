"""The vectorised emulation against a plain tile-by-tile loop written from the route's description alone.

The loop shares no helper with qsa_lab.routes.emulate or qsa_lab.analysis.fingerprints (it reads the
plan's tensors and decodes with qsa_lab.model.fp8 only), so a bug in the shared tile helpers
cannot hide in both. Tiny geometries keep the loop fast.
"""
import functools
import math

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from qsa_lab.model import fp8
from qsa_lab.model.case import Geometry, build_case
from qsa_lab.model.plan import pad_fix, plan_groups
from qsa_lab.model.poison import DIM_SITES, apply_poison
from qsa_lab.routes import emulate


def loop_grouped(case, plan, variant):
    """The grouped route, one group and one 32-token tile at a time -> [groups, 8, Hq, D] fp16."""
    g = case.geometry
    hq, D, ps = g.q_heads, g.head_dim, g.page_size
    R = 8 * hq
    raw = case.kv_cache[:, :, :, 0, :]
    vals = raw.float() if g.kv_dtype == "fp16" else fp8.decode(raw, g.kv_dtype)   # [pages, 2, ps, D]
    out = torch.empty(plan.groups, 8, hq, D, dtype=torch.float16)
    query_of_row = torch.arange(R) // hq
    for gi in range(plan.groups):
        Q = case.q[plan.members[gi]].float().reshape(R, D)
        m = torch.full((R,), -1e30)
        l = torch.zeros(R)
        O = torch.zeros(R, D)
        for t in range(int(plan.seq_len[gi]) // 32):
            mbs = plan.microblocks[gi, 8 * t:8 * t + 8].tolist()
            words = [int(x) & 0xFFFFFFFF for x in plan.masks[gi, 8 * t:8 * t + 8].tolist()]
            tok = [mb * 4 + j % 4 for mb in mbs for j in range(4)]
            K = torch.stack([vals[x // ps, 0, x % ps] for x in tok])
            V = torch.stack([vals[x // ps, 1, x % ps] for x in tok])
            att = torch.tensor([[bool((words[j // 4] >> (int(q) * 4 + j % 4)) & 1) for j in range(32)]
                                for q in query_of_row])
            if variant != "unfixed":          # fix A / fix C: unattended panel rows are zero
                dead = torch.tensor([(words[j // 4] & (0x11111111 << (j % 4))) == 0 for j in range(32)])
                K[dead] = 0.0
                V[dead] = 0.0
            tile_or = 0
            for w in words:
                tile_or |= w
            active_tiles = set()
            for q in range(8):
                if (tile_or >> (4 * q)) & 0xF:
                    active_tiles |= {(q * hq) // 16, (q * hq + hq - 1) // 16}
            rows = torch.tensor([r for r in range(R) if r // 16 in active_tiles], dtype=torch.long)
            if rows.numel() == 0:
                continue
            # the real route's softmax: C fmaxf (NaN ignored) for the maxima, fp32 probabilities
            # summed unrounded, max and sum moved only when the tile holds an attended token
            s = (Q[rows] @ K.T) * torch.tensor(case.sm_scale * case.k_scale, dtype=torch.float32)
            s = torch.where(att[rows], s, torch.tensor(-1e30))
            tile_max = functools.reduce(torch.fmax, s.unbind(dim=1))
            m_new = torch.fmax(m[rows], tile_max)
            p = torch.where(att[rows], torch.exp(torch.fmax(s - m_new[:, None], torch.tensor(-80.0))), 0.0)
            tile_sum = p.sum(dim=1)
            alpha = torch.where(tile_sum > 0, torch.exp(torch.fmax(m[rows] - m_new, torch.tensor(-80.0))), 1.0)
            l[rows] = torch.where(tile_sum > 0, l[rows] * alpha + tile_sum, l[rows])
            m[rows] = torch.where(tile_sum > 0, m_new, m[rows])
            O[rows] = O[rows] * alpha[:, None] + p.half().float() @ V
        scale = torch.where(l > 0, torch.tensor(case.v_scale, dtype=torch.float32) / l, 0.0)
        out[gi] = (O * scale[:, None]).half().view(8, hq, D)
    return out


@st.composite
def tiny_cases(draw):
    requests = draw(st.integers(1, 3))
    g = Geometry(rows=draw(st.integers(8, 17)), requests=requests,
                 layout=draw(st.sampled_from(["contiguous", "scatter"])),
                 context=draw(st.integers(24, 90)), topk=draw(st.integers(2, 12)),
                 page_size=draw(st.sampled_from([4, 8, 16])), q_heads=draw(st.integers(1, 8)),
                 head_dim=16, kv_dtype=draw(st.sampled_from(["e4m3", "e5m2", "fp16"])),
                 seed=draw(st.integers(0, 999)))
    assume(g.rows >= requests)
    site = draw(st.sampled_from(["targeted", "random", "fp16-state", "stale-tail", "attended-k", "attended-v"]))
    dims = draw(st.lists(st.integers(0, 15), min_size=1, max_size=3, unique=True)) \
        if site in DIM_SITES else None
    payload = draw(st.sampled_from([None, "nan", "inf"])) if site in DIM_SITES else None
    if payload == "inf" and g.kv_dtype == "e4m3":
        payload = "nan"                      # E4M3 has no Inf code
    try:
        return apply_poison(build_case(g), site, plane=draw(st.sampled_from(["v", "k", "kv"])), dims=dims,
                            seed=draw(st.integers(0, 99)), payload=payload)
    except ValueError:            # stale-tail needs a partial last microblock
        assume(False)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(tiny_cases(), st.sampled_from(["unfixed", "kernel_fix", "masked_load"]), st.booleans())
def test_vectorised_emulation_equals_the_tile_loop(case, variant, fixed_plan):
    plan = plan_groups(case)
    assume(plan.groups > 0)
    if fixed_plan:
        plan = pad_fix(plan)
    want = loop_grouped(case, plan, variant)
    got = emulate.grouped_forward(case.q, case.kv_cache, case.k_scale, case.v_scale, plan.members,
                                  plan.microblocks, plan.masks, plan.seq_len, kv_dtype=case.kv_dtype,
                                  sm_scale=case.sm_scale, variant=variant)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    fin = ~torch.isnan(want)
    assert torch.allclose(got[fin].float(), want[fin].float(), atol=1e-5, rtol=1e-3)  # one fp16 ulp: only the fp32 summation order differs


def test_the_loop_drops_an_attended_nan_key_where_the_reference_is_nan():
    """Guard against a loop whose max propagates NaN: a NaN in an attended key gives a
    finite grouped output (the token dropped), while the float64 reference is NaN."""
    from qsa_lab.routes.reference import reference_forward

    case = apply_poison(build_case(Geometry(rows=16, context=600, topk=40)), "attended-k", dims=[5])
    plan = plan_groups(case)
    out = loop_grouped(case, plan, "unfixed")
    ref = reference_forward(case)
    assert torch.isfinite(out).all() and torch.isnan(ref).any()
    emu = emulate.grouped_forward(case.q, case.kv_cache, case.k_scale, case.v_scale, plan.members,
                                  plan.microblocks, plan.masks, plan.seq_len, kv_dtype=case.kv_dtype,
                                  sm_scale=case.sm_scale, variant="unfixed")
    assert torch.isfinite(emu).all()


def test_the_loop_itself_sees_the_report_nan():
    """Guard against a loop that is trivially NaN-free: the report's fingerprint, small context."""
    case = apply_poison(build_case(Geometry(context=600, topk=40)), "targeted", dims=[3, 200])
    out = loop_grouped(case, plan_groups(case), "unfixed")
    nan_dims = torch.nonzero(torch.isnan(out).flatten(0, 2).any(dim=0)).flatten().tolist()
    assert nan_dims == [3, 200] and not math.isnan(float(loop_grouped(case, plan_groups(case), "kernel_fix").sum()))


def test_an_infinite_attended_score_matches_the_loop():
    """A +Inf score (E5M2 Inf in an attended key) becomes the running max: every p is then
    exp(-80), nothing is NaN; a max that turned +Inf into the largest float gave NaN here."""
    case = apply_poison(build_case(Geometry(rows=9, context=24, topk=2, page_size=4, q_heads=1, head_dim=16,
                                            kv_dtype="e5m2")), "attended-k", dims=[0], payload="inf")
    plan = plan_groups(case)
    got = emulate.grouped_forward(case.q, case.kv_cache, case.k_scale, case.v_scale, plan.members,
                                  plan.microblocks, plan.masks, plan.seq_len, kv_dtype=case.kv_dtype,
                                  sm_scale=case.sm_scale, variant="unfixed")
    want = loop_grouped(case, plan, "unfixed")
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and not torch.isnan(want).any()

"""The compiled kernels against their PyTorch twin (qsa_lab.routes.emulate) and the
float64 reference. Runs only where a CUDA GPU is visible; skips cleanly elsewhere.

Tolerance (finite values, CUDA vs emulation, stated once): |cuda - emu| <= ATOL + RTOL * |emu|;
NaN and Inf positions (and the Inf signs) must be equal.
The two differ only in fp32 summation order (tensor-core QK and P@V, row sums) and in the
kernel's fast exp (__expf, as upstream), which can move an fp16 P by one ulp.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from qsa_lab.routes import compiled as kernels  # noqa: E402
from qsa_lab.model.case import Geometry, build_case  # noqa: E402
from qsa_lab.model.plan import pad_fix, plan_groups  # noqa: E402
from qsa_lab.model.poison import ATTENDED_SITES, PAYLOAD_BITS, SITES, apply_poison  # noqa: E402
from qsa_lab.routes import emulate  # noqa: E402
from qsa_lab.routes.run import run_routes

ATOL, RTOL = 4e-3, 1e-2          # CUDA vs emulation
REF_ATOL, REF_RTOL = 1e-2, 2e-2  # fixed routes vs the float64 reference
KV_DTYPES = ("e4m3", "e5m2", "fp16")
NULL_BLOCK_SITES = ("none", "zeros", "targeted", "random", "fp16-state")
# A geometry that keeps every site meaningful (stale tails: context not a multiple of 4)
# and runs in about a second per case: 2 requests, 19 rows (2 groups + XQA remainder).
GEOM = dict(rows=19, requests=2, layout="scatter", context=2050, topk=128)


@pytest.fixture(scope="module", autouse=True)
def built():
    kernels.load()  # a build failure fails here, with the compiler's output


def case_for(kv_dtype, site, plane="v", seed=0, payload=None, **kw):
    g = Geometry(**{**GEOM, **kw, "kv_dtype": kv_dtype, "seed": seed})
    return apply_poison(build_case(g), site, plane=plane, seed=seed, payload=payload)


def bits(x):
    return x.view(torch.int16)


def assert_close_to(cuda, emu, atol, rtol, what):
    nan_c, nan_e = torch.isnan(cuda), torch.isnan(emu)
    assert torch.equal(nan_c, nan_e), f"{what}: NaN masks differ ({int(nan_c.sum())} vs {int(nan_e.sum())})"
    inf_c, inf_e = torch.isinf(cuda), torch.isinf(emu)
    assert torch.equal(inf_c, inf_e), f"{what}: Inf masks differ ({int(inf_c.sum())} vs {int(inf_e.sum())})"
    assert torch.equal(cuda[inf_c], emu[inf_e]), f"{what}: Inf signs differ"
    finite = ~(nan_c | inf_c)
    c, e = cuda[finite].double(), emu[finite].double()
    err = (c - e).abs() - (atol + rtol * e.abs())
    assert err.numel() == 0 or err.max() <= 0, f"{what}: max excess {float(err.max()):.3g} over tolerance"


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("site", SITES)
def test_routes_match_emulation(kv_dtype, site):
    case = case_for(kv_dtype, site)
    cuda = run_routes(case, backend="cuda")
    emu = run_routes(case, backend="emulate")
    for route, out in cuda.outputs.items():
        if route != "reference":
            assert_close_to(out, emu.outputs[route], ATOL, RTOL, f"{route} {kv_dtype} {site}")
    if site in ATTENDED_SITES:
        return  # poison in attended tokens: no route is clean (test_attended_poison_* below)
    if site == "query":  # NaN q: XQA NaN everywhere, the grouped rows exactly 0 on the GPU as emulated
        grouped_rows = cuda.plan.members.flatten()
        assert bool(torch.isnan(cuda.outputs["xqa"]).all())
        for route in ("grouped", "grouped+kernel_fix", "grouped+masked_load"):
            assert not torch.isnan(cuda.outputs[route][grouped_rows]).any(), route
        return
    # fixes A and C are clean and right everywhere; fix B wherever the poison is null-block padding
    fixed = ["grouped+kernel_fix", "grouped+masked_load", "grouped+both_fixes", "xqa"]
    if site in NULL_BLOCK_SITES:
        fixed.append("grouped+pad_fix")
    ref = cuda.reference64
    for route in fixed:
        out = cuda.outputs[route]
        assert not torch.isnan(out).any(), f"{route} {kv_dtype} {site}: NaN"
        assert_close_to(out.double(), ref, REF_ATOL, REF_RTOL, f"{route} vs reference")


ATTENDED_CASES = [(kv, site, payload) for kv in KV_DTYPES for site in ATTENDED_SITES for payload in ("nan", "inf")
                  if (kv, payload) in PAYLOAD_BITS]


@pytest.mark.parametrize("kv_dtype,site,payload", ATTENDED_CASES)
def test_attended_poison_matches_emulation(kv_dtype, site, payload):
    """NaN / Inf in a token that rows attend, K or V plane: every route, CUDA = emulation
    (bitwise NaN masks, values within the tolerance), lse included for the grouped kernels."""
    case = case_for(kv_dtype, site, payload=payload)
    assert case.poison["bytes_written"] > 0
    cuda = run_routes(case, backend="cuda")
    emu = run_routes(case, backend="emulate")
    for route, out in cuda.outputs.items():
        if route != "reference":
            assert_close_to(out, emu.outputs[route], ATOL, RTOL, f"{route} {kv_dtype} {site} {payload}")
    c = case.to("cuda")
    plan = plan_groups(c)
    for variant in ("unfixed", "kernel_fix", "masked_load"):
        kw = dict(kv_dtype=kv_dtype, sm_scale=c.sm_scale, variant=variant, return_lse=True)
        _, lse_c = kernels.grouped_forward(*grouped_args(c, plan), **kw)
        _, lse_e = emulate.grouped_forward(*grouped_args(c, plan), **kw)
        assert_close_to(lse_c, lse_e, 1e-4, 1e-5, f"lse {variant} {kv_dtype} {site} {payload}")


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_attended_k_nan_dropped_by_grouped_not_by_xqa(kv_dtype):
    """The second route divergence: a NaN key that rows attend is silently dropped by the
    grouped route (fmaxf running max, probability e^-80 -> 0 in fp16), while XQA and the
    reference give NaN on those rows."""
    case = case_for(kv_dtype, "attended-k", payload="nan")
    out = run_routes(case, routes=["xqa", "grouped", "grouped+kernel_fix", "grouped+masked_load"],
                     backend="cuda").outputs
    assert torch.isnan(out["xqa"]).any(), "XQA should propagate the NaN key"
    for route in ("grouped", "grouped+kernel_fix", "grouped+masked_load"):
        assert not torch.isnan(out[route]).any(), f"{route}: the grouped softmax drops a NaN key"


def test_early_v_bitwise_equals_unfixed():
    """early_v only moves the V panel's global reads earlier: same arithmetic, same bits."""
    for kv_dtype in KV_DTYPES:
        case = case_for(kv_dtype, "targeted", payload="nan").to("cuda")  # null-block NaN in every dtype
        plan = plan_groups(case)
        kw = dict(kv_dtype=kv_dtype, sm_scale=case.sm_scale, return_lse=True)
        out_u, lse_u = kernels.grouped_forward(*grouped_args(case, plan), variant="unfixed", **kw)
        out_e, lse_e = kernels.grouped_forward(*grouped_args(case, plan), variant="early_v", **kw)
        assert torch.isnan(out_u).any(), "the case should show the bug"
        assert torch.equal(bits(out_u), bits(out_e)) and torch.equal(lse_u.view(torch.int32), lse_e.view(torch.int32))


def test_unfixed_leaks_on_targeted_e4m3():
    """The bug itself: targeted V poison NaNs the unfixed kernel on exactly the poisoned dims."""
    case = case_for("e4m3", "targeted")
    out = run_routes(case, routes=["grouped"], backend="cuda").outputs["grouped"]
    nan_dims = torch.nonzero(torch.isnan(out).any(dim=(0, 1))).flatten().tolist()
    assert nan_dims == sorted(case.poison["poisoned_dims"])


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_stale_tail_only_kernel_fix_and_masked_load_clean(kv_dtype):
    case = case_for(kv_dtype, "stale-tail")
    out = run_routes(case, backend="cuda").outputs
    for route in ("grouped+kernel_fix", "grouped+masked_load", "grouped+both_fixes"):
        assert not torch.isnan(out[route]).any(), route
    if kv_dtype != "fp16":
        assert torch.isnan(out["grouped+pad_fix"]).any(), "fix B cannot clean stale tails"


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_k_plane_poison_clean_everywhere(kv_dtype):
    case = case_for(kv_dtype, "random", plane="k")
    for route, out in run_routes(case, backend="cuda").outputs.items():
        assert not torch.isnan(out).any(), route


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_decoded_panels_equal_emulation(kv_dtype):
    g = torch.Generator().manual_seed(1)
    pages, ps, d = 16, 32, 256
    if kv_dtype == "fp16":
        kv = torch.randn(pages, 2, ps, 1, d, generator=g).half()
    else:  # every code, NaNs and subnormals included
        kv = torch.randint(0, 256, (pages, 2, ps, 1, d), generator=g, dtype=torch.uint8)
        kv.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    kv = kv.cuda()
    mb = torch.randperm(pages * ps // 4, generator=g)[:40].to(torch.int32).cuda()
    for plane in (0, 1):
        cuda = kernels.decode_panel(kv, mb, plane=plane, kv_dtype=kv_dtype)
        emu = emulate.decode_panel(kv, mb, plane=plane, kv_dtype=kv_dtype)
        nan = torch.isnan(emu)
        assert torch.equal(torch.isnan(cuda), nan)
        assert torch.equal(bits(cuda)[~nan], bits(emu)[~nan]), "decoded values differ bitwise"
    if kv_dtype == "e4m3":  # the real route's NaN encodings
        codes = torch.tensor([0x7F, 0xFF], dtype=torch.uint8, device="cuda")
        one = torch.zeros(1, 2, 4, 1, 16, dtype=torch.uint8, device="cuda")
        one[0, 1, 0, 0, :2] = codes
        out = kernels.decode_panel(one, torch.zeros(1, dtype=torch.int32, device="cuda"), plane=1, kv_dtype="e4m3")
        assert bits(out)[0, :2].tolist() == [0x7E00, 0xFE00 - 0x10000]


def grouped_args(case, plan):
    return (case.q, case.kv_cache, case.k_scale, case.v_scale, plan.members, plan.microblocks,
            plan.masks, plan.seq_len)


@pytest.mark.parametrize("variant", ["unfixed", "kernel_fix", "masked_load", "finite_pv"])
def test_lse_and_repeat_bitwise(variant):
    case = case_for("e4m3", "random").to("cuda")
    plan = plan_groups(case)
    kw = dict(kv_dtype="e4m3", sm_scale=case.sm_scale, variant=variant, return_lse=True)
    out1, lse1 = kernels.grouped_forward(*grouped_args(case, plan), **kw)
    out2, lse2 = kernels.grouped_forward(*grouped_args(case, plan), **kw)
    assert torch.equal(bits(out1), bits(out2)) and torch.equal(lse1.view(torch.int32), lse2.view(torch.int32))
    _, lse_e = emulate.grouped_forward(*grouped_args(case, plan), **kw)
    assert torch.allclose(lse1, lse_e, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("q_heads,head_dim,page_size", [(1, 16, 4), (3, 64, 8), (5, 128, 16), (8, 256, 32)])
def test_other_shapes_match_emulation(q_heads, head_dim, page_size):
    case = case_for("e4m3", "random", q_heads=q_heads, head_dim=head_dim, page_size=page_size)
    routes = ["xqa", "grouped", "grouped+kernel_fix", "grouped+masked_load"]
    cuda = run_routes(case, routes=routes, backend="cuda")
    emu = run_routes(case, routes=routes, backend="emulate")
    for route in routes:
        assert_close_to(cuda.outputs[route], emu.outputs[route], ATOL, RTOL, f"{route} Hq{q_heads} D{head_dim}")


def test_cuda_graph_pad_fix_and_forward_equal_eager():
    """Fix B + grouped forward captured once, replayed on a new case of the same shape."""
    cases = [case_for("e4m3", "random", seed=s).to("cuda") for s in (0, 1)]
    plans = [plan_groups(c) for c in cases]
    cap = max(p.cap for p in plans)

    def widen(x):  # entries past seq_len are ignored, so zero columns keep a plan's meaning
        return torch.nn.functional.pad(x, (0, cap - x.shape[1]))

    plans = [p.__class__(**{**vars(p), "microblocks": widen(p.microblocks), "masks": widen(p.masks)}) for p in plans]
    static = {k: v.clone() for k, v in dict(q=cases[0].q, kv=cases[0].kv_cache, rows=plans[0].members,
                                              mb=plans[0].microblocks, masks=plans[0].masks,
                                              seq=plans[0].seq_len).items()}
    kw = dict(kv_dtype="e4m3", sm_scale=cases[0].sm_scale, variant="unfixed")
    scales = (cases[0].k_scale, cases[0].v_scale)

    def step():
        fixed = pad_fix(plans[0].__class__(**{**vars(plans[0]), "members": static["rows"],
                                               "microblocks": static["mb"], "masks": static["masks"],
                                               "seq_len": static["seq"]}))
        return kernels.grouped_forward(static["q"], static["kv"], *scales, fixed.members, fixed.microblocks,
                                       fixed.masks, fixed.seq_len, **kw)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture (allocator, kernel attributes)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step()
    # new inputs, same shapes; the scales are kernel arguments baked into the graph, so the
    # eager run below uses the same ones
    for k, v in dict(q=cases[1].q, kv=cases[1].kv_cache, rows=plans[1].members, mb=plans[1].microblocks,
                     masks=plans[1].masks, seq=plans[1].seq_len).items():
        static[k].copy_(v)
    graph.replay()
    torch.cuda.synchronize()
    fixed = pad_fix(plans[1])
    eager = kernels.grouped_forward(cases[1].q, cases[1].kv_cache, *scales, fixed.members, fixed.microblocks,
                                    fixed.masks, fixed.seq_len, **kw)
    assert torch.equal(bits(graph_out), bits(eager))
    assert not torch.isnan(graph_out).any()


# ---------------------------------------------------------------- bad input: exceptions, never a crash

@pytest.fixture(scope="module")
def good():
    case = case_for("e4m3", "none").to("cuda")
    return case, plan_groups(case)


def call_grouped(case, plan, binding=False, **over):
    a = dict(q=case.q, kv_cache=case.kv_cache, k_scale=case.k_scale, v_scale=case.v_scale,
             group_rows=plan.members, microblocks=plan.microblocks, masks=plan.masks, seq_len=plan.seq_len,
             kv_dtype="e4m3", sm_scale=case.sm_scale, variant="unfixed")
    a.update(over)
    if binding:  # straight to the C++ binding: its own checks, not the Python wrapper's
        return kernels.load().grouped_forward(
            a["q"], a["kv_cache"], a["k_scale"], a["v_scale"], a["group_rows"], a["microblocks"], a["masks"],
            a["seq_len"], kernels.KV_DTYPE_CODES.get(a["kv_dtype"], 7), a["sm_scale"],
            kernels.VARIANTS.get(a["variant"], 9), False)
    return kernels.grouped_forward(**a)


def bad_grouped(case, plan):
    mb, rows, seq = plan.microblocks.clone(), plan.members.clone(), plan.seq_len.clone()
    mb[0, 0] = case.kv_cache.shape[0] * case.geometry.page_size // 4  # one past the pool
    rows[0, 3] = case.q.shape[0]
    seq[0] += 4
    return {
        "microblocks": dict(microblocks=mb),
        "group_rows": dict(group_rows=rows),
        "seq_len": dict(seq_len=seq),
        "q": dict(q=case.q.float()),
        "kv_cache": dict(kv_cache=case.kv_cache.cpu()),
        "masks": dict(masks=plan.masks[:, :-1]),
        "kv_dtype": dict(kv_dtype="e3m4"),
        "variant": dict(variant="fixed"),
    }


@pytest.mark.parametrize("binding", [False, True], ids=["python", "binding"])
def test_bad_grouped_input_raises(good, binding):
    case, plan = good
    for arg, over in bad_grouped(case, plan).items():
        with pytest.raises((ValueError, RuntimeError), match=arg):
            call_grouped(case, plan, binding=binding, **over)
    q = case.q.new_zeros(case.q.shape[0], case.q.shape[1], 8)  # head_dim 8
    with pytest.raises((ValueError, RuntimeError), match="head_dim"):
        call_grouped(case, plan, binding=binding, q=q)
    q = case.q.new_zeros(case.q.shape[0], 9, case.q.shape[2])  # 9 heads
    with pytest.raises((ValueError, RuntimeError), match="q_heads"):
        call_grouped(case, plan, binding=binding, q=q)
    kv = torch.zeros(4, 2, 6, 1, case.q.shape[2], dtype=torch.uint8, device="cuda")  # page_size 6
    with pytest.raises((ValueError, RuntimeError), match="page_size"):
        call_grouped(case, plan, binding=binding, kv_cache=kv)
    torch.cuda.synchronize()  # no asynchronous error was left behind


@pytest.mark.parametrize("binding", [False, True], ids=["python", "binding"])
def test_bad_xqa_and_decode_input_raises(good, binding):
    case, _ = good
    n, T = 3, 8
    q = case.q[:n].contiguous()
    idx = torch.arange(T, device="cuda").repeat(n, 1)
    cnt = torch.full((n,), T, dtype=torch.int32, device="cuda")
    f = kernels.load().xqa_forward if binding else None

    def xqa(**over):
        a = dict(q_rows=q, kv_cache=case.kv_cache, k_scale=1.0, v_scale=1.0, token_index=idx, token_count=cnt)
        a.update(over)
        if binding:
            return f(a["q_rows"], a["kv_cache"], 1.0, 1.0, a["token_index"], a["token_count"], 0, 0.1)
        return kernels.xqa_forward(**a, kv_dtype="e4m3", sm_scale=0.1)

    xqa()
    big = idx.clone()
    big[1, 2] = case.kv_cache.shape[0] * case.kv_cache.shape[2]
    for arg, over in {"token_index": dict(token_index=big), "token_count": dict(token_count=cnt + 1),
                      "q_rows": dict(q_rows=q.cpu())}.items():
        with pytest.raises((ValueError, RuntimeError), match=arg):
            xqa(**over)
    mb = torch.tensor([0, 10**6], dtype=torch.int32, device="cuda")
    with pytest.raises((ValueError, RuntimeError), match="microblocks"):
        if binding:
            kernels.load().decode_panel(case.kv_cache, mb, 1, 0)
        else:
            kernels.decode_panel(case.kv_cache, mb, plane=1, kv_dtype="e4m3")
    torch.cuda.synchronize()

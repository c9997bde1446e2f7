"""The complete fixes of the cross-request leak on the compiled kernels (issue 37), against their
PyTorch twin: every mixed batch (upstream's 46 + 1 + 1 + 1 rows, a prefill-only mix, a decode-heavy
mix) x query heads 2, 6, 8 x NaN / Inf / a finite control in each request's attended V, every route's
NaN and Inf masks bit for bit as emulated (values within test_kernels_cuda's tolerance); the complete
fixes give no other request's row a non-finite value; padded request groups (empty query slots);
the binding takes -1 rows and refuses others. Runs only where a CUDA GPU is visible.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from test_kernels_cuda import ATOL, REF_ATOL, REF_RTOL, RTOL, assert_close_to, built, case_for  # noqa: E402,F401

from qsa_lab.analysis.cross_request import judge  # noqa: E402
from qsa_lab.analysis.leaks import LEAKS  # noqa: E402
from qsa_lab.model.case import build_case  # noqa: E402
from qsa_lab.model.geometry import MIXES  # noqa: E402
from qsa_lab.model.plan import EMPTY_ROW, plan_groups  # noqa: E402
from qsa_lab.model.poison import poison_request  # noqa: E402
from qsa_lab.routes import compiled as kernels, emulate  # noqa: E402
from qsa_lab.routes.labels import COMPLETE_FIXES  # noqa: E402
from qsa_lab.routes.run import run_routes  # noqa: E402

SMALL = dict(head_dim=64, context=240, topk=64)       # every block of every request selected, as upstream
PAYLOADS = [("e4m3", "nan"), ("e4m3", "max"), ("fp16", "nan"), ("fp16", "inf"), ("e5m2", "inf")]
POISONED = {"upstream-mix": (0, 1, 2, 3), "prefill-mix": (0, 1, 2), "decode-mix": (0, 19)}


@pytest.mark.parametrize("kv_dtype,payload", PAYLOADS)
@pytest.mark.parametrize("q_heads", [2, 6, 8])
@pytest.mark.parametrize("mix", list(MIXES))
def test_mixed_cases_match_emulation(mix, q_heads, kv_dtype, payload):
    base = build_case(MIXES[mix].replace(q_heads=q_heads, kv_dtype=kv_dtype, **SMALL))
    for r in POISONED[mix]:
        case = poison_request(base, r, payload)
        cuda = run_routes(case, backend="cuda")
        emu = run_routes(case, backend="emulate")
        for route, out in cuda.outputs.items():
            if route != "reference":
                assert_close_to(out, emu.outputs[route], ATOL, RTOL, f"{route} {mix} Hq{q_heads} {payload} in r{r}")
        leaked = [x for x in judge(cuda, r, payload) if x["verdict"] in LEAKS and x["route"] in COMPLETE_FIXES]
        assert not leaked, leaked


@pytest.mark.parametrize("variant", ["unfixed", "kernel_fix", "finite_pv"])
@pytest.mark.parametrize("mix", ["upstream-mix", "prefill-mix"])
def test_padded_request_groups_match_emulation(mix, variant):
    """Every request's remainder as one padded group: empty query slots read no query and give 0."""
    case = poison_request(build_case(MIXES[mix].replace(**SMALL)), 0, "nan").to("cuda")
    plan = plan_groups(case, "request", remainder_group_min=1)
    assert bool((plan.members == EMPTY_ROW).any()) and plan.xqa_rows.numel() == 0
    args = (case.q, case.kv_cache, case.k_scale, case.v_scale, plan.members, plan.microblocks, plan.masks,
            plan.seq_len)
    kw = dict(kv_dtype=case.kv_dtype, sm_scale=case.sm_scale, variant=variant)
    out = kernels.grouped_forward(*args, **kw).cpu()
    emu = emulate.grouped_forward(*(a.cpu() if torch.is_tensor(a) else a for a in args), **kw)
    assert_close_to(out, emu, ATOL, RTOL, f"{variant} padded {mix}")
    empty = (plan.members == EMPTY_ROW).cpu()
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))


@pytest.mark.parametrize("kv_dtype", ["e4m3", "e5m2", "fp16"])
@pytest.mark.parametrize("site", ["targeted", "random", "fp16-state", "stale-tail"])
def test_complete_fixes_clean_on_the_null_block_and_stale_tails(kv_dtype, site):
    """Where kernel_fix is clean (null-block padding, stale tails), the complete fixes are too."""
    case = case_for(kv_dtype, site)
    cuda = run_routes(case, routes=["grouped+kernel_fix", *COMPLETE_FIXES], backend="cuda")
    for route in COMPLETE_FIXES:
        out = cuda.outputs[route]
        assert not torch.isnan(out).any(), route
        assert_close_to(out, cuda.reference64.to(torch.float16), REF_ATOL, REF_RTOL, f"{route} vs reference")


def test_binding_takes_empty_slots_and_refuses_other_negative_rows():
    case = build_case(MIXES["prefill-mix"].replace(**SMALL)).to("cuda")
    plan = plan_groups(case, "request", remainder_group_min=1)
    kw = dict(kv_dtype=case.kv_dtype, sm_scale=case.sm_scale, variant="kernel_fix")
    rows = plan.members.clone()
    kernels.grouped_forward(case.q, case.kv_cache, case.k_scale, case.v_scale, rows, plan.microblocks, plan.masks,
                            plan.seq_len, **kw)
    rows[rows == EMPTY_ROW] = -2
    with pytest.raises((ValueError, RuntimeError), match="group_rows"):
        kernels.grouped_forward(case.q, case.kv_cache, case.k_scale, case.v_scale, rows, plan.microblocks,
                                plan.masks, plan.seq_len, **kw)
    torch.cuda.synchronize()


def test_upstream_script_on_the_compiled_route():
    """scripts/upstream/cross_request_nan.py through the shim at upstream's sizes: kernel_fix leaks (1),
    the complete fixes do not (0)."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "scripts" / "upstream"
    spec = importlib.util.spec_from_file_location("cross_request_nan", root / "cross_request_nan.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    shim = root / "qsa_lab_shim.py"
    assert script.main(["--op", f"{shim}:kernel_fix", "--requests", "0,1"]) == 1
    assert script.main(["--op", f"{shim}:finite_pv", "--requests", "0,1"]) == 0
    assert script.main(["--op", f"{shim}:request_groups", "--requests", "0,1"]) == 0

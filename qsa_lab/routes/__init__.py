"""Run a case through every route on one backend.

Routes (CONTRACT): reference, xqa, grouped, grouped+kernel_fix (fix A), grouped+pad_fix
(fix B), grouped+both_fixes (A and B), grouped+masked_load (fix C). A grouped route runs
the planner's groups through the grouped kernel and its remainder rows through XQA.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..case import Case, validate_case
from ..plan import GroupedPlan, pad_fix, plan_groups, xqa_tokens
from . import emulate
from .reference import reference_forward

#: grouped route -> (kernel variant, pad-fix applied to the plan)
GROUPED = {
    "grouped": ("unfixed", False),
    "grouped+kernel_fix": ("kernel_fix", False),
    "grouped+pad_fix": ("unfixed", True),
    "grouped+both_fixes": ("kernel_fix", True),
    "grouped+masked_load": ("masked_load", False),
}
ROUTES = ("reference", "xqa") + tuple(GROUPED)
BACKENDS = ("auto", "emulate", "cuda")


@dataclass
class RunResult:
    """outputs: route -> [rows, q_heads, head_dim] fp16 on the CPU; reference64: float64."""
    case: Case
    backend: str
    plan: GroupedPlan
    outputs: dict = field(default_factory=dict)
    reference64: torch.Tensor | None = None


def check_routes(routes) -> tuple:
    routes = ROUTES if routes is None else tuple(routes)
    bad = [r for r in routes if r not in ROUTES]
    if bad:
        raise ValueError(f"routes: unknown route(s) {bad}; choose from {ROUTES}")
    return routes


def kernel_limits_violation(geometry) -> str | None:
    """Why the compiled kernels cannot run this geometry (None when they can)."""
    from .. import kernels

    if not 1 <= geometry.q_heads <= kernels.MAX_Q_HEADS:
        return f"q_heads: the compiled kernels take 1..{kernels.MAX_Q_HEADS}, got {geometry.q_heads}"
    if geometry.head_dim > kernels.MAX_HEAD_DIM:
        return f"head_dim: the compiled kernels take at most {kernels.MAX_HEAD_DIM}, got {geometry.head_dim}"
    return None


def resolve_backend(backend: str, geometry=None) -> str:
    """'auto' -> 'cuda' when a GPU is visible, the kernels load and take this geometry,
    else 'emulate'. 'cuda' raises ValueError naming what stands in the way."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "emulate":
        return backend
    from .. import kernels

    limit = kernel_limits_violation(geometry) if geometry is not None else None
    if backend == "auto":
        return "cuda" if limit is None and kernels.available() else "emulate"
    if limit:
        raise ValueError(f"{limit} (use backend 'emulate')")
    try:
        kernels.load()
    except RuntimeError as e:
        raise ValueError(f"backend 'cuda' is unavailable: {str(e).splitlines()[0]}") from e
    return "cuda"


def backend_module(backend: str):
    if backend == "cuda":
        from .. import kernels

        return kernels
    return emulate


def grouped_output(case: Case, plan: GroupedPlan, variant: str, impl) -> torch.Tensor:
    """The grouped route's full output [rows, Hq, D]: groups through the grouped kernel,
    remainder rows through XQA."""
    out = torch.empty_like(case.q)
    if plan.groups:
        g = impl.grouped_forward(case.q, case.kv_cache, case.k_scale, case.v_scale, plan.group_rows,
                                 plan.microblocks, plan.masks, plan.seq_len, kv_format=case.kv_format,
                                 sm_scale=case.sm_scale, variant=variant)
        out[plan.group_rows.flatten()] = g.reshape(-1, *case.q.shape[1:])
    if plan.xqa_rows.numel():
        out[plan.xqa_rows] = xqa_output(case, plan.xqa_rows, impl)
    return out


def xqa_output(case: Case, rows: torch.Tensor, impl) -> torch.Tensor:
    token_index, token_count = xqa_tokens(case, rows)
    return impl.xqa_forward(case.q[rows], case.kv_cache, case.k_scale, case.v_scale, token_index,
                            token_count, kv_format=case.kv_format, sm_scale=case.sm_scale)


def run_routes(case: Case, routes=None, backend: str = "auto", grouping: str | None = None) -> RunResult:
    """Run `case` through `routes` (default all). Outputs come back on the CPU."""
    routes = check_routes(routes)
    validate_case(case)
    backend = resolve_backend(backend, case.geometry)
    impl = backend_module(backend)
    dev = torch.device("cuda") if backend == "cuda" else torch.device("cpu")
    run_case = case.to(dev)
    plan = plan_groups(run_case, grouping)
    fixed_plan = pad_fix(plan) if any(GROUPED.get(r, ("", False))[1] for r in routes) else None
    result = RunResult(case, backend, plan.to("cpu"))
    ref = reference_forward(case)
    result.reference64 = ref
    all_rows = torch.arange(case.geometry.rows, device=dev)
    for route in routes:
        if route == "reference":
            out = ref.to(torch.float16)
        elif route == "xqa":
            out = xqa_output(run_case, all_rows, impl)
        else:
            variant, fixed = GROUPED[route]
            out = grouped_output(run_case, fixed_plan if fixed else plan, variant, impl)
        result.outputs[route] = out.cpu()
    return result

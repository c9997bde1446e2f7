"""Run a case through every route on one backend.

Routes (routes.labels): reference, xqa, grouped, grouped+kernel_fix (A), grouped+pad_fix (B),
grouped+both_fixes (A+B), grouped+masked_load (C), grouped+request_groups (R),
grouped+finite_pv (F). A grouped route runs the planner's groups through the grouped kernel and
its remainder rows through XQA; its groups are the case's (geometry `group_rows`), except for a
route of labels.GROUPING, which plans its own (request_groups: groups that never span requests).
"""
from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field

import torch

from qsa_lab.model.case import Case, decoded_once, validate_case
from qsa_lab.model.geometry import BACKENDS
from qsa_lab.model.plan import EMPTY_ROW, GroupedPlan, pad_fix, plan_groups, xqa_tokens
from qsa_lab.routes import emulate
from qsa_lab.routes.reference import every_row, reference_forward

from qsa_lab.routes.labels import GROUPED, GROUPING, KERNEL_VARIANTS as VARIANTS, ROUTES, check_renamed  # noqa: F401 - the one vocabulary, named here too


@dataclass
class RunResult:
    """outputs: route -> [rows, q_heads, head_dim] fp16 on the CPU; reference64: float64."""
    case: Case
    backend: str
    plan: GroupedPlan
    outputs: dict = field(default_factory=dict)
    reference64: torch.Tensor | None = None


class NonFiniteQueryWarning(UserWarning):
    """q holds NaN or Inf that no poison site put there (the grouped route hides it)."""


def warn_nonfinite_query(case: Case) -> None:
    """Warn when q is non-finite and the case's poison ('query') does not say so: the grouped
    route returns such rows as 0 (its fmaxf softmax ignores NaN scores) where XQA and the
    reference give NaN, so the route table alone would not show it."""
    bad = ~torch.isfinite(case.q).flatten(1).all(dim=1)
    if case.poison.get("site") != "query" and bool(bad.any()):
        rows = torch.nonzero(bad).flatten().tolist()
        warnings.warn(f"q: rows {rows[:8]}{' ...' if len(rows) > 8 else ''} hold NaN or Inf; the grouped route "
                      "returns them as 0 (its softmax ignores NaN scores) where XQA and the reference give NaN",
                      NonFiniteQueryWarning, stacklevel=3)


def check_routes(routes) -> tuple:
    if isinstance(routes, str):  # a lone name would otherwise be read letter by letter
        routes = (routes,)
    routes = ROUTES if routes is None else tuple(routes)
    if not routes:   # an empty list ran nothing and answered with an empty result
        raise ValueError(f"routes: empty; name at least one of {ROUTES} (None: all of them)")
    for r in routes:
        if isinstance(r, str):
            check_renamed(r, "routes")
    bad = [r for r in routes if not isinstance(r, str) or r not in ROUTES]
    if bad:
        raise ValueError(f"routes: unknown route(s) {bad}; choose from {ROUTES}")
    twice = sorted({r for r in routes if routes.count(r) > 1})
    if twice:
        raise ValueError(f"routes: {twice} named more than once")
    return routes


def kernel_limits_violation(geometry) -> str | None:
    """Why the compiled kernels cannot run this geometry (None when they can)."""
    from qsa_lab.routes import compiled as kernels

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
    from qsa_lab.routes import compiled as kernels

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
        from qsa_lab.routes import compiled as kernels

        return kernels
    return emulate


def check_variant(variant) -> str:
    if not isinstance(variant, str) or variant not in VARIANTS:
        raise ValueError(f"variant: must be one of {VARIANTS}, got {variant!r}")
    return variant


def check_plan(case: Case, plan: GroupedPlan, group_rows: str | None = None) -> GroupedPlan:
    """Refuse a plan made for another case (ValueError naming 'plan'): its rows, heads and
    attended entries must be those the planner gives this case (padding entries may differ,
    as pad_fix repoints them); every microblock must lie inside the cache."""
    if not isinstance(plan, GroupedPlan):
        raise TypeError(f"plan: expected a GroupedPlan, got {type(plan).__name__}")
    g = case.geometry
    plan = plan.to(case.device)
    ref = plan_groups(case, group_rows)
    blocks = case.kv_cache.shape[0] * g.page_size // 4
    same = (plan.q_heads == g.q_heads and plan.microblocks.shape == ref.microblocks.shape
            and plan.masks.shape == ref.masks.shape and plan.seq_len.shape == ref.seq_len.shape
            and plan.microblocks.dtype == torch.int32 and plan.masks.dtype == torch.int32)
    same = same and torch.equal(plan.members, ref.members) and torch.equal(plan.xqa_rows, ref.xqa_rows)
    same = same and torch.equal(plan.masks, ref.masks) and torch.equal(plan.seq_len, ref.seq_len)
    same = same and torch.equal(torch.where(ref.masks != 0, plan.microblocks, 0),
                                torch.where(ref.masks != 0, ref.microblocks, 0))
    if not same:
        raise ValueError(f"plan: does not belong to this case ({case.describe()}); make it with plan_groups(case)")
    if plan.microblocks.numel() and not (0 <= int(plan.microblocks.min()) and int(plan.microblocks.max()) < blocks):
        raise ValueError(f"plan: microblocks must lie in [0, {blocks}) for this cache")
    return plan


def grouped_output(case: Case, plan: GroupedPlan, variant: str, impl, checked: bool = False) -> torch.Tensor:
    """The grouped route's full output [rows, Hq, D]: groups through the grouped kernel,
    remainder rows through XQA. checked=True: the caller made `plan` from `case` (or ran
    check_plan) and the case is validated, so the re-planning check is skipped."""
    check_variant(variant)
    if not checked:
        validate_case(case)
        check_plan(case, plan)
    out = torch.empty_like(case.q)
    if plan.groups:
        g = impl.grouped_forward(case.q, case.kv_cache, case.k_scale, case.v_scale, plan.members,
                                 plan.microblocks, plan.masks, plan.seq_len, kv_dtype=case.kv_dtype,
                                 sm_scale=case.sm_scale, variant=variant)
        scatter_groups(out, plan, g)
    if plan.xqa_rows.numel():
        out[plan.xqa_rows] = xqa_output(case, plan.xqa_rows, impl)
    return out


def scatter_groups(out: torch.Tensor, plan: GroupedPlan, grouped: torch.Tensor) -> None:
    """out[row] = the grouped kernel's output [groups, 8, Hq, D] of each row of the plan's groups
    (a padded group's empty slots, EMPTY_ROW, are dropped)."""
    rows = plan.members.flatten()
    real = rows != EMPTY_ROW
    out[rows[real]] = grouped.reshape(-1, *out.shape[1:])[real]


def route_plan(route: str, plan: GroupedPlan, fixed_plan: GroupedPlan | None, case: Case,
               memo: dict | None = None) -> GroupedPlan:
    """The plan a grouped route runs: `plan` (the case's groups, before any fix), its pad_fix
    `fixed_plan`, or for a route of labels.GROUPING its own groups (made from `case`, kept in
    `memo` when given: a plan does not read the cache's bytes)."""
    own = GROUPING.get(route)
    if own is None:
        return fixed_plan if GROUPED[route][1] else plan
    memo = {} if memo is None else memo
    key = f"plan.{own}"
    if key not in memo:
        memo[key] = plan_groups(case, own)
    return memo[key]


def xqa_output(case: Case, rows: torch.Tensor, impl) -> torch.Tensor:
    token_index, token_count = xqa_tokens(case, rows)
    return impl.xqa_forward(case.q[rows], case.kv_cache, case.k_scale, case.v_scale, token_index,
                            token_count, kv_dtype=case.kv_dtype, sm_scale=case.sm_scale)


def run_routes(case: Case, routes=None, backend: str = "auto", group_rows: str | None = None, *,
               plan: GroupedPlan | None = None, progress: bool = False, reference: bool = True) -> RunResult:
    """Run `case` through `routes` (default all). Outputs come back on the CPU.

    group_rows: how rows form groups, 'consecutive' | 'request' (default the geometry's); plan: the grouped plan before any fix, when the caller already has it (checked to belong
    to this case); progress: a progress bar over the routes on stderr; reference: compute the
    float64 reference (`reference64`) even when the route 'reference' is not asked for."""
    routes = check_routes(routes)
    validate_case(case)
    warn_nonfinite_query(case)
    backend = resolve_backend(backend, case.geometry)
    dev = torch.device("cuda") if backend == "cuda" else torch.device("cpu")
    run_case = case.to(dev)
    plan = plan_groups(run_case, group_rows) if plan is None else check_plan(run_case, plan, group_rows)
    return run_routes_planned(case, routes, backend, plan, progress=progress, reference=reference)


def run_routes_planned(case: Case, routes, backend: str, plan: GroupedPlan, *, progress: bool = False,
                       reference: bool = True, memo: dict | None = None) -> RunResult:
    """run_routes for a caller that checked its inputs already: `case` validated, `routes` and
    `backend` resolved, `plan` made from this case on the backend's device. memo: a dict kept
    across calls on cases that differ only in the cache's bytes (the canary's), where the token
    lists, which do not depend on those bytes, are kept; with memo["units"] a routes.reuse.CleanUnits
    of a base case, the emulation takes from it every unit that reads none of the bytes where
    `case`'s cache differs from the base's (cross-request's poisoned runs)."""
    impl = backend_module(backend)
    dev = torch.device("cuda") if backend == "cuda" else torch.device("cpu")
    run_case = case.to(dev)
    fixed_plan = pad_fix(plan) if any(GROUPED.get(r, ("", False))[1] for r in routes) else None
    result = RunResult(case, backend, plan.to("cpu"))
    from tqdm import tqdm  # plain text on stderr: the CLI's long runs

    bar = tqdm(routes, desc="routes", disable=not progress, file=sys.stderr)
    if backend == "emulate":
        with decoded_once(case.kv_cache, case.kv_dtype):  # every route reads this one decode
            result.outputs, result.reference64 = emulated_routes(case, routes, plan, fixed_plan, reference=reference,
                                                                 memo=memo, bar=bar)
        return result
    if reference or "reference" in routes:
        with decoded_once(case.kv_cache, case.kv_dtype):
            result.reference64 = reference_forward(case)
    all_rows = torch.arange(case.geometry.rows, device=dev)
    for route in bar:
        if route == "reference":
            out = result.reference64.to(torch.float16)
        elif route == "xqa":
            out = xqa_output(run_case, all_rows, impl)
        else:
            route_p = route_plan(route, plan, fixed_plan, run_case, memo)
            out = grouped_output(run_case, route_p, GROUPED[route][0], impl, checked=True)
        result.outputs[route] = out.cpu()
    return result


def emulated_routes(case: Case, routes, plan: GroupedPlan, fixed_plan, *, reference: bool = True,
                    remainder: bool = True, memo: dict | None = None, bar=None):
    """The emulation's routes -> (outputs, reference64), sharing what routes have in common, each
    output bit for bit what its route gives alone: one gather of each row's tokens for the
    reference and XQA (_every_row), one XQA run of the grouped routes' remainder rows, and one
    pass of the grouped kernel for all its variants (grouped_forward_many: they share S, the
    softmax and the sums).

    For a caller that checked its inputs (see run_routes_planned; memo likewise), best inside
    decoded_once(case.kv_cache, ...). reference: compute reference64 even when the route
    'reference' is not asked for (else None). remainder=False: the grouped routes' XQA rows are
    left unset (emulated_remainder gives them). bar: iterated instead of `routes` (a progress bar)."""
    memo = {} if memo is None else memo
    if memo.get("units") is not None:  # cases differing from a base case only in the cache's bytes
        memo["units"].bind(case)
    ref, xqa = _every_row(case, memo, reference or "reference" in routes, "xqa" in routes)
    grouped = [r for r in routes if r in GROUPED]
    outputs = {}
    for route in routes if bar is None else bar:
        if route == "reference":
            outputs[route] = ref.to(torch.float16)
        elif route == "xqa":
            outputs[route] = xqa
        elif route not in outputs:  # the first grouped route: all of them at once
            outputs.update(_emulated_grouped(case, grouped, plan, fixed_plan, memo, remainder))
    return {r: outputs[r] for r in routes}, ref


def _every_row(case: Case, memo: dict, reference: bool, xqa: bool) -> tuple:
    """reference.every_row over XQA's padded width, its token lists kept in `memo`."""
    if not (reference or xqa):
        return None, None
    if "xqa_tokens" not in memo:
        memo["xqa_tokens"] = xqa_tokens(case)
    index, count = memo["xqa_tokens"]
    return every_row(case, index, count, emulate.xqa_width(index.shape[1], case.kv_dtype), reference=reference,
                     xqa=xqa, units=memo.get("units"))


def emulated_remainder(case: Case, plan: GroupedPlan, memo: dict, key: str = "rest_tokens") -> torch.Tensor:
    """[len(plan.xqa_rows), Hq, D]: the rows outside every group, through XQA as every grouped route
    of `plan` runs them (their token lists kept in memo[key])."""
    if key not in memo and "xqa_tokens" in memo:  # every row's lists, cut to these rows' width
        index, count = memo["xqa_tokens"]
        count = count[plan.xqa_rows]
        memo[key] = index[plan.xqa_rows, :max(int(count.max()) if count.numel() else 0, 1)].contiguous(), count
    if key not in memo:
        memo[key] = xqa_tokens(case, plan.xqa_rows)
    token_index, token_count = memo[key]
    run = lambda: emulate.xqa_forward(case.q[plan.xqa_rows], case.kv_cache, case.k_scale, case.v_scale,  # noqa: E731
                                      token_index, token_count, kv_dtype=case.kv_dtype, sm_scale=case.sm_scale)
    units = memo.get("units")
    if units is None:
        return run()
    read = torch.arange(token_index.shape[1], device=token_index.device) < token_count.long().unsqueeze(1)
    return units(("remainder", key), token_index[read], run, (plan.xqa_rows, token_index, token_count))


def _emulated_grouped(case: Case, routes, plan: GroupedPlan, fixed_plan, memo: dict, remainder: bool) -> dict:
    """The grouped routes: those on the case's groups in one pass (grouped_forward_many), each route
    of labels.GROUPING on its own plan."""
    outs = {}
    shared = [r for r in routes if r not in GROUPING]
    if shared:
        outs.update(_grouped_pass(case, shared, plan, [(fixed_plan if GROUPED[r][1] else plan) for r in shared],
                                  memo, remainder, "rest_tokens"))
    for r in routes:
        if r in GROUPING:
            own = route_plan(r, plan, fixed_plan, case, memo)
            outs.update(_grouped_pass(case, [r], own, [own], memo, remainder, f"rest_tokens.{GROUPING[r]}"))
    return {r: outs[r] for r in routes}


def _grouped_pass(case: Case, routes, plan: GroupedPlan, plans, memo: dict, remainder: bool, key: str) -> dict:
    """Grouped routes whose plans share `plan`'s groups and masks (`plans`: each route's, a plan or its
    pad_fix): one grouped_forward_many, one XQA run of the remainder rows."""
    outs = {r: torch.empty_like(case.q) for r in routes}
    if plan.groups:
        panels = [(p.microblocks, GROUPED[r][0]) for r, p in zip(routes, plans)]
        many = emulate.grouped_forward_many(case.q, case.kv_cache, case.k_scale, case.v_scale, plan.members,
                                            panels, plan.masks, plan.seq_len, kv_dtype=case.kv_dtype,
                                            sm_scale=case.sm_scale, units=memo.get("units"), unit_key=key)
        for r, (g, _) in zip(routes, many):
            scatter_groups(outs[r], plan, g)
    if remainder and plan.xqa_rows.numel():
        rest = emulated_remainder(case, plan, memo, key)
        for r in routes:
            outs[r][plan.xqa_rows] = rest
    return outs

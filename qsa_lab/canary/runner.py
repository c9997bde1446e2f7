"""The canary run: for each kernel x region x plane x payload, a poisoned run of one call
compared with the same kernel's control run (the region zero-filled on that plane). The control
runs twice per kernel x region x plane, before and after the payloads. This module is the run
loop (the arguments, the devices, the poisoned pools, the calls); what a cell's calls mean and
what the run adds up to are qsa_lab.canary.results (judge, LeakResult, CanaryReport).
"""
from __future__ import annotations

import contextlib
import copy
import sys
from pathlib import Path

import torch

from qsa_lab.model.poison import PAYLOADS, int_list, payload_bits
from qsa_lab.support.processes import MAX_WAIT, torch_threads
from qsa_lab.model.regions import REGIONS, check_region, region_parts, region_referenced, regions_of
from qsa_lab.canary.case import CanaryCase, as_canary_case, canary_case, load_case
from qsa_lab.canary.execution import DEFAULT_TIMEOUT, InProcess, Worker
from qsa_lab.canary.overlap import take as take_overlap
from qsa_lab.canary.call import KernelSkipped
from qsa_lab.canary.kernels import builtin_kernels, kernel_name, resolve_kernel, working_set
from qsa_lab.model.memory import BASE_BYTES, CANARY_POOL_COPIES, budget_bytes, over_budget
from qsa_lab.canary.names import KernelName, as_kernel_name
from qsa_lab.canary.results import CanaryReport, LeakResult, available_payloads, judge
from qsa_lab.analysis.leaks import ERROR

MAX_TIMEOUT = MAX_WAIT    # a week: a longer wait is no timeout (and overflows the thread and select waits)
DEFAULT_PAYLOADS = ("nan", "inf", "max")
PLANES = {"k": 0, "v": 1}
#: what a kernel reads the pool through (its attribute `paged_inputs`): the block table with its
#: padding entries (default), only each request's used pages (page_table()), or tables of its
#: own that pad with the null block (the qsa grouped routes' plan)
PAGED_INPUTS = ("block_table", "page_table", "padded_plan")


def _choices(arg: str, given, allowed, default) -> tuple:
    if given is None:
        return tuple(default)
    if isinstance(given, str):
        given = [given]
    given = tuple(given)
    bad = [g for g in given if g not in allowed]
    if bad or not given:
        raise ValueError(f"{arg}: unknown {bad or 'empty list'}; choose from {tuple(allowed)}")
    return given


def resolve_devices(backend: str, geometry, qsa: bool = True) -> tuple[torch.device, str | None, str | None]:
    """-> (device for the other kernels, qsa backend or None, why the qsa routes cannot run).
    Only `qsa` (some qsa: kernel requested) looks at qsa_lab's compiled kernels."""
    from qsa_lab.routes.run import BACKENDS, resolve_backend

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    gpu = torch.cuda.is_available()
    if backend == "cuda" and not gpu:
        raise ValueError("backend: 'cuda' needs a CUDA GPU and none is visible (use 'emulate' or 'auto')")
    device = torch.device("cuda" if backend == "cuda" or (backend == "auto" and gpu) else "cpu")
    if not qsa:
        return device, None, None
    try:
        return device, resolve_backend(backend, geometry), None
    except ValueError as e:  # the compiled kernels cannot run: the other kernels still can
        return device, None, str(e).splitlines()[0]


def write_region(kv_cache: torch.Tensor, slots: torch.Tensor, plane: int, kv_dtype: str, payload: str, dims=None,
                 mla_v_dim: int | None = None) -> None:
    """Write `payload` as whole elements of the storage dtype into `slots` ([pages, page_size]
    bool) of one plane, every KV head, at every head dim or only `dims`, in place. MLA
    (`mla_v_dim`): both planes are the latent plane 0, "v" its first mla_v_dim dims."""
    bits = payload_bits(kv_dtype, payload)
    D = kv_cache.shape[-1]
    cols = torch.zeros(D, dtype=torch.bool)
    cols[list(range(D)) if dims is None else list(dims)] = True
    if mla_v_dim is not None and plane == 1:
        cols[mla_v_dim:] = False
    target = 0 if mla_v_dim is not None else plane
    elems = kv_cache.view(torch.int16 if kv_dtype == "fp16" else torch.uint8)[:, target]    # [pages, ps, H, D]
    where = (slots.unsqueeze(-1) & cols).unsqueeze(2).expand(-1, -1, kv_cache.shape[3], -1)
    elems[where.to(kv_cache.device)] = bits - 0x10000 if bits >= 0x8000 and kv_dtype == "fp16" else bits


def _named(kernels) -> list:
    """-> [(name, kernel)], kernel a KernelName (strings parsed here, canary.names) or a callable:
    names as given; a name twice is refused, callables of one name numbered."""
    if isinstance(kernels, dict):
        items = list(kernels.items())
        for name, _ in items:
            if not isinstance(name, str) or not name:
                raise ValueError(f"kernels: names must be non-empty strings, got {name!r}")
        return [(name, as_kernel_name(k)) for name, k in items]
    items, seen = [], set()
    for k in kernels:
        if isinstance(k, (str, KernelName)):
            k = as_kernel_name(k)
            name = k.text
            if name in seen:
                raise k.error(f"{name!r} given twice (each kernel is keyed by its name)")
        elif callable(k):
            base = kernel_name(k)
            name, n = base, 1
            while name in seen:
                n += 1
                name = f"{base}#{n}"
        else:
            raise TypeError(f"kernels: expected names or callables, got {type(k).__name__}")
        seen.add(name)
        items.append((name, k))
    return items


def _dims(dims, D: int):
    if dims is None:
        return None
    dims = int_list(dims, "dims")  # '12' is not dims 1 and 2, nor 5.9 dim 5, nor True dim 1
    if not dims or any(not 0 <= d < D for d in dims):
        raise ValueError(f"dims must be a non-empty list of head dims in [0, {D}), got {dims}")
    return dims


def _case(case, kv_dtype, attend, geometry, budget: int) -> CanaryCase:
    if case is None:
        return canary_case("fp16" if kv_dtype is None else kv_dtype, attend="sparse" if attend is None else attend,
                           max_memory=budget, **geometry)
    if geometry:
        raise ValueError(f"case: give a case or geometry options ({', '.join(geometry)}), not both")
    case = load_case(case, attend) if isinstance(case, (str, Path)) else as_canary_case(case, attend)
    if kv_dtype is not None and kv_dtype != case.kv_dtype:   # a case brings its own pool: never silently another
        raise ValueError(f"kv_dtype: the case's pool is {case.kv_dtype}, not {kv_dtype!r} (leave it out with a case)")
    return case


def run_canary(kernels=None, regions=None, payloads=None, planes=("k", "v"), backend: str = "auto",
               case=None, kv_dtype: str | None = None, dims=None, progress: bool = False, attend=None,
               timeout: float = DEFAULT_TIMEOUT, second=None, max_memory=None, **geometry) -> CanaryReport:
    """Run the canary matrix.

    kernels: names (`qsa:<route>`, `torch:...`, `module:function`, `file.py:function`; parsed by
        qsa_lab.canary.names, or given as its KernelName records), callables fn(PagedCall) ->
        [rows, q_heads, head_dim], or a dict {name: either};
        default every built-in kernel (then one that cannot run here is only listed as skipped).
    regions: of the case's spec (qsa_lab.model.regions.regions_of; default all); payloads: of nan,
        inf, max, zero (default nan, inf, max); planes: "k", "v".
    backend: "auto" | "emulate" | "cuda": the qsa routes' backend; the other kernels run on
        the GPU unless it is "emulate" (or none is visible).
    case: a CanaryCase, a qsa_lab Case, or a case file (see qsa_lab.canary.case.CASE_FORMAT);
        default canary_case(kv_dtype, attend=attend, **geometry) with geometry keywords rows,
        requests, context, topk, page_size, q_heads, kv_heads, head_dim, query_len, seed,
        layout, selection, overlap, free_pages, mla, v_head_dim. kv_dtype: that case's pool
        (default fp16); a given case brings its own, and another kv_dtype beside it is an error.
    attend: the attention spec ('dense', 'sparse', 'window:W[,sink:S]' or an AttentionSpec);
        default sparse (a loaded case without selections: dense).
    dims: head dims to poison (default every dim; one dim shows a kernel's leak pattern: a V
        leak stays on that dim, a K leak spreads over the row). timeout: seconds per call.
    second: a support.executor.SecondProcess started by the caller (`qsa-lab canary`, before it
        imports torch: overlap.start); a run of FlexAttention's kernels beside others, on the CPU
        or a CUDA GPU, runs them there (overlap.take); a run that takes it ends it (close() again is harmless).
    max_memory: the memory budget (bytes or text such as '8G'; default half the memory available
        now): a built case above it is refused (canary_case), and a built-in kernel whose working
        set would take the run above it is skipped, saying so (qsa_lab.canary.kernels.working_set).
    """
    requested = kernels is not None
    kernels = list(builtin_kernels()) if kernels is None else (
        kernels if isinstance(kernels, dict) else [kernels] if isinstance(kernels, (str, KernelName))
        or callable(kernels) else list(kernels))
    if not kernels:
        raise ValueError("kernels: empty list")
    named = _named(kernels)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout < MAX_TIMEOUT:
        raise ValueError(f"timeout: must be a number of seconds in (0, {MAX_TIMEOUT:g}), got {timeout!r}")
    budget = budget_bytes(max_memory)
    case = _case(case, kv_dtype, attend, geometry, budget)
    regions = _choices("regions", regions, REGIONS, regions_of(case.spec))
    for r in regions:
        try:
            check_region(r, case.spec)
        except ValueError as e:
            raise ValueError(f"regions: {e}") from None
    payloads = _choices("payloads", payloads, PAYLOADS, DEFAULT_PAYLOADS)
    planes = _choices("planes", planes, PLANES, PLANES)
    dims = _dims(dims, case.out_dim if case.mla and planes == ("v",) else case.head_dim)

    skipped = []
    usable = available_payloads(case.kv_dtype)
    skipped += [{"payload": p, "reason": f"{case.kv_dtype} has no {p} code"} for p in payloads if p not in usable]
    payloads = [p for p in payloads if p in usable]
    parts = {r: region_parts(case, r) for r in regions}     # [(slots, judged rows or None)] per region
    empty = [r for r in regions if not any(slots.any() for slots, _ in parts[r])]
    skipped += [{"region": r, "reason": "empty in this case"} for r in empty]
    regions = [r for r in regions if r not in empty]
    if not payloads:
        raise ValueError(f"payloads: {case.kv_dtype} has a code for none of them (it has {usable})")
    if not regions:
        raise ValueError(f"regions: every one asked for is empty in this case ({case.describe()})")

    if progress:        # what runs, at once: the bar follows once the kernels are loaded
        n = len(named)
        print(f"# canary: {n} kernel{'s' if n > 1 else ''} x {len(regions) * len(planes)} cells ({len(regions)} "
              f"regions x {','.join(planes)}), each {len(payloads) + 2} calls (2 controls + {','.join(payloads)}); "
              f"case: {case.describe()}", file=sys.stderr, flush=True)
    qsa = any(isinstance(k, KernelName) and k.source == "qsa" for _, k in named)
    why = case.qsa_unsupported() if qsa else None
    device, qsa_backend, qsa_reason = resolve_devices(backend, case.geometry, qsa and why is None)
    qsa_reason = why or qsa_reason
    runners, overlap = {}, None
    try:
        own = BASE_BYTES + case.kv_cache.numel() * case.kv_cache.element_size() * CANARY_POOL_COPIES
        too_big = {}
        for name, k in named:
            need = working_set(k, case)
            if need is not None and own + need[0] > budget:   # said per kernel: the others still run
                too_big[name] = over_budget(own + need[0], budget, f"{name} ({need[1]})")
                runners[name] = InProcess(_skipped(too_big[name]), timeout, thread=False)
            else:
                runners[name] = runner_of(k, qsa_backend, qsa_reason, timeout)
        for r in runners.values():
            r.begin()       # every worker process imports its kernel at once
        for r in runners.values():
            r.load()
        overlap = take_overlap(second, [(n, k) for n, k in named if n not in too_big], device)
        # the canary's tensors are small: on the CPU more threads only contend
        with torch_threads(1) if device.type == "cpu" else contextlib.nullcontext():
            results = _run_matrix(runners, case, parts, regions, planes, payloads, dims, device, skipped, progress,
                                  overlap)
    finally:
        for r in [*runners.values(), *([overlap] if overlap else [])]:
            r.close()
    return CanaryReport(qsa_backend, str(device), case, list(runners), results, skipped, requested, float(timeout),
                        {n: k for n, k in named if isinstance(k, KernelName)})


def _skipped(reason: str):
    def skipped(call):
        raise KernelSkipped(reason)
    return skipped


def runner_of(kernel, qsa_backend, qsa_reason, timeout):
    """How the canary calls `kernel` (a KernelName, a name or a callable): a user's file or
    module in a Worker process, anything else in this process (InProcess)."""
    kernel = as_kernel_name(kernel)
    if isinstance(kernel, KernelName) and not kernel.in_process:
        return Worker(kernel, timeout)
    return InProcess(resolve_kernel(kernel, qsa_backend, qsa_reason), timeout, thread=callable(kernel))


def _paged_inputs(runner) -> str:
    v = getattr(runner, "paged_inputs", None) or getattr(getattr(runner, "fn", None), "paged_inputs", "block_table")
    if v not in PAGED_INPUTS:
        problem = f"paged_inputs must be one of {PAGED_INPUTS}, got {v!r}"
        name = getattr(runner, "name", None)   # a Worker's KernelName: the error names its option
        if isinstance(name, KernelName):
            raise name.error(f"{name.text!r}: {problem}")
        raise ValueError(f"kernels: {problem}")
    return v


def call_meta(case: CanaryCase) -> dict:
    """The call's scalars and spec, as a kernel runner takes them beside the tensors."""
    return {"k_scale": float(case.k_scale), "v_scale": float(case.v_scale), "sm_scale": float(case.sm_scale),
            "kv_dtype": case.kv_dtype, "spec": case.spec, "mla": case.mla, "v_head_dim": case.v_head_dim,
            "geometry": case.geometry}


class _Pools:
    """The poisoned pools of one run, each built once: {**base, "kv_cache": that pool} per
    (region, part, plane, payload); every call still gets fresh copies (execution.call_kernel).
    parts: region -> [(slots, judged rows or None)] (qsa_lab.model.regions.region_parts)."""

    def __init__(self, case, parts, dims):
        self.case, self.parts, self.dims = case, parts, dims
        self.base = {k: t.detach().cpu() for k, t in case.tensors().items()}
        self.pools, self.cell = {}, None

    def __call__(self, region, part, plane, payload) -> dict:
        key = (region, part, plane, payload)
        if key[:3] != self.cell:     # only one cell's pools are kept: the memory estimate counts that many
            self.pools, self.cell = {}, key[:3]
        if key not in self.pools:
            c, kv = self.case, self.base["kv_cache"].clone()
            write_region(kv, self.parts[region][part][0], PLANES[plane], c.kv_dtype, payload, self.dims,
                         c.v_head_dim if c.mla else None)
            self.pools[key] = kv
        return {**self.base, "kv_cache": self.pools[key]}


def _run_matrix(runners, case, parts, regions, planes, payloads, dims, device, skipped, progress,
                overlap=None) -> list:
    """Every kernel's cells, in the order of `runners`. `overlap` (overlap.Overlap): some of
    the built-in kernels already run in that process; their results join in their place."""
    from tqdm.auto import tqdm

    cells = [(r, pl) for r in regions for pl in planes]
    # the second process gets its own copies: the executor pickles in a thread of its own, and torch's pickling
    # moves a CPU tensor's bytes into shared memory in place, under this thread's reads of the same tensors
    remote = overlap.submit(run_overlap, *copy.deepcopy((case, parts)), regions, planes, payloads,
                            copy.deepcopy(dims)) if overlap else []
    inputs, meta = _Pools(case, parts, dims), call_meta(case)
    done = {}
    bar = tqdm(total=len(runners) * len(cells), desc="canary", disable=not progress)
    try:
        for name, runner in runners.items():
            if name not in remote:
                bar.set_postfix_str(name)
                done[name] = _run_kernel(name, runner, case, inputs, meta, device, cells, payloads, bar)
        if remote:
            bar.set_postfix_str(f"{', '.join(remote)} (in a second process)")
            got = overlap.collect(bar)
            for name in remote:   # the second process failed: run them here, as always
                done[name] = got[name] if got else _run_kernel(name, runners[name], case, inputs, meta, device,
                                                               cells, payloads, bar)
    finally:
        bar.close()
    results = []
    for name in runners:
        results += done[name][0]
        skipped += done[name][1]
    return results


def _run_kernel(name, runner, case, inputs, meta, device, cells, payloads, bar) -> tuple[list, list]:
    """One kernel's cells -> (results, skipped entries)."""
    reads = _paged_inputs(runner)
    results, skipped = [], []
    stop = None         # (verdict, why) once the kernel cannot be called again
    for region, plane in cells:
        bar.update(1)
        row = {"kernel": name, "region": region, "plane": plane}
        if stop:
            if stop[0] == ERROR:
                results += [LeakResult(**row, payload=p, verdict=ERROR, error=stop[1]) for p in payloads]
            continue
        cell = []       # one per part of the region (other-requests: per judged requests)
        for part in range(len(inputs.parts[region])):
            cell.append(_cell(runner, inputs, meta, device, region, part, plane, payloads))
            if cell[-1]["skipped"] is not None or cell[-1]["dead"]:
                break
        cell = {"parts": cell, "rows": [rows for _, rows in inputs.parts[region]],
                "skipped": cell[-1]["skipped"], "dead": cell[-1]["dead"]}
        if cell["skipped"] is not None:
            skipped.append({"kernel": name, "reason": cell["skipped"]})
            stop = ("skipped", cell["skipped"])
            continue
        referenced = region_referenced(case, region, reads)
        for payload in payloads:
            results.append(judge(row, payload, cell, referenced))
        if cell["dead"]:
            stop = (ERROR, f"not run: the kernel {cell['dead']} at {region}/{plane}")
    return results, skipped


def run_overlap(names, case, parts, regions, planes, payloads, dims, device="cpu", progress=None) -> dict:
    """In the second process (overlap.Overlap): built-in kernels `names` on `device` (the CPU or
    the same CUDA GPU), as run_canary runs them -> {name: (results, skipped entries)}; progress(n)
    after each cell."""
    from qsa_lab.canary.kernels import TORCH_KERNELS

    class Bar:
        update = staticmethod(progress or (lambda n: None))

    device = torch.device(device)
    inputs, meta, cells = _Pools(case, parts, dims), call_meta(case), [(r, pl) for r in regions for pl in planes]
    if device.type == "cpu":
        torch.set_num_threads(1)     # as run_canary does on the CPU
    return {n: _run_kernel(n, InProcess(TORCH_KERNELS[n], DEFAULT_TIMEOUT, thread=False), case, inputs, meta,
                           device, cells, payloads, Bar) for n in names}


def _cell(runner, inputs, meta, device, region, part, plane, payloads) -> dict:
    """Control twice (back to back: a kernel that alternates shows too), then every payload:
    the outcomes of one kernel x region (one part of it) x plane."""
    out = {"control": None, "again": None, "payloads": {}, "skipped": None, "dead": None}

    def run(payload):
        o = runner.call(inputs(region, part, plane, payload), meta, device)
        if o.kind == "skipped":
            out["skipped"] = o.error
        if o.dead:
            out["dead"] = runner.dead or o.error
        return o

    for key in ("control", "again"):
        out[key] = run("zero")
        if out["skipped"] is not None or out["dead"]:
            return out
    for p in payloads:
        out["payloads"][p] = run(p)
        if out["skipped"] is not None or out["dead"]:
            return out
    return out



def assert_no_leak(kernel, regions=None, payloads=None, planes=("k", "v"), backend: str = "auto",
                   case=None, kv_dtype: str | None = None, dims=None, allow_skipped: bool = False, attend=None,
                   timeout: float = DEFAULT_TIMEOUT, **geometry) -> CanaryReport:
    """pytest helper: run the canary for one kernel (a callable fn(PagedCall) -> [rows, q_heads,
    head_dim], or a kernel name) and raise AssertionError listing every leak and every failure
    (an error, an unstable control, a modified input, no check at all; a kernel that raised
    KernelSkipped only unless allow_skipped). Returns the report when clean."""
    report = run_canary([kernel], regions=regions, payloads=payloads, planes=planes, backend=backend, case=case,
                        kv_dtype=kv_dtype, dims=dims, attend=attend, timeout=timeout, **geometry)
    name = report.kernels[0]
    failures = report.failures(allow_skipped=allow_skipped)
    lines = [f"{name} {f['message']}" for f in failures] + [r.describe() for r in report.leaks()]
    lines += [f"{name} could not run: {s['reason']}" for s in report.skipped
              if s.get("kernel") == name and not allow_skipped]
    if lines:
        raise AssertionError(f"{name}: {len(report.leaks())} leak(s) of unattended bytes into the output, "
                             f"{len(failures)} failure(s)\n  " + "\n  ".join(lines))
    return report

"""The canary's search: explore the geometries a kernel declares it supports, judge each case with
the canary (qsa_lab.canary.runner.run_canary: the same cells, controls and verdicts as the grid),
and shrink every leak to the smallest case that still leaks.

    from qsa_lab.canary import search
    found = search("qsa:grouped+kernel_fix", budget="60s", seed=0)     # or budget=300 (cases)
    print("\\n".join(found.lines())); found.exit_code()                 # 1: a leak was found

The space (each field drawn inside the kernel's limits, `limits_of`): requests and the rows of
each (decode, prefill chunks, mixed), query and KV heads (GQA ratios), head dim, page size,
context, KV dtype, attend spec (dense, window, window + sink, sparse top-k), page layout, free
pages, the seed of the call's values, and which regions, planes and payloads are poisoned.
Cases are drawn by Hypothesis (`@given` with `@seed(seed)` and no example database: nothing is
written anywhere), so a seed and a budget in cases give the same cases every time.

Each leaking cell (region x plane) is then shrunk, greedily, by its own runs of the canary: a
smaller candidate (fewer requests, rows, heads, pages, tokens, a simpler spec, one payload, ...;
`size` orders them) replaces the case while the cell still leaks. The shrunk case is run again
as a plain canary run (the re-check), and leaks that shrink to the same case are one finding.
Errors, unstable controls and modified inputs are counted apart and are never findings.

Exit codes (SearchReport.exit_code): 1 a finding, 3 no finding but a case failed (error,
unstable control, modified input) or no case ran a check, 0 every case clean.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import time
from dataclasses import dataclass, field

from qsa_lab.analysis.leaks import CLEAN
from qsa_lab.model.geometry import CANARY_RANGES, KV_DTYPES, LAYOUTS, RANGES

SCHEMA = "qsa_lab.canary-search/1"
DEFAULT_BUDGET = "60s"
ATTENDS = ("dense", "window", "sink", "sparse")    # simplest first (the shrinker's order)
PAYLOAD_ORDER = ("nan", "inf", "max")
RANK = PAYLOAD_ORDER + ("zero",)    # every payload a search may be given, in the shrinker's order
SHRINK_RUNS = 400     # canary runs one leak's shrinking may take
#: the fields a caller may pin (the CLI's geometry options given beside --search)
PINS = ("requests", "query_len", "q_heads", "kv_heads", "head_dim", "page_size", "context", "kv_dtype", "attend",
        "topk", "layout", "free_pages", "seed")


# -- the budget -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Budget:
    """What the generation may spend: `cases` cases, or `seconds` of wall time (one of them)."""
    cases: int | None = None
    seconds: float | None = None

    def __str__(self) -> str:
        return f"{self.cases} cases" if self.cases is not None else f"{self.seconds:g}s"


def parse_budget(value) -> Budget:
    """'120s' or '2m' (seconds of generation), '500' or '500 cases' (cases), an int (cases)."""
    if isinstance(value, Budget):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        text = str(value)
    elif isinstance(value, str):
        text = value.strip().lower()
    else:
        raise TypeError(f"budget: expected a number of cases or a time such as '120s', got {type(value).__name__}")
    m = re.fullmatch(r"([0-9]{1,9})\s*(cases?)?|([0-9]{1,7}(?:\.[0-9]+)?)\s*(s|sec|m|min)", text)
    if not m:
        raise ValueError(f"budget: expected cases (e.g. 500) or a time (e.g. 120s, 2m), got {value!r}")
    if m.group(1) is not None:
        if int(m.group(1)) < 1:
            raise ValueError(f"budget: at least 1 case, got {value!r}")
        return Budget(cases=int(m.group(1)))
    seconds = float(m.group(3)) * (60 if m.group(4).startswith("m") else 1)
    if seconds <= 0:
        raise ValueError(f"budget: more than 0 seconds, got {value!r}")
    return Budget(seconds=seconds)


# -- what a kernel declares it supports ------------------------------------------------------------

#: the integer fields of Limits and the values a kernel may declare
LIMIT_INTS = {"max_requests": (1, 256), "max_query_len": (1, 256), "max_extra_context": (0, 1 << 16),
              "max_free_pages": (0, 64), "max_group": (0, 1 << 12)}


@dataclass(frozen=True)
class Limits:
    """The geometries a kernel supports, as far as the search explores them. A kernel declares
    its own with an attribute `canary_limits` (a dict of these fields); the built-in ones are in
    BUILTIN_LIMITS; anything else gets the canary's own ranges, bounded so each case stays small."""
    q_heads: tuple = (1, 2, 3, 4, 8, 16, 32)
    gqa: bool = True                    # KV heads any divisor of the query heads (False: one KV head)
    max_group: int = 0                  # the most query heads a KV head may serve (0: no limit)
    head_dims: tuple = (16, 32, 64, 128)
    page_sizes: tuple = (4, 8, 16, 32)
    kv_dtypes: tuple = KV_DTYPES
    attends: tuple = ATTENDS
    max_requests: int = 5
    max_query_len: int = 12             # rows of one request (1: decode only)
    max_extra_context: int = 96         # tokens beyond the fewest the rows need
    layouts: tuple = LAYOUTS
    max_free_pages: int = 3

    def __post_init__(self):
        for name in ("q_heads", "head_dims", "page_sizes", "kv_dtypes", "attends", "layouts"):
            v = getattr(self, name)
            if not isinstance(v, tuple) or not v:
                raise ValueError(f"limits: {name} must be a non-empty tuple, got {v!r}")
        for name, known in (("attends", ATTENDS), ("kv_dtypes", KV_DTYPES), ("layouts", LAYOUTS)):
            bad = [a for a in getattr(self, name) if a not in known]
            if bad:
                raise ValueError(f"limits: {name} {bad} unknown; choose from {known}")
        for name, (low, high) in (("q_heads", CANARY_RANGES["q_heads"]), ("head_dims", RANGES["head_dim"]),
                                  ("page_sizes", RANGES["page_size"])):
            step = 16 if name == "head_dims" else 1     # the canary's head dims are multiples of 16
            bad = [v for v in getattr(self, name) if type(v) is not int or not low <= v <= high or v % step]
            if bad:
                raise ValueError(f"limits: {name} must hold ints in {low}..{high}"
                                 + (" (multiples of 16)" if step > 1 else "") + f", got {bad}")
        if not isinstance(self.gqa, bool):
            raise ValueError(f"limits: gqa must be true or false, got {self.gqa!r}")
        for name, (low, high) in LIMIT_INTS.items():   # bounded so each drawn case stays small
            v = getattr(self, name)
            if type(v) is not int or not low <= v <= high:
                raise ValueError(f"limits: {name} must be an int in {low}..{high}, got {v!r}")

    def describe(self) -> str:
        kv = ("1" if not self.gqa else f"a divisor, at most {self.max_group} query heads each" if self.max_group
              else "any divisor")
        return (f"requests 1..{self.max_requests}, rows per request 1..{self.max_query_len}, q_heads "
                f"{_values(self.q_heads)} (KV heads {kv}), head_dim {_values(self.head_dims)}, page_size "
                f"{_values(self.page_sizes)}, context up to +{self.max_extra_context} tokens, kv_dtype "
                f"{'/'.join(self.kv_dtypes)}, attend {'/'.join(self.attends)}, layout {'/'.join(self.layouts)}, "
                f"free pages 0..{self.max_free_pages}")


def _values(v: tuple) -> str:
    return ",".join(str(x) for x in v)


_QSA = dict(q_heads=(1, 2, 3, 4, 8, 16), gqa=False, attends=("sparse",))   # one KV head, the sparse selection
_DECODE = dict(attends=("dense", "window"), max_query_len=1)
#: FlashInfer builds a kernel per head dim just in time: the head dims it documents (and vLLM's
#: FlashInfer backend allows); its CUDA-core decode takes up to 8 query heads per KV head
_FLASHINFER = dict(head_dims=(64, 128, 256))
#: built-in kernels' limits: by full name, else by prefix ('qsa:'); what their adapters say they map
BUILTIN_LIMITS = {
    "qsa:": _QSA,
    "torch:sdpa-cut": dict(attends=("dense",)),                 # it needs each row to attend a prefix
    "flashinfer:": _FLASHINFER,
    "flashinfer:decode": dict(_DECODE, **_FLASHINFER, max_group=8),
    "flashinfer:decode-tc": dict(_DECODE, **_FLASHINFER),
    "vllm:unified": dict(attends=("dense", "window"), kv_dtypes=("fp16", "e4m3")),
    "vllm:unified-3d": dict(_DECODE, kv_dtypes=("fp16", "e4m3")),
}


def limits_of(kernel) -> Limits:
    """A kernel's declared limits (a name, a KernelName or a callable with `canary_limits`)."""
    own = getattr(kernel, "canary_limits", None)
    if own is not None:
        if not isinstance(own, dict):
            raise TypeError(f"limits: canary_limits must be a dict of Limits fields, got {type(own).__name__}")
        return _limits(own)
    text = str(kernel) if not callable(kernel) else ""
    found = BUILTIN_LIMITS.get(text) or next((v for k, v in BUILTIN_LIMITS.items()
                                              if k.endswith(":") and text.startswith(k)), {})
    return Limits(**found)


def _limits(fields: dict) -> Limits:
    known = {f.name for f in dataclasses.fields(Limits)}
    bad = sorted(set(fields) - known)
    if bad:
        raise ValueError(f"limits: unknown field(s) {bad}; choose from {sorted(known)}")
    return Limits(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


# -- one case of the space ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Params:
    """One case of the search: the call's geometry and what is poisoned. `case()` builds it."""
    request_rows: tuple
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    context: int
    kv_dtype: str
    attend: str
    topk: int
    layout: str
    free_pages: int
    seed: int
    regions: tuple
    planes: tuple
    payloads: tuple

    @property
    def requests(self) -> int:
        return len(self.request_rows)

    @property
    def rows(self) -> int:
        return sum(self.request_rows)

    def case_kwargs(self) -> dict:
        """canary_case's keywords for this call."""
        return dict(kv_dtype=self.kv_dtype, free_pages=self.free_pages, kv_heads=self.kv_heads, attend=self.attend,
                    rows=self.rows, requests=self.requests, request_rows=self.request_rows, context=self.context,
                    topk=self.topk, page_size=self.page_size, q_heads=self.q_heads, head_dim=self.head_dim,
                    layout=self.layout, seed=self.seed)

    def case(self):
        from qsa_lab.canary.case import canary_case

        return canary_case(**self.case_kwargs())

    def pages(self) -> int:
        return sum(-(-(self.context - r) // self.page_size) for r in range(self.requests))

    def size(self) -> tuple:
        """The shrinker's order: fewer requests, rows, heads, pages, tokens; smaller pages and dims; a simpler
        spec; fewer free pages; contiguous; fp16; fewer regions, planes, payloads; seed 0."""
        kind = "sink" if ",sink:" in self.attend else self.attend.split(":")[0]
        param = self.topk if kind == "sparse" else sum(int(x) for x in re.findall(r"[0-9]+", self.attend))
        return (self.requests, self.rows, self.q_heads, self.kv_heads, self.pages(), self.context, self.page_size,
                self.head_dim,
                ATTENDS.index(kind), param, self.free_pages, LAYOUTS.index(self.layout),
                ("fp16", "e4m3", "e5m2").index(self.kv_dtype), len(self.regions), len(self.planes),
                len(self.payloads), tuple(RANK.index(p) for p in self.payloads), self.seed,
                self.request_rows)

    def describe(self) -> str:
        rows = (f"query_len {self.request_rows[0]}" if len(set(self.request_rows)) == 1
                else f"rows {list(self.request_rows)}")
        return (f"{self.requests} req ({rows}), context {self.context}, page {self.page_size}, Hq {self.q_heads}, "
                f"Hkv {self.kv_heads}, D {self.head_dim}, {self.kv_dtype}, attend {self.attend}"
                + (f" (topk {self.topk})" if self.attend == "sparse" else "")
                + f", {self.layout}, {self.free_pages} free pages, seed {self.seed}")

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> "Params":
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def min_context(request_rows) -> int:
    """The fewest tokens of request 0 the rows need (Geometry: context - requests + 1 >= rows + 4)."""
    return max(request_rows) + len(request_rows) + 3


def _regions(attend: str, allowed) -> tuple:
    from qsa_lab.model.regions import OPT_IN, AttentionSpec, regions_of

    have = regions_of(AttentionSpec.parse(attend))
    return tuple(r for r in have + OPT_IN if r in allowed) if allowed else have   # other-rows only when named


def _payloads(kv_dtype: str, allowed) -> tuple:
    from qsa_lab.canary.results import available_payloads    # the payloads the dtype has a code for

    return tuple(p for p in allowed or PAYLOAD_ORDER if p in available_payloads(kv_dtype))


def strategy(limits: Limits, pins: dict, regions=None, planes=None, payloads=None):
    """The Hypothesis strategy of Params inside `limits`, the `pins` fixed."""
    from hypothesis import assume, strategies as st

    def one(name, values):
        return st.just(pins[name]) if name in pins else st.sampled_from(values)

    @st.composite
    def params(draw):
        requests = pins.get("requests") or draw(st.integers(1, limits.max_requests))
        if "query_len" in pins:
            rows = (pins["query_len"],) * requests
        else:
            rows = tuple(draw(st.lists(st.integers(1, limits.max_query_len), min_size=requests, max_size=requests)))
        q_heads = draw(one("q_heads", limits.q_heads))
        divisors = ([d for d in range(1, q_heads + 1) if q_heads % d == 0
                     and (not limits.max_group or q_heads // d <= limits.max_group)] if limits.gqa else [1])
        kv_heads = draw(one("kv_heads", divisors))
        assume(q_heads % kv_heads == 0)
        low = min_context(rows)
        context = pins.get("context") or low + draw(st.integers(0, limits.max_extra_context))
        assume(context >= low)
        if "attend" in pins:
            attend = pins["attend"]
        else:
            kind = draw(st.sampled_from(limits.attends))
            window = draw(st.integers(1, context))
            attend = {"dense": "dense", "sparse": "sparse", "window": f"window:{window}",
                      "sink": f"window:{window},sink:{draw(st.integers(1, 8))}"}[kind]
        topk = pins.get("topk") or draw(st.integers(1, context // 4 + 1))
        kv_dtype = draw(one("kv_dtype", limits.kv_dtypes))
        have = _regions(attend, regions)
        assume(have)
        usable = _payloads(kv_dtype, payloads)
        assume(usable)
        return Params(rows, q_heads, kv_heads, draw(one("head_dim", limits.head_dims)),
                      draw(one("page_size", limits.page_sizes)), context, kv_dtype, attend, topk,
                      draw(one("layout", limits.layouts)),
                      pins["free_pages"] if "free_pages" in pins else draw(st.integers(0, limits.max_free_pages)),
                      pins["seed"] if "seed" in pins else draw(st.integers(0, 1 << 16)),
                      have, tuple(planes or ("k", "v")),     # every region and plane: the shrinker narrows them
                      tuple(sorted(draw(st.sets(st.sampled_from(usable), min_size=1)), key=RANK.index)))
    return params()


# -- judging one case ---------------------------------------------------------------------------------

@dataclass
class Outcome:
    """One case's canary run, summed up: leaking cells {(region, plane): verdict}, failures
    [(verdict, message)], how many checks ran, or why nothing ran (skipped)."""
    params: Params
    leaks: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)
    checks: int = 0
    skipped: str = ""
    report: object = field(default=None, repr=False)
    at: float = 0.0          # seconds from the search's start to this case's verdict

    def kind(self) -> str:
        """The case's outcome: 'leak', 'failed' (an error or unstable control), the verdict clean, or
        'skipped' (no check ran)."""
        return "leak" if self.leaks else "failed" if self.failures else CLEAN if self.checks else "skipped"


class _Persistent:
    """A user's `module:function` / `file.py:function` kernel in one worker process for the whole
    search (run_canary would start one per case): a callable the canary runs in this process. A
    call the worker reports failed raises, so it is an error (a modified input says so in it)."""

    def __init__(self, name, timeout: float):
        self.name, self.timeout, self.canary_name = name, timeout, name.text
        self._start()
        self.paged_inputs = self.worker.paged_inputs or "block_table"

    def _start(self):
        from qsa_lab.canary.execution import Worker

        self.worker = Worker(self.name, self.timeout)
        self.worker.load()

    def __call__(self, call):
        from qsa_lab.canary.call import KernelSkipped
        from qsa_lab.canary.execution import INPUTS
        from qsa_lab.canary.runner import call_meta

        if self.worker.dead:      # a call timed out or ended the process: the next case gets a new one
            self._start()
        o = self.worker.call({k: getattr(call, k).detach().cpu() for k in INPUTS}, call_meta(call), call.device)
        if o.kind == "skipped":
            raise KernelSkipped(o.error)
        if o.kind != "ok":
            raise RuntimeError(f"the kernel {o.kind}: {o.error}")
        if o.modified:
            raise RuntimeError(f"input-modified: the kernel changed {', '.join(o.modified)}")
        return o.output.to(call.device)

    @property
    def canary_limits(self):
        return self.worker.canary_limits

    def close(self):
        self.worker.close()


def judge(kernel, p: Params, backend: str, timeout: float, keep: bool = False) -> Outcome:
    """Run the canary on the case `p` -> its Outcome (the report kept with `keep`)."""
    from qsa_lab.analysis.leaks import FAILURES, LEAKS
    from qsa_lab.canary.runner import run_canary

    try:
        report = run_canary([kernel], case=p.case(), regions=list(p.regions), planes=list(p.planes),
                            payloads=list(p.payloads), backend=backend, timeout=timeout)
    except ValueError as e:       # every region asked for is empty here, or the case is over the memory budget
        return Outcome(p, skipped=str(e))
    out = Outcome(p, checks=report.checks(report.kernels[0]), report=report if keep else None)
    for r in report.results:
        if r.verdict in LEAKS:
            out.leaks.setdefault((r.region, r.plane), r.verdict)
        elif r.verdict in FAILURES:
            out.failures.append((r.verdict, f"{r.region}/{r.plane}/{r.payload}: {r.error or r.note}"))
    if not out.checks and not out.failures:
        out.skipped = "; ".join(s["reason"] for s in report.skipped if s.get("kernel")) or "every cell n/a"
    return out


# -- shrinking --------------------------------------------------------------------------------------

def candidates(p: Params, limits: Limits, pins: dict) -> list:
    """Smaller neighbours of `p` (each differs in one field), valid for the kernel's limits."""
    out = []
    rows = p.request_rows

    def add(**kw):
        if any(k in pins for k in kw if k != "request_rows") or ("request_rows" in kw and "query_len" in pins
                                                                 and len(set(kw["request_rows"])) > 1):
            return
        if "request_rows" in kw and "requests" in pins and len(kw["request_rows"]) != p.requests:
            return
        q = dataclasses.replace(p, **kw)
        if (q.context >= min_context(q.request_rows) and q.q_heads % q.kv_heads == 0
                and (not limits.max_group or q.q_heads // q.kv_heads <= limits.max_group)):
            out.append(q)

    for i in range(len(rows)):
        if len(rows) > 1:
            add(request_rows=rows[:i] + rows[i + 1:])
        for n in {1, rows[i] // 2, rows[i] - 1}:
            if 1 <= n < rows[i]:
                add(request_rows=rows[:i] + (n,) + rows[i + 1:])
        if i + 1 < len(rows) and rows[i] > 1 and rows[i + 1] < limits.max_query_len:   # a row moved on
            add(request_rows=rows[:i] + (rows[i] - 1, rows[i + 1] + 1) + rows[i + 2:])
    for h in limits.q_heads:
        if h < p.q_heads:
            add(q_heads=h, kv_heads=p.kv_heads if h % p.kv_heads == 0 else 1)
    for h in range(1, p.kv_heads):
        if p.q_heads % h == 0:
            add(kv_heads=h)
    low = min_context(rows)
    for c in {low, low + 1, low + 2, low + 3, (low + p.context) // 2, p.context - 1}:
        if low <= c < p.context:
            add(context=c)
    for v in limits.page_sizes:
        if v != p.page_size:
            add(page_size=v)
    for v in limits.head_dims:
        if v < p.head_dim:
            add(head_dim=v)
    for spec in _simpler_specs(p, limits):
        add(attend=spec)
    if p.attend == "sparse":
        for k in {1, p.topk // 2, p.topk - 1}:
            if 1 <= k < p.topk:
                add(topk=k)
    for v in {0, p.free_pages - 1}:
        if 0 <= v < p.free_pages:
            add(free_pages=v)
    if p.layout != LAYOUTS[0] and LAYOUTS[0] in limits.layouts:
        add(layout=LAYOUTS[0])
    if p.kv_dtype != "fp16" and "fp16" in limits.kv_dtypes:
        add(kv_dtype="fp16")
    for s in {0, p.seed // 2}:
        if s < p.seed:
            add(seed=s)
    if len(p.payloads) > 1:
        for pay in p.payloads:
            out.append(dataclasses.replace(p, payloads=(pay,)))
    return out


def _simpler_specs(p: Params, limits: Limits) -> list:
    out = [a for a in ("dense",) if a in limits.attends and p.attend != "dense"]
    m = re.fullmatch(r"window:([0-9]+)(?:,sink:([0-9]+))?", p.attend)
    if m:
        w, s = int(m.group(1)), int(m.group(2) or 0)
        if s:
            out += [f"window:{w}"] if "window" in limits.attends else []
            out += [f"window:{w},sink:{n}" for n in {1, s // 2} if 1 <= n < s]
        out += [f"window:{n}" + (f",sink:{s}" if s else "") for n in {1, w // 2, w - 1} if 1 <= n < w]
    return out


def shrink(kernel, p: Params, cell: tuple, limits: Limits, pins: dict, backend: str, timeout: float,
           runs: int = SHRINK_RUNS) -> tuple[Params, int]:
    """The smallest case found (by Params.size) whose `cell` (region, plane) still leaks, starting
    from the leaking case `p`: greedy, one field at a time. -> (that case, canary runs spent)."""
    region, plane = cell
    p = dataclasses.replace(p, regions=(region,), planes=(plane,))
    seen, spent = {}, 0

    def leaks(q):
        nonlocal spent
        if q not in seen:
            spent += 1
            try:
                seen[q] = cell in judge(kernel, q, backend, timeout).leaks
            except (ValueError, TypeError):    # a candidate the case builder refuses: not smaller
                seen[q] = False
        return seen[q]

    improved = True
    while improved and spent < runs:
        improved = False
        for q in sorted(candidates(p, limits, pins), key=Params.size):
            if q.size() < p.size() and spent < runs and leaks(q):
                p, improved = q, True
                break
    return p, spent


# -- the search -------------------------------------------------------------------------------------

@dataclass
class Finding:
    """One shrunk case and the cells (region, plane) that shrank to it; `recheck` its plain canary
    run (a CanaryReport), `found_at` the case number where it first leaked."""
    params: Params
    cells: list
    found_at: int
    from_params: Params
    shrink_runs: int
    recheck: object = field(default=None, repr=False)
    found_s: float = 0.0     # seconds from the search's start to the case where it first leaked

    def reproduced(self) -> bool:
        return self.recheck is not None and bool(self.recheck.leaks())

    def to_dict(self, kernel: str) -> dict:
        return {"cells": [list(c) for c in self.cells], "found_at_case": self.found_at, "found_at_s": self.found_s,
                "found": self.from_params.to_dict(), "shrunk": self.params.to_dict(),
                "shrink_runs": self.shrink_runs, "reproduced": self.reproduced(),
                "results": [r.to_dict() for r in self.recheck.results] if self.recheck else [],
                "replay": replay_python(kernel, self.params)}


@dataclass
class SearchReport:
    kernel: str
    seed: int
    budget: Budget
    limits: Limits
    pins: dict
    backend: str
    cases: list                 # every Outcome, in order
    findings: list
    seconds: float
    shrink_seconds: float = 0.0
    stopped: str = ""           # why generation ended early ('' when the budget ran out)

    def failed(self) -> list:
        return [o for o in self.cases if o.failures]

    def checks(self) -> int:
        return sum(o.checks for o in self.cases)

    def exit_code(self) -> int:
        if any(f.reproduced() for f in self.findings):
            return 1
        return 3 if self.failed() or not self.checks() else 0

    def searched(self) -> str:
        pinned = ", ".join(f"{k} {v}" for k, v in self.pins.items())
        return self.limits.describe() + (f"; pinned: {pinned}" if pinned else "")

    def lines(self) -> list:
        kinds = [o.kind() for o in self.cases]
        out = [f"search {self.kernel} (seed {self.seed}, budget {self.budget}, backend {self.backend}): "
               f"{len(self.cases)} cases in {self.seconds:.1f} s, {kinds.count('leak')} leaking, "
               f"{kinds.count('failed')} failed, {kinds.count('skipped')} not judged, {self.checks()} checks"
               + (f"; {self.stopped}" if self.stopped else ""),
               f"limits searched: {self.searched()}"]
        for o in self.failed()[:3]:
            out.append(f"failed case {self.cases.index(o) + 1} ({o.params.describe()}): "
                       f"{o.failures[0][0]} at {o.failures[0][1]}")
        idle = [o for o in self.cases if o.kind() == "skipped"]
        if idle and not self.checks():
            out.append(f"not judged (case 1): {idle[0].skipped}")
        if not self.findings:
            out.append("no leak found" + (" (failures above: exit 3)" if self.failed() else
                                          " (no case ran a check: exit 3)" if not self.checks() else ""))
        for i, f in enumerate(self.findings, 1):
            p = f.params
            cells = ", ".join(f"{r}/{pl}" for r, pl in f.cells)
            out.append(f"finding {i}: {cells}, first at case {f.found_at} after {f.found_s:.1f} s; shrunk from "
                       f"{f.from_params.requests} req, {f.from_params.rows} rows in {f.shrink_runs} runs to "
                       f"{p.requests} req, {p.rows} rows:")
            out.append(f"  {p.describe()}; payload {'/'.join(p.payloads)}")
            if not f.reproduced():
                out.append("  re-check: it did not leak again (not counted as a finding)")
            for r in (f.recheck.results if f.recheck else []):
                w = r.where()
                out.append(f"  re-check {r.region}/{r.plane}/{r.payload}: {r.verdict} ({r.nan} NaN, {r.inf} Inf, "
                           f"{r.finite_changed} finite changed; rows {w['rows'][:12]})")
            out.append(f"  replay: {replay_python(self.kernel, p)}")
        return out

    def to_json(self) -> dict:
        return {"kernel": self.kernel, "seed": self.seed,
                "budget": str(self.budget), "backend": self.backend, "limits": dataclasses.asdict(self.limits),
                "pins": dict(self.pins), "seconds": round(self.seconds, 3),
                "shrink_seconds": round(self.shrink_seconds, 3), "stopped": self.stopped,
                "cases": [{"params": o.params.to_dict(), "outcome": o.kind(), "at_s": round(o.at, 3),
                           "leaks": [list(c) for c in o.leaks], "failures": [list(f) for f in o.failures]}
                          for o in self.cases],
                "findings": [f.to_dict(self.kernel) for f in self.findings], "exit_code": self.exit_code()}


def search_json(found: list) -> dict:
    """The --json document of one or more searches (schema qsa_lab.canary-search/1)."""
    from qsa_lab.support.version import __version__

    codes = [f.exit_code() for f in found]
    return {"schema": SCHEMA, "qsa_lab_version": __version__, "searches": [f.to_json() for f in found],
            "exit_code": 3 if 3 in codes else max(codes)}


def replay_python(kernel: str, p: Params) -> str:
    """The Python line that runs the canary on a found case again."""
    kw = ", ".join(f"{k}={v!r}" for k, v in p.case_kwargs().items())
    return (f"run_canary([{kernel!r}], case=canary_case({kw}), regions={list(p.regions)}, "
            f"planes={list(p.planes)}, payloads={list(p.payloads)})")


@contextlib.contextmanager
def _hypothesis_home():
    """Hypothesis keeps files (its example database, which the search turns off, and a cache of
    the constants in the code it runs) under ./.hypothesis: for the search's run they go to a
    temporary folder, removed after it, so nothing is written where the user runs the command."""
    import tempfile

    from hypothesis import configuration

    before = getattr(configuration, "__hypothesis_home_directory", None)
    with tempfile.TemporaryDirectory(prefix="qsa-lab-search-") as home:
        configuration.set_hypothesis_home_dir(home)
        try:
            yield
        finally:
            configuration.set_hypothesis_home_dir(before)


class _Stop(BaseException):
    """Ends Hypothesis's generation when the time budget runs out (it is no test failure)."""


class Progress:
    """Cases tried, leaks found and time left, on stderr: one line redrawn on a terminal, else a
    line every `every` seconds and one per new leaking cell. Silent when `stream` is None."""

    def __init__(self, stream, kernel: str, every: float = 10.0):
        self.stream, self.kernel, self.every = stream, kernel, every
        self.tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self.last = 0.0

    def __call__(self, text: str, force: bool = False):
        if self.stream is None:
            return
        now = time.monotonic()
        if self.tty:
            self.stream.write(f"\r\033[K{text}")
        elif force or now - self.last >= self.every:
            self.stream.write(text + "\n")
        else:
            return
        self.last = now
        self.stream.flush()

    def done(self):
        if self.stream is not None and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def search(kernel, budget=DEFAULT_BUDGET, seed: int = 0, *, backend: str = "auto", limits=None, regions=None,
           planes=None, payloads=None, timeout: float | None = None, progress=None, shrink_runs: int = SHRINK_RUNS,
           **pins) -> SearchReport:
    """Search the kernel's space (its declared limits, `limits_of`, narrowed by `limits`, a dict
    of Limits fields, and by `pins`: fields held fixed, any of PINS) for leaks; shrink each.

    budget: cases (an int, '500') or seconds of generation ('120s', '2m'); shrinking and the
    re-check come after it. seed: Hypothesis's seed (the same seed and case budget draw the same
    cases). regions, planes, payloads: what may be poisoned (default the spec's regions, both
    planes, nan/inf/max). progress: a stream for progress lines (e.g. sys.stderr; None: quiet)."""
    from qsa_lab.canary.execution import DEFAULT_TIMEOUT
    from qsa_lab.canary.kernels import kernel_name
    from qsa_lab.canary.names import as_kernel_name
    from qsa_lab.canary.runner import PLANES
    from qsa_lab.model.regions import REGIONS

    budget = parse_budget(budget)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 63:
        raise ValueError(f"seed: must be an int in 0..2**63-1, got {seed!r}")
    if not isinstance(shrink_runs, int) or isinstance(shrink_runs, bool) or shrink_runs < 0:
        raise ValueError(f"shrink_runs: must be an int >= 0, got {shrink_runs!r}")
    bad = sorted(set(pins) - set(PINS))
    if bad:
        raise TypeError(f"search() got unknown keyword(s) {bad}; pin one of {PINS}")
    pins = {k: v for k, v in pins.items() if v is not None}
    name = as_kernel_name(kernel) if not callable(kernel) else kernel
    regions = _names("regions", regions, REGIONS)
    planes = _names("planes", planes, PLANES)
    payloads = _names("payloads", payloads, RANK)
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    worker = _Persistent(name, timeout) if not callable(name) and not name.in_process else None
    try:
        lim = limits_of(worker or name)
        if limits:
            _limits(limits)    # names every unknown field
            lim = dataclasses.replace(lim, **{k: (tuple(v) if isinstance(v, list) else v) for k, v in limits.items()})
        _check_pins(pins, lim, kernel_name(name))
        _check_reachable(lim, pins, regions, payloads)
        _smallest(pins).case()     # a pin the canary refuses (head_dim 17, ...) is refused now, naming it
        return _search(name, worker or name, kernel_name(name), budget, seed, lim, pins, backend, regions, planes,
                       payloads, timeout, progress, shrink_runs)
    finally:
        if worker is not None:
            worker.close()


def _search(name, runs_as, label, budget, seed, lim, pins, backend, regions, planes, payloads, timeout, progress,
            shrink_runs) -> SearchReport:
    """search() once its arguments are checked: `runs_as` is what the cases call (a persistent
    worker for a user's file or module), `name` what the re-check runs (the canary's usual way)."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings, seed as hseed

    show = Progress(progress, label)
    outcomes, first = [], {}      # first: cell -> index of the case where it first leaked
    start = time.monotonic()
    end = start + budget.seconds if budget.seconds is not None else None

    def status():
        left = f", {max(0.0, end - time.monotonic()):.0f} s left" if end else f" of {budget.cases}"
        return (f"search {label}: {len(outcomes)} cases{left}, {len(first)} leaking cell(s)"
                + (f" ({', '.join(f'{r}/{pl}' for r, pl in first)})" if first else ""))

    def test(p):
        if end is not None and time.monotonic() >= end:
            raise _Stop()
        o = judge(runs_as, p, backend, timeout)
        o.at = time.monotonic() - start
        outcomes.append(o)
        new = [c for c in o.leaks if c not in first]
        for c in new:
            first[c] = len(outcomes)
        show(status(), force=bool(new))

    run = given(strategy(lim, pins, regions, planes, payloads))(test)
    run = settings(max_examples=budget.cases or 10 ** 9, database=None, deadline=None, phases=[Phase.generate],
                   suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet)(run)
    stopped = ""
    with _hypothesis_home():
        try:
            hseed(seed)(run)()
        except _Stop:
            pass
    if budget.cases is not None and len(outcomes) < budget.cases:
        stopped = "the space ran out of new cases"
    seconds = time.monotonic() - start

    shrunk = {}      # Params -> [cells], from each cell's smallest leaking case
    t0 = time.monotonic()
    for n, cell in enumerate(first, 1):
        leaking = [o.params for o in outcomes if cell in o.leaks]
        origin = min(leaking, key=Params.size)
        show(f"search {label}: shrinking {cell[0]}/{cell[1]} ({n} of {len(first)})", force=True)
        small, runs = shrink(runs_as, origin, cell, lim, pins, backend, timeout, shrink_runs)
        key = dataclasses.replace(small, regions=(), planes=())
        entry = shrunk.setdefault(key, {"cells": [], "found_at": first[cell], "from": origin, "runs": 0})
        entry["cells"].append(cell)
        entry["runs"] += runs
        entry["found_at"] = min(entry["found_at"], first[cell])
    findings = []
    for key, e in shrunk.items():
        regions_ = tuple(dict.fromkeys(r for r, _ in e["cells"]))
        planes_ = tuple(sorted({pl for _, pl in e["cells"]}))
        p = dataclasses.replace(key, regions=regions_, planes=planes_)
        recheck = judge(name, p, backend, timeout, keep=True).report   # the plain canary run of the shrunk case
        findings.append(Finding(p, e["cells"], e["found_at"], e["from"], e["runs"], recheck,
                                round(outcomes[e["found_at"] - 1].at, 3)))
    findings.sort(key=lambda f: f.found_at)
    show.done()
    return SearchReport(label, seed, budget, lim, pins, backend, outcomes, findings, seconds,
                        time.monotonic() - t0, stopped)


def _smallest(pins: dict) -> Params:
    """The smallest case with `pins` held (checked by building it)."""
    rows = (pins.get("query_len", 1),) * pins.get("requests", 1)
    return Params(rows, pins.get("q_heads", 1), pins.get("kv_heads", 1), pins.get("head_dim", 16),
                  pins.get("page_size", 16), pins.get("context", min_context(rows)), pins.get("kv_dtype", "fp16"),
                  pins.get("attend", "dense"), pins.get("topk", 1), pins.get("layout", LAYOUTS[0]),
                  pins.get("free_pages", 0), pins.get("seed", 0), (), ("v",), ("nan",))


def _names(arg: str, value, allowed) -> tuple | None:
    """A list option (regions, planes, payloads) checked against `allowed`; None stays None."""
    if value is None:
        return None
    value = (value,) if isinstance(value, str) else tuple(value)
    wrong = [x for x in value if x not in allowed]
    if wrong or not value:
        raise ValueError(f"{arg}: unknown {wrong or 'empty list'}; choose from {tuple(allowed)}")
    return value


def _check_pins(pins: dict, lim: Limits, who: str) -> None:
    """A pinned field outside the kernel's declared limits is refused, naming it."""
    from qsa_lab.model.regions import AttentionSpec

    def need(ok, arg, what):
        if not ok:
            raise ValueError(f"{arg}: {who} declares {what}; got {pins[arg]!r}")

    for arg in ("requests", "query_len", "q_heads", "kv_heads", "head_dim", "page_size", "context", "topk",
                "free_pages", "seed"):
        if arg in pins and (not isinstance(pins[arg], int) or isinstance(pins[arg], bool) or pins[arg] < 0):
            raise ValueError(f"{arg}: must be an int >= 0, got {pins[arg]!r}")
    for arg, values in (("q_heads", lim.q_heads), ("head_dim", lim.head_dims), ("page_size", lim.page_sizes),
                        ("kv_dtype", lim.kv_dtypes), ("layout", lim.layouts)):
        if arg in pins and pins[arg] not in values:
            # a pin outside the search's own values is fine where the canary accepts it (e.g. 256 heads)
            if arg in ("kv_dtype", "layout") or (arg == "q_heads" and not lim.gqa):
                need(False, arg, f"{_values(values)}")
    low, high = RANGES["requests"]
    if "requests" in pins and not low <= pins["requests"] <= high:    # the canary's own range, checked here
        raise ValueError(f"requests: must be in {low}..{high}, got {pins['requests']!r}")   # (0 is no request)
    if "kv_heads" in pins and not lim.gqa:
        need(pins["kv_heads"] == 1, "kv_heads", "one KV head")
    if lim.max_group and pins.get("q_heads") and pins.get("kv_heads"):
        need(pins["q_heads"] <= lim.max_group * pins["kv_heads"], "q_heads",
             f"at most {lim.max_group} query heads per KV head (--kv-heads {pins['kv_heads']})")
    if "query_len" in pins:
        need(1 <= pins["query_len"] <= lim.max_query_len, "query_len", f"1..{lim.max_query_len} rows per request")
    if "attend" in pins:
        spec = AttentionSpec.parse(pins["attend"])
        kind = "sink" if spec.kind == "window" and spec.sink else spec.kind
        need(kind in lim.attends, "attend", f"attend {'/'.join(lim.attends)}")
        pins["attend"] = str(spec)


def _check_reachable(lim: Limits, pins: dict, regions, payloads) -> None:
    """Regions or payloads no case of the search can hold (a region the attention specs searched
    never have, a payload no kv dtype searched has a code for) are refused, naming the option."""
    kinds = [pins["attend"]] if "attend" in pins else [
        {"dense": "dense", "sparse": "sparse", "window": "window:1", "sink": "window:1,sink:1"}[k] for k in lim.attends]
    if regions and not any(_regions(spec, regions) for spec in kinds):
        raise ValueError(f"regions: no case under attend {'/'.join(kinds)} has {','.join(regions)} (its regions: "
                         f"{', '.join(dict.fromkeys(r for spec in kinds for r in _regions(spec, None)))})")
    dtypes = [pins["kv_dtype"]] if "kv_dtype" in pins else list(lim.kv_dtypes)
    if payloads and not any(_payloads(d, payloads) for d in dtypes):
        raise ValueError(f"payloads: kv dtype {'/'.join(dtypes)} has no code for {','.join(payloads)}")


# -- writing the findings -----------------------------------------------------------------------------

#: what a search report folder holds (--force replaces only these)
NAMES = ("search.json", "cases") + tuple(f"finding-{i}" for i in range(1, 1000))


def save_case(path, case) -> None:
    """A case file (qsa_lab.canary.case.CASE_FORMAT) of `case`: `qsa-lab canary --case FILE`."""
    from pathlib import Path

    from safetensors.torch import save

    t = {k: v.contiguous().cpu() for k, v in case.tensors().items()}
    t["query_lens"] = case.query_lens().to(t["seq_lens"].dtype)
    meta = {"kv_dtype": case.kv_dtype, "sm_scale": repr(float(case.sm_scale)), "attend": str(case.spec)}
    if case.geometry is not None:
        meta["geometry"] = json.dumps(case.geometry.to_dict())
    Path(path).write_bytes(save(t, metadata=meta))


def write_search_report(found: SearchReport, out_dir, force: bool = False, command: str | None = None,
                        inputs: dict | None = None) -> list:
    """`--report DIR`: search.json, cases/finding-N.safetensors (each shrunk case as a case file)
    and finding-N/ (the canary's usual report of the re-check, qsa_lab.canary.report). -> the
    replay command of each finding, relative to DIR."""
    from pathlib import Path

    from qsa_lab.canary.report import write_report
    from qsa_lab.support.outputs import writing_folder

    lines = []
    with writing_folder(Path(out_dir), "report", force, NAMES, inputs) as tmp:
        (tmp / "search.json").write_text(json.dumps(search_json([found]), indent=1) + "\n")
        (tmp / "cases").mkdir()
        for i, f in enumerate(found.findings, 1):
            p = f.params
            save_case(tmp / "cases" / f"finding-{i}.safetensors", f.recheck.case)
            if f.recheck.leaks():
                write_report(f.recheck, tmp / f"finding-{i}", command=command)
            lines.append(f"qsa-lab canary --kernels {found.kernel} --case cases/finding-{i}.safetensors "
                         f"--attend {p.attend} --regions {','.join(p.regions)} --planes {','.join(p.planes)} "
                         f"--payloads {','.join(p.payloads)}" + (f" --backend {found.backend}"
                                                                 if found.backend != "auto" else ""))
    return lines

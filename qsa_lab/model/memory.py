"""How much memory and time a case will take, estimated from its Geometry before anything is
allocated, and the budget a run must fit.

The model counts the few tensors that dominate, each calibrated against the peak resident
memory of real runs on the emulation (build + poison + every route):

- the paged cache: [pages, 2, page_size, 1, head_dim] built in float32 and decoded again
  when poisoned (grows with requests x context x head_dim);
- each row's gathered K/V tokens for the reference (float64) and XQA (float32)
  (grows with rows x min(topk, context/4) x 4 tokens x head_dim);
- the grouped emulation's panels, processed in chunks of bounded size.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from qsa_lab.model.geometry import Geometry  # plain Python: the CLI checks budgets before torch loads

# bytes per element, fitted to measured peaks (see tests/app/test_reliability.py for the check
# that the estimate covers a real run) with a margin
CACHE_BYTES_PER_ELEM = 48       # float32 build, fp8 encode temporaries, decoded copy for poison
TOKEN_BYTES_PER_ELEM = 40       # gathered K and V per row: int64 codes, float32, float64 reference
GROUPED_CHUNK_BYTES = 1 << 30   # the grouped emulation's chunk bound (routes.emulate._CHUNK_ELEMS x temporaries)
BASE_BYTES = 256 << 20       # lazy imports, allocator arenas and thread pools of a first run
# seconds per (row x attended token x head_dim x q_head) and per cached token x head_dim on
# the CPU emulation: about 3x what a quiet 2-core machine took after the speed-ups (the report's
# decode case 0.7 s, causal3 1.3 s, 76 rows 2.0 s, ctx 32768 2.3 s), a margin for a busy one;
# only used to announce long runs
SECONDS_PER_UNIT = 2.5e-8
SECONDS_PER_CACHE_ELEM = 1.2e-7
LONG_RUN_S = 2.0                # a run estimated longer shows its progress (on a terminal)
DEFAULT_FRACTION = 0.5          # default budget: this share of the memory available now


@dataclass(frozen=True)
class Estimate:
    bytes: int
    seconds: float
    driver: str       # the CLI argument(s) that drive the largest term

    def describe(self) -> str:
        return f"~{format_bytes(self.bytes)}, ~{self.seconds:.0f} s on the CPU emulation"


def estimate(g: Geometry) -> Estimate:
    """Peak memory (bytes) and CPU-emulation time (s) of build + poison + every route."""
    pages = sum(-(-(g.context - r) // g.page_size) for r in range(g.requests)) + 1
    cache = pages * 2 * g.page_size * g.head_dim * CACHE_BYTES_PER_ELEM
    tokens = 4 * min(g.topk, g.context // 4)             # attended tokens per row, at most
    gathered = g.rows * tokens * g.head_dim * TOKEN_BYTES_PER_ELEM
    chunk = min(GROUPED_CHUNK_BYTES, -(-g.rows // 8) * 8 * (tokens + 64) * (g.head_dim + 8 * g.q_heads) * 8)
    terms = {"--requests x --context x --head-dim (the paged cache)": cache,
             "--rows x --topk x --head-dim (gathered tokens per row)": gathered,
             "--topk x --head-dim (grouped panels)": chunk}
    driver = max(terms, key=terms.get)
    if g.page_size > 256 and cache == terms[driver]:
        driver = "--page-size x --requests x --head-dim (the paged cache)"
    total = BASE_BYTES + sum(terms.values())
    seconds = (g.rows * tokens * g.head_dim * g.q_heads * SECONDS_PER_UNIT
               + pages * g.page_size * g.head_dim * SECONDS_PER_CACHE_ELEM)
    return Estimate(int(total), seconds, driver)


def available_memory() -> int:
    """Bytes of memory available now (MemAvailable on Linux, else physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def default_budget() -> int:
    return int(available_memory() * DEFAULT_FRACTION)


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000 ** 2,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1000 ** 3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000 ** 4,
          "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """'512M', '8G', '1.5GiB', '100000' -> bytes (ValueError otherwise)."""
    m = re.fullmatch(r"\s*([0-9]{1,15}(?:\.[0-9]{1,6})?)\s*([A-Za-z]{0,3})\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"expected a size such as 512M, 8G or 1.5GiB, got {text!r}")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"expected a size > 0, got {text!r}")
    return n


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def budget_bytes(value, arg: str = "max_memory") -> int:
    """A memory budget as given (None: the default budget; an int or float of bytes > 0; text
    such as '512M' or '8G') -> bytes. ValueError / TypeError naming `arg` otherwise."""
    if value is None:
        return default_budget()
    if isinstance(value, str):
        try:
            return parse_bytes(value)
        except ValueError as e:
            raise ValueError(f"{arg}: {e}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{arg}: expected bytes (an int) or a size such as '512M', got {type(value).__name__}")
    if not value >= 1 or value == float("inf"):      # refuses nan too
        raise ValueError(f"{arg}: expected a budget of at least 1 byte, got {value!r}")
    return int(value)


def require(g: Geometry, budget=None, api: bool = False) -> Estimate:
    """Raise MemoryBudgetError (a ValueError) when the estimate exceeds `budget` (budget_bytes:
    bytes or text such as '4G'; default DEFAULT_FRACTION of the memory available now). The error
    names the command line's options, or with `api` the Python arguments (the first that drives
    the estimate; max_memory when the budget is below what any case needs)."""
    est = estimate(g)
    limit = budget_bytes(budget)
    if est.bytes > limit:
        terms, why = est.driver.split(" (")[0], est.driver.split(" (")[1].rstrip(")")
        if api:
            terms = terms.replace("--", "").replace("-", "_")
            lead = "max_memory" if BASE_BYTES > limit else terms.split(" x ")[0]
            raise MemoryBudgetError(f"{lead}: this case needs an estimated {format_bytes(est.bytes)}, above the "
                                    f"budget of {format_bytes(limit)} ({terms}: {why}); shrink it or raise max_memory")
        raise MemoryBudgetError(
            f"{terms}: this case needs an estimated {format_bytes(est.bytes)}, above the "
            f"budget of {format_bytes(limit)} ({why} dominates); shrink it or raise --max-memory")
    return est


class MemoryBudgetError(ValueError):
    """A case estimated above the memory budget."""


# -- the canary's case ----------------------------------------------------------------------------
# Copies of the pool (in units of its own bytes) alive at the peak of a canary run: building it
# (float32 values, fp8 encode temporaries, the free pages' concatenation), the base record, the
# poisoned pools of one region x plane (one per payload and the zero control), each call's fresh
# copy, and a kernel's decoded float32 view of the whole pool; with a margin.
CANARY_POOL_COPIES = 24
# A built-in PyTorch kernel gathers K and V with every KV head repeated for its query heads:
# [rows, q_heads, tokens, head_dim] per plane, as fp16, transposed and upcast (bytes per element of
# one such tensor, both planes, with a margin).
GATHER_BYTES = 24


def canary_estimate(rows: int, requests: int, context: int, page_size: int, kv_heads: int, head_dim: int,
                    kv_dtype: str, free_pages: int) -> Estimate:
    """Peak memory of the canary's own tensors for a case (plain numbers: nothing allocated): the
    pool, built and copied as a run does; each kernel adds its working set (gather_bytes). driver:
    the API argument that drives the estimate."""
    used = sum(-(-max(context - r, 1) // page_size) for r in range(requests))
    pages = used + 1 + free_pages
    pool = pages * 2 * page_size * kv_heads * head_dim * (2 if kv_dtype == "fp16" else 1)
    total = BASE_BYTES + pool * CANARY_POOL_COPIES + rows * pages * page_size   # + the attended-token masks
    if pool * CANARY_POOL_COPIES < BASE_BYTES:
        driver = "max_memory"              # a budget below what any run needs
    elif free_pages > used:
        driver = "free_pages"
    else:
        driver = "context" if context >= requests * page_size else "requests"
    return Estimate(int(total), 0.0, driver)


def gather_bytes(rows: int, q_heads: int, tokens: int, head_dim: int) -> int:
    """Working set of a kernel that gathers `tokens` K and V tokens per row for every query head."""
    return rows * q_heads * tokens * head_dim * GATHER_BYTES


def over_budget(need: int, budget: int, what: str) -> str:
    """The sentence a refusal says: what needs how much, above which budget, and what to change."""
    return (f"{what} needs an estimated {format_bytes(need)}, above the memory budget of {format_bytes(budget)}; "
            "shrink the case or raise the budget (max_memory, --max-memory)")


def require_canary(budget=None, **case) -> Estimate:
    """canary_estimate(**case) against the budget (budget_bytes): MemoryBudgetError naming the
    argument that drives the estimate."""
    est = canary_estimate(**case)
    limit = budget_bytes(budget)
    if est.bytes > limit:
        raise MemoryBudgetError(f"{est.driver}: " + over_budget(est.bytes, limit, "the canary's case"))
    return est

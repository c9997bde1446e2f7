"""The write guard: every row of the pool compared, bit for bit, before and after each step (and around
warm-up), and after each step against before the next, with the engine's calls between steps compared
too. One copy of the pool, kept up to date, is what each comparison reads: a step's own writes are
compared row by row first and the rest in one memory pass (memcmp on the CPU), which finds nothing
unless a stray write landed. A row that changed outside the step's own writes and the write trash, or
between steps other than by the engine's own restore or fork copy into rows a request owns next, is a
`stray-write`, reported with where it landed (region, layer) and the engine call that wrote it.

The same hooks (`Scribbler`, the engine adapter's StepHooks) fill the read check's region with its
payload before every step, and give every filled row its own bytes back when it leaves the region.
"""
from __future__ import annotations

import contextlib
import math

import torch

from .engines.base import StepView
from .regions import OTHER, OWNED, PAYLOADS, POOL_REGIONS, REGIONS, TRASH, UNOWNED


def payload_value(dtype: torch.dtype, payload: str) -> float:
    """The element the read check writes: NaN, +Inf, or the dtype's largest finite value."""
    if payload not in PAYLOADS:
        raise ValueError(f"payload must be one of {PAYLOADS}, got {payload!r}")
    return {"nan": math.nan, "inf": math.inf, "max": torch.finfo(dtype).max}[payload]


def pool_words(pool: torch.Tensor) -> torch.Tensor:
    """The pool's bytes as [rows, words] of the widest integer type that divides a row (a view, no copy):
    what the write guard compares, bit for bit, so NaN payloads and -0.0 compare as the bytes they are."""
    raw = pool.view(torch.uint8)
    for dtype in (torch.int64, torch.int32, torch.int16):
        if raw.shape[1] % dtype.itemsize == 0 and raw.storage_offset() % dtype.itemsize == 0:
            return raw.view(dtype)
    return raw


def _memcmp():
    try:
        import ctypes
        f = ctypes.CDLL(None).memcmp
        f.restype, f.argtypes = ctypes.c_int, (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
        return f
    except (OSError, AttributeError):       # no C library to open (e.g. Windows): torch.equal below
        return None


_MEMCMP = _memcmp()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two integer tensors of one shape hold the same bytes: one memory pass (memcmp on the CPU)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        raise ValueError(f"pool: compared with a copy of another shape ({tuple(a.shape)} {a.dtype} {a.device} vs "
                         f"{tuple(b.shape)} {b.dtype} {b.device}); the guard needs one pool for the whole run")
    if _MEMCMP is not None and a.device.type == "cpu" and a.is_contiguous() and b.is_contiguous():
        return _MEMCMP(a.data_ptr(), b.data_ptr(), a.numel() * a.element_size()) == 0
    return torch.equal(a, b)


def changed_rows(words: torch.Tensor, copy: torch.Tensor, sync: bool = True) -> torch.Tensor | None:
    """[rows] bool: the rows of `words` (pool_words of the pool) whose bytes differ from `copy`; None when no row
    does. Exact: every changed bit of every row is seen (a copy, not a hash: nothing can collide). One
    memory pass when nothing changed. sync: bring `copy` up to date (only the rows that differ are written)."""
    if same_bytes(words, copy):
        return None
    out = (words != copy).any(dim=1)
    if sync:
        rows = torch.nonzero(out).reshape(-1)
        copy[rows] = words[rows]
    return out


def sync_rows(words: torch.Tensor, copy: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """int64: those of `rows` whose bytes differ from `copy`, which is brought up to date on `rows`: a step's
    own writes compared on their own, so that the rest of the pool is one memory pass (changed_rows)."""
    rows = rows.to(words.device)
    now = words[rows]
    hit = (now != copy[rows]).any(dim=1)
    copy[rows] = now
    return rows[hit]


class Scribbler:
    """StepHooks: fill `region` with `payload` before every step (None: a clean run) and guard writes.
    For the other-requests region, `victim` names the request whose own rows are filled."""

    def __init__(self, region: str | None = None, payload: str | None = None, victim: str | None = None):
        if region is not None and region not in REGIONS:
            raise ValueError(f"region must be one of {REGIONS}, got {region!r}")
        if (region == OTHER) != (victim is not None):
            raise ValueError("victim: name the request whose rows to fill exactly when the region is other-requests")
        self.region, self.payload, self.victim = region, payload, victim
        self.filled_rows = 0            # rows filled, summed over steps
        self.region_rows = {r: 0 for r in POOL_REGIONS}   # region sizes summed over steps (what each could hold)
        self.moved_rows = 0             # rows the engine itself moved between steps (restores, fork copies)
        self.taken_back = 0             # rows we filled that the engine wrote since: left alone, never restored
        self.strays = []                # {"step", "when", "call", "region", "layer", "rows", "count"}
        self._poisoned = None           # [rows] bool: rows holding our payload, not the engine's bytes
        self._shadow = None             # the engine's own bytes of those rows
        self._copy = None               # pool_words of the pool as the last hook left it: after our fills
                                        # (before_step), after the step (after_step)
        self._stepped = False           # a step (or warm-up) has run: the guard watches between steps
        self._last = None               # the label of that step
        self._calls = []                # (name, moves, changed rows) of the engine calls since then
        self._last_view = None          # the last step's view: whose rows were whose (_owners, when needed)
        self._request_ids = {}          # request -> its number in _owners()

    # ------------------------------------------------------------------ the hooks
    def before_step(self, view: StepView) -> None:
        pool = view.pool
        words = pool_words(pool)
        if self._poisoned is None:
            self._poisoned = torch.zeros(pool.shape[0], dtype=torch.bool, device=pool.device)
            self._shadow = torch.empty_like(pool) if self.payload is not None else None
        if self._stepped:
            moved = changed_rows(words, self._copy)
            if moved is not None:
                self._judge_moves(view, moved)
                # what the engine wrote is its own: never overwritten with bytes we saved earlier
                self.taken_back += int((self._poisoned & moved).sum())
                self._poisoned &= ~moved
        self._calls = []
        self._last_view = view
        for name, size in view.region_sizes().items():
            if name in self.region_rows:
                self.region_rows[name] += size
        if self._copy is None:
            self._copy = words.clone()
        if self.payload is None:          # a guard alone fills nothing, so nothing is ever restored
            return
        rows = view.request_rows.get(self.victim) if self.region == OTHER else view.rows_in(self.region)
        target = torch.zeros_like(self._poisoned)
        if rows is not None and self.payload is not None and view.step != "warmup":   # nothing reads at warm-up
            target[rows.to(pool.device)] = True
        # rows we filled before that left the region get the engine's bytes back: one region at a time
        restore = self._poisoned & ~target
        pool[restore] = self._shadow[restore]
        fresh = target & ~self._poisoned
        self._shadow[fresh] = pool[fresh]
        if target.any():
            pool[target] = payload_value(pool.dtype, self.payload)
            self.filled_rows += int(target.sum())
        self._poisoned = target
        written = torch.nonzero(restore | target).reshape(-1)     # the copy is the pool again: fills copied too
        self._copy[written] = words[written]

    def after_step(self, view: StepView) -> None:
        words, writes = pool_words(view.pool), view.may_write
        # a step's own writes compared on their own first, unless they are most of the pool (warm-up)
        hits = sync_rows(words, self._copy, writes) if writes.numel() * 4 < words.shape[0] else None
        rest = changed_rows(words, self._copy)
        self._stepped, self._last = True, view.step
        # rows the engine wrote hold its bytes now, not ours
        if hits is not None:
            self._poisoned[hits.to(self._poisoned.device)] = False
        if rest is None:
            return
        self._poisoned &= ~rest
        rest[writes.to(rest.device)] = False        # what the step may write is no stray
        stray = torch.nonzero(rest).reshape(-1).cpu()
        if stray.numel():
            self.strays.extend(describe_strays(view, stray, f"during step {_step_name(view.step)}"))

    @contextlib.contextmanager
    def engine_call(self, name: str, pool: torch.Tensor, moves: bool):
        """The pool compared around one of the engine's calls between steps, so a write there is named by it."""
        if not self._stepped:            # the engine is still being built: nothing to guard yet
            yield
            return
        words = pool_words(pool)
        # the pool as the last step left it (the usual case): the guard's copy is the start, no new copy
        ours = words.shape == self._copy.shape and words.dtype == self._copy.dtype and words.device == self._copy.device
        start = None if ours and same_bytes(words, self._copy) else words.clone()
        yield
        changed = changed_rows(words, self._copy if start is None else start, sync=False)
        if changed is not None:
            self._calls.append((name, moves, changed))

    # ------------------------------------------------------------------ between steps
    def _owners(self, view: StepView) -> torch.Tensor:
        """[rows] int64: a number per request for the rows only it may read, -2 for owned rows that several
        requests share, -1 for the rest."""
        device = view.pool.device
        owner = torch.full((view.pool.shape[0],), -1, dtype=torch.int64, device=device)
        owner[view.owned.to(device)] = -2
        for request, rows in view.request_rows.items():
            owner[rows.to(device)] = self._request_ids.setdefault(request, len(self._request_ids))
        return owner

    def _judge_moves(self, view: StepView, moved: torch.Tensor) -> None:
        """Rows that changed after the last step and before this one: the engine's own moves (a restore or
        fork copy into rows that a request owns now, and no request owned before) are accounted; anything
        else is a stray write, named by the innermost engine call that made it."""
        unowned = torch.zeros_like(moved)
        for name in UNOWNED:
            if name in view.regions:
                unowned[view.regions[name].to(moved.device)] = True
        legit = torch.zeros_like(moved)
        for _, moves, changed in self._calls:
            if moves:
                legit |= changed
        # a request's written rows are never a move's target while it still holds them
        kept = torch.zeros_like(moved)
        if self._last_view is not None:
            before = self._owners(self._last_view)
            kept = (before != -1) & (before == self._owners(view))
        legit &= moved & ~unowned & ~kept
        self.moved_rows += int(legit.sum())
        stray = moved & ~legit
        if not stray.any():
            return
        when = f"after step {_step_name(self._last)}, before step {_step_name(view.step)}"
        left = stray.clone()
        for name, _, changed in self._calls:          # innermost calls end first
            mine = torch.nonzero(left & changed).reshape(-1).cpu()
            if mine.numel():
                self.strays.extend(describe_strays(view, mine, when, call=name))
                left[mine.to(left.device)] = False
        rest = torch.nonzero(left).reshape(-1).cpu()
        if rest.numel():
            self.strays.extend(describe_strays(view, rest, when, call="outside every engine call the adapter wraps"))


def _step_name(step) -> str:
    return "warm-up" if step == "warmup" else str(step)


def layer_text(region: str, layer: int) -> str:
    """The layer a stray row belongs to, or why it has none."""
    if layer >= 0:
        return f"layer {layer}"
    return "no layer: trash sector" if region in TRASH else "no layer: unassigned sector"


def describe_strays(view: StepView, stray: torch.Tensor, when: str, call: str = "") -> list:
    """Stray rows -> one record per (region, layer): where they landed, in this view's terms."""
    names = {}
    for name, rows in view.regions.items():
        for r in rows[torch.isin(rows.cpu(), stray)].tolist():
            names[r] = name
    owned = set(view.owned[torch.isin(view.owned.cpu(), stray)].tolist())
    groups = {}
    for r in stray.tolist():
        region = names.get(r) or (OWNED if r in owned else "read-trash" if view.step == "warmup" else "unlabelled")
        groups.setdefault((region, int(view.row_layer[r])), []).append(r)
    return [{"step": view.step, "when": when, "call": call, "region": reg, "layer": layer,
             "where": layer_text(reg, layer), "rows": rows[:8], "count": len(rows)}
            for (reg, layer), rows in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1]))]

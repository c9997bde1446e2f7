"""The write guard: a digest of every row of the pool before and after each step (and around
warm-up), and after each step against before the next, with the engine's calls between steps digested
too. A row that changed outside the step's own writes and the write trash, or between steps other than
by the engine's own restore or fork copy into rows a request owns next, is a `stray-write`, reported
with where it landed (region, layer) and the engine call that wrote it.

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


def row_digest(pool: torch.Tensor) -> torch.Tensor:
    """[rows] int64: a digest of each row's bytes (sum of 32-bit words times fixed odd weights, mod 2^64).
    Any change confined to one word always changes it: an odd weight times a non-zero difference is
    never 0 mod 2^64."""
    words = pool.view(torch.int32) if (pool.shape[1] * pool.element_size()) % 4 == 0 else pool.view(torch.uint8)
    g = torch.Generator().manual_seed(0x5C1B)
    w = (torch.randint(0, 2 ** 62, (words.shape[1],), generator=g, dtype=torch.int64) * 2 + 1).to(pool.device)
    return (words.to(torch.int64) * w).sum(dim=1)


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
        self._before = None             # digest after our fills, before the step
        self._after = None              # digest after the last step (or warm-up)
        self._last = None               # the label of that step
        self._calls = []                # (name, moves, changed rows) of the engine calls since then
        self._owner = None              # _owners() of the last step's view
        self._request_ids = {}          # request -> its number in _owners()

    # ------------------------------------------------------------------ the hooks
    def before_step(self, view: StepView) -> None:
        pool = view.pool
        if self._poisoned is None:
            self._poisoned = torch.zeros(pool.shape[0], dtype=torch.bool, device=pool.device)
            self._shadow = torch.empty_like(pool)
        if self._after is not None:
            moved = row_digest(pool) != self._after
            if moved.any():
                self._judge_moves(view, moved)
                # what the engine wrote is its own: never overwritten with bytes we saved earlier
                self.taken_back += int((self._poisoned & moved).sum())
                self._poisoned &= ~moved
        self._calls = []
        self._owner = self._owners(view)
        for name, rows in view.regions.items():
            if name in self.region_rows:
                self.region_rows[name] += int(rows.numel())
        rows = view.request_rows.get(self.victim) if self.region == OTHER else view.regions.get(self.region)
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
        self._before = row_digest(pool)

    def after_step(self, view: StepView) -> None:
        self._after = row_digest(view.pool)
        self._last = view.step
        changed = self._after != self._before
        self._poisoned &= ~changed            # the engine wrote these rows: its bytes now, not ours
        allowed = torch.zeros_like(changed)
        allowed[view.may_write.to(changed.device)] = True
        stray = torch.nonzero(changed & ~allowed).reshape(-1).cpu()
        if stray.numel():
            self.strays.extend(describe_strays(view, stray, f"during step {_step_name(view.step)}"))

    @contextlib.contextmanager
    def engine_call(self, name: str, pool: torch.Tensor, moves: bool):
        """Digests around one of the engine's calls between steps, so a write there is named by it."""
        if self._after is None:          # the engine is still being built: nothing to guard yet
            yield
            return
        start = row_digest(pool)
        yield
        changed = row_digest(pool) != start
        if changed.any():
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
        if self._owner is not None:
            kept = (self._owner != -1) & (self._owner == self._owners(view))
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

"""The read check and the write guard over a whole generation.

Read check, per region x payload: before every step, fill the region's rows with the payload (one
region at a time; rows filled earlier that left the region get their own bytes back), run the whole
generation, and compare tokens, logprobs and (where no graph hides them) logits with a clean run by
the canary's rule (qsa_lab.analysis.leaks: bit for bit, two NaNs equal). Two clean runs that differ
make every read verdict `unstable-control`.

Write guard, every run: a digest of every row before and after each step (and around warm-up);
a row that changed outside the step's own writes and the write trash is a `stray-write`.

    report = scribble(engine)                     # every region x payload, plus the write guard
    report.frame()
"""
from __future__ import annotations

import math
import time
import traceback
from dataclasses import dataclass, field

import torch

from qsa_lab.analysis.leaks import (CLEAN, ERROR, FAILURES, LEAKS, NA, READ_LEAKS, STRAY_WRITE, UNSTABLE,
                                    LeakReport, compare_generation, verdict_of)
from qsa_lab.analysis.leaks import compare as compare_outputs

from .contract import Generation, StepView
from .verdicts import PAYLOADS, REGIONS, SCHEMA


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
    """StepHooks: fill `region` with `payload` before every step (None: a clean run) and guard writes."""

    def __init__(self, region: str | None = None, payload: str | None = None):
        if region is not None and region not in REGIONS:
            raise ValueError(f"region must be one of {REGIONS}, got {region!r}")
        self.region, self.payload = region, payload
        self.filled_rows = 0            # rows filled, summed over steps
        self.region_rows = {r: 0 for r in REGIONS}   # region sizes summed over steps (what each could hold)
        self.strays = []                # {"step", "region", "layer", "rows", "count"}
        self._poisoned = None           # [rows] bool: rows holding our payload, not the engine's bytes
        self._shadow = None             # the engine's own bytes of those rows
        self._before = None

    def before_step(self, view: StepView) -> None:
        pool = view.pool
        if self._poisoned is None:
            self._poisoned = torch.zeros(pool.shape[0], dtype=torch.bool, device=pool.device)
            self._shadow = torch.empty_like(pool)
        for name, rows in view.regions.items():
            self.region_rows[name] += int(rows.numel())
        rows = view.regions.get(self.region)
        target = torch.zeros_like(self._poisoned)
        if rows is not None and self.payload is not None:
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
        changed = row_digest(view.pool) != self._before
        self._poisoned &= ~changed            # the engine wrote these rows: its bytes now, not ours
        allowed = torch.zeros_like(changed)
        allowed[view.may_write.to(changed.device)] = True
        stray = torch.nonzero(changed & ~allowed).reshape(-1).cpu()
        if stray.numel():
            self.strays.extend(_describe_strays(view, stray))


def _describe_strays(view: StepView, stray: torch.Tensor) -> list:
    names = {}
    for name, rows in view.regions.items():
        for r in rows[torch.isin(rows.cpu(), stray)].tolist():
            names[r] = name
    owned = set(view.owned[torch.isin(view.owned.cpu(), stray)].tolist())
    groups = {}
    for r in stray.tolist():
        region = names.get(r) or ("owned" if r in owned else "read-trash" if view.step == "warmup" else "unlabelled")
        groups.setdefault((region, int(view.row_layer[r])), []).append(r)
    return [{"step": view.step, "region": reg, "layer": layer, "rows": rows[:8], "count": len(rows)}
            for (reg, layer), rows in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1]))]


# ---------------------------------------------------------------------------- comparing generations
def _flat(gen: Generation) -> tuple[list, torch.Tensor]:
    ids = sorted(gen.tokens)
    values = [torch.tensor(gen.logprobs[r], dtype=torch.float32) for r in ids]
    if gen.logits:
        values += [t.reshape(-1) for t in gen.logits]
    return [gen.tokens[r] for r in ids], torch.cat(values) if values else torch.zeros(0)


def same(a: Generation, b: Generation) -> bool:
    """Nothing changed between two generations (compare)."""
    return not any(compare(a, b).values())


def compare(clean: Generation, other: Generation) -> dict:
    """Counts of what changed (qsa_lab.analysis.leaks.compare_generation): nan / inf (values that
    became NaN / Inf), finite_changed, tokens_changed."""
    tc, vc = _flat(clean)
    to, vo = _flat(other)
    return compare_generation(tc, to, vc, vo).counts


def localise(clean: Generation, other: Generation) -> dict:
    """Where two generations' attention outputs first differ: step, request, layer, heads, head dims.
    Needs both recorded with record_attention (no graphs); {} when they do not differ there."""
    if not clean.attention or not other.attention:
        return {}
    for step, (a, b) in enumerate(zip(clean.attention, other.attention)):
        for layer in sorted(a):
            if layer not in b or a[layer].shape != b[layer].shape:
                continue
            diff = compare_outputs(a[layer], b[layer]).changed         # [q_rows, heads, head_dim]
            if not diff.any():
                continue
            rows = torch.nonzero(diff.any(dim=(1, 2))).reshape(-1).tolist()
            requests, query_rows = clean.steps[step] if step < len(clean.steps) else ([], [])
            starts = [sum(query_rows[:i]) for i in range(len(query_rows))]
            owner = [next((r for r, s, n in zip(requests, starts, query_rows) if s <= q < s + n), None) for q in rows]
            return {"step": step, "layer": layer, "requests": sorted({o for o in owner if o is not None}),
                    "query_rows": rows[:16], "heads": torch.nonzero(diff.any(dim=(0, 2))).reshape(-1).tolist(),
                    "dims": torch.nonzero(diff.any(dim=(0, 1))).reshape(-1).tolist(),
                    "nan": bool(b[layer].isnan().any())}
    return {}


# ---------------------------------------------------------------------------- the whole matrix
@dataclass
class Cell:
    check: str            # "read" | "write"
    region: str
    payload: str          # "-" for the write guard
    verdict: str
    nan: int = 0
    inf: int = 0
    finite_changed: int = 0
    tokens_changed: int = 0
    slots: int = 0        # rows filled over the run (read) / rows guarded (write)
    where: dict = field(default_factory=dict)
    strays: list = field(default_factory=list)
    error: str = ""
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v not in ("", [], {}) or k in ("verdict",)}


@dataclass
class ScribbleReport(LeakReport):
    engine: str
    reads_pool: str
    graphs: bool
    model: str
    workload: dict
    cells: list
    control_seconds: float = 0.0
    facts: dict = field(default_factory=dict)
    SCHEMA = SCHEMA            # the JSON's (LeakReport.header)

    def verdicts(self) -> list:
        return [c.verdict for c in self.cells]

    def leaks(self) -> list:
        return [c for c in self.cells if c.verdict in LEAKS]

    def failures(self) -> list:
        return [c for c in self.cells if c.verdict in FAILURES]

    def to_dict(self) -> dict:
        return {**self.header(), "engine": self.engine, "reads_pool": self.reads_pool, "graphs": self.graphs,
                "model": self.model, "workload": self.workload, "control_seconds": self.control_seconds,
                "facts": self.facts, "counts": self.counts(), "results": [c.to_dict() for c in self.cells]}

    def frame(self):
        import pandas as pd
        return pd.DataFrame([{k: v for k, v in c.to_dict().items() if k not in ("strays", "where")} |
                             {"where": _where_text(c)} for c in self.cells])

    def table(self) -> str:
        lines = [f"{self.engine} ({self.reads_pool}{', graphs' if self.graphs else ''}) on {self.model}, "
                 f"workload {self.workload.get('name')}"]
        lines.append(f"{'check':6} {'region':15} {'payload':7} {'verdict':17} {'nan':>5} {'inf':>5} "
                     f"{'changed':>7} {'tokens':>6}  where")
        for c in self.cells:
            lines.append(f"{c.check:6} {c.region:15} {c.payload:7} {c.verdict:17} {c.nan:5d} {c.inf:5d} "
                         f"{c.finite_changed:7d} {c.tokens_changed:6d}  {_where_text(c)}")
        lines.append(self.summary())
        return "\n".join(lines)


def _where_text(c: Cell) -> str:
    if c.error:
        return c.error.strip().splitlines()[-1][:120]
    if c.strays:
        s = c.strays[0]
        return f"step {s['step']} layer {s['layer']} rows {s['rows']}" + (
            f" (+{len(c.strays) - 1} more)" if len(c.strays) > 1 else "")
    w = c.where
    if w:
        return f"step {w['step']} layer {w['layer']} requests {w['requests']} heads {w['heads']} dims {w['dims'][:8]}"
    return ""


def _run(engine, hooks, record_attention=False) -> tuple[Generation, float, str]:
    start = time.perf_counter()
    try:
        gen = engine.generate(hooks, record_attention=record_attention)
        err = gen.error
    except Exception:
        gen, err = None, traceback.format_exc(limit=4)
    return gen, time.perf_counter() - start, err


def scribble(engine, regions=REGIONS, payloads=PAYLOADS, localise_leaks: bool = True) -> ScribbleReport:
    """Every region x payload read check, plus the write guard, on one engine adapter."""
    for r in regions:
        if r not in REGIONS:
            raise ValueError(f"regions: unknown region {r!r}; choose from {REGIONS}")
    for p in payloads:
        if p not in PAYLOADS:
            raise ValueError(f"payloads: unknown payload {p!r}; choose from {PAYLOADS}")
    guards = [Scribbler(), Scribbler()]
    clean, seconds, err = _run(engine, guards[0])
    again, _, err2 = _run(engine, guards[1])
    cells = []
    meta = dict(engine=engine.name, reads_pool=engine.reads_pool, graphs=engine.graphs,
                model=_model_name(engine.model), workload=engine.workload.to_dict(), control_seconds=seconds)
    if err or err2:
        cells = [Cell("read", r, p, ERROR, error=err or err2) for r in regions for p in payloads]
        return ScribbleReport(cells=cells, **meta)
    stable = same(clean, again)
    # the write guard, from the clean runs: every region that some step held, checked at every step
    strays = guards[0].strays + [s for s in guards[1].strays if s not in guards[0].strays]
    for r in regions:
        mine = [s for s in strays if s["region"] == r]
        held = guards[0].region_rows[r]
        verdict = STRAY_WRITE if mine else CLEAN if held or r == "read-trash" else NA
        cells.append(Cell("write", r, "-", verdict, slots=held, strays=mine))
    for s in strays:
        if s["region"] not in regions:          # owned rows or a region not asked for: still reported
            cells.append(Cell("write", s["region"], "-", STRAY_WRITE, strays=[s]))
    for r in regions:
        for p in payloads:
            if not stable:
                cells.append(Cell("read", r, p, UNSTABLE,
                                  error="two clean runs differ: no read verdict can be trusted"))
                continue
            hooks = Scribbler(r, p)
            gen, secs, err = _run(engine, hooks)
            if err:
                cells.append(Cell("read", r, p, ERROR, error=err, seconds=secs))
                continue
            if hooks.filled_rows == 0:
                cells.append(Cell("read", r, p, NA, seconds=secs))
                continue
            counts = compare(clean, gen)
            cell = Cell("read", r, p, verdict_of(counts), slots=hooks.filled_rows, seconds=secs, **counts)
            for s in hooks.strays:
                if s not in strays:
                    cell.strays.append(s)
            cells.append(cell)
    if localise_leaks and not engine.graphs:
        _localise(engine, cells)
    return ScribbleReport(cells=cells, **meta)


def _localise(engine, cells: list) -> None:
    leaking = [c for c in cells if c.check == "read" and c.verdict in READ_LEAKS]
    if not leaking:
        return
    base, _, err = _run(engine, Scribbler(), record_attention=True)
    if err:
        return
    for c in leaking:
        gen, _, err = _run(engine, Scribbler(c.region, c.payload), record_attention=True)
        if not err:
            c.where = localise(base, gen)


def _model_name(model) -> str:
    name = getattr(model, "name_or_path", "") or getattr(model.config, "name_or_path", "")
    return name or f"{type(model).__name__} (tiny, from a config)"

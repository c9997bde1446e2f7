"""The read check, the other-requests check and the write guard over a whole generation.

Read check, per region x payload: before every step, fill the region's rows with the payload (one
region at a time; rows filled earlier that left the region get their own bytes back, unless the
engine wrote them since: those are the engine's bytes now), run the whole generation, and compare
tokens, logprobs and (where no graph hides them) logits with a clean run by the canary's rule
(qsa_lab.analysis.leaks: bit for bit, two NaNs equal).

Other-requests check, per payload: the same, filling one live request's own rows at a time (rows
only it and its forked children may read); every OTHER request's tokens and logprobs must stay
bit-identical. A request whose output changes read another request's KV, at some weight.

Confirmation: a leak is re-run (a second clean run and a second poisoned run); only a leak that
reproduces bit for bit is a leak, anything else is `unstable-control`. Two clean runs that differ
make every read verdict `unstable-control`.

Write guard, every run: a digest of every row before and after each step (and around warm-up), and
after each step against before the next, with the engine's calls between steps digested too; a row
that changed outside the step's own writes and the write trash, or between steps other than by the
engine's own restore or fork copy into rows a request owns next, is a `stray-write`.

    report = scribble(engine)                     # every region x payload, other requests, write guard
    report.frame()
"""
from __future__ import annotations

import contextlib
import math
import time
import traceback
from dataclasses import dataclass, field

import torch

from qsa_lab.analysis.leaks import (CLEAN, ERROR, FAILURES, LEAKS, NA, READ_LEAKS, STRAY_WRITE, UNSTABLE, VERDICTS,
                                    LeakReport, compare_generation, verdict_of)
from qsa_lab.analysis.leaks import compare as compare_outputs

from .contract import Generation, StepView
from .verdicts import OTHER, PAYLOADS, POOL_REGIONS, REGION_TEXT, REGIONS, SCHEMA

_UNOWNED = ("free-blocks", "prefix-cache", "read-trash", "write-trash")   # rows in no live request's block


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
        for name in _UNOWNED:
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
    return "no layer: trash sector" if region in ("read-trash", "write-trash") else "no layer: unassigned sector"


def describe_strays(view: StepView, stray: torch.Tensor, when: str, call: str = "") -> list:
    """Stray rows -> one record per (region, layer): where they landed, in this view's terms."""
    names = {}
    for name, rows in view.regions.items():
        for r in rows[torch.isin(rows.cpu(), stray)].tolist():
            names[r] = name
    owned = set(view.owned[torch.isin(view.owned.cpu(), stray)].tolist())
    groups = {}
    for r in stray.tolist():
        region = names.get(r) or ("owned" if r in owned else "read-trash" if view.step == "warmup" else "unlabelled")
        groups.setdefault((region, int(view.row_layer[r])), []).append(r)
    return [{"step": view.step, "when": when, "call": call, "region": reg, "layer": layer,
             "where": layer_text(reg, layer), "rows": rows[:8], "count": len(rows)}
            for (reg, layer), rows in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1]))]


# ---------------------------------------------------------------------------- comparing generations
def _flat(gen: Generation, requests=None) -> tuple[list, torch.Tensor]:
    """Tokens and values to compare: every request's logprobs and the logits, or only the logprobs of
    `requests` (logits rows mix requests)."""
    ids = sorted(gen.tokens) if requests is None else [r for r in sorted(gen.tokens) if r in requests]
    values = [torch.tensor(gen.logprobs[r], dtype=torch.float32) for r in ids]
    if gen.logits and requests is None:
        values += [t.reshape(-1) for t in gen.logits]
    return [gen.tokens[r] for r in ids], torch.cat(values) if values else torch.zeros(0)


def same(a: Generation, b: Generation) -> bool:
    """Nothing changed between two generations (compare)."""
    return not any(compare(a, b).values())


def compare(clean: Generation, other: Generation, requests=None) -> dict:
    """Counts of what changed (qsa_lab.analysis.leaks.compare_generation): nan / inf (values that became
    NaN / Inf), finite_changed, tokens_changed; over every request and the logits, or over the tokens and
    logprobs of `requests` only."""
    tc, vc = _flat(clean, requests)
    to, vo = _flat(other, requests)
    return compare_generation(tc, to, vc, vo).counts


def changed_requests(clean: Generation, other: Generation, requests) -> dict:
    """request -> the index of its first generated token or logprob that changed (compare's rule), for the
    requests whose output changed."""
    out = {}
    for r in requests:
        a, b = clean.tokens.get(r, []), other.tokens.get(r, [])
        la = torch.tensor(clean.logprobs.get(r, []), dtype=torch.float32)
        lb = torch.tensor(other.logprobs.get(r, []), dtype=torch.float32)
        firsts = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        if la.shape == lb.shape:
            firsts += torch.nonzero(compare_outputs(la, lb).changed).reshape(-1).tolist()
        if firsts or len(a) != len(b) or la.shape != lb.shape:
            out[r] = min(firsts, default=min(len(a), len(b)))
    return out


def localise(clean: Generation, other: Generation, requests=None) -> dict:
    """Where two generations' attention outputs first differ: step, request, layer, heads, head dims
    (only in the query rows of `requests` when given). Needs both recorded with record_attention (no
    graphs); {} when they do not differ there."""
    if not clean.attention or not other.attention:
        return {}
    for step, (a, b) in enumerate(zip(clean.attention, other.attention)):
        batch, query_rows = clean.steps[step] if step < len(clean.steps) else ([], [])
        starts = [sum(query_rows[:i]) for i in range(len(query_rows))]
        for layer in sorted(a):
            if layer not in b or a[layer].shape != b[layer].shape:
                continue
            diff = compare_outputs(a[layer], b[layer]).changed          # [q_rows, heads, head_dim]
            if requests is not None:
                keep = torch.zeros(diff.shape[0], dtype=torch.bool)
                for r, s, n in zip(batch, starts, query_rows):
                    if r in requests:
                        keep[s: s + n] = True
                diff &= keep[:, None, None]
            if not diff.any():
                continue
            rows = torch.nonzero(diff.any(dim=(1, 2))).reshape(-1).tolist()
            owner = [next((r for r, s, n in zip(batch, starts, query_rows) if s <= q < s + n), None) for q in rows]
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
    pairs: list = field(default_factory=list)     # other-requests: {"reader", "poisoned", "first_token", ...}
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
    events: dict = field(default_factory=dict)     # what the clean run's engine did (Generation.events)
    moved_rows: int = 0                            # rows the engine moved between steps in the clean run
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
                "facts": self.facts, "events": self.events, "moved_rows": self.moved_rows, "counts": self.counts(),
                "results": [c.to_dict() for c in self.cells]}

    def frame(self):
        import pandas as pd
        return pd.DataFrame([{k: v for k, v in c.to_dict().items() if k not in ("strays", "where", "pairs")} |
                             {"where": _where_text(c)} for c in self.cells])

    def verdict_line(self) -> str:
        """The one line under the table: the leak check's counts (LeakReport.summary), each verdict's cells,
        the regions that leaked, and the exit code."""
        verdicts = self.verdicts()
        found = ", ".join(f"{verdicts.count(v)} {v}" for v in VERDICTS if v in verdicts)
        leaking = sorted({c.region for c in self.leaks()})
        return (f"{self.summary()}: {found}" + (f"; leaks or stray writes in {', '.join(leaking)}" if leaking
                                                    else "") + f"; exit code {self.exit_code()}")

    def legend(self) -> list:
        """One line per region in the report: the rows one read run filled (summed over steps), what it holds."""
        slots = {}
        for c in self.cells:
            if c.check == "read":
                slots[c.region] = max(slots.get(c.region, 0), c.slots)
        return [f"  {r:15} {slots[r]:7d}  {REGION_TEXT[r]}" for r in REGIONS if r in slots]

    def table(self) -> str:
        lines = [f"{self.engine} ({self.reads_pool}{', graphs' if self.graphs else ''}) on {self.model}, "
                 f"workload {self.workload.get('name')}"]
        lines.append(f"{'check':6} {'region':15} {'payload':7} {'verdict':17} {'nan':>5} {'inf':>5} "
                     f"{'changed':>7} {'tokens':>6}  where")
        for c in self.cells:
            lines.append(f"{c.check:6} {c.region:15} {c.payload:7} {c.verdict:17} {c.nan:5d} {c.inf:5d} "
                         f"{c.finite_changed:7d} {c.tokens_changed:6d}  {_where_text(c)}")
        lines.append(f"summary: {self.verdict_line()}")
        legend = self.legend()
        if legend:
            lines += ["regions (rows filled per read run, summed over steps):"] + legend
        return "\n".join(lines)


def _where_text(c: Cell) -> str:
    if c.error:
        return c.error.strip().splitlines()[-1][:160]
    if c.strays:
        s = c.strays[0]
        call = f" in {s['call']}" if s.get("call") else ""
        return f"{s['when']}{call}: {s['region']}, {s['where']}, rows {s['rows']}" + (
            f" (+{len(c.strays) - 1} more)" if len(c.strays) > 1 else "")
    if c.pairs:
        p = c.pairs[0]
        at = f" at step {p['step']} layer {p['layer']}" if "step" in p else f" from its token {p['first_token']}"
        return f"{p['reader']} read {p['poisoned']}'s rows{at}" + (
            f" (+{len(c.pairs) - 1} more pairs)" if len(c.pairs) > 1 else "")
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
    """Every region x payload read check (other-requests: one request at a time), every leak confirmed by
    a re-run, plus the write guard, on one engine adapter. localise_leaks: record attention outputs in the
    confirming re-runs to name the first step and layer where a leak shows (not under CUDA graphs)."""
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
        if r == OTHER:           # live requests' own rows: a stray write there is reported as `owned`
            continue
        mine = [s for s in strays if s["region"] == r]
        held = guards[0].region_rows[r]
        verdict = STRAY_WRITE if mine else CLEAN if held or r == "read-trash" else NA
        cells.append(Cell("write", r, "-", verdict, slots=held, strays=mine))
    for s in strays:
        if s["region"] not in regions:          # owned rows or a region not asked for: still reported
            cells.append(Cell("write", s["region"], "-", STRAY_WRITE, strays=[s]))
    judge = _Judge(engine, clean, strays, record=localise_leaks and not engine.graphs)
    for r in regions:
        for p in payloads:
            if not stable:
                cells.append(Cell("read", r, p, UNSTABLE,
                                  error="two clean runs differ: no read verdict can be trusted"))
            elif r == OTHER:
                cells.append(judge.other_requests(p))
            else:
                cells.append(judge.region(r, p))
    return ScribbleReport(cells=cells, events=clean.events, moved_rows=guards[0].moved_rows, **meta)


class _Judge:
    """Runs the poisoned generations of one report against its clean run, and confirms every leak."""

    def __init__(self, engine, clean: Generation, strays: list, record: bool):
        self.engine, self.clean, self.strays, self.record = engine, clean, strays, record

    def _new_strays(self, hooks) -> list:
        return [s for s in hooks.strays if s not in self.strays]

    def _control(self):
        """A second clean run for a confirmation -> (generation, problem text or '')."""
        gen, _, err = _run(self.engine, Scribbler(), record_attention=self.record)
        if err:
            return None, f"the confirming clean run failed: {err.strip().splitlines()[-1]}"
        if not same(gen, self.clean):
            return None, "the confirming clean run differs from the first: no read verdict can be trusted"
        return gen, ""

    def _again(self, first: Generation, hooks) -> tuple:
        """The poisoned run again -> (generation, problem text or '')."""
        gen, _, err = _run(self.engine, hooks, record_attention=self.record)
        if err:
            return None, f"the confirming poisoned run failed: {err.strip().splitlines()[-1]}"
        if not same(gen, first):
            return None, "the leak did not reproduce: the second poisoned run differs from the first"
        return gen, ""

    def region(self, region: str, payload: str) -> Cell:
        hooks = Scribbler(region, payload)
        gen, secs, err = _run(self.engine, hooks)
        if err:
            return Cell("read", region, payload, ERROR, error=err, seconds=secs)
        if hooks.filled_rows == 0:
            return Cell("read", region, payload, NA, seconds=secs)
        counts = compare(self.clean, gen)
        cell = Cell("read", region, payload, verdict_of(counts), slots=hooks.filled_rows, seconds=secs,
                    strays=self._new_strays(hooks), **counts)
        if cell.verdict in READ_LEAKS:
            control, problem = self._control()
            if not problem:
                second, problem = self._again(gen, Scribbler(region, payload))
            if problem:
                cell.verdict, cell.error = UNSTABLE, problem
            else:
                cell.where = localise(control, second)
        return cell

    def other_requests(self, payload: str) -> Cell:
        """One request's own rows at a time; a confirmed leak names each request that read them."""
        families = {}
        for r in self.clean.tokens:
            families.setdefault(self.clean.family(r), []).append(r)
        cell = Cell("read", OTHER, payload, NA)
        control, problems, errors, checked = None, [], [], False
        for victim in sorted(families):
            others = [r for r in self.clean.tokens if r not in families[victim]]
            hooks = Scribbler(OTHER, payload, victim=victim)
            gen, secs, err = _run(self.engine, hooks)
            cell.seconds += secs
            if err:
                errors.append(f"{victim}: {err.strip().splitlines()[-1]}")
                continue
            cell.slots += hooks.filled_rows
            cell.strays += self._new_strays(hooks)
            if hooks.filled_rows == 0 or not others:
                continue
            checked = True
            counts = compare(self.clean, gen, others)
            if verdict_of(counts) not in READ_LEAKS:
                continue
            problem = ""
            if control is None:
                control, problem = self._control()
            if not problem:
                second, problem = self._again(gen, Scribbler(OTHER, payload, victim=victim))
            if problem:
                problems.append(f"{victim}: {problem}")
                continue
            for reader, token in sorted(changed_requests(self.clean, gen, others).items()):
                where = localise(control, second, {reader})
                cell.pairs.append({"reader": reader, "poisoned": victim, "first_token": token} |
                                  ({"step": where["step"], "layer": where["layer"]} if where else {}))
            for k, v in counts.items():
                setattr(cell, k, getattr(cell, k) + v)
        if cell.pairs:           # a confirmed leak stands, whatever another request's run gave
            cell.verdict = verdict_of({k: getattr(cell, k) for k in ("nan", "inf", "finite_changed", "tokens_changed")})
        elif problems or errors:
            cell.verdict, cell.error = (UNSTABLE if problems else ERROR), "; ".join(problems + errors)
        elif checked:
            cell.verdict = CLEAN
        return cell


def _model_name(model) -> str:
    name = getattr(model, "name_or_path", "") or getattr(model.config, "name_or_path", "")
    return name or f"{type(model).__name__} (tiny, from a config)"

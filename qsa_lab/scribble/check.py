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
make every read verdict `unstable-control`, and so does a clean run whose logprobs are all NaN or
infinite (an attention that returns NaN everywhere): a filled run could not change them.

Write guard, every run (guard.Scribbler): a row changed where no write may land is a `stray-write`.

The pieces: the regions (regions.py), the hooks that fill and guard (guard.py), comparing generations
(compare.py), the report (report.py), the engines (engines/: one adapter each, on engines.base).

    report = scribble(engine)                     # every region x payload, other requests, write guard
    report.frame()
"""
from __future__ import annotations

import math
import time
import traceback

from qsa_lab.analysis.leaks import CLEAN, ERROR, NA, READ_LEAKS, STRAY_WRITE, UNSTABLE, verdict_of

from .compare import changed_requests, compare, localise, same
from .engines.base import Generation
from .guard import Scribbler
from .regions import OTHER, PAYLOADS, REGIONS
from .report import Cell, ScribbleReport


class _Progress:
    """The generations planned so far (`total`) and the caller's progress(what, total), told before each."""

    def __init__(self, progress):
        self.fn, self.total = progress, 2         # the two clean runs; the checks and confirmations add theirs

    def plan(self, regions, payloads, families: int = 1) -> None:
        """The two clean runs and one generation a read cell (other-requests: one a family of requests)."""
        self.total = 2 + len(payloads) * sum(families if r == OTHER else 1 for r in regions)

    def __call__(self, what: str) -> None:
        if self.fn is not None:
            self.fn(what, self.total)


def _run(engine, hooks, record_attention=False, say=None, what="") -> tuple[Generation, float, str]:
    if say is not None:
        say(what)
    start = time.perf_counter()
    try:
        gen = engine.generate(hooks, record_attention=record_attention)
        err = gen.error
    except Exception:
        gen, err = None, traceback.format_exc(limit=4)
    return gen, time.perf_counter() - start, err


def scribble(engine, regions=REGIONS, payloads=PAYLOADS, localise_leaks: bool = True, progress=None) -> ScribbleReport:
    """Every region x payload read check (other-requests: one request at a time), every leak confirmed by
    a re-run, plus the write guard, on one engine adapter. localise_leaks: record attention outputs in the
    confirming re-runs to name the first step and layer where a leak shows (not under CUDA graphs).
    progress: None or fn(what, total) called before each generation: what it runs and how many
    generations are planned so far (a confirmed leak adds its re-runs as they start)."""
    regions, payloads = _names("regions", regions, REGIONS), _names("payloads", payloads, PAYLOADS, empty=True)
    say = _Progress(progress)
    say.plan(regions, payloads)              # before the clean runs: other-requests counted as one family
    guards = [Scribbler(), Scribbler()]
    clean, seconds, err = _run(engine, guards[0], say=say, what="clean run")
    again, _, err2 = _run(engine, guards[1], say=say, what="second clean run")
    cells = []
    meta = dict(engine=engine.name, reads_pool=engine.reads_pool, graphs=engine.graphs,
                model=_model_name(engine.model), workload=engine.workload.to_dict(), control_seconds=seconds)
    if err or err2:
        cells = [Cell("read", r, p, ERROR, error=err or err2) for r in regions for p in payloads]
        return ScribbleReport(cells=cells, **meta)
    stable = same(clean, again)
    unusable = ("two clean runs differ" if not stable else
                "the clean run's logprobs are all NaN or infinite" if _all_nonfinite(clean) else "")
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
    judge = _Judge(engine, clean, strays, record=localise_leaks and not engine.graphs, say=say)
    say.plan(regions if stable else (), payloads, len(judge.families()))
    for r in regions:
        for p in payloads:
            if unusable:
                cells.append(Cell("read", r, p, UNSTABLE, error=f"{unusable}: no read verdict can be trusted"))
            elif r == OTHER:
                cells.append(judge.other_requests(p))
            else:
                cells.append(judge.region(r, p))
    return ScribbleReport(cells=cells, events=clean.events, moved_rows=guards[0].moved_rows, **meta)


def _all_nonfinite(gen: Generation) -> bool:
    """Every logprob of the generation NaN or infinite (and at least one logprob)."""
    values = [v for lp in gen.logprobs.values() for v in lp]
    return bool(values) and not any(math.isfinite(v) for v in values)


def _names(arg: str, given, allowed: tuple, empty: bool = False) -> tuple:
    """Regions or payloads as asked for, each once, in order. No region at all checks nothing: refused (no
    payload is the write guard alone: `empty`)."""
    if isinstance(given, str):
        given = (given,)
    given = tuple(dict.fromkeys(given))
    for g in given:
        if g not in allowed:
            raise ValueError(f"{arg}: unknown {arg[:-1]} {g!r}; choose from {allowed}")
    if not given and not empty:
        raise ValueError(f"{arg}: empty: nothing would be checked; choose from {allowed}")
    return given


def _with_strays(cell: Cell) -> Cell:
    """A read run's own stray writes (rows changed that no clean run changed: an attention that scrubs the
    payload out of the pool in place, say) make a cell that found no read leak a stray-write, never clean."""
    if cell.strays and cell.verdict in (CLEAN, NA):
        cell.verdict = STRAY_WRITE
    return cell


class _Judge:
    """Runs the poisoned generations of one report against its clean run, and confirms every leak."""

    def __init__(self, engine, clean: Generation, strays: list, record: bool, say=None):
        self.engine, self.clean, self.strays, self.record = engine, clean, strays, record
        self.say = say or _Progress(None)

    def families(self) -> dict:
        """{family: its requests} of the clean run: the other-requests check poisons one family at a time."""
        families = {}
        for r in self.clean.tokens:
            families.setdefault(self.clean.family(r), []).append(r)
        return families

    def _confirm(self, hooks, what: str):
        """One confirming generation, counted in the plan as it starts."""
        self.say.total += 1
        return _run(self.engine, hooks, record_attention=self.record, say=self.say, what=f"confirming: {what}")

    def _new_strays(self, hooks) -> list:
        return [s for s in hooks.strays if s not in self.strays]

    def _control(self):
        """A second clean run for a confirmation -> (generation, problem text or '')."""
        gen, _, err = self._confirm(Scribbler(), "a clean run")
        if err:
            return None, f"the confirming clean run failed: {err.strip().splitlines()[-1]}"
        if not same(gen, self.clean):
            return None, "the confirming clean run differs from the first: no read verdict can be trusted"
        return gen, ""

    def _again(self, first: Generation, hooks, what: str) -> tuple:
        """The poisoned run again -> (generation, problem text or '')."""
        gen, _, err = self._confirm(hooks, what)
        if err:
            return None, f"the confirming poisoned run failed: {err.strip().splitlines()[-1]}"
        if not same(gen, first):
            return None, "the leak did not reproduce: the second poisoned run differs from the first"
        return gen, ""

    def region(self, region: str, payload: str) -> Cell:
        hooks = Scribbler(region, payload)
        gen, secs, err = _run(self.engine, hooks, say=self.say, what=f"{region} / {payload}")
        if err:
            return Cell("read", region, payload, ERROR, error=err, seconds=secs)
        if hooks.filled_rows == 0:
            return _with_strays(Cell("read", region, payload, NA, seconds=secs, strays=self._new_strays(hooks)))
        counts = compare(self.clean, gen)
        cell = _with_strays(Cell("read", region, payload, verdict_of(counts), slots=hooks.filled_rows, seconds=secs,
                                 strays=self._new_strays(hooks), **counts))
        if cell.verdict in READ_LEAKS:
            control, problem = self._control()
            if not problem:
                second, problem = self._again(gen, Scribbler(region, payload), f"{region} / {payload}")
            if problem:
                cell.verdict, cell.error = UNSTABLE, problem
            else:
                cell.where = localise(control, second)
        return cell

    def other_requests(self, payload: str) -> Cell:
        """One request's own rows at a time; a confirmed leak names each request that read them."""
        families = self.families()
        cell = Cell("read", OTHER, payload, NA)
        control, problems, errors, checked = None, [], [], False
        for victim in sorted(families):
            others = [r for r in self.clean.tokens if r not in families[victim]]
            hooks = Scribbler(OTHER, payload, victim=victim)
            what = f"{OTHER} / {payload}: request {victim}'s rows"
            gen, secs, err = _run(self.engine, hooks, say=self.say, what=what)
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
                second, problem = self._again(gen, Scribbler(OTHER, payload, victim=victim), what)
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
        return _with_strays(cell)


def _model_name(model) -> str:
    name = getattr(model, "name_or_path", "") or getattr(model.config, "name_or_path", "")
    return name or f"{type(model).__name__} (tiny, from a config)"

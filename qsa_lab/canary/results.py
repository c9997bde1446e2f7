"""The canary's results: what one kernel x region x plane x payload cell's calls mean (judge: the
one leak check of qsa_lab.analysis.leaks over the cell's parts) and what a run's cells add up to
(CanaryReport: counts, failures, exit code, the qsa_lab.canary/1 document). The run loop that
makes the calls is qsa_lab.canary.runner.

What each verdict means for a kernel call:
    nan-leak, inf-leak, finite-leak   outputs went NaN, +-Inf, or changed finite: the kernel gave
                     unattended bytes weight
    error            the call raised (SystemExit and KeyboardInterrupt too), timed out, ended its
                     process, or returned a non-tensor / wrong shape, dtype or device
    unstable-control the two control runs differ, or the control holds NaN / Inf
    input-modified   the call changed an input (pool, block table, seq_lens, q, ...)
    n/a              clean, but the call's inputs reference no byte of the region (say so
                     rather than "clean")
A requested kernel with no clean-or-leak cell at all fails the run (no-checks), it never passes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qsa_lab.analysis.leaks import (CHECKED, CLEAN, ERROR, FAILURES, FINITE_LEAK, INPUT_MODIFIED, LEAKS, NA,
                                    NO_CHECKS, UNSTABLE, LeakReport, bits, compare, control_problem)
from qsa_lab.canary.case import CanaryCase
from qsa_lab.canary.execution import DEFAULT_TIMEOUT, Outcome
from qsa_lab.model.poison import PAYLOADS, payload_bits
from qsa_lab.model.regions import region_sizes

SCHEMA = "qsa_lab.canary/1"
MAX_HINT = ("the max payload changed outputs: the kernel reads these slots into its result, so either it "
            "attends them (is the attention spec right for this kernel? see --attend) or it leaks finite values")


@dataclass
class LeakResult:
    """One kernel x region x plane x payload. leak: [rows, q_heads, head_dim] bool, the outputs
    whose bits changed; output: the poisoned run's output as float32 (CPU); both None where
    no comparison was drawn (error, unstable-control, input-modified)."""
    kernel: str
    region: str
    plane: str
    payload: str
    verdict: str
    nan: int = 0
    inf: int = 0
    finite_changed: int = 0
    leak: torch.Tensor | None = field(default=None, repr=False)
    output: torch.Tensor | None = field(default=None, repr=False)
    note: str = ""
    error: str = ""
    traceback: str = field(default="", repr=False)
    modified: list = field(default_factory=list)

    def where(self) -> dict:
        """The leaking outputs: sorted rows, heads, head dims."""
        if self.leak is None:
            return {"rows": [], "heads": [], "dims": []}
        idx = torch.nonzero(self.leak)
        return {k: sorted(set(idx[:, i].tolist())) for i, k in enumerate(("rows", "heads", "dims"))}

    def to_dict(self) -> dict:
        out = {"kernel": self.kernel, "region": self.region, "plane": self.plane, "payload": self.payload,
               "verdict": self.verdict, "nan": self.nan, "inf": self.inf, "finite_changed": self.finite_changed,
               **self.where()}
        for k in ("note", "error", "traceback", "modified"):
            if getattr(self, k):
                out[k] = getattr(self, k)
        return out

    def describe(self) -> str:
        head = f"{self.kernel} {self.region}/{self.plane}/{self.payload}: {self.verdict}"
        if self.verdict in LEAKS:
            w = self.where()
            head += (f" ({self.nan} NaN, {self.inf} Inf, {self.finite_changed} finite changed; "
                     f"rows {w['rows']}, heads {w['heads']}, dims {w['dims']})")
        detail = self.error or (f"changed {', '.join(self.modified)}" if self.modified else "") or self.note
        return head + (f": {detail}" if detail else "")

@dataclass
class CanaryReport(LeakReport):
    backend: str | None        # what the qsa routes ran on: "cuda" | "emulate" (None: not run)
    device: str                # where the other kernels ran
    case: CanaryCase
    kernels: list
    results: list
    skipped: list              # {"kernel"?, "region"?, "payload"?, "reason"}
    requested: bool = True     # the kernels were named (a skipped one then fails the run)
    timeout: float = DEFAULT_TIMEOUT
    names: dict = field(default_factory=dict)   # kernel -> its canary.names.KernelName (none for a callable)
    SCHEMA = SCHEMA            # the JSON's (LeakReport.header)

    def verdicts(self) -> list:
        return [r.verdict for r in self.results]

    def leaks(self) -> list:
        return [r for r in self.results if r.verdict in LEAKS]

    def non_clean(self) -> list:
        return [r for r in self.results if r.verdict != CLEAN]

    def checks(self, kernel: str) -> int:
        """Cells of `kernel` whose leak check ran (clean or a leak)."""
        return sum(r.kernel == kernel and r.verdict in CHECKED for r in self.results)

    def failures(self, allow_skipped: bool = False) -> list:
        """One dict per kernel whose run cannot be trusted: {"kernel", "verdict", "cells", "message"};
        verdict one of FAILURES or NO_CHECKS."""
        out = []
        for k in self.kernels:
            cells = [r for r in self.results if r.kernel == k and r.verdict in FAILURES]
            if cells:
                worst = next(v for v in FAILURES if any(r.verdict == v for r in cells))
                first = next(r for r in cells if r.verdict == worst)
                out.append({"kernel": k, "verdict": worst, "cells": len(cells),
                            "message": f"{worst} in {len(cells)} cell(s), first "
                                       f"{first.region}/{first.plane}/{first.payload}: "
                                       f"{first.error or ', '.join(first.modified) or first.note}"})
            elif self.checks(k) == 0:
                reason = next((s["reason"] for s in self.skipped if s.get("kernel") == k), None)
                if reason is not None and (allow_skipped or not self.requested):
                    continue
                why = f"skipped: {reason}" if reason else "every cell n/a: the call's inputs reference no region"
                out.append({"kernel": k, "verdict": NO_CHECKS, "cells": 0,
                            "message": f"no leak check ran ({why})"})
        if not out and not allow_skipped and not any(self.checks(k) for k in self.kernels):   # it never passes
            out.append({"kernel": "every kernel", "verdict": NO_CHECKS, "cells": 0,
                        "message": "no leak check ran: each kernel was skipped or every cell n/a (see 'skipped')"})
        return out

    def exit_code(self) -> int:
        """The CLI's: 3 a kernel failed (error, unstable control, modified input, no checks), 1 a leak, 0 clean."""
        return 3 if self.failures() else super().exit_code()

    def to_json(self) -> dict:
        c = self.case
        return {**self.header(), "backend": self.backend, "device": self.device, "kv_dtype": c.kv_dtype,
                "attend": str(c.spec), "geometry": c.geometry_dict(),
                "pool_pages": int(c.kv_cache.shape[0]), "regions": region_sizes(c),
                "payload_bits": {p: f"0x{payload_bits(c.kv_dtype, p):X}" for p in available_payloads(c.kv_dtype)},
                "timeout_s": self.timeout, "kernels": list(self.kernels), "counts": self.counts(),
                "results": [r.to_dict() for r in self.results], "skipped": list(self.skipped),
                "failures": self.failures(), "exit_code": self.exit_code()}

    def frame(self):
        """One row per result (pandas DataFrame)."""
        import pandas as pd

        return pd.DataFrame([r.to_dict() for r in self.results],
                            columns=["kernel", "region", "plane", "payload", "verdict", "nan", "inf",
                                     "finite_changed", "rows", "heads", "dims", "note", "error", "modified"])

    def find(self, kernel: str, region: str, plane: str, payload: str) -> LeakResult:
        for r in self.results:
            if (r.kernel, r.region, r.plane, r.payload) == (kernel, region, plane, payload):
                return r
        raise KeyError(f"no result for {kernel} {region}/{plane}/{payload}")


def available_payloads(kv_dtype: str) -> tuple:
    out = []
    for p in PAYLOADS:
        try:
            payload_bits(kv_dtype, p)
            out.append(p)
        except ValueError:
            pass
    return tuple(out)


def _failed(o: Outcome | None, what: str) -> dict | None:
    """The error / input-modified fields of a cell whose call `o` failed (None when it did not)."""
    if o is None:
        return {"verdict": ERROR, "error": "not run: the kernel failed earlier in this cell"}
    if o.kind == "skipped":
        return {"verdict": ERROR, "error": f"{what}: skipped ({o.error}) after other calls ran"}
    if o.kind != "ok":
        return {"verdict": ERROR, "error": f"{what}: {o.error}", "traceback": o.traceback}
    if o.modified:
        return {"verdict": INPUT_MODIFIED, "modified": list(o.modified),
                "error": f"{what} changed {', '.join(o.modified)}"}
    return None


def _combine(judged: list) -> tuple[torch.Tensor, torch.Tensor]:
    """[(control, poisoned, rows [rows] bool or None)] of a cell's parts -> one (control, poisoned)
    pair: each output from a part that judges its row, and from one where it changed when any
    did. A row is judged by several parts (other-requests at 5+ requests: one per bit of the
    request id); a later part where it stayed the same never hides an earlier part's leak."""
    first = judged[0][0]
    if len(judged) == 1 and judged[0][2] is None:
        return first, judged[0][1]
    control, poisoned = bits(first).clone(), bits(first).clone()    # raw bits: float8 has no index_put
    leaked = torch.zeros(first.shape, dtype=torch.bool)
    for ctrl, out, rows in judged:
        pick = torch.ones(first.shape, dtype=torch.bool) if rows is None else \
            rows.cpu().view(-1, *[1] * (first.dim() - 1)).expand(first.shape)
        pick = pick & ~leaked
        control[pick], poisoned[pick] = bits(ctrl)[pick], bits(out)[pick]
        leaked |= pick & compare(ctrl, out).changed
    return control.view(first.dtype), poisoned.view(first.dtype)


def judge(row: dict, payload: str, cell: dict, referenced: bool) -> LeakResult:
    """One payload's verdict over every part of the cell: each part's outputs count on its judged
    rows only (all rows for a one-part region)."""
    judged = []
    for part, rows in zip(cell["parts"], cell["rows"]):
        control, again, o = part["control"], part["again"], part["payloads"].get(payload)
        for call, what in ((control, "control run"), (o, f"{payload} run"), (again, "second control run")):
            bad = _failed(call, what)
            if bad:
                return LeakResult(**row, payload=payload, **bad)
        problem = control_problem(control.output, again.output)
        if problem:
            return LeakResult(**row, payload=payload, verdict=UNSTABLE, note=problem)
        if control.output.shape != o.output.shape or control.output.dtype != o.output.dtype:
            judged = [(control.output, o.output, None)]   # compare() names the mismatch
            break
        judged.append((control.output, o.output, rows))
    try:
        control, poisoned = _combine(judged)
        verdict, counts, changed = compare(control, poisoned)
    except (TypeError, ValueError) as e:
        return LeakResult(**row, payload=payload, verdict=ERROR, error=f"{payload} run: {e}")
    note = MAX_HINT if verdict == FINITE_LEAK and payload == "max" else ""
    if verdict == CLEAN and not referenced:
        verdict, note = NA, "the call's inputs reference no byte of this region"
    return LeakResult(**row, payload=payload, verdict=verdict, leak=changed, output=poisoned.float(), note=note,
                      **counts)


def load_canary(path) -> dict:
    """A canary JSON document (schema qsa_lab.canary/1), checked."""
    doc = json.loads(Path(path).read_text())
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"path: {path} is not a {SCHEMA} document (schema {doc.get('schema')!r})")
    return doc

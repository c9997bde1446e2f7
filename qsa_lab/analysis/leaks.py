"""The one leak check under the canary (one kernel call) and the scribble (a running engine):
the verdicts, what "changed" means, the counts, and the report base both reports extend.

Plain Python at import (the command line names verdicts without torch); torch is imported only
inside the functions that compare tensors or read the machine.

Verdicts, in this order (a table of verdicts lists them so: leaks before failures before no-check):

    verdict           category  exit  meaning
    clean             clean     0     the check ran and nothing changed
    nan-leak          leak      1     an output became NaN: a byte nobody attends reached it (0 * NaN = NaN)
    inf-leak          leak      1     an output became +-Inf
    finite-leak       leak      1     finite outputs whose bits changed, or a generated token changed
    stray-write       leak      1     (the scribble's write guard) a step wrote a pool row it must not
                                      write: a leak of writes, since another request's reads see those
                                      bytes; it fails a run as a read leak does
    error             failure   3     the kernel or engine raised, exited, hung or returned junk: no verdict
    unstable-control  failure   3     two clean runs differ (or the canary's control holds NaN / Inf):
                                      no verdict can be trusted
    input-modified    failure   3     the kernel wrote into its inputs
    n/a               no-check  0     nothing to poison, or nothing references the region: no check ran,
                                      which is never "clean"
    not-run           no-check  0     the cell never ran (a kernel that was skipped: a grid's empty cell)

A run's exit code is the largest of its verdicts' (0, 1, 3). One more name is a report's, never a
cell's:

    no-checks         failure   3     no cell's check ran (every cell n/a, not-run or a failure, or no
                                      cell at all): a run that checked nothing never passes

(the canary also names it for one requested kernel with no check at all).

What "changed" means, for every output (compare): bit for bit against the control, except that
**two NaNs are equal whatever their payload bits**. IEEE 754 leaves which NaN payload an operation
returns to the implementation (x86 returns the first operand's, NVIDIA GPUs a canonical NaN, and
summation order decides which operand comes first), so a payload change is a fact about the
hardware, not about what the kernel read; and an output that was NaN in the control cannot show a
leak in the first place. Everything else is compared by its bits: -0.0 against +0.0 is a change,
+Inf against -Inf is an inf change. float8 outputs (no isnan kernel of their own) are classified
through float32, which holds every float8 value exactly; fp16, bf16 and fp32 alike. An engine's
generation (compare_generation) is its tokens plus its logprobs and logits as one flat float
tensor: the values by the same rule, and a token that differs is a finite change.
"""
from __future__ import annotations

from typing import NamedTuple

# what a report says about where it ran: the one function in support (its names re-exported here)
from qsa_lab.support.machine import gpu_name, machine_facts  # noqa: F401

# ---------------------------------------------------------------------------- the vocabulary
CLEAN = "clean"
NAN_LEAK = "nan-leak"
INF_LEAK = "inf-leak"
FINITE_LEAK = "finite-leak"
STRAY_WRITE = "stray-write"
ERROR = "error"
UNSTABLE = "unstable-control"
INPUT_MODIFIED = "input-modified"
NA = "n/a"
NOT_RUN = "not-run"


class Verdict(NamedTuple):
    name: str
    category: str      # clean | leak | failure | no-check
    exit_code: int     # a run's exit code is the largest of its verdicts'


TABLE = (Verdict(CLEAN, "clean", 0),
         Verdict(NAN_LEAK, "leak", 1), Verdict(INF_LEAK, "leak", 1), Verdict(FINITE_LEAK, "leak", 1),
         Verdict(STRAY_WRITE, "leak", 1),
         Verdict(ERROR, "failure", 3), Verdict(UNSTABLE, "failure", 3), Verdict(INPUT_MODIFIED, "failure", 3),
         Verdict(NA, "no-check", 0), Verdict(NOT_RUN, "no-check", 0))
BY_NAME = {v.name: v for v in TABLE}

VERDICTS = tuple(v.name for v in TABLE)
LEAKS = tuple(v.name for v in TABLE if v.category == "leak")
READ_LEAKS = (NAN_LEAK, INF_LEAK, FINITE_LEAK)      # what compare can find; stray-write is the write guard's
FAILURES = tuple(v.name for v in TABLE if v.category == "failure")     # worst first: error names a failure
NO_CHECK = tuple(v.name for v in TABLE if v.category == "no-check")
CHECKED = (CLEAN,) + LEAKS          # the verdicts of a check that ran
#: a report's verdict (no cell's): no check ran at all; a run that checked nothing fails, it never passes
NO_CHECKS = "no-checks"
NO_CHECKS_EXIT = 3


def category(verdict: str) -> str:
    """'nan-leak' -> 'leak'; ValueError for a name that is not a verdict."""
    if verdict not in BY_NAME:
        raise ValueError(f"verdict: unknown {verdict!r}; one of {', '.join(VERDICTS)}")
    return BY_NAME[verdict].category


def exit_code(verdicts) -> int:
    """The exit code of a run with these verdicts: 3 a failure, else 1 a leak, else 0."""
    return max((BY_NAME[v].exit_code for v in verdicts), default=0)


def counts(verdicts) -> dict:
    """A run's counts, defined once for the command line, the JSON and the reports:
    cells    every verdict (n/a and failures included)
    checks   the cells whose check ran (clean or a leak)
    leaking  the checks that leaked"""
    verdicts = list(verdicts)
    return {"cells": len(verdicts), "checks": sum(v in CHECKED for v in verdicts),
            "leaking": sum(v in LEAKS for v in verdicts)}


def summary(c: dict) -> str:
    """counts() as one line: '36 leaking of 200 checks (264 cells)'."""
    return f"{c['leaking']} leaking of {c['checks']} checks ({c['cells']} cells)"


def verdict_of(c: dict) -> str:
    """Counts of what changed -> the verdict: NaN first, then Inf, then any finite value or token."""
    if c.get("nan"):
        return NAN_LEAK
    if c.get("inf"):
        return INF_LEAK
    if c.get("finite_changed") or c.get("tokens_changed"):
        return FINITE_LEAK
    return CLEAN


# ---------------------------------------------------------------------------- comparing an output
class Comparison(NamedTuple):
    """verdict; counts {"nan", "inf", "finite_changed"} (a generation adds "tokens_changed"): the
    outputs that became NaN, +-Inf, or another finite value; changed: bool mask in the output's
    shape (None where a generation's values did not line up)."""
    verdict: str
    counts: dict
    changed: object


def bits(t):
    """The tensor's raw bits as an integer tensor of the same element size."""
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().contiguous().view(ints[t.element_size()]) if t.element_size() in ints else t


def compare(control, output) -> Comparison:
    """Every output element against its control (see the module docstring for the rule).
    ValueError when the two differ in shape or dtype, TypeError when they are not floating point."""
    import torch

    if control.shape != output.shape or control.dtype != output.dtype:
        raise ValueError(f"poisoned output {list(output.shape)} {output.dtype} does not match the control "
                         f"{list(control.shape)} {control.dtype}")
    if not control.is_floating_point():
        raise TypeError(f"kernel output must be a floating-point tensor, got {control.dtype}")
    c, o = control.float(), output.float()      # float8 has no isnan kernel; float32 holds it exactly
    changed = (bits(control) != bits(output)) & ~(torch.isnan(c) & torch.isnan(o))
    got = {"nan": int((changed & torch.isnan(o)).sum()), "inf": int((changed & torch.isinf(o)).sum()),
           "finite_changed": int((changed & torch.isfinite(o)).sum())}
    return Comparison(verdict_of(got), got, changed)


def tokens_changed(control, tokens) -> int:
    """Generated tokens that differ: per sequence position by position, plus any difference in length.
    control, tokens: the same number of sequences of token ids, in the same order."""
    return sum(x != y for a, b in zip(control, tokens) for x, y in zip(a, b)) + abs(
        sum(map(len, control)) - sum(map(len, tokens)))


def compare_generation(control_tokens, tokens, control_values, values) -> Comparison:
    """An engine's generation against a clean one: tokens (sequences of ids) and values (a flat
    float tensor: logprobs, then logits). Values that do not line up (a different number of steps
    or requests) count as changed, all of them, and at least one token with them."""
    moved = tokens_changed(control_tokens, tokens)
    if control_values.shape != values.shape or control_values.dtype != values.dtype:
        got = {"nan": int(values.float().isnan().sum()), "inf": int(values.float().isinf().sum()),
               "finite_changed": int(values.numel()), "tokens_changed": max(moved, 1)}
        return Comparison(verdict_of(got), got, None)
    c = compare(control_values, values)
    got = {**c.counts, "tokens_changed": moved}
    return Comparison(verdict_of(got), got, c.changed)


def control_problem(first, second=None) -> str:
    """Why no leak verdict can be drawn from a kernel's control outputs ('' when none): the control
    holds NaN or Inf (a poison's NaN could hide behind it), or two control runs differ (by compare's
    rule). An engine's control is two clean generations: any compare_generation change between them."""
    f = first.float()
    nan, inf = int(f.isnan().sum()), int(f.isinf().sum())
    if nan or inf:
        return f"the control output holds {nan} NaN and {inf} Inf of {f.numel()}"
    if second is not None:
        if second.shape != first.shape or second.dtype != first.dtype:
            return (f"two control runs returned {list(first.shape)} {first.dtype} and "
                    f"{list(second.shape)} {second.dtype}")
        differ = int(compare(first, second).changed.sum())
        if differ:
            d = float((second.double() - first.double()).abs().max())
            return (f"two control runs differ in {differ} outputs (max |difference| {d:.3g}): "
                    "the kernel is not deterministic")
    return ""


# ---------------------------------------------------------------------------- the report base
class LeakReport:
    """What every probe's report shares (CanaryReport, ScribbleReport, CrossRequestReport): a subclass
    names its SCHEMA and its cells' verdicts(); the counts, their one line, the exit code, the
    "nothing checked" rule and the JSON header come from here."""

    SCHEMA = ""

    def verdicts(self) -> list:
        raise NotImplementedError

    def exit_verdicts(self) -> list:
        """The verdicts the exit code is drawn from: every cell's (a probe whose exit code answers a
        narrower question, such as cross-request's routes that must stay clean, names fewer)."""
        return self.verdicts()

    def counts(self) -> dict:
        """{"cells", "checks", "leaking"} (counts()): what every surface prints."""
        return counts(self.verdicts())

    def summary(self) -> str:
        return summary(self.counts())

    def nothing_checked(self) -> bool:
        """No cell's check ran (none clean or leaking; no cell at all counts too): NO_CHECKS."""
        return not any(v in CHECKED for v in self.verdicts())

    def exit_code(self) -> int:
        """The largest of exit_verdicts()' exit codes; NO_CHECKS_EXIT (3) instead of 0 when nothing
        was checked (never a pass on nothing)."""
        code = exit_code(self.exit_verdicts())
        return NO_CHECKS_EXIT if code == 0 and self.nothing_checked() else code

    def header(self) -> dict:
        """{"schema", **machine_facts()}: the facts are read once per report, so every document
        written from one report says the same."""
        if "_facts" not in self.__dict__:
            self._facts = machine_facts()
        return {"schema": self.SCHEMA, **self._facts}


def spans(numbers) -> str:
    """Every number, runs written as spans: [40, 41, 42, 45] -> '40-42,45' (a list of head dims or rows
    shown whole, never its first few as if they were all)."""
    out, run = [], []
    for n in sorted(set(numbers)):
        if run and n != run[-1] + 1:
            out.append(run)
            run = []
        run.append(n)
    if run:
        out.append(run)
    return ",".join(f"{x[0]}-{x[-1]}" if len(x) > 1 else str(x[0]) for x in out)

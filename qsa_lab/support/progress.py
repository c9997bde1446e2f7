"""Progress of a run made of counted steps, one line a step: `# [3/24] what (about 12 s left)`.

The commands that run many slow steps (cross-request's poisoned runs, the scribble's generations)
say each one as it starts, on stderr, so the count and the time left show from the first step; the
estimate is the mean time of the steps done so far times the steps left (none before the first
step ends). A total that grows on the way (a leak's confirming re-runs) is told with `add`.
"""
from __future__ import annotations

import sys
import time


class Steps:
    """`step(text)` before each step prints its line to `out` (default: stderr at the time of the
    call); `add(n)` counts n more steps in the total, or `step(text, total)` gives the new total."""

    def __init__(self, total: int, out=None, clock=time.monotonic):
        if not isinstance(total, int) or isinstance(total, bool) or total < 0:
            raise ValueError(f"total: a count of steps (an int >= 0), got {total!r}")
        self.total, self.done, self.out, self.clock = total, 0, out, clock
        self.start = clock()

    def add(self, n: int) -> None:
        self.total += n

    def step(self, text: str, total: int | None = None) -> None:
        if total is not None:
            self.total = total
        self.done += 1
        self.total = max(self.total, self.done)
        left = ""
        if self.done > 1:
            per_step = (self.clock() - self.start) / (self.done - 1)
            left = f" (about {seconds(per_step * (self.total - self.done + 1))} left)"
        print(f"# [{self.done}/{self.total}] {text}{left}", file=self.out or sys.stderr, flush=True)


def seconds(s: float) -> str:
    """A duration as a person reads it: '8 s', '2 min 05 s'."""
    s = round(s)
    return f"{s} s" if s < 60 else f"{s // 60} min {s % 60:02d} s"

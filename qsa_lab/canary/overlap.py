"""Worker processes of the canary without importing torch: how one starts and ends, the
length-prefixed pickles on its pipes, and the --overlap process (`qsa-lab canary` starts it
before it imports torch, so that both imports run at once on two cores).
"""
from __future__ import annotations

import pickle
import subprocess

from qsa_lab.support import processes as procs
from qsa_lab.support.processes import recv, send  # noqa: F401 - the worker's protocol


def _spawn(*args: str) -> subprocess.Popen:
    """python -m qsa_lab.canary.worker [args], its stdin / stdout the request / reply pipes."""
    return procs.spawn("qsa_lab.canary.worker", *args)


_end = procs.end


# -- the slow built-in kernels beside the others ---------------------------------------------------

#: built-in kernels whose first call on the CPU is slow (FlexAttention imports torch._dynamo and
#: traces its operator, ~3 s of a default run): `qsa-lab canary` runs them in a second process
#: when a core is idle, started before it imports torch, while this one runs the other kernels
OVERLAP = ("torch:flex", "torch:flex-paged")
_SPARE = None     # the started process no run has taken yet


class Overlap:
    """The second process (python -m qsa_lab.canary.worker --overlap). It runs the same code
    as this one would (runner._run_kernel, each call in its main thread, unbounded, on fresh
    copies, one torch thread) and sends back every result; if it fails in any way, the run
    calls those kernels here instead, as it does without it."""

    def __init__(self):
        self.proc, self.names, self.used, self.answered = _spawn("--overlap"), [], False, False

    def submit(self, *job) -> list:
        """Send the matrix (case, slots, regions, planes, payloads, dims); -> the names it runs."""
        self.used = True
        try:
            send(self.proc.stdin, ("matrix", list(self.names), *job))
        except (OSError, pickle.PicklingError):
            self.close()       # collect() then answers None: the kernels run here
        return list(self.names)

    def collect(self, bar) -> dict | None:
        """{name: (results, skipped entries)}, updating `bar` per cell; None if the process failed."""
        cells = 0
        while self.proc is not None:
            try:
                msg = recv(self.proc.stdout)
            except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError):
                msg = None
            if msg is None or msg[0] == "error":
                break
            if msg[0] == "done":
                self.answered = True
                return msg[1]
            bar.update(msg[1])
            cells += msg[1]
        bar.update(-cells)     # they run again here
        self.close()
        return None

    def close(self) -> None:
        p, self.proc = self.proc, None
        _end(p, wait=0.5 if self.used else 0)     # an unused one is still importing: kill it


_others_running = procs.others_running


def idle_core() -> bool:
    """Is a core free for the second process (procs.idle_core)?"""
    return procs.idle_core(_others_running())


def start_overlap() -> Overlap | None:
    """Start the second process now; the next run_canary that takes it (take_overlap) uses it."""
    global _SPARE
    close_overlap()
    try:
        _SPARE = Overlap()
    except OSError:
        _SPARE = None
    return _SPARE


def close_overlap() -> None:
    global _SPARE
    spare, _SPARE = _SPARE, None
    if spare is not None:
        spare.close()


def take_overlap(named: list, device) -> Overlap | None:
    """The started process, for a CPU run of named OVERLAP kernels beside others (else None;
    a started one is ended: one run takes it or none)."""
    global _SPARE
    spare, _SPARE = _SPARE, None
    if spare is None:
        return None
    spare.names = [n for n, k in named if isinstance(k, str) and k == n and n in OVERLAP]
    if getattr(device, "type", str(device)) != "cpu" or not spare.names or len(spare.names) == len(named):
        spare.close()
        return None
    return spare

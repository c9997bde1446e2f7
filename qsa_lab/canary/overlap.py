"""Worker processes of the canary without importing torch: how one starts and ends, the
length-prefixed pickles on its pipes, and the --overlap process (`qsa-lab canary` starts it
before it imports torch, so that both imports run at once on two cores).
"""
from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path


def send(stream, obj) -> None:
    blob = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(blob)) + blob)
    stream.flush()


def recv(stream):
    """From a blocking binary stream (the worker side); None at EOF."""
    head = stream.read(8)
    if len(head) < 8:
        return None
    (n,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(n))


def _spawn(*args: str) -> subprocess.Popen:
    """python -m qsa_lab.canary.worker [args], its stdin / stdout the request / reply pipes."""
    import qsa_lab

    env = dict(os.environ)
    root = str(Path(qsa_lab.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return subprocess.Popen([sys.executable, "-m", "qsa_lab.canary.worker", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env)


def _end(p: subprocess.Popen | None, wait: float = 2) -> None:
    if p is None:
        return
    if p.poll() is None:
        try:
            p.stdin.close()          # a worker waiting for a request exits at EOF
            p.wait(timeout=wait)
        except (OSError, subprocess.TimeoutExpired):
            p.kill()
            p.wait()
    for s in (p.stdin, p.stdout):
        try:
            s.close()
        except OSError:
            pass


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


def _others_running() -> float:
    """Processes running or waiting for a core now, this one not counted (Linux: /proc/loadavg;
    elsewhere the load average of the last minute)."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[0]) - 1
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return float("inf")


def idle_core() -> bool:
    """Is a core free for the second process, beside this one and whatever else runs now? On a
    busy machine it would only add its own import of torch to the work."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return _others_running() <= cores - 2


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

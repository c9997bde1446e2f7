"""The canary's slow built-in kernels beside the others: FlexAttention's first call imports
torch._dynamo (on the CPU, where it runs eagerly) or torch._dynamo and inductor and compiles its
kernels (on a GPU), seconds either way, so `qsa-lab canary` runs those kernels (OVERLAP) in a second
process (support.executor.SecondProcess) when a core is idle. The command starts it before it
imports torch (start), so both imports run at once on two cores, and hands it to
run_canary(second=...), which uses it for a run of OVERLAP kernels beside others, on the CPU or a
GPU (take), and otherwise ends it.
"""
from __future__ import annotations

from concurrent.futures import as_completed

from qsa_lab.canary.names import KernelName
from qsa_lab.support import processes as procs
from qsa_lab.support.executor import SecondProcess, start_second

#: built-in kernels whose first call on the CPU is slow
OVERLAP = ("torch:flex", "torch:flex-paged")
#: what the second process imports while the command imports its own
WARM = ("torch.nn.attention.flex_attention", "torch._dynamo", "qsa_lab.canary.runner")


def idle_core() -> bool:
    """Is a core free for the second process (procs.idle_core)?"""
    return procs.idle_core()


def start() -> SecondProcess | None:
    """The second process, started now (a plain-Python caller, before torch is imported)."""
    return start_second(*WARM)


class Overlap:
    """Kernels `names` of one run in the second process. It runs the same code as this one would
    (runner.run_overlap: runner._run_kernel, each call in its main thread, unbounded, on fresh
    copies, one torch thread), one call per kernel; if any fails, the run calls them all here,
    as it does without it."""

    def __init__(self, second: SecondProcess, names: list, device: str = "cpu"):
        self.second, self.names, self.device, self.answered = second, list(names), device, False
        self.futures, self.cells = [], 0

    def submit(self, run, case, slots, regions, planes, payloads, dims) -> list:
        """Send each kernel's matrix to run there (run: runner.run_overlap) -> the names it runs."""
        self.cells = len(regions) * len(planes)
        try:
            self.futures = [self.second.submit(run, [n], case, slots, regions, planes, payloads, dims,
                                               self.device)
                            for n in self.names]
        except Exception:  # noqa: BLE001 - gone, or the case does not pickle: collect() answers None
            self.futures = []
        return list(self.names)

    def collect(self, bar) -> dict | None:
        """{name: (results, skipped entries)}, updating `bar` per kernel; None if a call failed."""
        got, counted = {}, 0
        try:
            if len(self.futures) != len(self.names):
                raise RuntimeError("not sent")
            for f in as_completed(self.futures):
                got.update(f.result())
                bar.update(self.cells)
                counted += self.cells
        except Exception:  # noqa: BLE001 - the kernels run here
            bar.update(-counted)
            self.close()
            return None
        self.answered = True
        return got

    def close(self) -> None:
        self.second.close()


def take(second: SecondProcess | None, named: list, device) -> Overlap | None:
    """An Overlap on `second` for a run of named OVERLAP kernels beside others on `device` (the
    CPU or a CUDA GPU, which the second process then uses as well); else None, and `second` is
    ended (one run takes it or none)."""
    if second is None:
        return None
    names = [n for n, k in named if isinstance(k, KernelName) and k.text == n and n in OVERLAP]
    kind = getattr(device, "type", str(device))
    if kind not in ("cpu", "cuda") or not names or len(names) == len(named):
        second.close()
        return None
    return Overlap(second, names, str(device))

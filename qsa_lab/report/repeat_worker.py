"""`run_repro`'s second process: `python -m qsa_lab.report.repeat_worker` runs the cases' repeats (the
bit-identity check) while the caller runs the cases, when a core is idle.

The caller (repro.run_repro) sends (backend, geometry overrides, cases, torch threads) once. This
process builds, poisons and runs each case again from nothing (its own builds, its own process),
from the last case back: ("start", i) before case i, ("repeat", i, outputs) after it, ("done",)
at the end. The caller, done with the cases, runs the repeats from the first one on, telling this
process ("claim", i) for each; once this process sees a case claimed it stops, so the two meet in
the middle and at most the case each started as they met is run twice. It ignores Ctrl-C (the
caller decides), prints nothing, dies with the caller (procs.die_with_parent) and ends at EOF on
its stdin. If it fails in any way, the caller runs the repeats it has not answered itself.
"""
from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading

from qsa_lab.support import processes as procs


class Repeats:
    """The started second process, seen from the caller (proc: python -m qsa_lab.report.repeat_worker
    unless given). on_repeat(): called for each repeat it answers."""

    def __init__(self, cases, backend: str, overrides, threads: int | None, on_repeat=None,
                 proc: subprocess.Popen | None = None):
        self.proc = proc or procs.spawn("qsa_lab.report.repeat_worker", stderr=subprocess.DEVNULL)
        self.started, self.outputs, self.ok = set(), {}, True
        self.mine = set()            # the repeats the caller claimed
        self.done = False            # it sent all it will run
        self.on_repeat = on_repeat
        self.inbox, self.reader = procs.reader(self.proc.stdout)   # its messages as they come; None: it ended
        self._send((backend, overrides, list(cases), threads))

    def _send(self, msg) -> None:
        self.ok = self.ok and procs.try_send(self.proc.stdin, msg)

    def _take(self, block: bool) -> bool:
        """Handle one message (waiting for it when `block`) -> False when none was there."""
        try:
            msg = self.inbox.get(block)
        except queue.Empty:
            return False
        if isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "start":
            self.started.add(msg[1])
        elif isinstance(msg, tuple) and len(msg) == 3 and msg[0] == "repeat" and isinstance(msg[2], dict):
            self.outputs[msg[1]] = msg[2]
            if self.on_repeat is not None and msg[1] not in self.mine:
                self.on_repeat()
        elif msg == ("done",):
            self.done = True
        else:
            self.ok = False          # ended, failed or garbled: nothing more comes from it
        return True

    def claim(self, i: int) -> bool:
        """Case i's repeat for the caller to run, unless this process has started it."""
        while self._take(block=False):
            pass
        if self.ok and i in self.started:
            return False
        self.mine.add(i)
        self._send(("claim", i))
        return True

    def wait(self, i: int) -> dict | None:
        """The repeat outputs of case i, which it started; None if it failed first."""
        while self.ok and i not in self.outputs:
            self._take(block=True)
        return self.outputs.get(i)

    def close(self) -> None:
        p, self.proc = self.proc, None
        procs.end(p, wait=0)


def main() -> int:
    proto_in, proto_out = procs.worker_pipes()
    job = procs.recv(proto_in)
    if job is None:
        os._exit(0)
    backend, overrides, cases, threads = job
    claimed = set()

    def read_claims():
        while True:
            msg = procs.recv(proto_in)
            if msg is None:     # the caller is done with it: no teardown of torch
                os._exit(0)
            claimed.add(msg[1])

    threading.Thread(target=read_claims, daemon=True).start()
    try:
        import torch

        from qsa_lab.report.repro import run_case

        if threads:
            torch.set_num_threads(threads)
        builds = {}
        for i in reversed(range(len(cases))):
            if i in claimed:
                break
            procs.send(proto_out, ("start", i))
            procs.send(proto_out, ("repeat", i, run_case(cases[i], backend, overrides, builds).outputs))
        procs.send(proto_out, ("done",))
    except BrokenPipeError:
        os._exit(0)
    except Exception:  # noqa: BLE001 - the caller then runs these repeats itself
        import traceback

        procs.send(proto_out, ("error", traceback.format_exc()))
    threading.Event().wait()    # until EOF from the caller
    return 0


if __name__ == "__main__":
    sys.exit(main())

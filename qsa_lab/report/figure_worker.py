"""`qsa-lab repro`'s second process: `python -m qsa_lab.report.figure_worker` renders the figures that need
no repro results (figures.INDEPENDENT: 01, 03, 05) while the command runs the cases.

The command starts it before it imports torch, when a core is idle (procs.idle_core), so both
imports run at once too; once the backend is known it sends ("draw", backend). The process
renders each figure to bytes with the same code the command would run (figures.figure_specs,
export.render_figure) and sends them back ("figure", Rendered) ... ("done",); then, with
("specs", [figures.Spec]), some figures of the results (figures.HANDED) while the command
renders the others. It writes no file: the command writes every figure itself, in its own
order, as without it. It ignores
Ctrl-C (the command decides), prints nothing, and dies with the command (procs.die_with_parent).
If it fails in any way, or answers for another backend, code or machine, the command renders
those figures itself.
"""
from __future__ import annotations

import os
import queue
import subprocess
import sys

from qsa_lab.support import processes as procs

_SPARE = None     # the started process no write_repro_figures has taken yet


class Drawer:
    """The started process (proc: python -m qsa_lab.report.figure_worker unless given)."""

    def __init__(self, proc: subprocess.Popen | None = None):
        self.proc = proc or procs.spawn("qsa_lab.report.figure_worker", stderr=subprocess.DEVNULL)
        self.backend = None
        self.inbox, self.reader = procs.reader(self.proc.stdout)   # its messages as they come; None: it ended

    def _send(self, msg) -> None:
        if self.proc is None or not procs.try_send(self.proc.stdin, msg):
            self.close()

    def request(self, backend: str) -> None:
        """Render figures.INDEPENDENT for `backend`."""
        self._send(("draw", backend))
        self.backend = backend

    def hand(self, specs: list) -> None:
        """Render these figures.Spec too, after those."""
        if specs and self.proc is not None:
            self._send(("specs", specs))

    def collect(self, specs: list, render) -> dict:
        """{name: export.Rendered} of `specs`, the figures asked of it, in its order: its answers
        as they come, while this process renders, from the last one back, those it has not
        answered yet (render(spec)). If it fails in any way, or answers for another commit, GPU
        or version than this process, none of its answers is used: every figure is rendered
        here. Then it is ended."""
        from qsa_lab.plotting.export import META_KEYS, Rendered, full_meta

        here = {k: v for k, v in full_meta(None).items() if k not in ("case", "backend")}
        theirs, mine, ok = {}, {}, self.proc is not None
        left = list(specs)
        while left:
            while ok and left:
                try:
                    msg = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if msg == ("done",):
                    continue
                r = msg[1] if isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "figure" else None
                ok = isinstance(r, Rendered) and set(META_KEYS) <= set(r.meta) and \
                    all(r.meta[k] == v for k, v in here.items())
                if ok:
                    theirs[r.name] = r
                    left = [s for s in left if s.name != r.name]
            if not ok:
                theirs, left = {}, [s for s in specs if s.name not in mine]
            if left:
                s = left.pop()
                mine[s.name] = render(s)
        self.close()
        return {**theirs, **mine}

    def close(self) -> None:
        p, self.proc = self.proc, None
        procs.end(p, wait=0)


def start() -> Drawer | None:
    """Start the second process now (a plain-Python caller, before torch is imported)."""
    global _SPARE
    close()
    try:
        _SPARE = Drawer()
    except OSError:
        _SPARE = None
    return _SPARE


def request(backend: str) -> None:
    """Tell the started process the backend; it renders for the emulation only (a GPU run
    would start CUDA a second time)."""
    if _SPARE is not None:
        if backend == "emulate":
            _SPARE.request(backend)
        else:
            close()


def running() -> int:
    """1 while a started process is waiting to be taken (it renders beside the command), else 0."""
    return int(_SPARE is not None and _SPARE.proc is not None)


def take(backend: str) -> Drawer | None:
    """The started process, asked for `backend`'s figures, for write_repro_figures (else None;
    a started one is ended: one call takes it or none)."""
    global _SPARE
    spare, _SPARE = _SPARE, None
    if spare is None or spare.proc is None:
        return None
    if spare.backend != backend:
        spare.close()
        return None
    return spare


def close() -> None:
    global _SPARE
    spare, _SPARE = _SPARE, None
    if spare is not None:
        spare.close()


def main() -> int:
    proto_in, proto_out = procs.worker_pipes()
    import traceback

    from qsa_lab.report import figures       # matplotlib, torch: imported while the command imports its own

    while True:
        msg = procs.recv(proto_in)
        if msg is None:         # the command is done with it: no teardown of torch and matplotlib
            os._exit(0)
        try:
            specs = figures.figure_specs([], None, msg[1]) if msg[0] == "draw" else msg[1]
            for spec in specs:
                procs.send(proto_out, ("figure", figures.render_spec(spec)))
            procs.send(proto_out, ("done",))
        except BrokenPipeError:
            os._exit(0)
        except Exception:  # noqa: BLE001 - the command then renders these figures itself
            procs.send(proto_out, ("error", traceback.format_exc()))


if __name__ == "__main__":
    sys.exit(main())

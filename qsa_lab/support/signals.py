"""Ctrl-C, SIGTERM and SIGHUP on the command line: at any moment, one line and an exit code.

`install()` runs first thing in `python -m qsa_lab` and in `qsa-lab` (before torch is
imported). Its handler does not raise KeyboardInterrupt: it removes the temporary files that
qsa_lab.support.outputs is writing (registered with `track`), prints one line and ends the process
with os._exit:

    SIGINT (Ctrl-C)  qsa-lab: interrupted             exit 130
    SIGTERM          qsa-lab: terminated (SIGTERM)    exit 143
    SIGHUP           qsa-lab: hung up (SIGHUP)        exit 129

Why not the KeyboardInterrupt Python raises by default: it is raised wherever the main thread
happens to be, and there it can go wrong in three ways. During start-up imports (torch takes
seconds) it escapes as a traceback. Inside a library's `try/except` around an import or in a
`finally` it can be swallowed: the run goes on and exits 0, or later fails on a half-imported
module (numpy without `numpy.void`). And when it is raised while torch's C++ is calling back
into Python, it has to cross C++ frames; where they cannot unwind it (a destructor, a noexcept
function, an extern "C" entry point) the C++ runtime calls std::terminate: "terminate called
after throwing an instance of ...", SIGABRT, exit -6. A handler that never raises has none of
these. A signal that arrives while the main thread is inside one long C++ call is handled when
that call returns (Python runs handlers between bytecodes).

Outside the command line (notebooks, tests, a user's script) nothing is installed and Ctrl-C
raises KeyboardInterrupt as usual; `installed()` restores the previous handlers on exit.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

EXITS = {signal.SIGINT: (130, "interrupted"), signal.SIGTERM: (143, "terminated (SIGTERM)")}
if hasattr(signal, "SIGHUP"):
    EXITS[signal.SIGHUP] = (129, "hung up (SIGHUP)")

_temporaries: set[str] = set()


def track(path) -> None:
    """Remove `path` if a signal ends the process before `untrack(path)`. Call it before the
    file is created, so there is no moment where it exists unregistered."""
    _temporaries.add(os.fspath(path))


def untrack(path) -> None:
    _temporaries.discard(os.fspath(path))


def _cleanup() -> None:
    import shutil

    for path in list(_temporaries):
        with contextlib.suppress(OSError):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)   # a folder being written beside its final name (outputs.writing_folder)
            else:
                os.unlink(path)
    _temporaries.clear()


_held: list | None = None   # signals received inside a Hold, acted on when it ends


class Hold:
    """Outputs published together: from `start()` (the commit point: every temporary written
    whole) until the block ends, a signal is noted instead of ending the process, so the files
    are published all or none. At the end a noted signal ends the process as usual when the block
    failed (its outputs were removed: none published, exit 130); when every file was published it
    is said in one line and the command goes on (all published, exit 0)."""

    def __enter__(self):
        return self

    def start(self) -> None:
        global _held
        _held = []

    def __exit__(self, kind, value, tb):
        global _held
        noted, _held = _held or [], None
        if not noted:
            return False
        code, what = EXITS.get(noted[0], (128 + noted[0], f"signal {noted[0]}"))
        if kind is not None:
            _handler(noted[0], None)
        with contextlib.suppress(OSError):
            os.write(2, f"qsa-lab: {what} while publishing the outputs: every one was written whole; "
                        "going on\n".encode())
        return False


def _handler(signum, frame) -> None:  # noqa: ARG001 - the signal module's signature
    if _held is not None:     # inside a Hold's commit: publish everything first (Hold.__exit__)
        _held.append(signum)
        return
    _cleanup()
    code, what = EXITS.get(signum, (128 + signum, f"signal {signum}"))
    with contextlib.suppress(BaseException):  # stdout may be mid-write (re-entrant flush fails): keep going
        sys.stdout.flush()
    with contextlib.suppress(OSError):
        os.write(2, f"qsa-lab: {what}\n".encode())
    os._exit(code)


def install() -> dict:
    """Install the handler for SIGINT, SIGTERM and SIGHUP -> the previous handlers. A signal
    that is ignored (nohup's SIGHUP) stays ignored. Only the main thread can set handlers;
    elsewhere (a thread calling cli.main) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for signum in EXITS:
        if signal.getsignal(signum) is signal.SIG_IGN:
            continue  # ignored on purpose (nohup, a shell's background job): keep it that way
        previous[signum] = signal.signal(signum, _handler)
    return previous


@contextlib.contextmanager
def installed():
    """install() for the duration of the block, then the previous handlers again."""
    previous = install()
    try:
        yield
    finally:
        for signum, h in previous.items():
            signal.signal(signum, h if h is not None else signal.SIG_DFL)

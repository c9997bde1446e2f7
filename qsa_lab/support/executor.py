"""The one way qsa_lab starts a second process: a spawn executor of one worker (the standard
library's ProcessPoolExecutor), for work that runs beside the caller's (`qsa-lab repro`'s figures
and repeats, the canary's slow built-in kernels, cross-request's largest query-head count). Plain
Python, no torch: a command starts it before it imports torch, so both imports run at once on two
cores.

    second = SecondProcess("qsa_lab.report.figures")   # started now, importing that module
    relay = Relay(second)
    relay.add("a", render, spec_a)                       # sent one at a time, in order ...
    if relay.take("a"): ...                              # ... so the caller can take back one not sent yet
    relay.result("a")                                    # its answer; None if the process failed
    second.close()                                       # killed: never waited for

With spawn the process imports only what the functions it runs need (not even the caller's main
script: _blank_main), never the caller's state. It prints nothing (stdout and stderr to the null
device: answers come back through the executor), ignores Ctrl-C (the caller decides) and, on
Linux, dies with the caller (a signal ends the command with os._exit, which ends no child).
The canary's user-kernel worker is not started here: it must also kill a call on a timeout and
show the kernel's stdout (qsa_lab.canary.execution).
"""
from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import signal
import sys
import threading
import types
from concurrent.futures import Future, ProcessPoolExecutor

from qsa_lab.support.processes import die_with_parent


def _quiet_child(caller: int) -> None:
    """First thing in the second process: nothing it prints reaches the caller's output, Ctrl-C
    is the caller's, and it dies with the caller (pid `caller`), also one gone before this ran."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    if os.getppid() != caller:      # it ended while this process started: nothing to wait for
        os._exit(0)
    # a lock made here (tqdm's, at every tqdm()) is otherwise a named semaphore of the spawn context,
    # which the resource tracker removes after close() kills this process, warning on the caller's
    # stderr; a fork-context lock has no name (this process starts no process of its own)
    with contextlib.suppress(ValueError):
        multiprocessing.set_start_method("fork", force=True)


def import_modules(names) -> None:
    """Import `names` (the slow imports, done while the caller does its own)."""
    for name in names:
        importlib.import_module(name)


def _quiet_tracker() -> None:
    """Start multiprocessing's resource tracker (a helper process the first spawn-context lock
    starts) with the null device for its stderr. It removes the executor's named semaphores when
    this process ends without removing them, as a command ended by a signal does (os._exit), and
    would say so in a warning on the command's stderr, where a signal gets one line."""
    from multiprocessing import resource_tracker

    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        resource_tracker.ensure_running()     # nothing when it runs already
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


@contextlib.contextmanager
def _blank_main():
    """A blank __main__ while the process starts. Spawn runs the caller's main script again in
    the child (as __mp_main__) so that functions defined there can be called: a user's script
    that is not guarded by `if __name__ == "__main__"` would run again, a notebook kernel's
    launcher would load. The functions sent here live in qsa_lab's modules and need none of it."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


class SecondProcess:
    """One worker process, started at once (a spawn ProcessPoolExecutor of one worker), importing
    `warm` modules. submit() as an executor's; close() kills it without waiting."""

    def __init__(self, *warm: str):
        from qsa_lab.support.safepath import children_off_the_current_folder

        with children_off_the_current_folder():   # a received folder's modules never run in them
            _quiet_tracker()
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_quiet_child, initargs=(os.getpid(),))
            with _blank_main():
                self._pool.submit(import_modules, warm)    # the first call starts the process, now
        self.pid = next(iter(self._pool._processes))   # the executor keeps its processes by pid

    def submit(self, fn, *args) -> Future:
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        """Kill the process (a call it runs is not waited for), then end the executor: its thread
        sees the process gone, fails what is left, and releases the queues' semaphores."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        for p in list((pool._processes or {}).values()):
            with contextlib.suppress(OSError, ValueError):
                p.kill()
        pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def start_second(*warm: str) -> SecondProcess | None:
    """A SecondProcess importing `warm`, started now; None where the system cannot start one (the
    caller then runs everything itself)."""
    try:
        return SecondProcess(*warm)
    except OSError:
        return None


class Relay:
    """Calls for the second process, sent one at a time in the order added, so that the caller
    can take back any call not sent yet and run it itself: the two meet in the middle, neither
    runs a call twice, and neither waits for a call the other could have run. If the process
    fails, what is not answered is the caller's (take, or result() None). answered(key): called
    (in the executor's thread) as each call returns."""

    def __init__(self, second: SecondProcess, answered=None):
        self._second, self._lock, self._answered = second, threading.Condition(), answered
        self._left: dict = {}       # key -> (fn, args), not sent yet, in order
        self._sent: dict = {}       # key -> Future
        self._busy = False          # a call is out
        self._failed = False        # the process can take no more

    def add(self, key, fn, *args) -> None:
        with self._lock:
            self._left[key] = (fn, args)
        self._send()

    def _send(self, done: Future | None = None) -> None:
        with self._lock:
            if done is not None:
                self._busy = False
            if self._busy or self._failed or not self._left:
                return
            key = next(iter(self._left))
            fn, args = self._left.pop(key)
            try:
                f = self._second.submit(fn, *args)
            except Exception:  # noqa: BLE001 - broken or closed: the caller runs what is left
                self._failed, self._left[key] = True, (fn, args)
                self._lock.notify_all()
                return
            self._sent[key], self._busy = f, True
            self._lock.notify_all()
        if self._answered is not None:
            f.add_done_callback(lambda f: f.cancelled() or f.exception() or self._answered(key))
        f.add_done_callback(self._send)

    def take(self, key) -> bool:
        """Call `key` back for the caller to run -> False when it was sent already."""
        with self._lock:
            return self._left.pop(key, None) is not None

    def result(self, key, timeout: float | None = None):
        """The answer of call `key` (waiting for it to be sent and answered); None when it failed,
        or was taken back, or will never be sent (the process failed first)."""
        with self._lock:
            self._lock.wait_for(lambda: key not in self._left or self._failed, timeout)
            f = self._sent.get(key)
        if f is None:
            return None
        try:
            return f.result(timeout)
        except Exception:  # noqa: BLE001 - failed, killed, or timed out: the caller runs it
            return None

"""Processes and cores, in plain Python (no torch): whether a core is idle for a second process
(qsa_lab.support.executor starts it), how many torch threads fit the cores free now, and the
pipes of the canary's user-kernel worker (length-prefixed pickles; qsa_lab.canary.execution),
which must also kill a call on a timeout and so is started here, not by the executor.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import selectors
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

#: the longest wait on a worker: a week (a longer one is no timeout, and overflows the thread and select waits)
MAX_WAIT = 7 * 24 * 3600.0


def send(stream, obj) -> None:
    blob = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(blob)) + blob)
    stream.flush()


def recv(stream):
    """From a blocking binary stream; None at EOF."""
    head = stream.read(8)
    if len(head) < 8:
        return None
    (n,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(n))


def read_reply(proc: subprocess.Popen, deadline: float) -> tuple:
    """One length-prefixed pickle from a spawned worker's stdout, waiting until `deadline`
    (time.monotonic()) -> ("msg", obj) | ("timeout", None) | ("eof", returncode)."""
    fd = proc.stdout.fileno()
    buf, need = b"", None
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                return "timeout", None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return "eof", proc.wait()
            buf += chunk
            if need is None and len(buf) >= 8:
                (n,) = struct.unpack("<Q", buf[:8])
                need = 8 + n
            if need is not None and len(buf) >= need:
                return "msg", pickle.loads(buf[8:need])


def spawn(module: str, *args: str, stderr=None, python: str | None = None, pipes: bool = True) -> subprocess.Popen:
    """`module` run as by python -m, with this qsa_lab first on its path and the current folder
    not on it at all (a received folder's torch.py is never imported: support.safepath); its
    stdin / stdout the request / reply pipes (pipes=False: this process's own). `python`: another
    interpreter (the scribble's vLLM environment), default this one."""
    from qsa_lab.support.safepath import RUN_MODULE

    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])   # the folder holding this qsa_lab
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("PYTHONUNBUFFERED", "1")
    pipe = subprocess.PIPE if pipes else None
    return subprocess.Popen([python or sys.executable, "-c", RUN_MODULE.format(module), *args], stdin=pipe,
                            stdout=pipe, stderr=stderr, env=env)


def end(p: subprocess.Popen | None, wait: float = 2) -> None:
    """End a spawned process: EOF on its stdin (a worker waiting for a request exits), killed
    after `wait` seconds (at once with wait=0)."""
    if p is None:
        return
    if p.poll() is None:
        try:
            p.stdin.close()
            p.wait(timeout=wait)
        except (OSError, subprocess.TimeoutExpired):
            p.kill()
            p.wait()
    for s in (p.stdin, p.stdout):
        try:
            s.close()
        except OSError:
            pass


def others_running() -> float:
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


def idle_core(others: float | None = None) -> bool:
    """Is a core free for a second process, beside this one and whatever else runs now
    (`others`: default others_running())? On a busy machine it would only add its own imports
    to the work."""
    return (others_running() if others is None else others) <= cores() - 2


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent goes away (a signal ends the command with
    os._exit, which ends no child); elsewhere nothing."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def threads_set_by_user() -> bool:
    """OMP_NUM_THREADS or MKL_NUM_THREADS is set: torch's thread count is the user's, left as it is."""
    return bool(os.environ.get("OMP_NUM_THREADS") or os.environ.get("MKL_NUM_THREADS"))


def fit_torch_threads(started: int = 0) -> int:
    """Give torch's CPU ops at most one thread per core that no other running process holds, nor
    the `started` second processes this command runs beside itself; at least 1, never more than
    torch's own count. -> the count now in use. OMP_NUM_THREADS or MKL_NUM_THREADS set by the user
    is left as it is. Why: a thread without a core of its own makes every op wait for it at the
    op's end; on a 2-core machine at load 3, `qsa-lab diff decode` took 3.8-4.2 s with torch's 2
    threads and 1.9-2.5 s with 1. Outputs do not depend on the count (no route splits a reduction
    by thread)."""
    import torch

    if threads_set_by_user():
        return torch.get_num_threads()
    free = max(1, cores() - max(others_running(), started))     # others: inf where unknown
    n = int(min(torch.get_num_threads(), free))
    if n != torch.get_num_threads():
        torch.set_num_threads(n)
    return n


@contextlib.contextmanager
def torch_threads(n: int):
    """Torch's CPU ops on `n` threads inside; the previous count restored after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)

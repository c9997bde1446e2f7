"""How the canary calls a kernel so that no kernel can fool or stall the run.

Each call gets fresh copies of every input; after the call each input is compared bit for
bit with what was given (a kernel that edits its pool, block table, seq_lens, q or
selections is caught). The output must be a floating-point tensor of the call's output
shape on the call's device. Anything raised, SystemExit and KeyboardInterrupt included, is
an outcome, never a crash.

    InProcess   Python callables: each call runs in a thread joined with the timeout; a call
                that has not returned by then is reported as timed out (the thread is
                abandoned, its result ignored) and the kernel is not called again. Built-in
                kernels (qsa:, torch:, registered adapters) run in the main thread, unbounded
                (torch.compile and JIT builds expect it)
    Worker      user kernels named `module:function` / `file.py:function`: one subprocess
                per kernel (python -m qsa_lab.canary.worker), reused for all of its calls;
                its stdout goes to stderr, so nothing a kernel prints reaches `--json -`;
                a call past the timeout kills the worker

A real Ctrl-C reaches the main thread (InProcess) or the parent (a Worker ignores SIGINT)
and stops the run.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch

from qsa_lab.analysis.leaks import bits
from qsa_lab.canary.call import KernelSkipped, PagedCall
from qsa_lab.canary.names import FILE, MODULE, KernelName
from qsa_lab.support.loading import LoadError, first_line, import_function
from qsa_lab.support.processes import end as _end, read_reply, recv, send, spawn  # noqa: F401 - recv / send: the worker's protocol
from qsa_lab.model.paged import TENSORS as INPUTS  # the paged call's tensors, declared once

DEFAULT_TIMEOUT = 600.0
LOAD_TIMEOUT_MIN = 120.0     # importing a module (torch, the kernel's own deps) on a loaded machine


@dataclass
class Outcome:
    """One call. kind: ok | error | skipped | timeout | exited."""
    kind: str
    output: torch.Tensor | None = None
    modified: list = field(default_factory=list)
    error: str = ""
    traceback: str = ""

    @property
    def dead(self) -> bool:
        """The kernel cannot be called again (it hung or ended its process)."""
        return self.kind in ("timeout", "exited")


def portable(o: Outcome) -> Outcome:
    """The outcome as the worker sends it: its output as raw bytes and a dtype name (torch cannot
    unpickle a float8 tensor it pickled: the worker's float8 output would end the run)."""
    out = o.output
    if isinstance(out, torch.Tensor) and out.dim() >= 1:
        o.output = (str(out.dtype).removeprefix("torch."), out.contiguous().view(torch.uint8))
    return o


def restored(o: Outcome) -> Outcome:
    """A worker's portable() outcome back as the outcome it made."""
    if isinstance(o.output, tuple):
        dtype, raw = o.output
        o.output = raw.view(getattr(torch, dtype))
    return o


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a.cpu()), bits(b.cpu()))


def call_kernel(fn, inputs: dict, meta: dict, device, memo: dict, interruptible: bool = False) -> Outcome:
    """Run fn once on fresh copies of `inputs` (CPU tensors) on `device`; check its output and
    that no input changed. Never raises, except KeyboardInterrupt when `interruptible` (the
    main thread: that is a real Ctrl-C)."""
    given = {k: inputs[k].to(device, copy=True) for k in INPUTS}
    call = PagedCall(**given, **meta, memo=memo)
    want = (call.rows, call.q_heads, call.out_dim)
    try:
        out = fn(call)
    except KernelSkipped as e:
        return Outcome("skipped", error=str(e))
    except KeyboardInterrupt:
        if interruptible:
            raise
        return Outcome("error", error="raised KeyboardInterrupt", traceback=traceback.format_exc())
    except BaseException as e:  # noqa: BLE001 - SystemExit / KeyboardInterrupt from a kernel are its outcome
        return Outcome("error", error=f"raised {first_line(e)}", traceback=traceback.format_exc())
    modified = [k for k in INPUTS if not same_bits(given[k], inputs[k])]
    if not isinstance(out, torch.Tensor):
        return Outcome("error", modified=modified,
                       error=f"returned {type(out).__name__}, expected a tensor [rows, q_heads, head_dim]")
    if tuple(out.shape) != want:
        return Outcome("error", modified=modified, error=f"returned shape {list(out.shape)}, expected "
                       f"[rows, q_heads, head_dim] = {list(want)}")
    if not out.is_floating_point():
        return Outcome("error", modified=modified, error=f"returned dtype {out.dtype}, expected a float dtype")
    if out.device != torch.device(device) and not (out.device.type == torch.device(device).type == "cuda"):
        return Outcome("error", modified=modified, error=f"returned a tensor on {out.device}, expected {device}")
    return Outcome("ok", output=out.detach().to("cpu", copy=True), modified=modified)


class InProcess:
    """A callable run in this process: in a thread joined with the timeout (`thread`), or in
    the main thread (built-in kernels)."""

    def __init__(self, fn, timeout: float, thread: bool = True):
        self.fn, self.timeout, self.memo, self.dead, self.thread = fn, timeout, {}, None, thread
        self.paged_inputs = getattr(fn, "paged_inputs", None)

    def begin(self) -> None:
        pass

    def load(self) -> None:
        pass

    def call(self, inputs: dict, meta: dict, device) -> Outcome:
        if not self.thread:
            return call_kernel(self.fn, inputs, meta, device, self.memo, interruptible=True)
        box = {}

        def target():
            box["outcome"] = call_kernel(self.fn, inputs, meta, device, self.memo)

        t = threading.Thread(target=target, name="qsa-lab-canary-call", daemon=True)
        t.start()
        t.join(self.timeout)
        if t.is_alive():
            self.dead = f"timed out after {self.timeout:g} s"
            return Outcome("timeout", error=f"timed out after {self.timeout:g} s (the call still runs in a "
                                            "background thread; its result is ignored)")
        return box.get("outcome") or Outcome("error", error="the call ended without an outcome")

    def close(self) -> None:
        pass


# -- a worker process per user kernel -----------------------------------------------------------

class Worker:
    """A user's kernel (canary.names: `module:function` or `file.py:function`) in its own process
    (see the module docstring)."""

    def __init__(self, name: KernelName, timeout: float):
        self.name, self.timeout, self.proc, self.dead = name, timeout, None, None
        self.paged_inputs = self.canary_limits = None

    def _start(self) -> None:
        self.proc = spawn("qsa_lab.canary.worker")

    def _read(self, deadline: float) -> tuple:
        """-> ("msg", obj) | ("timeout", None) | ("eof", returncode)."""
        return read_reply(self.proc, deadline)

    def _send(self, msg):
        """None, or ("eof", returncode) when the worker is gone."""
        try:
            send(self.proc.stdin, msg)
        except (BrokenPipeError, OSError):
            return "eof", self.proc.wait()
        return None

    def _request(self, msg, timeout: float):
        return self._send(msg) or self._read(time.monotonic() + timeout)

    def begin(self) -> None:
        """Start the worker and ask it to import the kernel; load() waits for the answer (the
        workers of one run import at once)."""
        if self.proc is None:
            self._start()
            self._loading = (self._send(("load", self.name, os.getcwd(), [p for p in sys.path if isinstance(p, str)])),
                             time.monotonic() + max(self.timeout, LOAD_TIMEOUT_MIN))

    def load(self) -> None:
        """Import the kernel in the worker; ValueError naming the name's option when it cannot be loaded."""
        self.begin()
        failed, deadline = self._loading
        kind, reply = failed or self._read(deadline)
        if kind == "msg" and reply[0] == "ok":
            self.paged_inputs = reply[1].get("paged_inputs")
            self.canary_limits = reply[1].get("canary_limits")   # what the search may draw (canary.leak_search)
            return
        self.close()
        if kind == "timeout":
            raise self.name.error(f"{self.name.text!r}: importing it did not finish within "
                                  f"{max(self.timeout, LOAD_TIMEOUT_MIN):g} s")
        if kind == "eof":
            raise self.name.error(f"{self.name.text!r}: importing it ended the process (exit code {reply})")
        raise ValueError(reply[1])

    def call(self, inputs: dict, meta: dict, device) -> Outcome:
        if self.proc is None or self.proc.poll() is not None:
            return Outcome("exited", error="the kernel's worker process is gone")
        kind, reply = self._request(("call", inputs, meta, str(device)), self.timeout)
        if kind == "msg":
            return restored(reply)
        if kind == "timeout":
            self.dead = f"timed out after {self.timeout:g} s"
            self.close()
            return Outcome("timeout", error=f"timed out after {self.timeout:g} s (its worker process was killed)")
        self.dead = f"ended its process (exit code {reply})"
        return Outcome("exited", error=f"ended its process (exit code {reply}) instead of returning")

    def close(self) -> None:
        p, self.proc = self.proc, None
        _end(p)


def load_kernel(name: KernelName):
    """A user's kernel (canary.names: FILE 'path/to/file.py:function' or MODULE
    'package.module:function') -> the callable (the file's folder goes first on sys.path, so it
    can import its neighbours). ValueError naming the option the name came from."""
    if name.kind not in (FILE, MODULE):
        raise name.error(f"{name.text!r} is not a module:function / file.py:function")
    try:
        return import_function(name.source, name.function)
    except LoadError as e:
        raise name.error(f"{name.text!r}: {e}") from None

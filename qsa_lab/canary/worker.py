"""One user kernel in its own process (started by the canary: support.processes.spawn, as `python -m
qsa_lab.canary.worker` would run it, but without the current folder on the import path).

Requests and replies are length-prefixed pickles on the worker's original stdin / stdout;
the kernel itself sees stdout redirected to stderr and stdin to /dev/null, ignores Ctrl-C
(the parent stops the run) and dies with its parent where the OS allows.
"""
from __future__ import annotations

import os
import signal
import sys

from qsa_lab.support.processes import die_with_parent
from qsa_lab.support.safepath import take_path


def main() -> int:
    proto_in = os.fdopen(os.dup(0), "rb")
    proto_out = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(2, 1)               # whatever the kernel prints goes to stderr
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()

    from qsa_lab.canary.execution import Outcome, call_kernel, load_kernel, portable, recv, send

    fn, memo = None, {}
    while True:
        msg = recv(proto_in)
        if msg is None:
            return 0
        if msg[0] == "load":
            _, name, cwd, path = msg   # a canary.names.KernelName
            os.chdir(cwd)
            take_path(cwd, path)   # the current folder last: nothing there shadows an installed module
            try:
                fn = load_kernel(name)
                reply = ("ok", {"paged_inputs": getattr(fn, "paged_inputs", None),
                                "canary_limits": getattr(fn, "canary_limits", None)})
            except ValueError as e:
                reply = ("error", str(e))
            send(proto_out, reply)
        elif msg[0] == "call":
            _, inputs, meta, device = msg
            out = call_kernel(fn, inputs, meta, device, memo) if fn is not None else \
                Outcome("error", error="no kernel loaded")
            sys.stdout.flush()
            send(proto_out, portable(out))


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # the canary is done with it: skip the interpreter's teardown (~1 s with torch loaded, and the
    # canary waits for it); a kernel's atexit handlers do not run
    os._exit(code)

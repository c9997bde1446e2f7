"""One user kernel in its own process: `python -m qsa_lab.canary.worker` (started by the canary);
with --overlap, the slow built-in kernels of one run (overlap.Overlap).

Requests and replies are length-prefixed pickles on the worker's original stdin / stdout;
the kernel itself sees stdout redirected to stderr and stdin to /dev/null, ignores Ctrl-C
(the parent stops the run) and dies with its parent where the OS allows.
"""
from __future__ import annotations

import os
import signal
import sys

from qsa_lab.support.processes import die_with_parent


def main() -> int:
    proto_in = os.fdopen(os.dup(0), "rb")
    proto_out = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(2, 1)               # whatever the kernel prints goes to stderr
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()

    from qsa_lab.canary.execution import Outcome, call_kernel, load_kernel, recv, send

    if sys.argv[1:] == ["--overlap"]:
        return _overlap(proto_in, proto_out)
    fn, memo = None, {}
    while True:
        msg = recv(proto_in)
        if msg is None:
            return 0
        if msg[0] == "load":
            _, spec, cwd, path = msg
            os.chdir(cwd)
            sys.path[:0] = [p for p in path if p not in sys.path]
            try:
                fn = load_kernel(spec)
                reply = ("ok", {"paged_inputs": getattr(fn, "paged_inputs", None)})
            except ValueError as e:
                reply = ("error", str(e))
            send(proto_out, reply)
        elif msg[0] == "call":
            _, inputs, meta, device = msg
            out = call_kernel(fn, inputs, meta, device, memo) if fn is not None else \
                Outcome("error", error="no kernel loaded")
            sys.stdout.flush()
            send(proto_out, out)


def _overlap(proto_in, proto_out) -> int:
    """Built-in kernels (overlap.OVERLAP) for one canary run: import what they need while the
    canary's own process starts, then run the matrix it sends and reply with every result."""
    import traceback

    from torch.nn.attention import flex_attention  # noqa: F401 - the slow imports, done ahead
    import torch._dynamo  # noqa: F401

    from qsa_lab.canary.overlap import recv, send
    from qsa_lab.canary.runner import run_overlap

    msg = recv(proto_in)
    if msg is None or msg[0] != "matrix":
        return 0
    try:
        done = run_overlap(*msg[1:], progress=lambda n: send(proto_out, ("progress", n)))
        send(proto_out, ("done", done))
    except Exception:  # noqa: BLE001 - the canary then runs these kernels itself
        send(proto_out, ("error", traceback.format_exc()))
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # the canary is done with it: skip the interpreter's teardown (~1 s with torch loaded, and the
    # canary waits for it); a kernel's atexit handlers do not run
    os._exit(code)

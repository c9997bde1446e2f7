"""One scribble with a user's attention function in its own process: `python -m qsa_lab.scribble.worker`
(started by qsa_lab.scribble.isolated.scribble_attention).

One request and one reply, length-prefixed pickles on the worker's original stdin / stdout; the user's
function sees stdout redirected to stderr and stdin to /dev/null, ignores Ctrl-C (the parent stops
the run) and dies with its parent where the OS allows.
"""
from __future__ import annotations

import os
import signal
import sys
import traceback

from qsa_lab.support.processes import die_with_parent, recv, send
from qsa_lab.support.safepath import take_path


def main() -> int:
    proto_in = os.fdopen(os.dup(0), "rb")
    proto_out = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(2, 1)               # whatever the attention function prints goes to stderr
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()

    msg = recv(proto_in)
    if msg is None or msg[0] != "run":
        return 0
    _, spec, argument, cwd, path, settings, regions, payloads, localise = msg
    os.chdir(cwd)
    take_path(cwd, path)   # the current folder last: nothing there shadows an installed module
    from qsa_lab.support.loading import load_callable

    try:
        fn = load_callable(spec, argument)
    except ValueError as e:
        reply = ("bad", str(e))
    else:
        try:
            from qsa_lab.scribble.check import scribble
            from qsa_lab.scribble.isolated import attention_contract, build_engine

            engine = build_engine(attn=fn, attn_name=spec, **settings)
            breach = attention_contract(engine, spec, argument)     # held to its contract before the matrix
            reply = ("bad", *breach) if breach else ("ok", scribble(engine, regions, payloads, localise_leaks=localise))
        except BaseException as e:  # noqa: BLE001 - the run's failure is its reply, whatever it was
            reply = ("failed", f"{type(e).__name__}: {e}".splitlines()[0] + "\n" + traceback.format_exc(limit=4))
    sys.stdout.flush()
    send(proto_out, reply)
    recv(proto_in)              # the parent closes the pipe when it has the reply
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)      # skip the interpreter's teardown (~1 s with torch loaded); atexit handlers do not run

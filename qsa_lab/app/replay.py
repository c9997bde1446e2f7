"""`qsa-lab replay`: re-run one saved poisoned call of a canary leak report (qsa_lab.canary.replay).

The way to replay inside a folder you received: the `qsa-lab` program's import path starts with
its own folder, never the current one, so nothing lying in the folder (a `shlex.py`, `torch.py`,
`safetensors/` or `qsa_lab/`) is imported. `python -m qsa_lab.canary.replay` would put the current
folder first.

Exit codes: 1 the leak reproduces, 0 it does not, 3 it cannot run or cannot tell here, 2 bad input
(one line naming the argument), 130 interrupted.
"""
from __future__ import annotations

import sys

from qsa_lab.app.args import Failure, UsageError, blame, one_line
from qsa_lab.model.geometry import BACKENDS

#: what the call file's errors say about it, as the command line names it
FLAGS = {"path": "CALL_FILE", "case": "CALL_FILE", "call file": "CALL_FILE", "kernel": "--kernel",
         "backend": "--backend"}


def add_parser(sub, parents=()):
    p = sub.add_parser("replay", parents=list(parents),
                       help="re-run one saved poisoned call of a canary --report and say whether the leak reproduces",
                       description="Runs the kernel on a call file's control call (the poisoned slots zero-filled) "
                                   "and on its poisoned call, compares the outputs bit for bit and prints the NaN / "
                                   "Inf / changed counts and where they sit. Safe inside a folder you received: "
                                   "nothing in the current folder is imported. Exit 1 the leak reproduces, 0 it "
                                   "does not, 3 cannot run or cannot tell here, 2 bad input.")
    p.add_argument("call_file", metavar="CALL_FILE",
                   help="a call file written by qsa-lab canary --report (REPORT/calls/<cell>.safetensors; "
                        "required: no default)")
    p.add_argument("--kernel", metavar="NAME",
                   help="the kernel to run: a built-in name, module:function or file.py:function (e.g. "
                        "kernels/<file>.py:fn inside a report); default: the recorded one when it is a built-in "
                        "(another is never run unnamed)")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="where qsa: and torch: kernels run (default auto)")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    if not args.call_file.strip():
        raise UsageError("CALL_FILE: empty path")
    from qsa_lab.canary.names import parse_kernel
    from qsa_lab.canary.replay import replay, report_lines

    try:
        with blame(FLAGS, "CALL_FILE"):
            kernel = None if args.kernel is None else parse_kernel(args.kernel, "--kernel")
            r = replay(args.call_file, kernel, args.backend)
    except RuntimeError as e:      # the kernel cannot load or run here
        raise Failure(f"replay: {one_line(e)}") from e
    out, err, code = report_lines(r)
    print("\n".join(out))
    if err:
        print(f"qsa-lab: replay: {err}", file=sys.stderr)
    return code

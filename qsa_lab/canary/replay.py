"""Re-run one saved poisoned call (a `--report` call file) and show what reaches the output.

    qsa-lab replay DIR/calls/<cell>.safetensors [--kernel NAME] [--backend B]

Runs the kernel on the control call (the poisoned slots zero-filled) and on the poisoned
call, compares them bit for bit, and prints the NaN / Inf / changed counts with the rows,
heads and dims they sit in. Exit 1: the leak reproduces, 0: it does not (clean), 3: it cannot
run or cannot tell here (the kernel does not load or raised, or the control output holds NaN /
Inf), 2: bad input (not a call file, or a kernel that must be named, below), 130: interrupted.
The same rule as the report's standalone scripts.

A call file is data, often a stranger's: the kernel it records is text to show (every text read
from it reaches the terminal with its control characters escaped). Replay runs a built-in kernel
it names (qsa:, torch:, flashinfer:, vllm:; qsa_lab.canary.names), looked up in qsa_lab's
registry; anything else (module:function, file.py:function) runs only when you name it yourself
with --kernel (or `kernel=` in Python). Without that it runs nothing, prints the recorded name
and the command that would run it, and exits 2.

Run it as `qsa-lab replay` inside a received folder, never as `python -m qsa_lab.canary.replay`:
`python -m` puts the current folder first on the import path, so a `qsa_lab/` folder lying there
would be imported in place of this one (on Python 3.11+ `python -P -m ...` is safe too). Run as a
module anyway, this file takes the current folder off the path before it imports anything else
(qsa_lab.support.safepath), which stops a `shlex.py` or `torch.py` there; an installed qsa_lab's .pth
(qsa_lab.support.installed_only) keeps a `qsa_lab.py` or `qsa_lab/` there from being imported at all.
"""
import sys   # no `from __future__ import` either: it would import a __future__.py lying in the folder

if __name__ == "__main__":      # first, before any other import: see the module docstring
    from qsa_lab.support.safepath import drop_current_folder, refuse_shadowed

    drop_current_folder()
    refuse_shadowed("python -m qsa_lab.canary.replay")

import argparse  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
from pathlib import Path  # noqa: E402

from qsa_lab.canary.names import KernelName, as_kernel_name, parse_kernel  # noqa: E402

#: the option a name read from a call file came from, in its errors
CALL_FILE = "call file"


class KernelNotNamed(ValueError):
    """The call file records a kernel that is not a built-in: replay runs it only when named.
    `suggested`: the name to give (the report's copy of a kernel file, when there is one)."""

    def __init__(self, path, recorded: str, suggested: str | None = None):
        self.recorded = recorded
        self.command = f"qsa-lab replay {shlex.quote(str(path))} --kernel {shlex.quote(suggested or recorded)}"
        super().__init__(f"kernel: the call file records the kernel {show(recorded)}, not a built-in; replay runs "
                         f"code only when you name it: check that kernel, then run: {self.command}")


def show(text: str) -> str:
    """Text from a file as it may appear on a terminal, quoted (control bytes escaped)."""
    return repr(text) if not text.isprintable() else f"'{text}'"


def printable(text) -> str:
    """Text (from a file) with every control character escaped: no escape code, carriage return or
    newline it holds reaches the terminal raw."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def saved_kernel(path, meta: dict) -> KernelName:
    """The kernel a call file records, when replay may run it unnamed: a name qsa_lab looks up
    itself (built-in or registered), never one naming a module or a file to import
    (KernelNotNamed); a name that does not parse is bad input (ValueError naming the call file)."""
    recorded = meta.get("kernel", "")
    name = parse_kernel(recorded, CALL_FILE) if isinstance(recorded, str) and recorded.strip() else None
    if name is None or not name.in_process:
        raise KernelNotNamed(path, str(recorded), report_copy(path, meta))
    return name


#: how a report names its copy of a kernel file (qsa_lab.canary.report): nothing else is suggested
COPY = re.compile(r"kernels/[\w.-]+\.py:[A-Za-z_]\w*")


def report_copy(path, meta: dict) -> str | None:
    """The report's copy of the call's kernel file ('kernels/f.py:fn', beside the calls/ folder
    that holds `path`) as a name that works from the current folder; None where there is none."""
    import os

    copy = meta.get("kernel_copy")
    if not isinstance(copy, str) or not COPY.fullmatch(copy):
        return None
    file, _, function = copy.rpartition(":")
    there = Path(path).resolve().parent.parent / file
    return f"{os.path.relpath(there)}:{function}" if there.is_file() else None


class CannotRun(RuntimeError):
    """The saved call is fine, but its kernel cannot run (or be judged) here: exit 3."""


def replay(path, kernel=None, backend: str = "auto") -> dict:
    """-> {"kernel", "verdict", "recorded", "nan", "inf", "finite_changed", "rows", "heads", "dims",
    "outputs", "device"} for the saved call at `path`. kernel: a name or callable to run; None runs
    the saved one only when it is a built-in (KernelNotNamed, a ValueError, otherwise). A name
    given as a string is parsed here (errors name `kernel`)."""
    import torch

    from qsa_lab.analysis.leaks import compare
    from qsa_lab.canary.calls import kernel_runner, load_call, run_call
    from qsa_lab.canary.kernels import kernel_name
    from qsa_lab.canary.runner import resolve_devices

    name = None if kernel is None else as_kernel_name(kernel, "kernel")
    control, poisoned, meta = load_call(path)
    name = saved_kernel(path, meta) if name is None else name
    qsa = isinstance(name, KernelName) and name.source == "qsa"
    device, qsa_backend, qsa_reason = resolve_devices(backend, control.geometry, qsa)
    if qsa and (control.qsa_unsupported() or qsa_backend is None):
        raise RuntimeError(f"{name} cannot run here: {control.qsa_unsupported() or qsa_reason}")
    try:
        runner = kernel_runner(name, qsa_backend)
    except Exception as e:  # noqa: BLE001 - a kernel that does not load here cannot run: exit 3, not bad input
        raise CannotRun(f"the kernel {kernel_name(name)} cannot be loaded here: {type(e).__name__}: {e}") from None
    try:
        ctrl = run_call(runner, control, device)
        out = run_call(runner, poisoned, device)
    finally:
        runner.close()
    verdict, counts, changed = compare(ctrl, out)
    idx = torch.nonzero(changed)
    where = {k: sorted(set(idx[:, i].tolist())) for i, k in enumerate(("rows", "heads", "dims"))}
    nan = torch.isnan(out.float()) & changed
    return {"kernel": kernel_name(name), "verdict": verdict,
            "recorded": meta.get("verdict", "?"), "region": meta.get("region", "?"),
            "plane": meta.get("plane", "?"), "payload": meta.get("payload", "?"), **counts, **where,
            "outputs": int(out.numel()), "device": str(device),
            "control_nan": int((~torch.isfinite(ctrl.float())).sum()),   # float(): float8 has no isfinite
            "first_nan": torch.nonzero(nan)[0].tolist() if bool(nan.any()) else None}


def report_lines(r: dict) -> tuple[list, str, int]:
    """What replay prints for the result `r` of replay(): (stdout lines, a stderr line or '', exit
    code). Every text read from the call file is escaped (printable)."""
    from qsa_lab.analysis.leaks import CLEAN

    t = {k: printable(r[k]) for k in ("kernel", "region", "plane", "payload", "recorded", "verdict")}
    where = f"rows {r['rows']}, heads {r['heads']}, dims {r['dims'][:16]}{' ...' if len(r['dims']) > 16 else ''}"
    out = [f"replay {t['kernel']} {t['region']}/{t['plane']}/{t['payload']} on {r['device']}: "
           f"control {r['control_nan']} NaN; poisoned {r['nan']} NaN, {r['inf']} Inf, "
           f"{r['finite_changed']} finite changed of {r['outputs']} outputs ({where})",
           f"verdict {t['verdict']} (recorded when saved: {t['recorded']})"]
    if r["nan"] and r.get("first_nan") is not None:
        out.append(f"first NaN at [row, head, dim] {r['first_nan']}")
    if r["control_nan"]:
        return out, "cannot tell: the control output holds NaN", 3
    return out, "", 0 if r["verdict"] == CLEAN else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m qsa_lab.canary.replay", description=__doc__.splitlines()[0],
                                epilog="Inside a folder you received, run `qsa-lab replay` instead (see the module "
                                       "docstring: `python -m` imports from the current folder).")
    p.add_argument("path", help="a call file written by qsa-lab canary --report (DIR/calls/*.safetensors)")
    p.add_argument("--kernel", help="the kernel to run (module:function, file.py:function, or a built-in name); "
                                    "default: the saved one when it is a built-in")
    p.add_argument("--backend", default="auto", choices=("auto", "emulate", "cuda"),
                   help="where qsa: and torch: kernels run (default auto)")
    args = p.parse_args(argv)
    try:
        kernel = None if args.kernel is None else parse_kernel(args.kernel, "--kernel")
        r = replay(args.path, kernel, args.backend)
    except KeyboardInterrupt:
        print("replay: interrupted", file=sys.stderr)
        return 130
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"replay: error: {printable(str(e).splitlines()[0] if str(e) else type(e).__name__)}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a kernel failure is its own exit code
        print(f"replay: {type(e).__name__}: {printable(str(e).splitlines()[0] if str(e) else '')}", file=sys.stderr)
        return 3
    out, err, code = report_lines(r)
    print("\n".join(out))
    if err:
        print(f"replay: {err}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())

"""Re-run one saved poisoned call (a `--report` call file) and show what reaches the output.

    python -m qsa_lab.canary.replay DIR/calls/<cell>.safetensors [--kernel NAME] [--backend B]

Runs the kernel on the control call (the poisoned slots zero-filled) and on the poisoned
call, compares them bit for bit, and prints the NaN / Inf / changed counts with the rows,
heads and dims they sit in. Exit 1: the leak reproduces, 0: it does not (clean), 3: it cannot
run or cannot tell here (the kernel does not load or raised, or the control output holds NaN /
Inf), 2: bad input (not a call file). The same rule as the report's standalone scripts.
"""
from __future__ import annotations

import argparse
import sys


class CannotRun(RuntimeError):
    """The saved call is fine, but its kernel cannot run (or be judged) here: exit 3."""


def replay(path, kernel=None, backend: str = "auto") -> dict:
    """-> {"kernel", "verdict", "recorded", "nan", "inf", "finite_changed", "rows", "heads", "dims",
    "outputs", "device"} for the saved call at `path` (kernel: a name or callable, default the saved one)."""
    import torch

    from qsa_lab.canary.kernels import kernel_name
    from qsa_lab.canary.report import _outputs, kernel_runner, load_call
    from qsa_lab.canary.runner import compare, resolve_devices

    control, poisoned, meta = load_call(path)
    name = meta["kernel"] if kernel is None else kernel
    qsa = isinstance(name, str) and name.startswith("qsa:")
    device, qsa_backend, qsa_reason = resolve_devices(backend, control.geometry, qsa)
    if qsa and (control.qsa_unsupported() or qsa_backend is None):
        raise RuntimeError(f"{name} cannot run here: {control.qsa_unsupported() or qsa_reason}")
    try:
        runner = kernel_runner(name, qsa_backend)
    except Exception as e:  # noqa: BLE001 - a kernel that does not load here cannot run: exit 3, not bad input
        raise CannotRun(f"the kernel {kernel_name(name)} cannot be loaded here: {type(e).__name__}: {e}") from None
    try:
        ctrl = _outputs(runner, control, device)
        out = _outputs(runner, poisoned, device)
    finally:
        runner.close()
    verdict, counts, changed = compare(ctrl, out)
    idx = torch.nonzero(changed)
    where = {k: sorted(set(idx[:, i].tolist())) for i, k in enumerate(("rows", "heads", "dims"))}
    return {"kernel": kernel_name(name), "verdict": verdict,
            "recorded": meta["verdict"], "region": meta["region"], "plane": meta["plane"],
            "payload": meta["payload"], **counts, **where, "outputs": int(out.numel()), "device": str(device),
            "control_nan": int((~torch.isfinite(ctrl)).sum()),
            "first_nan": torch.nonzero(torch.isnan(out) & changed)[0].tolist() if bool((torch.isnan(out) & changed).any())
            else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m qsa_lab.canary.replay", description=__doc__.splitlines()[0])
    p.add_argument("path", help="a call file written by qsa-lab canary --report (DIR/calls/*.safetensors)")
    p.add_argument("--kernel", help="run this kernel instead of the saved one (module:function, file.py:function, "
                                    "or a built-in name)")
    p.add_argument("--backend", default="auto", choices=("auto", "emulate", "cuda"),
                   help="where qsa: and torch: kernels run (default auto)")
    args = p.parse_args(argv)
    try:
        r = replay(args.path, args.kernel, args.backend)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"replay: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a kernel failure is its own exit code
        print(f"replay: {type(e).__name__}: {e}", file=sys.stderr)
        return 3
    where = f"rows {r['rows']}, heads {r['heads']}, dims {r['dims'][:16]}{' ...' if len(r['dims']) > 16 else ''}"
    print(f"replay {r['kernel']} {r['region']}/{r['plane']}/{r['payload']} on {r['device']}: "
          f"control {r['control_nan']} NaN; poisoned {r['nan']} NaN, {r['inf']} Inf, "
          f"{r['finite_changed']} finite changed of {r['outputs']} outputs ({where})")
    print(f"verdict {r['verdict']} (recorded when saved: {r['recorded']})")
    if r["nan"] and r.get("first_nan") is not None:
        print(f"first NaN at [row, head, dim] {r['first_nan']}")
    if r["control_nan"]:
        print("replay: cannot tell: the control output holds NaN", file=sys.stderr)
        return 3
    return 0 if r["verdict"] == "clean" else 1


if __name__ == "__main__":
    sys.exit(main())

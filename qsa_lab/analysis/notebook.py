"""What a notebook's first cell needs before anything heavy loads: the backend it runs on.

    BACKEND = notebook_backend()          # $QSA_LAB_BACKEND, checked

The same contract as the command line (a bad value gets one line naming it), but a notebook falls
back to the emulation instead of exiting, so the cells after it still run. Plain Python: notebook 05
on a machine without a GPU reads the committed timings without ever importing torch.
"""
from __future__ import annotations

import os
import sys

BACKEND_ENV = "QSA_LAB_BACKEND"


def notebook_backend(value: str | None = None, env: str = BACKEND_ENV) -> str:
    """`value` (default: $QSA_LAB_BACKEND, else 'auto') if it is a backend this machine can run:
    'auto', 'emulate', or 'cuda' when the compiled kernels load. Anything else ('bogus', '',
    'CUDA', 'cuda' without a GPU) prints one line saying why and returns 'emulate'."""
    if value is None:
        value = os.environ.get(env, "auto")
    if isinstance(value, str) and value in ("auto", "emulate"):   # no torch needed (notebook 05 on a CPU)
        return value
    from qsa_lab.routes.run import BACKENDS, resolve_backend

    if not isinstance(value, str) or value not in BACKENDS:
        hint = " (names are lower case)" if isinstance(value, str) and value.lower() in BACKENDS else ""
        return _fallback(f"{env}: {value!r} is not one of {', '.join(BACKENDS)}{hint}")
    if value == "cuda":
        try:
            resolve_backend("cuda")
        except ValueError as e:
            return _fallback(f"{env}: {str(e).splitlines()[0]}")
    return value


def _fallback(why: str) -> str:
    print(f"{why}; using the emulation", file=sys.stderr)
    return "emulate"


def results_table(results: dict):
    """A notebook's key_results as a table to read: one row per result, its value as text (a list
    joined by commas, a dict as 'key: value' pairs), not a raw dict. -> pandas DataFrame."""
    import pandas as pd

    def text(v) -> str:
        if isinstance(v, dict):
            return "; ".join(f"{k}: {text(x)}" for k, x in v.items()) or "none"
        if isinstance(v, (list, tuple, set, frozenset)):
            return ", ".join(text(x) for x in v) or "none"
        return str(v)

    return pd.DataFrame({"value": {k: text(v) for k, v in results.items()}}).rename_axis("result")

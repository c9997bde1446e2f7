"""qsa_lab: reproduce, fingerprint and fix the grouped page4 null-block NaN.

Data flow: case -> poison -> plan -> route -> fingerprint -> figure.
"""
# Importing qsa_lab changes nothing in the host interpreter (no atexit handler, no signal handler,
# no thread): the processes qsa_lab owns, the `qsa-lab` program and its second processes, end with
# os._exit once their work is flushed, which skips the interpreter's teardown and its last garbage
# collections (qsa_lab.app.cli._leave; tests/support/test_exit.py).

# The names below are imported on first use (PEP 562; `qsa_lab.build_case` imports torch then):
# `import qsa_lab.app.cli` and `qsa-lab --help` stay free of torch, and `python -m qsa_lab` / `qsa-lab`
# install their signal handling (qsa_lab.support.signals) before the seconds-long torch import.
from .support.lazy import lazy  # noqa: E402 - plain Python, imports nothing
from .support.version import __version__  # noqa: E402, F401 - a constant

_LAZY = {"Case": ".model.case", "Geometry": ".model.geometry", "build_case": ".model.case",
         "apply_poison": ".model.poison", "plan_groups": ".model.plan", "pad_fix": ".model.plan",
         "ROUTES": ".routes.labels", "run_routes": ".routes.run"}

__all__ = ["Case", "Geometry", "build_case", "apply_poison", "plan_groups", "pad_fix", "ROUTES",
           "run_routes", "__version__"]


__getattr__, __dir__ = lazy(__name__, _LAZY)
del lazy

"""Names a package exports but imports on first use (PEP 562), so importing the package imports
nothing heavy: `qsa-lab --help` needs no torch.

    __getattr__, __dir__ = lazy(__name__, {"run_canary": ".runner", "AttentionSpec": "qsa_lab.model.regions"})

No `from __future__ import`: this module is imported by the package face, before `python -m
qsa_lab...` can take the current folder off the import path (support.safepath), so it imports only
what Python has loaded at start-up.
"""
import importlib
import sys


def lazy(package: str, names: dict[str, str]):
    """(__getattr__, __dir__) for `package`: each of `names` is taken from its module (relative to
    the package, or absolute) when first asked for, then kept in the package's namespace."""
    def __getattr__(name):
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(names[name], package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__():
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__

"""A user's function named on the command line, `package.module:function` or `path/to/file.py:function`,
imported in the process that runs it (the canary's and the scribble's worker processes). Plain Python.

    fn = load_callable("my_attn.py:attention", "--attn")     # ValueError naming --attn when it cannot load
    fn = import_function("my_attn.py", "attention")          # LoadError with the problem alone
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path


class LoadError(ValueError):
    """Why a function could not be imported; the message names no option (the caller adds it)."""


def first_line(e: BaseException) -> str:
    """'Type: first line of the message' (SystemExit: its code)."""
    if isinstance(e, SystemExit):
        return f"SystemExit: {e.code!r}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ").rstrip()


def import_function(source: str, function: str):
    """source 'path/to/file.py' or 'package.module' -> its callable `function` (a file's folder goes first
    on sys.path, so it can import its neighbours). LoadError: no file, cannot import, no such callable."""
    try:
        if source.endswith(".py"):
            path = Path(source).resolve()
            if not path.is_file():
                raise LoadError(f"no file {source}")
            folder = str(path.parent)
            if folder not in sys.path:
                sys.path.insert(0, folder)
            mspec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(mspec)
            sys.modules.setdefault(path.stem, module)
            mspec.loader.exec_module(module)
        else:
            module = importlib.import_module(source)
    except LoadError:
        raise
    except BaseException as e:  # noqa: BLE001 - a module that fails (or exits) on import is bad input
        raise LoadError(f"cannot import {source!r} ({first_line(e)})") from None
    fn = getattr(module, function, None)
    if not callable(fn):
        raise LoadError(f"{source} has no callable {function!r}")
    return fn


def load_callable(spec: str, argument: str):
    """'package.module:function' or 'path/to/file.py:function' -> the callable. ValueError naming `argument`."""
    source, _, function = spec.rpartition(":")
    if not source or not function:
        raise ValueError(f"{argument}: {spec!r} is not module:function nor file.py:function")
    try:
        return import_function(source, function)
    except LoadError as e:
        raise ValueError(f"{argument}: {spec!r}: {e}") from None

"""A user's function named on the command line, `package.module:function` or `path/to/file.py:function`,
imported in the process that runs it (the canary's and the scribble's worker processes). Plain Python.

    fn = load_callable("my_attn.py:attention", "--attn")     # ValueError naming --attn when it cannot load
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path


def first_line(e: BaseException) -> str:
    """'Type: first line of the message' (SystemExit: its code)."""
    if isinstance(e, SystemExit):
        return f"SystemExit: {e.code!r}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ").rstrip()


def load_callable(spec: str, argument: str):
    """'package.module:function' or 'path/to/file.py:function' -> the callable (the file's folder goes
    first on sys.path, so it can import its neighbours). ValueError naming `argument`."""
    mod_name, _, fn_name = spec.rpartition(":")
    if not mod_name or not fn_name:
        raise ValueError(f"{argument}: {spec!r} is not module:function nor file.py:function")
    try:
        if mod_name.endswith(".py"):
            path = Path(mod_name).resolve()
            if not path.is_file():
                raise ValueError(f"{argument}: {spec!r}: no file {mod_name}")
            folder = str(path.parent)
            if folder not in sys.path:
                sys.path.insert(0, folder)
            mspec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(mspec)
            sys.modules.setdefault(path.stem, module)
            mspec.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except ValueError:
        raise
    except BaseException as e:  # noqa: BLE001 - a module that fails (or exits) on import is bad input
        raise ValueError(f"{argument}: {spec!r}: cannot import {mod_name!r} ({first_line(e)})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"{argument}: {spec!r}: {mod_name} has no callable {fn_name!r}")
    return fn

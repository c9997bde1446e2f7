"""A user's function named on the command line, `package.module:function` or `path/to/file.py:function`:
the grammar of such a name, once (the canary's kernel names and the scribble's --attn both read it
here), and the import, in the process that runs it (the canary's and the scribble's worker
processes). Plain Python.

    user_function_kind("my_attn.py:attention")               # FILE; MODULE for 'pkg.mod:fn'; None: neither form
    parse_function_name("my_attn.py:attention")              # (FILE, 'my_attn.py', 'attention'), or FunctionNameError
    fn = load_callable("my_attn.py:attention", "--attn")     # ValueError naming --attn when it cannot load
    fn = import_function("my_attn.py", "attention")          # LoadError with the problem alone
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path


#: the two forms of a user's function name
FILE, MODULE = "file", "module"
NOT_A_FUNCTION_NAME = "is not file.py:function nor module:function"


class LoadError(ValueError):
    """Why a function could not be imported; the message names no option (the caller adds it)."""


class FunctionNameError(LoadError):
    """A name that is not `package.module:function` nor `path/to/file.py:function`; `shape_ok`: it has
    the shape source:function (a bad module or function name), else not even that."""

    def __init__(self, problem: str, shape_ok: bool):
        super().__init__(problem)
        self.shape_ok = shape_ok


def user_function_kind(text) -> str | None:
    """FILE for 'path/to/file.py:function', MODULE for 'package.module:function', None for anything else
    (a built-in or implementation name such as paged|eager, a hub kernel 'org/repo:kernel', 'file.py');
    the function part is not checked here (parse_function_name does)."""
    source, sep, function = text.strip().rpartition(":") if isinstance(text, str) else ("", "", "")
    if not (sep and source and function):
        return None
    if source.endswith(".py"):
        return FILE
    return MODULE if all(p.isidentifier() for p in source.split(".")) else None


def parse_function_name(text) -> tuple[str, str, str]:
    """'path/to/file.py:function' or 'package.module:function' -> (FILE or MODULE, source, function);
    FunctionNameError with the problem (naming no option) for anything else."""
    source, _, function = text.strip().rpartition(":") if isinstance(text, str) else ("", "", "")
    if not source or not function:
        raise FunctionNameError(f"{text!r} {NOT_A_FUNCTION_NAME}", shape_ok=False)
    if not function.isidentifier():
        raise FunctionNameError(f"{text!r}: {function!r} is not a function name", shape_ok=True)
    kind = user_function_kind(text)
    if kind is None:
        raise FunctionNameError(f"{text!r}: {source!r} is neither a module (package.module) nor a file.py",
                                shape_ok=True)
    return kind, source, function


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
    try:
        _, source, function = parse_function_name(spec)
    except FunctionNameError as e:
        raise ValueError(f"{argument}: {e}") from None
    try:
        return import_function(source, function)
    except LoadError as e:
        raise ValueError(f"{argument}: {spec!r}: {e}") from None

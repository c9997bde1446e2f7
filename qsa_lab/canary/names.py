"""The canary's kernel names, parsed once where they enter (the command line, the Python API,
a call file, the pytest marker) into a `KernelName` that every later step takes.

    qsa:<route>            built-in: a qsa_lab route by its name in routes.labels
    torch:<kernel>         built-in: PyTorch SDPA / FlexAttention (canary.kernels)
    flashinfer:<kernel>    third-party adapter (canary.adapters), run in this process
    vllm:<kernel>
    <library>:<kernel>     a name another module registered (canary.kernels.register_kernel)
    path/to/file.py:fn     a user's file, imported in a worker process
    package.module:fn      a user's module, imported in a worker process
                           (these two forms: qsa_lab.support.loading's grammar, which the
                           scribble's --attn reads too)

A name whose prefix is a built-in or third-party one is looked up, never imported: only the
user forms name code to import, and a name read from a file (a call file) runs only when the
user names it again (canary.replay). Each record keeps the option it came from, so an error
about it names that option. Plain Python, no torch: the command line parses names before
torch loads.
"""
from __future__ import annotations

from dataclasses import dataclass

from qsa_lab.routes.labels import ROUTES, was_renamed
from qsa_lab.support.loading import FILE, MODULE  # noqa: F401 - a user's function's two kinds, kinds of a name here
from qsa_lab.support.loading import FunctionNameError, parse_function_name

#: the kinds of a name (FILE and MODULE: a user's function, support.loading's two forms)
BUILTIN, ADAPTER = "built-in", "adapter"
#: the prefixes of the kernels qsa_lab runs itself, listed once, with their kind
PREFIXES = {"qsa": BUILTIN, "torch": BUILTIN, "flashinfer": ADAPTER, "vllm": ADAPTER}
#: names other modules add (canary.kernels.register_kernel): name -> fn(PagedCall)
REGISTERED: dict = {}


class KernelNameError(ValueError):
    """A bad kernel name: '<option>: <problem>'."""

    def __init__(self, option: str, problem: str):
        self.option, self.problem = option, problem
        super().__init__(f"{option}: {problem}")


@dataclass(frozen=True)
class KernelName:
    """One kernel name, parsed. kind: BUILTIN (qsa:, torch:), ADAPTER (flashinfer:, vllm:, a
    registered name), FILE or MODULE (a user's kernel). source: the prefix, the file or the
    module; function: the route, kernel or function after the last ':'. option: where the name
    came from ('--kernels', '--kernel', 'kernels' of the API, 'call file', ...)."""
    text: str
    kind: str
    source: str
    function: str
    option: str = "kernels"

    def __str__(self) -> str:
        return self.text

    @property
    def in_process(self) -> bool:
        """qsa_lab looks it up and runs it in this process (never imports a module it names)."""
        return self.kind in (BUILTIN, ADAPTER)

    def error(self, problem: str) -> KernelNameError:
        """The error to raise about this name, naming the option it came from."""
        return KernelNameError(self.option, problem)


def parse_kernel(text, option: str = "kernels", registering: bool = False) -> KernelName:
    """A kernel name -> KernelName; KernelNameError (a ValueError naming `option`) for a bad
    one, TypeError for a value that is not a string. registering: read a name outside the
    built-in prefixes as a registered one (register_kernel's check)."""
    if not isinstance(text, str):
        raise TypeError(f"{option}: expected a kernel name, got {type(text).__name__}")
    text = text.strip()
    if not text:
        raise KernelNameError(option, "an empty kernel name")
    prefix, _, rest = text.partition(":")
    kind = PREFIXES.get(prefix)
    if kind is None and (registering or text in REGISTERED):
        kind = ADAPTER
    if prefix == "qsa":
        _check_route(rest, option)
    if kind:
        return KernelName(text, kind, prefix, rest, option)
    try:
        form, source, function = parse_function_name(text)
    except FunctionNameError as e:
        raise KernelNameError(option, str(e) if e.shape_ok else
                              f"{text!r} is not a known kernel nor module:function / file.py:function") from None
    return KernelName(text, form, source, function, option)


def _check_route(route: str, option: str) -> None:
    """A qsa route by its name now; an earlier spelling is refused naming the new one."""
    renamed = was_renamed(route, prefix="qsa:")
    if renamed:
        raise KernelNameError(option, renamed)
    if route not in ROUTES:
        raise KernelNameError(option, f"unknown qsa route {route!r}; choose from {ROUTES}")


def as_kernel_name(kernel, option: str = "kernels"):
    """A KernelName as it is, a string parsed (`option` recorded), a callable as it is."""
    if isinstance(kernel, KernelName) or callable(kernel):
        return kernel
    return parse_kernel(kernel, option)


def check_registrable(name) -> None:
    """register_kernel's rule: 'library:kernel', the library not a built-in prefix."""
    try:
        parsed = parse_kernel(name, "name", registering=True)
    except (TypeError, ValueError):
        parsed = None
    if parsed is None or parsed.kind != ADAPTER or not parsed.source or not parsed.function or parsed.text != name:
        builtin = ", ".join(f"{p}:" for p, kind in PREFIXES.items() if kind == BUILTIN)
        raise ValueError(f"name: expected 'library:kernel' outside {builtin}, got {name!r}")

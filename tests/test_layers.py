"""The package's house rules, read from the source: layers import only downward, and no module
imports another in a circle (imports inside functions count: they are dependencies too).

The layer order is declared here once. A folder of qsa_lab is one layer; modules of one layer
may import each other (without a circle), a layer may import any layer below it, never one
beside or above it.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "qsa_lab"

#: bottom to top; names on one line are side by side (neither imports the other)
LAYERS = [
    ("support",),
    ("model",),
    ("routes",),
    ("analysis",),
    ("plotting",),
    ("widgets", "report", "canary", "scribble"),   # siblings over analysis/leaks: the scribble imports no canary
    ("app",),
    ("__main__", "__init__", "fp8"),   # the face: lazy names, `python -m qsa_lab`, the fp8 codecs' public name
]
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}


def module_name(path: Path) -> str:
    """'.../qsa_lab/model/case.py' -> 'qsa_lab.model.case'; a package's __init__.py -> the package
    ('qsa_lab.model', and 'qsa_lab' for the face)."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer_of(module: str) -> str:
    """'qsa_lab.model.case' -> 'model'; 'qsa_lab.widgets' -> 'widgets'; 'qsa_lab' -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports_of(path: Path, modules: set[str], source: str | None = None) -> set[str]:
    """The qsa_lab modules `path` imports anywhere in its body (resolved to a module that exists).
    `from P import name` depends on the module P.name when there is one, else on P (a name P
    defines): `from qsa_lab import __version__` is an import of the face. `source` stands in for
    the file's text (tests of this reader)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source, str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:   # an attribute of a module -> that module
                t = t.rpartition(".")[0]
            if t and t != me:
                found.add(t)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {m: imports_of(p, set(files)) for m, p in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def wrong_way(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for m, deps in sorted(graph.items()):
        for d in sorted(deps):
            a, b = layer_of(m), layer_of(d)
            if a == b:
                continue
            if a not in LEVEL or b not in LEVEL:
                bad.append(f"{m} -> {d}: {a if a not in LEVEL else b} is in no layer")
            elif LEVEL[b] >= LEVEL[a]:
                bad.append(f"{m} ({a}) -> {d} ({b}): {'beside' if LEVEL[a] == LEVEL[b] else 'up'}")
    return bad


def test_every_folder_is_a_layer():
    names = {layer_of(module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert names <= set(LEVEL), f"modules outside every layer: {sorted(names - set(LEVEL))}"


def test_no_circle():
    assert circles(import_graph()) == []


def test_imports_go_down_only():
    assert wrong_way(import_graph()) == []


@pytest.mark.parametrize("bad, expect", [
    ({"qsa_lab.model.case": {"qsa_lab.routes.run"}}, "up"),
    ({"qsa_lab.report.figures": {"qsa_lab.widgets"}}, "beside"),
    ({"qsa_lab.canary.runner": {"qsa_lab"}}, "up"),
])
def test_the_checks_see_a_wrong_import(bad, expect):
    """The two checks are not vacuous: an upward and a sideways import are named, a circle found."""
    assert expect in wrong_way(bad)[0]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_an_import_of_the_face_is_seen():
    """The face is a module like the others: a name taken from it is an upward import, a
    submodule taken through it is an import of that submodule only."""
    modules = set(import_graph())
    assert "qsa_lab" in modules
    text = "from qsa_lab import __version__\nfrom qsa_lab import fp8\nfrom ..model import case\n"
    assert imports_of(PACKAGE / "canary" / "runner.py", modules, text) == {"qsa_lab", "qsa_lab.fp8", "qsa_lab.model.case"}
    assert "up" in wrong_way({"qsa_lab.canary.runner": imports_of(PACKAGE / "canary" / "runner.py", modules, text)})[0]

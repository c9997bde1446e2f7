"""One vocabulary for every probe: each verdict name (analysis.leaks' verdicts and its report verdict
NO_CHECKS) is written as a string literal in qsa_lab/analysis/leaks.py only; every other module of
the package (the canary, the scribble, cross-request, the command line) imports the names.

Three names are also ordinary words of other vocabularies: 'error' names the error fields and the
outcomes of calls and processes, 'clean' and 'n/a' could name a state or a missing value. Those
three are flagged where the code uses them as a verdict: beside a name that says verdict (an
argument, a dict key, a comparison, an assignment, a function's result) or in the verdict field
of a class that has one (a dataclass or NamedTuple with a `verdict` field, called positionally).
Every other verdict name is flagged wherever it is written.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from qsa_lab.analysis import leaks

PACKAGE = Path(leaks.__file__).resolve().parents[1]
NAMES = frozenset(leaks.VERDICTS + (leaks.NO_CHECKS,))
WORDS = frozenset({leaks.ERROR, leaks.CLEAN, leaks.NA})       # also words of other vocabularies


def _says_verdict(node) -> bool:
    """An expression that names a verdict: `verdict`, `r.verdict`, `r["verdict"]`, `worst_verdict`..."""
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and "verdict" in n.id.lower():
            return True
        if isinstance(n, ast.Attribute) and "verdict" in n.attr.lower():
            return True
        if isinstance(n, ast.Constant) and n.value == "verdict":
            return True
    return False


def _values(node):
    """The string constants an expression can evaluate to: itself, a tuple / list / set of them,
    either branch of `a if c else b`, either side of `a or b`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node
    elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        for e in node.elts:
            yield from _values(e)
    elif isinstance(node, ast.IfExp):
        yield from _values(node.body)
        yield from _values(node.orelse)
    elif isinstance(node, ast.BoolOp):
        for v in node.values:
            yield from _values(v)


def verdict_fields(trees) -> dict:
    """{class name: position of its `verdict` field} over every class whose annotated fields
    (a dataclass's, a NamedTuple's) include one."""
    out = {}
    for tree in trees:
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            fields = [s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                      and "ClassVar" not in ast.unparse(s.annotation)]
            if "verdict" in fields:
                out[cls.name] = fields.index("verdict")
    return out


def in_verdict_position(tree, fields: dict) -> set:
    """The string constants of `tree` that the code uses as a verdict."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg and "verdict" in node.arg.lower():
            found.update(_values(node.value))
        elif isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and k.value == "verdict":
                    found.update(_values(v))
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_says_verdict(s) for s in sides):
                for s in sides:
                    found.update(_values(s))
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if node.value is not None and any(_says_verdict(t) for t in targets):
                found.update(_values(node.value))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args
            for a, d in zip(args[len(args) - len(node.args.defaults):], node.args.defaults):
                if "verdict" in a.arg.lower():
                    found.update(_values(d))
            for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults):
                if d is not None and "verdict" in a.arg.lower():
                    found.update(_values(d))
            if "verdict" in node.name.lower():
                for r in ast.walk(node):
                    if isinstance(r, ast.Return) and r.value is not None:
                        found.update(_values(r.value))
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in fields and len(node.args) > fields[name]:
                found.update(_values(node.args[fields[name]]))
    return found


def verdict_literals(tree, fields: dict) -> list:
    """(line, name) of each verdict name `tree` writes as a literal where it should import it."""
    used = {id(n) for n in in_verdict_position(tree, fields)}
    return sorted((n.lineno, n.value) for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and n.value in NAMES and (n.value not in WORDS or id(n) in used))


def test_the_names_checked():
    assert "no-checks" in NAMES and {"nan-leak", "stray-write", "not-run", "error", "n/a"} <= NAMES
    assert NAMES == set(leaks.VERDICTS) | {leaks.NO_CHECKS}


@pytest.mark.parametrize("code, found", [
    ('r = Result(verdict="nan-leak")', [(1, "nan-leak")]),
    ('x = "input-modified"', [(1, "input-modified")]),                  # no word of another vocabulary
    ('r = Result(verdict="error")', [(1, "error")]),
    ('d = {"kernel": k, "verdict": "no-checks"}', [(1, "no-checks")]),
    ('ok = r.verdict in ("clean", "n/a")', [(1, "clean"), (1, "n/a")]),
    ('if cell["verdict"] != "error":\n    pass', [(1, "error")]),
    ('verdict = "clean" if a else "error"', [(1, "clean"), (1, "error")]),
    ('def f(verdict="n/a"):\n    pass', [(1, "n/a")]),
    ('def the_verdict(c):\n    return "clean"', [(2, "clean")]),
    ('class Cell:\n    check: str\n    verdict: str\nc = Cell("read", "error", error="boom")', [(4, "error")]),
    # other vocabularies' 'error', 'clean' and 'n/a' are not verdicts
    ('o = Outcome("error", error="raised")', []),
    ('out = {"error": msg, "build_error": first}', []),
    ('reply = ("error", str(e))', []),
    ('for k in ("note", "error", "traceback"):\n    pass', []),
    ('got = "n/a" if measured is None else measured', []),
    ('if o.kind == "error":\n    pass', []),
])
def test_the_scan_finds_verdict_literals_only(code, found):
    tree = ast.parse(code)
    assert verdict_literals(tree, verdict_fields([tree])) == found


def test_each_verdict_name_is_a_literal_in_analysis_leaks_only():
    trees = {p.relative_to(PACKAGE).as_posix(): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}
    fields = verdict_fields(trees.values())
    assert "LeakResult" in fields                               # the canary's result: its verdict is the 5th field
    found = {rel: lits for rel, tree in trees.items() if rel != "analysis/leaks.py"
             and (lits := verdict_literals(tree, fields))}
    assert found == {}, f"verdict names written outside analysis/leaks.py (import them from there): {found}"
    assert NAMES <= {n.value for n in ast.walk(trees["analysis/leaks.py"]) if isinstance(n, ast.Constant)}

"""The one vocabulary of routes and fixes: every surface (command-line tables, repro, the
playground, figure titles, export file names, notebooks, canary kernel names) takes its names
from here. Plain Python, no torch: the command line checks names before torch loads.

    reference              float64 attention over each row's attended tokens
    xqa                    the row-wise XQA page4 route (never reads the null block)
    grouped                the grouped page4 route as upstream shipped it (the bug)
    grouped+kernel_fix     fix A: the kernel zeroes every panel row no query attends (upstream)
    grouped+pad_fix        fix B: the planner's padding repointed at a real microblock (upstream)
    grouped+both_fixes     fixes A and B together (upstream's default)
    grouped+masked_load    fix C: the panel loader never reads an unattended row (this project's own)

The letters A, B, C are an abbreviation shown beside a name (`label`), never a name of their own.
"""
from __future__ import annotations

#: fix -> its letter (shown beside the name, never instead of it)
FIXES = {"kernel_fix": "A", "pad_fix": "B", "both_fixes": "A+B", "masked_load": "C"}

#: grouped route -> (kernel variant, pad-fix applied to the plan)
GROUPED = {
    "grouped": ("unfixed", False),
    "grouped+kernel_fix": ("kernel_fix", False),
    "grouped+pad_fix": ("unfixed", True),
    "grouped+both_fixes": ("kernel_fix", True),
    "grouped+masked_load": ("masked_load", False),
}
ROUTES = ("reference", "xqa") + tuple(GROUPED)
#: the grouped routes that apply a fix
FIXED_ROUTES = tuple(r for r in GROUPED if r != "grouped")

#: the narrowest column heading of each route (text tables): the fixes by their letters
SHORT = {"reference": "ref", "xqa": "xqa", "grouped": "grp",
         **{f"grouped+{fix}": letter for fix, letter in FIXES.items()}}


def fix_of(route: str) -> str | None:
    """'grouped+pad_fix' -> 'pad_fix'; None for a route that applies no fix."""
    return route.split("+", 1)[1] if route.startswith("grouped+") else None


def label(route: str) -> str:
    """The name with its letter beside it: 'grouped+kernel_fix (A)'; other routes as they are."""
    fix = fix_of(route)
    return f"{route} ({FIXES[fix]})" if fix in FIXES else route


def fix_label(fix: str) -> str:
    """'kernel_fix' -> 'kernel_fix (A)'; 'unfixed' as it is."""
    return f"{fix} ({FIXES[fix]})" if fix in FIXES else fix


def short_routes(names: str) -> str:
    """'grouped,grouped+pad_fix' -> 'grp,B' (a comma-separated list of routes, shortened)."""
    return ",".join(SHORT.get(r, r) for r in names.split(",") if r) or "none"


def slug(names) -> str:
    """Names of fixes or routes joined for a file name: ('kernel_fix', 'pad_fix') -> 'kernel_fix+pad_fix',
    () -> 'none'. The names themselves, never their letters: a file says what a table says."""
    unknown = [n for n in names if n not in FIXES and n not in ROUTES]
    if unknown:
        raise ValueError(f"slug: {unknown} are not names of labels.FIXES or labels.ROUTES")
    return "+".join(names) or "none"

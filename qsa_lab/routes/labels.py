"""The one vocabulary of routes and fixes: every surface (command-line tables, repro, the
playground, figure titles, export file names, notebooks, canary kernel names) takes its names
from here. Plain Python, no torch: the command line checks names before torch loads.

    reference              float64 attention over each row's attended tokens
    xqa                    the row-wise XQA page4 route (never reads the null block)
    grouped                the grouped page4 route as upstream shipped it (the bug)
    grouped+kernel_fix     (A) the kernel zeroes every panel row no query attends (upstream)
    grouped+pad_fix        (B) the planner's padding repointed at a real microblock (upstream)
    grouped+both_fixes     (A+B) kernel_fix and pad_fix together (upstream's default)
    grouped+masked_load    (C) the panel loader never reads an unattended row (this project's own)
    grouped+request_groups (R) groups never span requests: request-aligned groups (planner and
                           host split), each request's remainder rows to XQA, on kernel_fix's
                           kernel (this project's complete fix for the cross-request leak)
    grouped+finite_pv      (F) the kernel keeps mixed groups but multiplies P by V's finite values
                           only, then gives each row the non-finite result of exactly the values
                           it attends (IEEE: NaN, +Inf or -Inf); no other row sees them (this
                           project's in-kernel complete fix)

kernel_fix (A) zeroes a panel row only when NO row of the group attends it, and pad_fix (B)
repoints padding at the group's first real microblock: in a group whose 8 rows belong to
several requests, a non-finite V value that one request attends still reaches the other
requests' rows through P = 0 (0 * NaN = NaN). request_groups (R) and finite_pv (F) close that.

The letters A, B, C, R, F are an abbreviation shown beside a name (`label`), never a name of their own.
Earlier spellings (fix A, fixA, the bench's `both`, ...) are not names: `renamed_route` and
`renamed_fix` say what such a spelling is called now, for an error that names it. A JSON document
an earlier version wrote (keys such as `fix_a_vs_report`) is read through `current_keys`.
"""
from __future__ import annotations

#: fix -> its letter (shown beside the name, never instead of it)
FIXES = {"kernel_fix": "A", "pad_fix": "B", "both_fixes": "A+B", "masked_load": "C", "request_groups": "R",
         "finite_pv": "F"}

#: grouped route -> (kernel variant, pad-fix applied to the plan)
GROUPED = {
    "grouped": ("unfixed", False),
    "grouped+kernel_fix": ("kernel_fix", False),
    "grouped+pad_fix": ("unfixed", True),
    "grouped+both_fixes": ("kernel_fix", True),
    "grouped+masked_load": ("masked_load", False),
    "grouped+request_groups": ("kernel_fix", False),
    "grouped+finite_pv": ("finite_pv", False),
}
#: grouped route -> the group_rows it runs whatever the case's geometry says (model.plan.form_groups);
#: every other grouped route groups as the geometry's `group_rows` says
GROUPING = {"grouped+request_groups": "request"}
#: the fixes that close the cross-request leak of a mixed group (the complete fixes)
COMPLETE_FIXES = ("grouped+request_groups", "grouped+finite_pv")
ROUTES = ("reference", "xqa") + tuple(GROUPED)
#: route -> what it is, in one line: the docs' route table (the home page and every page that lists
#: the routes take it from here) and the module docstring above say the same
ROUTE_TEXT = {
    "reference": "dense float64 attention over each row's attended tokens",
    "xqa": "the row-wise XQA page4 route: never reads the null block",
    "grouped": "the grouped page4 route as upstream ships it: the bug",
    "grouped+kernel_fix": "the kernel zeroes every panel row no query of the group attends, after each K and V load "
                          "(upstream's kernel fix)",
    "grouped+pad_fix": "the planner repoints padding at the group's first real microblock (upstream's planner fix)",
    "grouped+both_fixes": "kernel_fix and pad_fix together (upstream's default)",
    "grouped+masked_load": "the panel loader never reads a row no query attends (this project's own)",
    "grouped+request_groups": "groups never span requests, each request's remainder rows go to XQA, on kernel_fix's "
                              "kernel (this project's complete fix for the cross-request leak)",
    "grouped+finite_pv": "mixed groups kept; the kernel multiplies P by V's finite values only, then gives each row the "
                         "non-finite result of exactly the values it attends (this project's in-kernel complete fix)",
}
#: the grouped kernel's variants the routes run (routes.compiled adds its test-only ones)
KERNEL_VARIANTS = tuple(dict.fromkeys(variant for variant, _ in GROUPED.values()))
#: the grouped routes that apply a fix
FIXED_ROUTES = tuple(r for r in GROUPED if r != "grouped")

#: the narrowest column heading of each route (text tables): the fixes by their letters
SHORT = {"reference": "ref", "xqa": "xqa", "grouped": "grp",
         **{f"grouped+{fix}": letter for fix, letter in FIXES.items()}}


#: earlier spellings of a fix (the letters, "fix A", export names' "fixA", the bench's "both"), and a
#: fix spelled without its underscore, compared without case, spaces, "_" or "-" -> the fix's name
OLD_FIX_NAMES = {"a": "kernel_fix", "fixa": "kernel_fix", "b": "pad_fix", "fixb": "pad_fix", "padfix": "pad_fix",
                 "ab": "both_fixes", "a+b": "both_fixes", "fixab": "both_fixes", "fixa+b": "both_fixes",
                 "both": "both_fixes", "c": "masked_load", "fixc": "masked_load", "maskedload": "masked_load",
                 "requestgroups": "request_groups", "finitepv": "finite_pv"}


#: keys of the JSON documents earlier versions wrote (the bench's qsa_lab.bench/1, the committed
#: qsa_lab.upstream_fix_cost/1) -> their names now
OLD_KEYS = {"fix_a_vs_report": "kernel_fix_vs_report",
            "report_v100_fix_a_ratio": "report_v100_kernel_fix_ratio",
            "fix_a_commit": "kernel_fix_commit", "fix_a_source": "kernel_fix_source",
            "upstream_fix_a_ratio": "upstream_kernel_fix_ratio", "upstream_fix_a_extra_us": "upstream_kernel_fix_extra_us",
            "qsa_lab_fix_a_ratio": "qsa_lab_kernel_fix_ratio", "qsa_lab_fix_a_extra_us": "qsa_lab_kernel_fix_extra_us"}


def current_keys(doc):
    """A JSON value with every key of OLD_KEYS renamed, at any depth (values unchanged); a
    document already in today's keys comes back equal."""
    if isinstance(doc, dict):
        return {OLD_KEYS.get(k, k): current_keys(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [current_keys(v) for v in doc]
    return doc


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


def heading(route: str) -> str:
    """A route as a column heading: a fixed route by its fix ('kernel_fix (A)'), others as they are."""
    fix = fix_of(route)
    return fix_label(fix) if fix else route


def short_key(routes=ROUTES) -> str:
    """What SHORT's abbreviations stand for: 'ref = reference, grp = grouped, A = grouped+kernel_fix, ...'."""
    return ", ".join(f"{SHORT[r]} = {r}" for r in routes if SHORT[r] != r)


def slug(names) -> str:
    """Fixes or routes for a file name: ('kernel_fix', 'grouped+masked_load') -> 'kernel_fix+masked_load'
    (a fixed route by its fix); 'none' when there are none."""
    return "+".join(fix_of(n) or n for n in names) or "none"


def renamed_fix(name: str) -> str | None:
    """The fix an earlier spelling names now ('fix A', 'fixA', 'A', 'both' -> ...); None for any other
    text, the fixes' own names included."""
    old = "".join(c for c in str(name).lower() if c not in " _-")
    new = OLD_FIX_NAMES.get(old[len("grouped+"):] if old.startswith("grouped+") else old)
    return new if new != name else None


def renamed_route(name: str) -> str | None:
    """The route an earlier spelling names now ('fixA', 'grouped+A', 'both', 'kernel_fix' ->
    'grouped+kernel_fix', ...); None for a route's own name and for any other text."""
    fix = renamed_fix(name) or (name if name in FIXES else None)
    return f"grouped+{fix}" if fix and f"grouped+{fix}" != name else None


def was_renamed(name: str, route: bool = True, prefix: str = "") -> str | None:
    """"'<prefix+name>' is now called '<prefix+new name>'" when `name` is an earlier spelling of a
    route (route=True) or of a fix; None for any other name."""
    new = renamed_route(name) if route else renamed_fix(name)
    return f"{prefix + name!r} is now called {prefix + new!r}" if new else None


def check_renamed(name: str, argument: str, route: bool = True, prefix: str = "") -> None:
    """ValueError '<argument>: ... is now called ...' (was_renamed) for an earlier spelling."""
    message = was_renamed(name, route, prefix)
    if message:
        raise ValueError(f"{argument}: {message}")

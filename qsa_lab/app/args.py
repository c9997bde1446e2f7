"""What every command shares: exit codes, the parser that answers a bad argument with one line
naming it, typed argument parsers, turning an API error into that line, the geometry and
poison options and their checks. Plain Python only: `qsa-lab --help` and argument errors
answer before torch is imported.
"""
from __future__ import annotations

import argparse
import contextlib
import re
import sys

EXIT_OK, EXIT_DIFFERS, EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


class UsageError(Exception):
    """Bad input: one line on stderr naming the argument, exit 2."""


class Failure(Exception):
    """A failure that is not the input's fault (no GPU for bench, ...): one line, exit 3."""


class Parser(argparse.ArgumentParser):
    def __init__(self, *a, **kw):
        kw.setdefault("allow_abbrev", False)  # --ro must not silently mean --rows
        super().__init__(*a, **kw)

    def error(self, message):  # one line naming the argument, not the usage block
        message = re.sub(r"^argument ", "", message)
        message = re.sub(r"^unrecognized arguments: (.*)", r"\1: unrecognized argument(s)", message)
        message = re.sub(r"^the following arguments are required: (.*)", r"\1: required", message)
        raise UsageError(message)


def one_line(text: str) -> str:
    line = " ".join(str(text).split("\n")[:1]) or "(no message)"
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in line)[:1000]


@contextlib.contextmanager
def blame(flags: dict, default: str):
    """ValueError/TypeError (or a file that is missing or appeared) raised inside -> UsageError
    naming the CLI flag: a message that starts with an API argument name ('rows: ...',
    'site must ...') gets that name's flag, any other gets `default`."""
    try:
        yield
    except (ValueError, TypeError, FileExistsError, FileNotFoundError) as e:
        msg = one_line(e)
        m = re.match(r"([A-Za-z_][\w ]*?)(?::\s*| (?=must |only ))", msg)     # names such as 'call file' too
        if m and m.group(1) in flags:
            msg = f"{flags[m.group(1)]}: {msg[m.end():]}"
        elif not msg.startswith("--"):
            msg = f"{default}: {msg}"
        raise UsageError(msg) from e


def integer(text: str) -> int:
    """Plain decimal integers only: no '1_000', no other scripts' digits, no floats."""
    if not re.fullmatch(r"\s*[+-]?[0-9]{1,100}\s*", text):
        raise argparse.ArgumentTypeError(f"expected an integer, got {text[:40]!r}")
    return int(text)


def seconds(text: str) -> float:
    """A number of seconds > 0 and below a week (support.processes.MAX_WAIT: a worker's longest wait)."""
    from qsa_lab.support.processes import MAX_WAIT

    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0 < v < MAX_WAIT:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0 and below {MAX_WAIT:g} (a week), got {text!r}")
    return v


def int_list(text: str) -> list[int]:
    parts = [x for x in text.replace(" ", ",").split(",") if x]
    if not parts or len(parts) > 4096 or not all(re.fullmatch(r"[+-]?[0-9]{1,9}", x) for x in parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text[:40]!r}")
    return [int(x) for x in parts]


def size(text: str) -> int:
    from qsa_lab.model.memory import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def geometry_flag(name: str) -> str:
    """A geometry field's option: group_rows -> --group-rows."""
    return "--" + name.replace("_", "-")


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def add_old_names(group) -> None:
    """Each renamed geometry option (model.geometry.RENAMED_FIELDS) under its old name too, taking
    the same values, not shown in --help: --grouping is --group-rows."""
    from qsa_lab.model.geometry import RENAMED_FIELDS

    actions = {a.dest: a for a in group._group_actions}
    for old, new in RENAMED_FIELDS.items():
        a = actions[new]
        group.add_argument(geometry_flag(old), dest=new, type=a.type, choices=a.choices, metavar=a.metavar,
                           help=argparse.SUPPRESS)


def add_case_args(p):
    from qsa_lab.model.geometry import (BACKENDS, DEFAULT_OVERLAP, GROUPINGS, KV_DTYPES, LAYOUTS, MIXES, PAYLOADS, PLANES, RANGES, SELECTIONS, SITES, Geometry)

    d = Geometry()

    def rng(name, what):
        lo, hi = RANGES[name]
        return f"{what} (default {getattr(d, name)}; {lo}..{hi})"

    g = p.add_argument_group("geometry (defaults: the report's decode-like case; a preset changes them)")
    g.add_argument("geometry", nargs="?", choices=["decode", "causal3", *MIXES], default=None,
                   help="preset: decode = the report's 19 decode-like rows (the default); "
                        "causal3 = 24 rows of 3 requests, scatter, seed 63; batches that mix requests in a "
                        "group of 8 rows: upstream-mix = upstream's regression test shape (46 + 1 + 1 + 1 rows, "
                        "ctx 2051), prefill-mix = 20 + 13 + 7 rows, decode-mix = 4 + 19 x 3 rows")
    g.add_argument("--rows", type=integer, help=rng("rows", "query rows"))
    g.add_argument("--requests", type=integer, help=rng("requests", "requests; request r holds context - r tokens"))
    g.add_argument("--request-rows", type=int_list, metavar="N,N,..",
                   help="rows of each request in order, summing to --rows, e.g. 46,1,1,1 (default: the rows "
                        "spread evenly)")
    g.add_argument("--layout", choices=LAYOUTS, help=f"physical page order (default {d.layout})")
    g.add_argument("--context", type=integer, help=rng("context", "tokens of request 0"))
    g.add_argument("--topk", type=integer, help=rng("topk", "selected 4-token blocks per row"))
    g.add_argument("--page-size", type=integer, help=rng("page_size", "tokens per page, a multiple of 4"))
    g.add_argument("--q-heads", type=integer, help=rng("q_heads", "query heads per KV head"))
    g.add_argument("--head-dim", type=integer, help=rng("head_dim", "head dimension, a multiple of 16"))
    g.add_argument("--kv-dtype", choices=KV_DTYPES, help=f"KV cache element type (default {d.kv_dtype})")
    g.add_argument("--seed", type=integer, help=rng("seed", "seed of q, K/V and the selections"))
    g.add_argument("--group-rows", choices=GROUPINGS,
                   help=f"how rows form the grouped kernel's groups of 8: consecutive rows or request-aligned "
                        f"groups (default {d.group_rows})")
    g.add_argument("--selection", choices=SELECTIONS,
                   help="indexer (default): top-k of an indexer-style block scorer over correlated queries; "
                        "random: sink + window + independent random blocks (the earlier generator)")
    g.add_argument("--overlap", type=fraction, metavar="F",
                   help=f"target mean overlap of neighbouring rows' indexer selections, in [0, 1] "
                        f"(default {DEFAULT_OVERLAP})")
    g.add_argument("--max-memory", type=size, metavar="SIZE",
                   help="refuse a case whose estimated peak memory is above SIZE, e.g. 4G or 512M "
                        "(default: half the memory available when the command starts)")
    add_old_names(g)
    q = p.add_argument_group("poison")
    q.add_argument("--poison", choices=SITES, default="none", help="poison site (default none)")
    q.add_argument("--dims", type=int_list,
                   help="head dims for targeted, stale-tail, attended-k and attended-v "
                        "(default 102,152,168,170,230 modulo --head-dim)")
    q.add_argument("--plane", choices=tuple(PLANES), default="v", help="plane(s) poisoned (default v)")
    q.add_argument("--poison-seed", type=integer, default=0, help="seed of the random poison bytes (default 0)")
    q.add_argument("--payload", choices=PAYLOADS, default=None,
                   help="write whole elements of this value in the cache's dtype at --dims (nan, inf: E5M2 and "
                        "fp16 only, max finite, zero); default: the site's own bytes (the NaN byte 0x7F for "
                        "targeted / stale-tail, a NaN element for attended-k / attended-v)")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="auto = the compiled kernels when a GPU is visible and takes the geometry, "
                        "else the emulation (default auto)")


def geometry_of(args):
    """The requested Geometry, range-checked and within the memory budget (UsageError otherwise)."""
    from qsa_lab.model import memory as resources
    from qsa_lab.model.geometry import CAUSAL3, DECODE, MIXES, Geometry

    base = {"decode": DECODE, "causal3": CAUSAL3, **MIXES, None: Geometry()}[args.geometry]
    names = ["rows", "requests", "layout", "context", "topk", "page_size", "q_heads", "head_dim", "kv_dtype", "seed",
             "group_rows", "selection", "overlap", "request_rows"]
    over = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    if "request_rows" in over:
        over["request_rows"] = tuple(over["request_rows"])
    elif base.request_rows and ("rows" in over or "requests" in over):
        over["request_rows"] = ()   # a preset's split does not hold other row or request counts: spread evenly
    if args.overlap is not None and over.get("selection", base.selection) != "indexer":
        raise UsageError("--overlap: applies to --selection indexer only")
    flags = {n: geometry_flag(n) for n in list(base.to_dict()) + names}
    with blame(flags, "geometry"):
        geometry = base.replace(**over)
    if getattr(args, "max_memory", None) is None:
        args.max_memory = resources.default_budget()  # fixed once: the same budget for every later check
    with blame({}, "--max-memory"):
        resources.require(geometry, args.max_memory)
    return geometry


POISON_FLAGS = {"site": "--poison", "plane": "--plane", "dims": "--dims", "seed": "--poison-seed", "payload": "--payload"}


def check_outputs(args, paths: dict, inputs: dict | None = None) -> dict:
    """{flag: path or None} -> checked Paths, before any work: each writable, none the same file
    as another output or as an input."""
    from qsa_lab.support.outputs import check_distinct, check_output

    force = getattr(args, "force", False)
    checked = {}
    for flag, path in paths.items():
        if path is not None:
            with blame({}, flag):
                checked[flag] = check_output(path, flag, force)
    with blame({}, next(iter(paths), "output")):
        check_distinct({**(inputs or {}), **checked})
    return checked


def publish(text: str, args, path, show) -> None:
    """A command's JSON document and its table, one way for every command: under `--json -` the document
    alone on stdout; else show() prints the table, then the document goes to `path` (the checked --json
    FILE, written whole, never over a file unless --force) and a line names it."""
    if args.json == "-":
        sys.stdout.write(text)
        return
    show()
    if path is not None:
        from qsa_lab.support.outputs import write_text

        with blame({}, "--json"):
            write_text(path, text, "--json", force=args.force)
        print(f"# wrote {args.json}")

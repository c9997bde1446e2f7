"""`qsa-lab` command line: diff, repro, bench, doctor.

Exit codes (README "Exit codes and errors"): 0 success; 1 a `--load` replay that differs;
2 bad input, one line `qsa-lab: error: <argument>: <what is wrong>`; 3 any other failure,
one line (the traceback only with --debug); 130 interrupted.

Every input is checked before any work: geometry ranges and the memory estimate, the
backend, every output path. Only then is anything built, run or written.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import traceback

EXIT_OK, EXIT_DIFFERS, EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_BAD_ARGS = EXIT_BAD_INPUT  # older name


class UsageError(Exception):
    """Bad input: one line on stderr naming the argument, exit 2."""


class Failure(Exception):
    """A failure that is not the input's fault (no GPU for bench, ...): one line, exit 3."""


class _Parser(argparse.ArgumentParser):
    def __init__(self, *a, **kw):
        kw.setdefault("allow_abbrev", False)  # --ro must not silently mean --rows
        super().__init__(*a, **kw)

    def error(self, message):  # one line naming the argument, not the usage block
        message = re.sub(r"^argument ", "", message)
        message = re.sub(r"^unrecognized arguments: (.*)", r"\1: unrecognized argument(s)", message)
        message = re.sub(r"^the following arguments are required: (.*)", r"\1: required", message)
        raise UsageError(message)


def _one_line(text: str) -> str:
    line = " ".join(str(text).split("\n")[:1]) or "(no message)"
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in line)[:1000]


@contextlib.contextmanager
def _blame(flags: dict, default: str):
    """ValueError/TypeError (or a file that is missing or appeared) raised inside -> UsageError
    naming the CLI flag: a message that starts with an API argument name ('rows: ...',
    'site must ...') gets that name's flag, any other gets `default`."""
    try:
        yield
    except (ValueError, TypeError, FileExistsError, FileNotFoundError) as e:
        msg = _one_line(e)
        m = re.match(r"([A-Za-z_]\w*)(?::\s*| (?=must |only ))", msg)
        if m and m.group(1) in flags:
            msg = f"{flags[m.group(1)]}: {msg[m.end():]}"
        elif not msg.startswith("--"):
            msg = f"{default}: {msg}"
        raise UsageError(msg) from e


def _int(text: str) -> int:
    """Plain decimal integers only: no '1_000', no other scripts' digits, no floats."""
    if not re.fullmatch(r"\s*[+-]?[0-9]{1,100}\s*", text):
        raise argparse.ArgumentTypeError(f"expected an integer, got {text[:40]!r}")
    return int(text)


def _int_list(text: str) -> list[int]:
    parts = [x for x in text.replace(" ", ",").split(",") if x]
    if not parts or len(parts) > 4096 or not all(re.fullmatch(r"[+-]?[0-9]{1,9}", x) for x in parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text[:40]!r}")
    return [int(x) for x in parts]


def _size(text: str) -> int:
    from .resources import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _geometry_flag(name: str) -> str:
    return "--grouping" if name == "group_rows" else "--" + name.replace("_", "-")


def _overlap(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def _add_case_args(p):
    from .case import DEFAULT_OVERLAP, GROUPINGS, KV_DTYPES, LAYOUTS, RANGES, SELECTIONS, Geometry
    from .poison import PAYLOADS, PLANES, SITES
    from .routes import BACKENDS

    d = Geometry()

    def rng(name, what):
        lo, hi = RANGES[name]
        return f"{what} (default {getattr(d, name)}; {lo}..{hi})"

    g = p.add_argument_group("geometry (defaults: the report's decode-like case; a preset changes them)")
    g.add_argument("geometry", nargs="?", choices=["decode", "causal3"], default=None,
                   help="preset: decode = the report's 19 decode-like rows (the default); "
                        "causal3 = 24 rows of 3 requests, scatter, seed 63")
    g.add_argument("--rows", type=_int, help=rng("rows", "query rows"))
    g.add_argument("--requests", type=_int, help=rng("requests", "requests; request r holds context - r tokens"))
    g.add_argument("--layout", choices=LAYOUTS, help=f"physical page order (default {d.layout})")
    g.add_argument("--context", type=_int, help=rng("context", "tokens of request 0"))
    g.add_argument("--topk", type=_int, help=rng("topk", "selected 4-token blocks per row"))
    g.add_argument("--page-size", type=_int, help=rng("page_size", "tokens per page, a multiple of 4"))
    g.add_argument("--q-heads", type=_int, help=rng("q_heads", "query heads per KV head"))
    g.add_argument("--head-dim", type=_int, help=rng("head_dim", "head dimension, a multiple of 16"))
    g.add_argument("--kv-dtype", choices=KV_DTYPES, help=f"KV cache element type (default {d.kv_dtype})")
    g.add_argument("--seed", type=_int, help=rng("seed", "seed of q, K/V and the selections"))
    g.add_argument("--grouping", choices=GROUPINGS,
                   help=f"consecutive rows or request-aligned groups (default {d.group_rows})")
    g.add_argument("--selection", choices=SELECTIONS,
                   help="indexer (default): top-k of an indexer-style block scorer over correlated queries; "
                        "random: sink + window + independent random blocks (the earlier generator)")
    g.add_argument("--overlap", type=_overlap, metavar="F",
                   help=f"target mean overlap of neighbouring rows' indexer selections, in [0, 1] "
                        f"(default {DEFAULT_OVERLAP})")
    g.add_argument("--max-memory", type=_size, metavar="SIZE",
                   help="refuse a case whose estimated peak memory is above SIZE, e.g. 4G or 512M "
                        "(default: half the memory available when the command starts)")
    q = p.add_argument_group("poison")
    q.add_argument("--poison", choices=SITES, default="none", help="poison site (default none)")
    q.add_argument("--dims", type=_int_list,
                   help="head dims for targeted / stale-tail (default 102,152,168,170,230 modulo --head-dim)")
    q.add_argument("--plane", choices=tuple(PLANES), default="v", help="plane(s) poisoned (default v)")
    q.add_argument("--poison-seed", type=_int, default=0, help="seed of the random poison bytes (default 0)")
    q.add_argument("--payload", choices=PAYLOADS, default=None,
                   help="write whole elements of this value in the cache's dtype at --dims (nan, inf: E5M2 and "
                        "fp16 only, max finite, zero); default: the site's own bytes (the NaN byte 0x7F for "
                        "targeted / stale-tail, a NaN element for attended-k / attended-v)")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="auto = the compiled kernels when a GPU is visible and takes the geometry, "
                        "else the emulation (default auto)")


def _geometry(args):
    """The requested Geometry, range-checked and within the memory budget (UsageError otherwise)."""
    from . import resources
    from .case import Geometry
    from .repro import CAUSAL3, DECODE

    base = {"decode": DECODE, "causal3": CAUSAL3, None: Geometry()}[args.geometry]
    names = ["rows", "requests", "layout", "context", "topk", "page_size", "q_heads", "head_dim", "kv_dtype", "seed",
             "selection", "overlap"]
    over = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    if args.grouping:
        over["group_rows"] = args.grouping
    if args.overlap is not None and over.get("selection", base.selection) != "indexer":
        raise UsageError("--overlap: applies to --selection indexer only")
    flags = {n: _geometry_flag(n) for n in list(base.to_dict()) + names}
    with _blame(flags, "geometry"):
        geometry = base.replace(**over)
    if getattr(args, "max_memory", None) is None:
        args.max_memory = resources.default_budget()  # fixed once: the same budget for every later check
    with _blame({}, "--max-memory"):
        resources.require(geometry, args.max_memory)
    return geometry


POISON_FLAGS = {"site": "--poison", "plane": "--plane", "dims": "--dims", "seed": "--poison-seed", "payload": "--payload"}


def _outputs(args, paths: dict, inputs: dict | None = None) -> dict:
    """{flag: path or None} -> checked Paths, before any work: each writable, none the same file
    as another output or as an input."""
    from .outputs import check_distinct, check_output

    force = getattr(args, "force", False)
    checked = {}
    for flag, path in paths.items():
        if path is not None:
            with _blame({}, flag):
                checked[flag] = check_output(path, flag, force)
    with _blame({}, next(iter(paths), "output")):
        check_distinct({**(inputs or {}), **checked})
    return checked


def _print_table(result, out=None):
    import pandas as pd

    from .analysis import route_table

    t = route_table(result)
    t["nan_dims"] = t["nan_dims"].map(lambda d: ",".join(map(str, d[:12])) + (" ..." if len(d) > 12 else ""))
    with pd.option_context("display.width", 200, "display.max_columns", 10, "display.float_format", "{:.3g}".format):
        print(t.to_string(), file=out or sys.stdout)


def _load_case(args):
    """--load: the saved case, plan and outputs; no geometry or poison option may come with it."""
    from . import io, resources

    given = [_geometry_flag(k) if k != "geometry" else "a preset"
             for k in ("geometry", "rows", "requests", "layout", "context", "topk", "page_size", "q_heads",
                       "head_dim", "kv_dtype", "seed", "grouping", "selection", "overlap", "dims")
             if getattr(args, k, None) is not None]
    given += [f"--{k.replace('_', '-')}" for k, d in (("poison", "none"), ("plane", "v"), ("poison_seed", 0),
                                                                  ("payload", None))
              if getattr(args, k) != d]
    if given:
        raise UsageError(f"--load: replays the saved case; drop {', '.join(given)}")
    budget = args.max_memory or resources.default_budget()
    with _blame({}, "--load"):
        case, saved_plan, saved, _ = io.load(args.load, "--load", max_bytes=budget)
    with _blame({}, "--max-memory"):
        resources.require(case.geometry, budget)
    return case, saved_plan, saved


def _replay_differs(case, result, saved_plan, saved) -> list[str]:
    """What a replay did not reproduce bit for bit: plan fields and route outputs."""
    import torch

    from .plan import plan_groups

    plan = plan_groups(case)
    differs = [f"plan.{k}" for k in ("microblocks", "masks", "seq_len")
               if not torch.equal(getattr(plan, k), getattr(saved_plan, k))]
    return differs + [r for r in saved
                      if not torch.equal(saved[r].view(torch.int16), result.outputs[r].view(torch.int16))]


def cmd_diff(args) -> int:
    from . import io, resources
    from .analysis import diff_json
    from .case import build_case
    from .outputs import write_text
    from .poison import apply_poison
    from .routes import resolve_backend, run_routes

    if args.save == "-":
        raise UsageError("--save: writes a file; '-' (stdout) is only for --json")
    outs = _outputs(args, {"--json": None if args.json == "-" else args.json, "--save": args.save},
                    inputs={"--load": args.load} if args.load is not None else None)
    if args.load is not None:
        case, saved_plan, saved = _load_case(args)
        geometry = case.geometry
    else:
        geometry = _geometry(args)
        saved = None
    with _blame({}, "--backend"):
        backend = resolve_backend(args.backend, geometry)
    if saved is None:
        case = build_case(geometry, max_memory=args.max_memory)
        with _blame(POISON_FLAGS, "--poison"):
            case = apply_poison(case, args.poison, plane=args.plane, dims=args.dims, seed=args.poison_seed,
                                payload=args.payload)
    est = resources.estimate(geometry)
    long_run = backend == "emulate" and est.seconds > 10
    if long_run:
        print(f"# estimated {est.describe()}", file=sys.stderr)
    result = run_routes(case, routes=list(saved) if saved else None, backend=backend, progress=long_run)
    replay = None
    if saved is not None:
        differs = _replay_differs(case, result, saved_plan, saved)
        replay = "bit-identical" if not differs else f"DIFFERS on {differs}"
    doc = diff_json(result)
    text = json.dumps(doc, indent=2) + "\n"
    if args.json == "-":
        sys.stdout.write(text)
    else:
        print(f"# {case.describe()}  [backend: {result.backend}]")
        p = case.poison
        print(f"# poison: {p.get('nan_bytes', 0)} NaN bytes, dims {p.get('poisoned_dims', [])}"
              + (f"; {p['inf_bytes']} Inf bytes (0 * Inf = NaN too)" if p.get("inf_bytes") else ""))
        _print_table(result)
        if replay:
            print(f"# replay of {args.load}: {replay}")
    with _blame({}, "--json"):
        if "--json" in outs:
            write_text(outs["--json"], text, "--json", force=args.force)
            if args.json != "-":
                print(f"# wrote {outs['--json']}")
    with _blame({}, "--save"):
        if "--save" in outs:
            io.save(result, outs["--save"], overwrite=args.force, arg="--save")
            if args.json != "-":
                print(f"# saved {outs['--save']}")
    return EXIT_OK if replay in (None, "bit-identical") else EXIT_DIFFERS


def cmd_repro(args) -> int:
    from .outputs import check_folder, check_output, writing, write_text
    from .routes import resolve_backend

    with _blame({}, "--out"):
        out = check_folder(args.out, "--out")
        files = {"repro.csv": out / "repro.csv", "repro.json": out / "repro.json"}
        if out.is_dir():
            for p in files.values():
                check_output(p, "--out", args.force)
    if not args.no_figures:
        with _blame({}, "--figures"):
            check_folder(args.figures, "--figures")
    with _blame({}, "--backend"):
        resolve_backend(args.backend)
    from .repro import run_repro

    table, results = run_repro(backend=args.backend, progress=not args.quiet)
    backend = results[0].backend if results else args.backend
    print(f"# backend: {backend}")
    show = ["case", "nan_bytes", "nan[xqa]", "nan[grouped]", "nan[grouped+kernel_fix]", "nan[grouped+pad_fix]",
            "nan[grouped+masked_load]", "max|grouped+kernel_fix-xqa|", "report_grouped_nan"]
    shown = table[show].astype(object)
    shown["report_grouped_nan"] = shown["report_grouped_nan"].where(shown["report_grouped_nan"].notna(), "—")
    diff = "max|grouped+kernel_fix-xqa|"  # undefined where either output holds NaN
    shown[diff] = [f"{v:.2g}" if v == v else "NaN in output" for v in table[diff]]
    print(shown.to_string(index=False))
    print("# the report's numbers come from its own data; ours from a regenerated case with the same mechanism")
    with _blame({}, "--out"):
        check_folder(out, "--out", create=True)
        with writing(files["repro.csv"], "--out", force=args.force) as tmp:
            table.to_csv(tmp, index=False)
        write_text(files["repro.json"], json.dumps({"schema": "qsa_lab.repro/1", "backend": backend,
                                                    "cases": json.loads(table.to_json(orient="records"))},
                                                   indent=2) + "\n", "--out", force=args.force)
    written = list(files.values())
    if not args.no_figures:
        from .figures import write_repro_figures

        # without --force an existing figure is kept and the new one numbered (export_figure)
        with _blame({}, "--figures"):
            written += write_repro_figures(results, args.figures, table=table, overwrite=args.force)
    for w in written:
        print(f"# wrote {w}")
    return EXIT_OK


def cmd_bench(args) -> int:
    import torch

    from .outputs import write_text

    outs = _outputs(args, {"--json": args.json})
    if not torch.cuda.is_available():
        raise Failure("bench: no CUDA GPU visible; timings need one (committed H200 numbers: "
                      "data/bench_h200.json)")
    from .kernels.bench import run_bench

    doc = run_bench()
    if "--json" in outs:
        with _blame({}, "--json"):
            write_text(outs["--json"], json.dumps(doc, indent=1) + "\n", "--json", force=args.force)
    return EXIT_OK


def cmd_doctor(args) -> int:
    import platform

    from . import __version__, kernels

    info = {"qsa_lab": __version__, "python": platform.python_version(), **kernels.status()}
    width = max(map(len, info))
    for k, v in info.items():
        print(f"{k:<{width}}  {v}")
    backend = "cuda (compiled kernels)" if kernels.available() else "emulate (PyTorch emulation)"
    print(f"{'backend auto':<{width}}  {backend}")
    from .doctor import verdict
    print(verdict(kernels.status()))
    return EXIT_OK


# -- canary -----------------------------------------------------------------------------------------

def cmd_canary(args) -> int:
    """qsa-lab canary: every kernel x region x plane x payload, controls and poisoned runs (qsa_lab.canary.cli)."""
    from .canary import cli

    return cli.run(args)


def _add_canary_parser(sub, parents=()):
    from .canary import cli

    cli.add_parser(sub, parents).set_defaults(func=cmd_canary)


def build_parser():
    """One subparser per command; each sets `func`, so a new command is one add_parser +
    set_defaults. --debug is accepted before or after the command."""
    common = _Parser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="on a failure print the full traceback (default: off)")
    p = _Parser(prog="qsa-lab", description="Reproduce, fingerprint and fix the grouped page4 null-block NaN.",
                parents=[common])
    sub = p.add_subparsers(dest="cmd", metavar="command", required=True, parser_class=_Parser)

    d = sub.add_parser("diff", parents=[common], help="one case through every route; prints a table")
    _add_case_args(d)
    o = d.add_argument_group("output")
    o.add_argument("--json", metavar="PATH|-", help="write the qsa_lab.diff/1 document (- for stdout; default: none)")
    o.add_argument("--save", metavar="PATH", help="save case, plan and outputs as safetensors (default: none)")
    o.add_argument("--load", metavar="PATH", help="replay a saved case; takes no geometry or poison option "
                                                  "(default: none)")
    o.add_argument("--force", action="store_true", help="let --save / --json replace a file (default: never)")
    d.set_defaults(func=cmd_diff)

    r = sub.add_parser("repro", parents=[common],
                       help="the report's verification table plus extra cases; CSV, JSON, figures")
    r.add_argument("--out", default="results", metavar="DIR", help="folder for repro.csv and repro.json "
                                                                    "(default results)")
    r.add_argument("--figures", default="figures", metavar="DIR", help="folder for the figures (default figures)")
    r.add_argument("--backend", choices=("auto", "emulate", "cuda"), default="auto", help="(default auto)")
    r.add_argument("--no-figures", action="store_true", help="skip the figures (default: write them)")
    r.add_argument("--force", action="store_true",
                   help="replace earlier results and figures (default: refuse results, number new figures)")
    r.add_argument("--quiet", action="store_true", help="no progress bar (default: show it)")
    r.set_defaults(func=cmd_repro)

    b = sub.add_parser("bench", parents=[common], help="GPU timings of every route and fix")
    b.add_argument("--json", metavar="PATH", help="write the timings as JSON (default: none)")
    b.add_argument("--force", action="store_true", help="let --json replace a file (default: never)")
    b.set_defaults(func=cmd_bench)

    sub.add_parser("doctor", parents=[common], help="what this machine can do").set_defaults(func=cmd_doctor)
    _add_canary_parser(sub, parents=[common])
    return p


def _fail(message: str, code: int, debug: bool) -> int:
    if debug:
        traceback.print_exc()
    print(f"qsa-lab: {message}", file=sys.stderr)
    return code


def _unknown_options(parser, argv) -> None:
    """Name an unknown option first: argparse would otherwise report the value after it as a
    bad preset ('--ro 5' -> "invalid choice: '5'")."""
    known = set()
    for p in [parser, *next(a for a in parser._actions if a.dest == "cmd").choices.values()]:
        known.update(o for a in p._actions for o in a.option_strings)
    for tok in argv:
        if tok == "--":
            break
        if tok.startswith("--") and tok.split("=", 1)[0] not in known:
            raise UsageError(f"{tok.split('=', 1)[0]}: unrecognized option")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    debug = "--debug" in argv
    try:
        parser = build_parser()
        _unknown_options(parser, argv)
        args = parser.parse_args(argv)
        return args.func(args)
    except UsageError as e:
        return _fail(f"error: {_one_line(e)}", EXIT_BAD_INPUT, False)  # bad input: one line, even with --debug
    except Failure as e:
        return _fail(f"failed: {_one_line(e)}", EXIT_FAILURE, debug)
    except SystemExit as e:  # --help / --version
        return e.code if isinstance(e.code, int) else EXIT_OK
    except BrokenPipeError:  # output piped into `head` and closed early: not an error
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")
        return EXIT_OK
    except KeyboardInterrupt:
        return _fail("interrupted", EXIT_INTERRUPTED, debug)
    except MemoryError:
        return _fail("failed: out of memory (lower --max-memory to refuse such cases up front)", EXIT_FAILURE,
                     debug)
    except Exception as e:  # noqa: BLE001 - anything else is a bug or the machine: one line, distinct code
        hint = "" if debug else " (run with --debug for the traceback)"
        return _fail(f"failed: {type(e).__name__}: {_one_line(e)}{hint}", EXIT_FAILURE, debug)


if __name__ == "__main__":
    sys.exit(main())

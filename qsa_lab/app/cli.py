"""`qsa-lab` command line: diff, repro, bench, doctor, notebooks, lab, canary, replay, scribble,
cross-request.

Exit codes (README "Exit codes and errors"): 0 success; 1 a `--load` replay that differs;
2 bad input, one line `qsa-lab: error: <argument>: <what is wrong>`; 3 any other failure,
one line (the traceback only with --debug); 130 interrupted.

Every input is checked before any work: geometry ranges and the memory estimate, the
backend, every output path. Only then is anything built, run or written.

Start-up is kept light: parsing, --help and every check of an argument import only plain-Python
modules (qsa_lab.model.geometry, .resources, .outputs); torch, pandas and matplotlib load inside a
command's handler, after its arguments were checked (tests/app/test_cli_startup.py holds this).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import traceback
import warnings

from qsa_lab.app.args import (EXIT_BAD_INPUT, EXIT_DIFFERS, EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, Failure, POISON_FLAGS, Parser, UsageError, add_case_args, blame, check_outputs, geometry_flag, geometry_of, integer, one_line)

def _print_table(rows, result, out=None):
    """route_rows as a table (pandas' layout, without loading pandas), with each route's
    pass/fail against the tolerance."""
    from qsa_lab.analysis.fingerprints import TOLERANCE, route_table_text, within_tolerance

    kv = result.case.geometry.kv_dtype
    ok = ["pass" if within_tolerance(result.outputs[r["route"]], result.reference64, kv) else "FAIL" for r in rows]
    out = out or sys.stdout
    print(route_table_text(rows, extra={"within_tol": ok}), file=out)
    atol, rtol = TOLERANCE[kv]
    print(f"# within_tol: every element |route - reference| <= {atol:g} + {rtol:g} * |reference| (reference in\n"
          f"# float64; NaN fails). Row 'reference' is that float64 reference rounded to fp16, as every route\n"
          f"# returns it: its difference is the rounding alone.", file=out)


def _load_case(args):
    """--load: the saved case, plan and outputs; no geometry or poison option may come with it."""
    from qsa_lab.app import case_file as io
    from qsa_lab.model import memory as resources

    given = [geometry_flag(k) if k != "geometry" else "a preset"
             for k in ("geometry", "rows", "requests", "layout", "context", "topk", "page_size", "q_heads",
                       "head_dim", "kv_dtype", "seed", "group_rows", "selection", "overlap", "dims", "request_rows")
             if getattr(args, k, None) is not None]
    given += [f"--{k.replace('_', '-')}" for k, d in (("poison", "none"), ("plane", "v"), ("poison_seed", 0),
                                                                  ("payload", None))
              if getattr(args, k) != d]
    if given:
        raise UsageError(f"--load: replays the saved case; drop {', '.join(given)}")
    budget = args.max_memory or resources.default_budget()
    with blame({}, "--load"):
        case, saved_plan, saved, meta = io.load(args.load, "--load", max_bytes=budget)
    with blame({}, "--max-memory"):
        resources.require(case.geometry, budget)
    if "checksum" not in meta:
        print(f"qsa-lab: note: --load: {one_line(args.load)} has no checksum (saved by an older qsa_lab): "
              "a file changed while it was read cannot be detected; replaying it", file=sys.stderr)
    return case, saved_plan, saved, meta


def _replay_differs(case, result, saved_plan, saved) -> list[str]:
    """What a replay did not reproduce bit for bit: plan fields and route outputs."""
    import torch

    from qsa_lab.model.plan import plan_groups

    plan = plan_groups(case)
    differs = [f"plan.{k}" for k in ("microblocks", "masks", "seq_len")
               if not torch.equal(getattr(plan, k), getattr(saved_plan, k))]
    return differs + [r for r in saved
                      if not torch.equal(saved[r].view(torch.int16), result.outputs[r].view(torch.int16))]


def cmd_diff(args) -> int:
    from qsa_lab.model import memory as resources
    from qsa_lab.support.outputs import write_together

    if args.save == "-":
        raise UsageError("--save: writes a file; '-' (stdout) is only for --json")
    outs = check_outputs(args, {"--json": None if args.json == "-" else args.json, "--save": args.save},
                    inputs={"--load": args.load} if args.load is not None else None)
    if args.load is not None:
        case, saved_plan, saved, meta = _load_case(args)
        geometry, origin = case.geometry, meta.get("origin")
    else:
        geometry = geometry_of(args)
        saved, origin = None, "geometry"  # built here from the geometry and the poison options
    from qsa_lab.app import case_file as io  # torch from here on: every argument above was checked without it
    from qsa_lab.analysis.fingerprints import diff_json, route_rows
    from qsa_lab.model.case import build_case
    from qsa_lab.model.poison import apply_poison
    from qsa_lab.routes.run import resolve_backend, run_routes

    with blame({}, "--backend"):
        backend = resolve_backend(args.backend, geometry)
    if backend == "emulate":
        _fit_threads()
    if saved is None and not 0 <= args.poison_seed < 1 << 63:  # cheap poison checks before any work starts
        raise UsageError(f"--poison-seed: must be in 0..{(1 << 63) - 1}, got {args.poison_seed}")
    if saved is None and args.dims is not None:
        from qsa_lab.model.poison import DIM_SITES

        if args.poison not in DIM_SITES:
            raise UsageError(f"--dims: only applies to --poison {', '.join(DIM_SITES)}, not {args.poison!r}")
        bad = [d for d in args.dims if not 0 <= d < geometry.head_dim]
        if bad:
            raise UsageError(f"--dims: head dims must lie in [0, {geometry.head_dim}), got {bad}")
    est = resources.estimate(geometry)
    long_run = backend == "emulate" and est.seconds > resources.LONG_RUN_S
    if saved is None:
        from tqdm import tqdm  # stderr: never into --json -

        # on a terminal only: a poison option found bad after the build must still be the only
        # line a script reading stderr gets
        shown = long_run and sys.stderr.isatty()
        with tqdm(total=2, desc="building the case", file=sys.stderr, disable=not shown,
                  bar_format="{desc}: {n}/{total} [{elapsed}]") as stage:
            case = build_case(geometry, max_memory=args.max_memory)
            stage.update()
            stage.set_description_str("poisoning the case")
            with blame(POISON_FLAGS, "--poison"):
                case = apply_poison(case, args.poison, plane=args.plane, dims=args.dims, seed=args.poison_seed,
                                    payload=args.payload)
            stage.update()
    if long_run:
        print(f"# estimated {est.describe()}", file=sys.stderr)
    result = run_routes(case, routes=list(saved) if saved else None, backend=backend, progress=long_run)
    replay = None
    if saved is not None:
        differs = _replay_differs(case, result, saved_plan, saved)
        replay = "bit-identical" if not differs else f"DIFFERS on {differs}"
    rows = route_rows(result)
    doc = diff_json(result, rows)
    text = json.dumps(doc, indent=2) + "\n"
    if args.json == "-":
        sys.stdout.write(text)
    else:
        print(f"# {case.describe()}  [backend: {result.backend}]")
        p = case.poison
        print(f"# poison: {p.get('nan_bytes', 0)} NaN bytes, dims {p.get('poisoned_dims', [])}"
              + (f"; {p['inf_bytes']} Inf bytes (0 * Inf = NaN too)" if p.get("inf_bytes") else ""))
        _print_table(rows, result)
        if replay:
            print(f"# replay of {args.load}: {replay}")
    files = []       # published together: a signal or a failure leaves both or neither
    if "--json" in outs:
        files.append((outs["--json"], text.encode("utf-8"), "--json"))
    if "--save" in outs:
        with blame({}, "--save"):
            files.append((outs["--save"], io.encode(result, origin=origin), "--save"))
    with blame({}, files[-1][2] if files else "output"):
        write_together(files, force=args.force)
    if args.json != "-":
        for path, _, flag in files:
            print(f"# {'wrote' if flag == '--json' else 'saved'} {path}")
    return EXIT_OK if replay in (None, "bit-identical") else EXIT_DIFFERS


def cmd_repro(args) -> int:
    from qsa_lab.support.outputs import check_folder, check_output

    with blame({}, "--out"):
        out = check_folder(args.out, "--out")
        files = {"repro.csv": out / "repro.csv", "repro.json": out / "repro.json"}
        if out.is_dir():
            for p in files.values():
                check_output(p, "--out", args.force)
    if not args.no_figures:
        with blame({}, "--figures"):
            check_folder(args.figures, "--figures")
    from qsa_lab.support.executor import start_second
    from qsa_lab.support.processes import idle_core

    second = None
    if not args.no_figures and args.backend != "cuda" and idle_core():
        # figures 01, 03, 05 are rendered in a second process while this one runs the cases; started
        # now, before torch is imported here, so that both processes' imports run at once
        second = start_second("qsa_lab.report.figures")
    try:
        return _repro(args, out, files, second)
    finally:
        if second is not None:
            second.close()   # whatever it still runs (bad input found later, a failure): ended with the command


def _repro(args, out, files: dict, second=None) -> int:
    from qsa_lab.support.outputs import check_folder, undone_on_failure, writing
    from qsa_lab.routes.run import resolve_backend  # torch from here on

    with blame({}, "--backend"):
        backend = resolve_backend(args.backend)
    ahead = None
    if second is not None and backend != "emulate":
        second.close()      # on a GPU it would start CUDA a second time
    elif second is not None:
        from qsa_lab.report.figures import draw_ahead

        ahead = draw_ahead(second, backend)
    if backend == "emulate":
        _fit_threads(started=int(ahead is not None))   # the second process holds a core of its own
    from qsa_lab.report.repro import run_repro

    table, results = run_repro(backend=args.backend, progress=not args.quiet, beside=int(ahead is not None))
    backend = results[0].backend if results else args.backend
    print(f"# backend: {backend}")
    from qsa_lab.report.repro import format_table

    print(format_table(table))
    print("# the report's numbers come from its own data; ours from a regenerated case with the same mechanism")
    doc = json.dumps({"schema": "qsa_lab.repro/1", "backend": backend,
                      "cases": json.loads(table.to_json(orient="records"))}, indent=2) + "\n"
    written = list(files.values())
    # everything is written before repro.csv / repro.json are published: a run that fails part-way
    # (a full disk, a result file that appeared meanwhile: exit 2) leaves neither of them, nor
    # figures or folders of its own; what another run wrote meanwhile stays untouched
    with undone_on_failure(), blame({}, "--out"):
        check_folder(out, "--out", create=True)
        with writing(files["repro.csv"], "--out", force=args.force) as csv_tmp, \
                writing(files["repro.json"], "--out", force=args.force) as json_tmp:
            with blame({}, "--out"):
                table.to_csv(csv_tmp, index=False)
                json_tmp.write_text(doc)
            if not args.no_figures:
                from qsa_lab.report.figures import write_repro_figures

                if not args.quiet:
                    print(f"# drawing the figures into {args.figures} ...", file=sys.stderr, flush=True)
                # without --force an existing figure is kept and the new one numbered (export_figure)
                with blame({}, "--figures"):
                    written += write_repro_figures(results, args.figures, table=table, overwrite=args.force,
                                                   ahead=ahead)
    for w in written:
        print(f"# wrote {w}")
    return EXIT_OK


def cmd_bench(args) -> int:
    from qsa_lab.support.outputs import write_text

    if args.reps < 1:
        raise UsageError(f"--reps: must be >= 1, got {args.reps}")
    outs = check_outputs(args, {"--json": args.json})
    import torch

    if not torch.cuda.is_available():
        raise Failure("bench: no CUDA GPU visible; timings need one (committed H200 numbers: "
                      "data/bench_h200.json)")
    from qsa_lab.routes.bench import run_bench

    doc = run_bench(quick=args.quick, reps=args.reps)
    if "--json" in outs:
        with blame({}, "--json"):
            write_text(outs["--json"], json.dumps(doc, indent=1) + "\n", "--json", force=args.force)
    return EXIT_OK


def cmd_doctor(args) -> int:
    import platform

    from qsa_lab.routes import compiled as kernels
    from qsa_lab.support.machine import table, verdict
    from qsa_lab.support.version import __version__

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the qsa_lab folder this runs from
    info = {"qsa_lab": f"{__version__} ({package})",
            "python": platform.python_version(), **kernels.status()}
    backend = "cuda (compiled kernels)" if kernels.available() else "emulate (PyTorch emulation)"
    print("\n".join(table({**info, "backend auto": backend})))
    print(verdict(kernels.status()))
    return EXIT_OK


def cmd_notebooks(args) -> int:
    from qsa_lab.support.package_data import copy_notebooks, notebooks

    notebooks()  # an install without them is not the user's input error (exit 3, not 2)
    with blame({"dest": "DIR"}, "DIR"):
        written = copy_notebooks(args.dir, force=args.force)
    for w in written:
        print(f"# wrote {w}")
    print(f"# open them with: qsa-lab lab {args.dir}")
    return EXIT_OK


def cmd_lab(args) -> int:
    import importlib.util
    import subprocess
    import tempfile

    from qsa_lab.support.package_data import copy_notebooks, lab_command, quiet_lab_args

    if importlib.util.find_spec("jupyterlab") is None:
        raise Failure("lab: JupyterLab is not installed here: pip install 'qsa_lab[lab]'")
    with blame({"dest": "DIR"}, "DIR"):
        for w in copy_notebooks(args.dir, keep=True):   # the user's own copies stay as they are
            print(f"# wrote {w}")
    extra = [f"--port={args.port}"] * (args.port is not None) + ["--no-browser"] * args.no_browser
    with tempfile.TemporaryDirectory(prefix="qsa_lab-lab-settings-") as settings:
        server = subprocess.Popen(lab_command(args.dir, quiet_lab_args(settings) + extra))
        return _wait_forwarding_signals(server)


def _wait_forwarding_signals(child) -> int:
    """Wait for `child` (the JupyterLab server); Ctrl-C, SIGTERM and SIGHUP sent to qsa-lab are
    passed on to it and qsa-lab waits for it to end, so the server never outlives the command.
    -> the child's exit code, or 128 + the signal that ended qsa-lab."""
    import signal
    import subprocess
    import threading

    from qsa_lab.support.signals import EXITS

    got = []

    def forward(signum, frame):  # noqa: ARG001 - the signal module's signature
        got.append(signum)
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, forward) for s in EXITS} if main_thread else {}
    try:
        code = child.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        if child.poll() is None:      # this process is failing: take the server down with it
            child.terminate()
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
    return 128 + got[0] if got else code


# -- canary -----------------------------------------------------------------------------------------

def cmd_canary(args) -> int:
    """qsa-lab canary: every kernel x region x plane x payload, controls and poisoned runs (qsa_lab.app.canary)."""
    from qsa_lab.app import canary as cli

    return cli.run(args)


def _add_canary_parser(sub, parents=()):
    from qsa_lab.app import canary as cli

    cli.add_parser(sub, parents).set_defaults(func=cmd_canary)


def _add_replay_parser(sub, parents=()):
    from qsa_lab.app import replay

    replay.add_parser(sub, parents)


def _add_scribble_parser(sub, parents=()):
    from qsa_lab.app import scribble

    scribble.add_parser(sub, parents)


def _add_cross_request_parser(sub, parents=()):
    from qsa_lab.app import cross_request

    cross_request.add_parser(sub, parents)


def build_parser():
    """One subparser per command; each sets `func`, so a new command is one add_parser +
    set_defaults. --debug is accepted before or after the command."""
    common = Parser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="on a failure print the full traceback (default: off)")
    p = Parser(prog="qsa-lab", description="Reproduce, fingerprint and fix the grouped page4 null-block NaN.",
                parents=[common])
    sub = p.add_subparsers(dest="cmd", metavar="command", required=True, parser_class=Parser)

    d = sub.add_parser("diff", parents=[common], help="one case through every route; prints a table")
    add_case_args(d)
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

    b = sub.add_parser("bench", parents=[common], help="GPU timings of every route and fix",
                       description="Times every route and fix on the visible CUDA GPU (CUDA events, CUDA graphs, "
                                   "L2 flushed, medians): the report's geometry (16 rows, ctx 8192, top-512, E4M3; "
                                   "µs per tile, ratio to unfixed, kernel_fix (A) beside the report's V100 ratio) and a "
                                   "sweep of contexts x rows. Needs a GPU; the committed H200 run is "
                                   "data/bench_h200.json (notebook 05 and `make demo` draw it without one).")
    b.add_argument("--json", metavar="PATH", help="write the timings as JSON, schema qsa_lab.bench/1 (default: none)")
    b.add_argument("--quick", action="store_true", help="one context and two row counts (default: the full sweep)")
    b.add_argument("--reps", type=integer, default=30, metavar="N", help="timed replays per point (default 30)")
    b.add_argument("--force", action="store_true", help="let --json replace a file (default: never)")
    b.set_defaults(func=cmd_bench)

    sub.add_parser("doctor", parents=[common], help="what this machine can do").set_defaults(func=cmd_doctor)
    n = sub.add_parser("notebooks", parents=[common], help="copy the project's notebooks into a folder")
    n.add_argument("dir", metavar="DIR", help="folder to copy them into, created if needed (required: no default)")
    n.add_argument("--force", action="store_true", help="replace notebooks already there (default: refuse)")
    n.set_defaults(func=cmd_notebooks)
    lab = sub.add_parser("lab", parents=[common], help="JupyterLab on a copy of the notebooks")
    lab.add_argument("dir", metavar="DIR", nargs="?", default="qsa_lab-notebooks",
                     help="folder of the copy; notebooks missing there are copied, others kept "
                          "(default qsa_lab-notebooks)")
    lab.add_argument("--port", type=integer, help="JupyterLab's port (default: its own, 8888 or the next free)")
    lab.add_argument("--no-browser", action="store_true", help="do not open a browser (default: open one)")
    lab.set_defaults(func=cmd_lab)
    _add_canary_parser(sub, parents=[common])
    _add_replay_parser(sub, parents=[common])
    _add_scribble_parser(sub, parents=[common])
    _add_cross_request_parser(sub, parents=[common])
    return p


def _show_warning(message, category, filename, lineno, file=None, line=None):
    print(f"qsa-lab: warning: {one_line(message)}", file=sys.stderr)


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


REPEATABLE = ("--kernel", "--debug")  # options that may be given more than once


def _repeated_options(argv) -> None:
    """An option given twice would silently keep only its last value ('--regions a --regions b'
    runs b alone): refuse it, naming the option."""
    seen = set()
    for tok in argv:
        if tok == "--":
            break
        name = tok.split("=", 1)[0]
        if name.startswith("--") and name not in REPEATABLE:
            if name in seen:
                raise UsageError(f"{name}: given more than once; give it once (a list is comma-separated)")
            seen.add(name)


def parse_args(argv) -> argparse.Namespace:
    """Parse and check the command line; plain Python only (no torch, pandas, matplotlib), so
    --help and a bad argument answer at once. UsageError / SystemExit (--help) propagate."""
    parser = build_parser()
    _unknown_options(parser, argv)
    _repeated_options(argv)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """The `qsa-lab` program (argv None: sys.argv) or one command in-process (argv a list).
    Ctrl-C / SIGTERM / SIGHUP: one line, temporaries removed (qsa_lab.support.signals); as the program
    the handler stays until the interpreter exits, in-process the caller's handlers come back."""
    from qsa_lab.support import signals

    global _PROGRAM
    if argv is None:
        signals.install()
        _PROGRAM = True
        _leave(_main(argv))
    with signals.installed():
        return _main(argv)


_PROGRAM = False   # main() runs as the program (not one command inside a caller's process)


def _fit_threads(started: int = 0) -> None:
    """As the program, torch's CPU threads fit the cores free now (procs.fit_torch_threads); one
    command in a caller's process leaves the caller's setting alone."""
    if _PROGRAM:
        from qsa_lab.support.processes import fit_torch_threads

        fit_torch_threads(started)


def _leave(code: int):
    """End the program with `code` once its command is done: the atexit handlers run and stdout
    and stderr are flushed, then os._exit skips the interpreter's teardown, which frees every
    module and tensor one by one (0.5-1 s after a run with torch loaded) in a process that is
    ending anyway. Every file a command writes is closed (and published) before it returns."""
    import atexit

    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):   # a closed pipe (`| head`) is not an error here either
            stream.flush()
    os._exit(code)


def _main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    debug = "--debug" in argv
    try:
        args = parse_args(argv)
        args.argv = list(argv)   # the command line as given, for what a run records (a report's "Command")
        with warnings.catch_warnings():  # a warning is one line too, e.g. a loaded q holding NaN
            warnings.simplefilter("always", UserWarning)  # every run says it, not only the first in a process
            warnings.showwarning = _show_warning
            return args.func(args)  # the handler imports what it needs (torch ...) after its own checks
    except UsageError as e:
        return _fail(f"error: {one_line(e)}", EXIT_BAD_INPUT, False)  # bad input: one line, even with --debug
    except Failure as e:
        return _fail(f"failed: {one_line(e)}", EXIT_FAILURE, debug)
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
        return _fail(f"failed: {type(e).__name__}: {one_line(e)}{hint}", EXIT_FAILURE, debug)


if __name__ == "__main__":
    sys.exit(main())

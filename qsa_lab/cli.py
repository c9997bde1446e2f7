"""`qsa-lab` command line: diff, repro, bench, doctor (CONTRACT.md)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

EXIT_BAD_ARGS = 2


class UsageError(Exception):
    """Bad arguments: one line on stderr, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line naming the argument, not the usage block
        raise UsageError(message)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _add_case_args(p):
    from .case import GROUPINGS, KV_DTYPES, LAYOUTS
    from .poison import PLANES, SITES
    from .routes import BACKENDS

    g = p.add_argument_group("geometry")
    g.add_argument("geometry", nargs="?", choices=["decode", "causal3"], default=None,
                   help="preset: decode = the report's 19 decode-like rows; causal3 = 24 rows of 3 requests, scatter")
    g.add_argument("--rows", type=int)
    g.add_argument("--requests", type=int)
    g.add_argument("--layout", choices=LAYOUTS)
    g.add_argument("--context", type=int, help="tokens per request (8192)")
    g.add_argument("--topk", type=int, help="selected blocks per row (512)")
    g.add_argument("--page-size", type=int)
    g.add_argument("--q-heads", type=int)
    g.add_argument("--head-dim", type=int)
    g.add_argument("--kv-dtype", choices=KV_DTYPES)
    g.add_argument("--seed", type=int)
    g.add_argument("--grouping", choices=GROUPINGS, help="consecutive rows (default) or request-aligned groups")
    q = p.add_argument_group("poison")
    q.add_argument("--poison", choices=SITES, default="none")
    q.add_argument("--dims", type=_int_list, help="head dims for targeted / stale-tail (102,152,168,170,230)")
    q.add_argument("--plane", choices=tuple(PLANES), default="v")
    q.add_argument("--poison-seed", type=int, default=0)
    p.add_argument("--backend", choices=BACKENDS, default="auto")


def _geometry(args):
    from .case import Geometry
    from .repro import CAUSAL3, DECODE

    base = {"decode": DECODE, "causal3": CAUSAL3, None: Geometry()}[args.geometry]
    names = ["rows", "requests", "layout", "context", "topk", "page_size", "q_heads", "head_dim", "kv_dtype", "seed"]
    over = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    if args.grouping:
        over["group_rows"] = args.grouping
    return base.replace(**over)


def _print_table(result, out=sys.stdout):
    import pandas as pd

    from .analysis import route_table

    t = route_table(result)
    t["nan_dims"] = t["nan_dims"].map(lambda d: ",".join(map(str, d[:12])) + (" ..." if len(d) > 12 else ""))
    with pd.option_context("display.width", 200, "display.max_columns", 10, "display.float_format", "{:.3g}".format):
        print(t.to_string(), file=out)


def _writable(arg: str, path, force: bool) -> Path:
    """Check an output path before any work: never replace a file without --force."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"argument {arg}: {path} is a directory")
    if not path.parent.is_dir():
        raise UsageError(f"argument {arg}: folder {path.parent} does not exist")
    if path.exists() and not force:
        raise UsageError(f"argument {arg}: {path} exists (add --force to overwrite)")
    return path


def _replay(args):
    """--load: the saved case through the saved routes; compares plan and outputs bit for bit."""
    import torch

    from . import io
    from .plan import plan_groups
    from .routes import run_routes

    given = [f"--{k.replace('_', '-')}" for k in ("geometry", "rows", "requests", "layout", "context", "topk",
                                                   "page_size", "q_heads", "head_dim", "kv_dtype", "seed",
                                                   "grouping", "dims")
             if getattr(args, k) is not None]
    given += [f"--{k.replace('_', '-')}" for k, d in (("poison", "none"), ("plane", "v"), ("poison_seed", 0))
              if getattr(args, k) != d]
    if given:
        raise UsageError(f"argument --load: replays the saved case; drop {', '.join(given)}")
    case, saved_plan, saved, _ = io.load(args.load)
    result = run_routes(case, routes=list(saved) or None, backend=args.backend)
    plan = plan_groups(case)
    differs = [f"plan.{k}" for k in ("microblocks", "masks", "seq_len")
               if not torch.equal(getattr(plan, k), getattr(saved_plan, k))]
    differs += [r for r in saved if not torch.equal(saved[r].view(torch.int16), result.outputs[r].view(torch.int16))]
    return case, result, "bit-identical" if not differs else f"DIFFERS on {differs}"


def cmd_diff(args) -> int:
    from . import io
    from .analysis import diff_json
    from .case import build_case
    from .poison import apply_poison
    from .routes import run_routes

    if args.save:
        _writable("--save", args.save, args.force)
    if args.json and args.json != "-":
        _writable("--json", args.json, args.force)
    if args.load:
        case, result, replay = _replay(args)
    else:
        case = apply_poison(build_case(_geometry(args)), args.poison, plane=args.plane, dims=args.dims,
                            seed=args.poison_seed)
        result = run_routes(case, backend=args.backend)
        replay = None
    doc = diff_json(result)
    if args.json == "-":
        print(json.dumps(doc, indent=2))
    else:
        print(f"# {case.describe()}  [backend: {result.backend}]")
        p = case.poison
        print(f"# poison: {p.get('nan_bytes', 0)} NaN bytes, dims {p.get('poisoned_dims', [])}"
              + (f"; {p['inf_bytes']} Inf bytes (0 * Inf = NaN too)" if p.get("inf_bytes") else ""))
        _print_table(result)
        if replay:
            print(f"# replay of {args.load}: {replay}")
        if args.json:
            Path(args.json).write_text(json.dumps(doc, indent=2))
    if args.save:
        io.save(result, args.save, overwrite=args.force)
        if args.json != "-":
            print(f"# saved {args.save}")
    return 0 if replay is None or replay == "bit-identical" else 1


def cmd_repro(args) -> int:
    from .repro import run_repro

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = _writable("--out", out / "repro.csv", args.force)
    json_path = _writable("--out", out / "repro.json", args.force)
    table, results = run_repro(backend=args.backend, progress=not args.quiet)
    backend = results[0].backend if results else args.backend
    print(f"# backend: {backend}")
    show = ["case", "nan_bytes", "nan[xqa]", "nan[grouped]", "nan[grouped+kernel_fix]", "nan[grouped+pad_fix]",
            "nan[grouped+masked_load]", "max|grouped+kernel_fix-xqa|", "report_grouped_nan"]
    print(table[show].to_string(index=False))
    print("# the report's numbers come from its own data; ours from a regenerated case with the same mechanism")
    table.to_csv(csv_path, index=False)
    json_path.write_text(json.dumps({"schema": "qsa_lab.repro/1", "backend": backend,
                                     "cases": json.loads(table.to_json(orient="records"))}, indent=2))
    written = [csv_path, json_path]
    if not args.no_figures:
        from .figures import write_repro_figures

        # without --force an existing figure is kept and the new one numbered (export_figure)
        written += write_repro_figures(results, args.figures, table=table, overwrite=args.force)
    for w in written:
        print(f"# wrote {w}")
    return 0


def cmd_bench(args) -> int:
    import torch

    if not torch.cuda.is_available():
        print("qsa-lab bench: no CUDA GPU visible; timings need one (committed H200 numbers: data/bench_h200.json)",
              file=sys.stderr)
        return 1
    from .kernels.bench import run_bench

    run_bench(json_path=args.json)
    return 0


def cmd_doctor(args) -> int:
    import platform

    from . import __version__, kernels

    info = {"qsa_lab": __version__, "python": platform.python_version(), **kernels.status()}
    width = max(map(len, info))
    for k, v in info.items():
        print(f"{k:<{width}}  {v}")
    backend = "cuda (compiled kernels)" if kernels.available() else "emulate (PyTorch emulation)"
    print(f"{'backend auto':<{width}}  {backend}")
    return 0


# -- canary -----------------------------------------------------------------------------------------

CANARY_FLAGS = {"kernels": "--kernels", "regions": "--regions", "payloads": "--payloads", "backend": "--backend",
                "dims": "--dims"}
VERDICT_MARKS = {"clean": ".", "nan-leak": "N", "inf-leak": "I", "finite-leak": "F"}


def _name_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def _canary_matrix(report) -> str:
    """Kernels down, region/plane/payload across: . clean, N NaN, I Inf, F finite leak."""
    import pandas as pd

    df = report.frame()
    if df.empty:
        return "(no results)"
    df["mark"] = df.verdict.map(VERDICT_MARKS)
    t = df.pivot_table(index="kernel", columns=["region", "plane", "payload"], values="mark", aggfunc="first",
                       sort=False).fillna("-")
    with pd.option_context("display.width", 250, "display.max_columns", 200):
        return t.to_string()


def cmd_canary(args) -> int:
    """qsa-lab canary: every kernel x region x plane x payload, a control and a poisoned run."""
    from .canary import run_canary
    from .canary.kernels import builtin_kernels

    if args.json and args.json != "-":
        _writable("--json", args.json, args.force)
    kernels = (args.kernels or []) + (args.kernel or [])
    try:
        report = run_canary(kernels or None, regions=args.regions, payloads=args.payloads, backend=args.backend,
                            kv_dtype=args.kv_dtype, progress=sys.stderr.isatty() and args.json != "-")
    except (ValueError, TypeError) as e:
        arg, _, problem = str(e).partition(": ")
        if arg in CANARY_FLAGS:  # name the option, not the Python argument
            raise UsageError(f"argument {CANARY_FLAGS[arg]}: {problem}") from None
        raise
    doc = report.to_json()
    leaks = report.leaks()
    builtin = set(builtin_kernels())
    user_failed = [s for s in report.skipped if s.get("kernel") and s["kernel"] not in builtin]
    if args.json == "-":
        print(json.dumps(doc, indent=2))
    else:
        print(f"# canary: {report.case.describe()}; {doc['pool_pages']} pool pages; "
              f"backend {report.backend}, device {report.device}")
        print(f"# regions (slots): {doc['regions']}; payload bits: {doc['payload_bits']}")
        print(_canary_matrix(report))
        print("# . clean   N NaN leak   I Inf leak   F finite leak (bits changed)   - not run")
        for s in report.skipped:
            what = "/".join(s[k] for k in ("kernel", "region", "plane", "payload") if k in s)
            print(f"# skipped {what}: {s['reason']}")
        print(f"# {len(leaks)} leaking of {len(report.results)} results")
        if args.json:
            Path(args.json).write_text(json.dumps(doc, indent=2))
            print(f"# wrote {args.json}")
    if args.fail_on_leak and (leaks or user_failed):
        return 1
    return 0


def _add_canary_parser(sub):
    from .case import KV_DTYPES
    from .routes import BACKENDS

    c = sub.add_parser("canary", help="poison every byte a paged-attention call does not attend; which kernels leak",
                       description="For each kernel x region x plane (k, v) x payload: a zero-filled control run and "
                                   "a poisoned run; verdict clean, nan-leak, inf-leak or finite-leak.")
    c.add_argument("--kernels", type=_name_list, metavar="K,..",
                   help="qsa:<route>, torch:sdpa-math|sdpa-efficient|sdpa-cudnn|sdpa-flash|sdpa-cut|flex|flex-paged, "
                        "or module:function / file.py:function (default: every built-in kernel)")
    c.add_argument("--kernel", action="append", metavar="module:function",
                   help="your own kernel fn(PagedCall) -> [rows, q_heads, head_dim] (repeatable)")
    c.add_argument("--regions", type=_name_list, metavar="R,..",
                   help="null-block, stale-tail, stale-microblock, free-pages, unselected (default: all)")
    c.add_argument("--payloads", type=_name_list, metavar="P,..", help="nan, inf, max, zero (default nan,inf,max)")
    c.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="qsa routes: compiled kernels or emulation; torch kernels on the GPU unless 'emulate'")
    c.add_argument("--kv-dtype", choices=KV_DTYPES, default="fp16", help="the pool's storage dtype (fp16)")
    c.add_argument("--json", metavar="PATH|-", help="write the qsa_lab.canary/1 document (- for stdout)")
    c.add_argument("--force", action="store_true", help="allow --json to overwrite a file")
    c.add_argument("--fail-on-leak", action="store_true",
                   help="exit 1 when anything leaks (or a module:function kernel could not run)")


def build_parser():
    p = _Parser(prog="qsa-lab", description="Reproduce, fingerprint and fix the grouped page4 null-block NaN.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    d = sub.add_parser("diff", help="one case through every route; prints a table")
    _add_case_args(d)
    d.add_argument("--json", metavar="PATH|-", help="write the qsa_lab.diff/1 document (- for stdout)")
    d.add_argument("--save", metavar="PATH", help="save case, plan and outputs (safetensors)")
    d.add_argument("--load", metavar="PATH", help="replay a saved case")
    d.add_argument("--force", action="store_true", help="allow --save / --json to overwrite a file")
    r = sub.add_parser("repro", help="the report's verification table plus extra cases; CSV, JSON, figures")
    r.add_argument("--out", default="results")
    r.add_argument("--figures", default="figures")
    r.add_argument("--backend", choices=("auto", "emulate", "cuda"), default="auto")
    r.add_argument("--no-figures", action="store_true")
    r.add_argument("--force", action="store_true", help="replace earlier results and figures")
    r.add_argument("--quiet", action="store_true")
    b = sub.add_parser("bench", help="GPU timings of every route and fix")
    b.add_argument("--json", metavar="PATH")
    sub.add_parser("doctor", help="what this machine can do")
    _add_canary_parser(sub)
    return p


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return {"diff": cmd_diff, "repro": cmd_repro, "bench": cmd_bench, "doctor": cmd_doctor,
                "canary": cmd_canary}[args.cmd](args)
    except (UsageError, ValueError, FileExistsError, FileNotFoundError) as e:
        print(f"qsa-lab: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return EXIT_BAD_ARGS
    except BrokenPipeError:  # output piped into `head` and closed early: not an error
        sys.stdout = open(os.devnull, "w")
        return 0


if __name__ == "__main__":
    sys.exit(main())

"""`qsa-lab canary`: its options and its handler (qsa_lab.app.cli registers them).

Exit codes: 0 every requested check ran and none leaked; 1 a leak; 3 a kernel error, an
unstable control, a modified input or a requested kernel with no check at all (one line per
kernel on stderr); 2 bad input (one line naming the option); 130 interrupted.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys

#: API argument -> CLI option, so that an error names what the user typed
FLAGS = {"kernels": "--kernels", "regions": "--regions", "payloads": "--payloads", "backend": "--backend",
         "dims": "--dims", "planes": "--planes", "attend": "--attend", "timeout": "--timeout", "case": "--case",
         "kv_dtype": "--kv-dtype",
         "rows": "--rows", "requests": "--requests", "context": "--context", "topk": "--topk",
         "page_size": "--page-size", "q_heads": "--q-heads", "kv_heads": "--kv-heads", "head_dim": "--head-dim",
         "query_len": "--query-len", "seed": "--seed", "layout": "--layout", "selection": "--selection",
         "overlap": "--overlap", "free_pages": "--free-pages"}
GEOMETRY = ("rows", "requests", "context", "topk", "page_size", "q_heads", "kv_heads", "head_dim", "query_len",
            "seed", "layout", "selection", "overlap", "free_pages")
#: what a script that still passes the removed --fail-on-leak is told (stderr, after the run)
FAIL_ON_LEAK_GONE = ("qsa-lab: note: --fail-on-leak: no longer an option and ignored: a leak always exits 1 "
                     "(and a failed check 3); drop it from the command")


def _name_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def _kernel_list(text: str) -> list[str]:
    """_name_list, refusing an earlier spelling of a qsa route with its name now (labels.was_renamed)."""
    from qsa_lab.routes.labels import was_renamed

    names = _name_list(text)
    for name in names:
        message = name.startswith("qsa:") and was_renamed(name[4:], prefix="qsa:")
        if message:
            raise argparse.ArgumentTypeError(message)
    return names


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return v


def add_parser(sub, parents=()):
    from qsa_lab.app.args import fraction as _overlap, int_list as _int_list, integer as _int
    from qsa_lab.model.geometry import BACKENDS, KV_DTYPES, LAYOUTS, SELECTIONS

    c = sub.add_parser("canary", parents=list(parents),
                       help="poison every byte a paged-attention call does not attend; which kernels leak",
                       description="For each kernel x region x plane (k, v) x payload: a poisoned run compared bit "
                                   "for bit with the same call zero-filled (run twice); verdict clean, nan-leak, "
                                   "inf-leak, finite-leak, error, unstable-control, input-modified or n/a. "
                                   "Exit 0 clean, 1 a leak, 3 a kernel failed, 2 bad input.")
    k = c.add_argument_group("kernels and matrix")
    k.add_argument("--kernels", type=_kernel_list, metavar="K,..",
                   help="qsa:<route>, torch:sdpa-math|sdpa-efficient|sdpa-cudnn|sdpa-flash|sdpa-cut|flex|flex-paged, "
                        "flashinfer:decode|decode-tc|prefill|prefill-fa2, vllm:unified|unified-3d (README "
                        "'Third-party kernels'), or module:function / file.py:function (default: every built-in "
                        "qsa: and torch: kernel)")
    k.add_argument("--vllm-src", metavar="PATH", help="a vLLM source checkout for the vllm: kernels "
                   "(default: $QSA_LAB_VLLM_SRC, else an installed vllm)")
    k.add_argument("--kernel", action="append", metavar="module:function",
                   help="your own kernel fn(PagedCall) -> [rows, q_heads, head_dim], run in a worker process "
                        "(repeatable; default: none)")
    k.add_argument("--regions", type=_name_list, metavar="R,..",
                   help="null-block, stale-tail, stale-microblock, free-pages, other-requests and the spec's "
                        "in-range one: unselected (sparse), out-of-window (window) (default: all of the spec); "
                        "other-rows, the per-row rule (slots other rows attend, judged on each row alone: a "
                        "call per row), runs only when named")
    k.add_argument("--payloads", type=_name_list, metavar="P,..", help="nan, inf, max, zero (default nan,inf,max)")
    k.add_argument("--planes", type=_name_list, metavar="P,..", help="k, v (default k,v)")
    k.add_argument("--dims", type=_int_list, metavar="D,..", help="head dims to poison (default: every dim)")
    k.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="qsa routes: compiled kernels or emulation (only qsa: kernels build qsa_lab's extension); "
                        "the other kernels run on the GPU unless 'emulate' (default auto)")
    k.add_argument("--timeout", type=_seconds, metavar="S",
                   help="seconds one call of your own kernel may take before it is an error (default 600); "
                        "built-in kernels run in this process, unbounded (Ctrl-C stops them)")
    g = c.add_argument_group("the call's geometry and attention (default: 10 rows of 3 requests of 33, 32, 31 "
                             "tokens, page 16, 2 query heads, 1 KV head, head dim 16, fp16, attend sparse)")
    g.add_argument("--attend", metavar="SPEC",
                   help="what each row attends: dense (causal, the whole prefix), window:W or window:W,sink:S, "
                        "sparse (the rows' 4-token block selections; the qsa routes' semantics) (default sparse; "
                        "a --case without selections: dense)")
    g.add_argument("--rows", type=_int, help="query rows (default 10)")
    g.add_argument("--requests", type=_int, help="requests; request r holds context - r tokens (default 3)")
    g.add_argument("--context", type=_int, help="tokens of request 0 (default 33)")
    g.add_argument("--query-len", type=_int, metavar="N",
                   help="query rows per request: 1 = decode, more = a prefill chunk (sets --rows; default: "
                        "rows spread over the requests)")
    g.add_argument("--page-size", type=_int, help="tokens per page, a multiple of 4 (default 16)")
    g.add_argument("--q-heads", type=_int, help="query heads (default 2)")
    g.add_argument("--kv-heads", type=_int, help="KV heads, a divisor of --q-heads: GQA (default 1)")
    g.add_argument("--head-dim", type=_int, help="head dimension, a multiple of 16 (default 16)")
    g.add_argument("--topk", type=_int, help="selected 4-token blocks per row, for the sparse spec (default 16)")
    g.add_argument("--kv-dtype", choices=KV_DTYPES, help="the pool's storage dtype (default fp16)")
    g.add_argument("--seed", type=_int, help="seed of q, K/V and the selections (default 0)")
    g.add_argument("--layout", choices=LAYOUTS, help="physical page order (default contiguous)")
    g.add_argument("--selection", choices=SELECTIONS, help="how rows select blocks (default indexer)")
    g.add_argument("--overlap", type=_overlap, metavar="F", help="neighbour overlap of indexer selections (sparse spec; default 0.8)")
    g.add_argument("--free-pages", type=_int, metavar="N", help="spare pages no block table references (default 2)")
    g.add_argument("--case", metavar="FILE",
                   help="the call from a file instead: a `qsa-lab diff --save` file or your engine's own dump "
                        "(safetensors or .pt; README 'Canary any attention kernel' gives the format); takes no "
                        "geometry option but --attend (default: none: the case is built from the geometry options)")
    o = c.add_argument_group("output")
    o.add_argument("--json", metavar="PATH|-", help="write the qsa_lab.canary/1 document (- for stdout; default: none)")
    o.add_argument("--report", metavar="DIR", help="write a leak report there: report.md / .html, the leak matrix, "
                   "versions, and per leaking cell its smallest poisoned call with a replay command (default: none)")
    o.add_argument("--force", action="store_true", help="let --json / --report replace files (default: never)")
    o.add_argument("--fail-on-leak", action="store_true", help=argparse.SUPPRESS)   # removed: FAIL_ON_LEAK_GONE
    return c


def _kernel_flag(message: str, args) -> str:
    """'kernels: ...' -> the option the named kernel came from."""
    m = re.match(r"kernels: '([^']*)'", message)
    own = args.kernel or []
    if (m and m.group(1) in own) or (not m and own and not args.kernels):
        return "--kernel"
    return "--kernels"


@contextlib.contextmanager
def _quiet_stdout(active: bool):
    """While kernels run for `--json -`: whatever they print goes to stderr, fd 1 included."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = None
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:
        saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def _group_cells(cells) -> str:
    regions = list(dict.fromkeys(r.region for r in cells))
    planes = list(dict.fromkeys(r.plane for r in cells))
    payloads = list(dict.fromkeys(r.payload for r in cells))
    if len(regions) * len(planes) * len(payloads) == len(cells):
        return f"{','.join(regions)} / {','.join(planes)} / {','.join(payloads)}"
    return ", ".join(f"{r.region}/{r.plane}/{r.payload}" for r in cells)


def notes(report) -> list[str]:
    """One line per group of non-clean cells: same verdict, detail and cells; kernels merged."""
    from qsa_lab.analysis.leaks import FAILURES, LEAKS

    groups = {}
    for r in report.non_clean():
        detail = r.error or (f"changed {', '.join(r.modified)}" if r.modified else "") or r.note
        # a failure's detail differs cell by cell (counts, differences): its first one stands for all
        key = (r.kernel, r.verdict, "" if r.verdict in FAILURES else detail)
        groups.setdefault(key, [detail, []])[1].append(r)
    groups = {(k, v, d): cells for (k, v, _), (d, cells) in groups.items()}
    merged = {}
    for (kernel, verdict, detail), cells in groups.items():
        counts = ""
        if verdict in LEAKS:
            counts = f" ({sum(c.nan for c in cells)} NaN, {sum(c.inf for c in cells)} Inf, " \
                     f"{sum(c.finite_changed for c in cells)} finite changed)"
        merged.setdefault((verdict, _group_cells(cells), counts, detail), []).append(kernel)
    out = []
    for (verdict, where, counts, detail), kernels in merged.items():
        who = "every kernel" if len(kernels) > 1 and len(kernels) == len(report.kernels) else ", ".join(kernels)
        out.append(f"# {who}: {verdict} at {where}{counts}" + (f": {detail}" if detail else ""))
    return out


def matrix(report) -> str:
    """Kernels down, region/plane/payload across, one mark per verdict (qsa_lab.plotting.verdicts)."""
    import pandas as pd

    from qsa_lab.analysis.leaks import NOT_RUN
    from qsa_lab.plotting.verdicts import MARKS

    df = report.frame()
    if df.empty:
        return "(no results)"
    df["mark"] = df.verdict.map(MARKS)
    t = df.pivot_table(index="kernel", columns=["region", "plane", "payload"], values="mark", aggfunc="first",
                       sort=False).fillna(MARKS[NOT_RUN])
    with pd.option_context("display.width", 250, "display.max_columns", 200):
        return t.to_string()


def _overlaps(kernels: list) -> bool:
    """Does the run hold a kernel of overlap.OVERLAP beside another one (the default: every kernel),
    and a core to spare for it?"""
    from qsa_lab.canary.overlap import OVERLAP, idle_core

    mixed = not kernels or (any(k in OVERLAP for k in kernels) and any(k not in OVERLAP for k in kernels))
    return mixed and idle_core()


def kernel_source(spec: str) -> str | None:
    """The file a user's kernel `file.py:function` or `module:function` is read from (found on
    sys.path as the worker would, nothing imported); None for a built-in name or a module not found."""
    from pathlib import Path

    name = spec.rpartition(":")[0]
    if not name or spec.startswith(("qsa:", "torch:", "flashinfer:", "vllm:")):
        return None
    if name.endswith(".py"):
        return name
    parts = name.split(".")
    for entry in ["", *sys.path]:   # the worker finds modules in the current folder too
        base = Path(entry or ".", *parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return str(candidate)
    return None


def run(args) -> int:
    from qsa_lab.app.args import UsageError, check_outputs as _outputs

    geometry = {n: getattr(args, n) for n in GEOMETRY if getattr(args, n, None) is not None}
    for flag, value in (("--case", args.case), ("--report", args.report)):
        if value is not None and not value.strip():
            raise UsageError(f"{flag}: empty path")
    if args.case and (geometry or args.kv_dtype):   # the case file holds its own pool and its dtype
        given = [*geometry, *(["kv_dtype"] if args.kv_dtype else [])]
        raise UsageError(f"--case: takes no geometry option (got {', '.join(FLAGS[n] for n in given)})")
    outs = _outputs(args, {"--json": None if args.json == "-" else args.json}, _inputs(args))
    kernels = (args.kernels or []) + (args.kernel or [])
    second = None
    if args.backend != "cuda" and _overlaps(kernels):
        from qsa_lab.canary.overlap import start

        second = start()   # FlexAttention's slow start runs in a second process while this one imports torch
    try:
        code = _run(args, outs, kernels, geometry, second)
    finally:
        if second is not None:
            second.close()   # not taken (bad input found later, a GPU run): ended with the command
    if args.fail_on_leak:   # after the run: bad input stays one line on stderr
        print(FAIL_ON_LEAK_GONE, file=sys.stderr)
    return code


def _inputs(args) -> dict:
    """{option: path} of the run's input files (the case, every kernel's source, whichever option
    and form named it), which no output may be or hold."""
    out = {"--case": args.case} if args.case else {}
    for flag, specs in (("--kernels", args.kernels), ("--kernel", args.kernel)):
        for spec in specs or []:
            source = kernel_source(spec)
            if source is not None and source not in out.values():   # two kernels of one file: one input
                out[f"{flag} {spec}"] = source
    return out


def _run(args, outs: dict, kernels: list, geometry: dict, second=None) -> int:
    from qsa_lab.app.args import UsageError, blame as _blame

    from qsa_lab.canary.case import load_case  # torch from here on: every argument above was checked without it
    from qsa_lab.canary.runner import run_canary
    report_inputs = _inputs(args)
    if args.report:  # checked before any kernel runs
        from qsa_lab.canary.report import check_report_dir

        with _blame({"report": "--report"}, "--report"):
            check_report_dir(args.report, args.force, report_inputs)
    if args.vllm_src:
        from qsa_lab.canary.adapters.vllm import set_source

        with _blame({"path": "--vllm-src"}, "--vllm-src"):
            set_source(args.vllm_src)

    if second is not None and args.json != "-":
        import pandas  # noqa: F401 - the matrix printed at the end needs it; this process is ahead of the second one

    case = None
    if args.case:
        with _blame({"attend": "--attend"}, "--case"):
            case = load_case(args.case, args.attend)
    try:
        with _blame(FLAGS, "canary"), _quiet_stdout(args.json == "-"):
            report = run_canary(kernels or None, regions=args.regions, payloads=args.payloads,
                                planes=args.planes or ("k", "v"), backend=args.backend,
                                kv_dtype=args.kv_dtype, dims=args.dims, attend=None if case else args.attend,
                                case=case, progress=sys.stderr.isatty() and args.json != "-", second=second,
                                **({"timeout": args.timeout} if args.timeout else {}), **geometry)
    except UsageError as e:
        msg = str(e)
        if msg.startswith("--kernels:"):
            msg = _kernel_flag("kernels:" + msg[len("--kernels:"):], args) + msg[len("--kernels"):]
        raise UsageError(msg) from e
    doc = report.to_json()
    if args.json == "-":
        print(json.dumps(doc, indent=2))
    else:
        print(f"# canary: {report.case.describe()}; {doc['pool_pages']} pool pages; "
              f"backend {report.backend}, device {report.device}")
        print(f"# regions (slots): {doc['regions']}; payload bits: {doc['payload_bits']}")
        from qsa_lab.analysis.leaks import STRAY_WRITE, VERDICTS
        from qsa_lab.plotting.verdicts import legend_line

        print(matrix(report))
        print(legend_line([v for v in VERDICTS if v != STRAY_WRITE]))   # a kernel call writes no pool
        for line in notes(report):
            print(line)
        for s in report.skipped:
            what = "/".join(s[k] for k in ("kernel", "region", "plane", "payload") if k in s)
            print(f"# skipped {what}: {s['reason']}")
        print(f"# {report.summary()}")
        if "--json" in outs:
            from qsa_lab.support.outputs import write_text

            with _blame({}, "--json"):
                write_text(outs["--json"], json.dumps(doc, indent=2) + "\n", "--json", force=args.force)
            print(f"# wrote {args.json}")
    if args.report:
        from qsa_lab.canary.report import write_report

        import shlex

        with _blame({"report": "--report"}, "--report"):
            path = write_report(report, args.report, force=args.force, inputs=report_inputs,
                                command=shlex.join(["qsa-lab", *getattr(args, "argv", ["canary", "..."])]),
                                progress=lambda m: print(f"# {m}", file=sys.stderr))
        print(f"# wrote {path} (and report.html, leak_matrix.png, calls/)", file=sys.stderr if args.json == "-" else None)
    debug = getattr(args, "debug", False)
    for f in report.failures():
        if debug:
            for r in report.results:
                if r.kernel == f["kernel"] and r.traceback:
                    print(r.traceback, file=sys.stderr, end="" if r.traceback.endswith("\n") else "\n")
                    break
        print(f"qsa-lab: canary: {f['kernel']}: {f['message']}", file=sys.stderr)
    return report.exit_code()

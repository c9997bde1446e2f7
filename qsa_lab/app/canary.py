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
import sys

from qsa_lab.app.args import publish, seconds

#: API argument -> CLI option, so that an error names what the user typed
FLAGS = {"kernels": "--kernels", "regions": "--regions", "payloads": "--payloads", "backend": "--backend",
         "dims": "--dims", "planes": "--planes", "attend": "--attend", "timeout": "--timeout", "case": "--case",
         "kv_dtype": "--kv-dtype",
         "rows": "--rows", "requests": "--requests", "context": "--context", "topk": "--topk",
         "page_size": "--page-size", "q_heads": "--q-heads", "kv_heads": "--kv-heads", "head_dim": "--head-dim",
         "query_len": "--query-len", "seed": "--seed", "layout": "--layout", "selection": "--selection",
         "overlap": "--overlap", "free_pages": "--free-pages", "max_memory": "--max-memory"}
GEOMETRY = ("rows", "requests", "context", "topk", "page_size", "q_heads", "kv_heads", "head_dim", "query_len",
            "seed", "layout", "selection", "overlap", "free_pages")
#: what a script that still passes the removed --fail-on-leak is told (stderr, after the run)
FAIL_ON_LEAK_GONE = ("qsa-lab: note: --fail-on-leak: no longer an option and ignored: a leak always exits 1 "
                     "(and a failed check 3); drop it from the command")


def _name_list(text: str) -> list[str]:
    """Comma-separated names, each once (a name given twice runs once), in the order given."""
    names = list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def _kernel_names(option: str):
    """An argparse type: comma-separated kernel names (--kernels) or one (--kernel), each parsed
    here, once (qsa_lab.canary.names), recording `option`."""
    from qsa_lab.canary.names import KernelNameError, parse_kernel

    def parse(text: str):
        try:
            names = [parse_kernel(n, option) for n in (_name_list(text) if option == "--kernels" else [text])]
        except KernelNameError as e:
            raise argparse.ArgumentTypeError(e.problem) from None
        return names if option == "--kernels" else names[0]
    return parse


def add_parser(sub, parents=()):
    from qsa_lab.app.args import fraction as _overlap, int_list as _int_list, integer as _int, size as _size
    from qsa_lab.model.geometry import BACKENDS, CANARY_RANGES, KV_DTYPES, LAYOUTS, RANGES, SELECTIONS

    def rng(name, ranges=RANGES):
        return "{}..{}".format(*ranges[name])

    c = sub.add_parser("canary", parents=list(parents),
                       help="poison every byte a paged-attention call does not attend; which kernels leak",
                       description="For each kernel x region x plane (k, v) x payload: a poisoned run compared bit "
                                   "for bit with the same call zero-filled (run twice); verdict clean, nan-leak, "
                                   "inf-leak, finite-leak, error, unstable-control, input-modified or n/a. "
                                   "Exit 0 clean, 1 a leak, 3 a kernel failed, 2 bad input.")
    k = c.add_argument_group("kernels and matrix")
    k.add_argument("--kernels", type=_kernel_names("--kernels"), metavar="K,..",
                   help="qsa:<route>, torch:sdpa-math|sdpa-efficient|sdpa-cudnn|sdpa-flash|sdpa-cut|flex|flex-paged, "
                        "flashinfer:decode|decode-tc|prefill|prefill-fa2, vllm:unified|unified-3d (README "
                        "'Third-party kernels'), or module:function / file.py:function (default: every built-in "
                        "qsa: and torch: kernel)")
    k.add_argument("--vllm-src", metavar="PATH", help="a vLLM source checkout for the vllm: kernels "
                   "(default: $QSA_LAB_VLLM_SRC, else an installed vllm)")
    k.add_argument("--kernel", action="append", type=_kernel_names("--kernel"), metavar="module:function",
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
    k.add_argument("--timeout", type=seconds, metavar="S",
                   help="seconds one call of your own kernel may take before it is an error (default 600); "
                        "built-in kernels run in this process, unbounded (Ctrl-C stops them)")
    g = c.add_argument_group("the call's geometry and attention (default: 10 rows of 3 requests of 33, 32, 31 "
                             "tokens, page 16, 2 query heads, 1 KV head, head dim 16, fp16, attend sparse)")
    g.add_argument("--attend", metavar="SPEC",
                   help="what each row attends: dense (causal, the whole prefix), window:W or window:W,sink:S, "
                        "sparse (the rows' 4-token block selections; the qsa routes' semantics) (default sparse; "
                        "a --case without selections: dense)")
    g.add_argument("--rows", type=_int, help=f"query rows (default 10; {rng('rows')})")
    g.add_argument("--requests", type=_int, help=f"requests; request r holds context - r tokens (default 3; "
                                                 f"{rng('requests')})")
    g.add_argument("--context", type=_int, help=f"tokens of request 0 (default 33; {rng('context')})")
    g.add_argument("--query-len", type=_int, metavar="N",
                   help="query rows per request: 1 = decode, more = a prefill chunk (sets --rows; default: "
                        "rows spread over the requests)")
    g.add_argument("--page-size", type=_int, help=f"tokens per page, a multiple of 4 (default 16; {rng('page_size')})")
    g.add_argument("--q-heads", type=_int, help=f"query heads (default 2; {rng('q_heads', CANARY_RANGES)}, e.g. 32 "
                                                f"for Llama-3 8B, 128 for 405B; the qsa: kernels take "
                                                f"{rng('q_heads')} and one KV head, and are skipped otherwise)")
    g.add_argument("--kv-heads", type=_int, help="KV heads, a divisor of --q-heads: GQA, any ratio (default 1; "
                                                 f"{rng('kv_heads', CANARY_RANGES)})")
    g.add_argument("--head-dim", type=_int, help="head dimension, a multiple of 16 (default 16; "
                                                 f"{rng('head_dim', CANARY_RANGES)}, e.g. 64, 128, 256)")
    g.add_argument("--topk", type=_int, help=f"selected 4-token blocks per row, for the sparse spec (default 16; "
                                             f"{rng('topk')})")
    g.add_argument("--kv-dtype", choices=KV_DTYPES, help="the pool's storage dtype (default fp16)")
    g.add_argument("--seed", type=_int, help="seed of q, K/V and the selections (default 0)")
    g.add_argument("--layout", choices=LAYOUTS, help="physical page order (default contiguous)")
    g.add_argument("--selection", choices=SELECTIONS, help="how rows select blocks (default indexer)")
    g.add_argument("--overlap", type=_overlap, metavar="F", help="neighbour overlap of indexer selections (sparse spec; default 0.8)")
    g.add_argument("--free-pages", type=_int, metavar="N", help="spare pages no block table references (default 2)")
    g.add_argument("--max-memory", type=_size, metavar="SIZE",
                   help="refuse a case whose estimated memory is above SIZE, e.g. 4G or 512M, and skip a built-in "
                        "kernel whose working set would take the run above it, saying so (default: half the "
                        "memory available when the command starts)")
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
    from qsa_lab.app.canary_search import add_options

    add_options(c)
    return c


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


def _overlaps(kernels: list) -> bool:
    """Does the run hold a kernel of overlap.OVERLAP beside another one (the default: every kernel),
    and a core to spare for it? kernels: KernelName records."""
    from qsa_lab.canary.overlap import OVERLAP, idle_core

    mixed = not kernels or (any(k.text in OVERLAP for k in kernels) and any(k.text not in OVERLAP for k in kernels))
    return mixed and idle_core()


def kernel_source(name) -> str | None:
    """The file a user's kernel (a KernelName of kind file or module) is read from (found on
    sys.path as the worker would, nothing imported); None for a built-in or a module not found."""
    from pathlib import Path

    from qsa_lab.canary.names import FILE, MODULE

    if name.kind == FILE:
        return name.source
    if name.kind != MODULE:
        return None
    parts = name.source.split(".")
    for entry in [*sys.path, ""]:   # the worker finds modules in the current folder too, last
        base = Path(entry or ".", *parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return str(candidate)
    return None


def run(args) -> int:
    from qsa_lab.app.args import UsageError, check_outputs as _outputs

    geometry = {n: getattr(args, n) for n in GEOMETRY if getattr(args, n, None) is not None}
    if getattr(args, "search", False):
        from qsa_lab.app.canary_search import run as search

        return search(args, FLAGS, geometry, _inputs(args), _quiet_stdout)
    if getattr(args, "budget", None) is not None:
        raise UsageError("--budget: only with --search")
    for flag, value in (("--case", args.case), ("--report", args.report)):
        if value is not None and not value.strip():
            raise UsageError(f"{flag}: empty path")
    if args.case and (geometry or args.kv_dtype):   # the case file holds its own pool and its dtype
        given = [*geometry, *(["kv_dtype"] if args.kv_dtype else [])]
        raise UsageError(f"--case: takes no geometry option (got {', '.join(FLAGS[n] for n in given)})")
    outs = _outputs(args, {"--json": None if args.json == "-" else args.json}, _inputs(args))
    kernels = (args.kernels or []) + (args.kernel or [])
    second = None
    if _overlaps(kernels):
        from qsa_lab.canary.overlap import start

        second = start()   # FlexAttention's slow start runs in a second process while this one imports torch
    try:
        code = _run(args, outs, kernels, geometry, second)
    finally:
        if second is not None:
            second.close()   # not taken (bad input found later, a GPU the kernels cannot use): ended with the command
    if args.fail_on_leak:   # after the run: bad input stays one line on stderr
        print(FAIL_ON_LEAK_GONE, file=sys.stderr)
    return code


def _inputs(args) -> dict:
    """{option: path} of the run's input files (the case, every kernel's source, whichever option
    and form named it), which no output may be or hold."""
    out = {"--case": args.case} if args.case else {}
    for name in (args.kernels or []) + (args.kernel or []):
        source = kernel_source(name)
        if source is not None and source not in out.values():   # two kernels of one file: one input
            out[f"{name.option} {name.text}"] = source
    return out


def _run(args, outs: dict, kernels: list, geometry: dict, second=None) -> int:
    from qsa_lab.app.args import blame as _blame

    if sys.stderr.isatty() and args.json != "-":    # the first second says what is coming (torch takes one or more)
        named = ", ".join(k.text for k in kernels) if kernels else "every built-in kernel"
        print(f"# canary: {named}: importing torch, building the case", file=sys.stderr, flush=True)
    from qsa_lab.canary.case import load_case  # torch from here on: every argument above was checked without it
    from qsa_lab.canary.runner import run_canary
    report_inputs = _inputs(args)
    if args.report:  # checked before any kernel runs
        from qsa_lab.canary.report import check_report_dir

        with _blame({"report": "--report"}, "--report"):
            check_report_dir(args.report, args.force, report_inputs, {"--json": outs.get("--json")})
    if args.vllm_src:
        from qsa_lab.canary.adapters.vllm import set_source

        with _blame({"path": "--vllm-src"}, "--vllm-src"):
            set_source(args.vllm_src)

    case = None
    if args.case:
        with _blame({"attend": "--attend"}, "--case"):
            case = load_case(args.case, args.attend)
    with _blame(FLAGS, "canary"), _quiet_stdout(args.json == "-"):   # a kernel's error names its own option
        report = run_canary(kernels or None, regions=args.regions, payloads=args.payloads,
                            planes=args.planes or ("k", "v"), backend=args.backend,
                            kv_dtype=args.kv_dtype, dims=args.dims, attend=None if case else args.attend,
                            case=case, progress=sys.stderr.isatty() and args.json != "-", second=second,
                            max_memory=args.max_memory,
                            **({"timeout": args.timeout} if args.timeout else {}), **geometry)
    doc = report.to_json()

    def show():
        from qsa_lab.canary.render import terminal

        print("\n".join(terminal(report, doc)))

    publish(json.dumps(doc, indent=2) + "\n", args, outs.get("--json"), show)
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

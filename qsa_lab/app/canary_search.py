"""`qsa-lab canary --search`: its options and its handler (qsa_lab.canary.leak_search does the work).

Each named kernel is searched in turn: cases drawn inside its declared limits (the geometry
options given beside --search pin their field), judged by the canary, every leak shrunk and
re-checked. Progress goes to stderr (none under `--json -`). Exit codes as the canary's: 1 a
finding, 3 a kernel failed (or no case ran a check) with no finding, 0 clean, 2 bad input.
"""
from __future__ import annotations

import argparse
import json
import sys

#: geometry options the search cannot pin (it draws the rows of each request itself)
NOT_PINNED = {"rows": "--rows", "selection": "--selection", "overlap": "--overlap", "dims": "--dims"}


def budget(text: str):
    """An argparse type: --budget 120s / 2m (seconds of generation) or 500 (cases)."""
    from qsa_lab.canary.leak_search import parse_budget

    try:
        return parse_budget(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("budget: ")) from None


def add_options(parser) -> None:
    s = parser.add_argument_group("search (qsa_lab.canary.leak_search)")
    s.add_argument("--search", action="store_true",
                   help="search each kernel's declared geometries for leaks instead of one case: cases drawn by "
                        "Hypothesis (seed --seed, no example database), every leak shrunk to its smallest case "
                        "and re-checked; geometry options given pin their field (default: off)")
    s.add_argument("--budget", type=budget, metavar="N|Ts",
                   help="with --search: N cases, or T seconds of generation (120s, 2m); shrinking comes after "
                        "(default 60s)")


def run(args, flags: dict, geometry: dict, inputs: dict, quiet_stdout) -> int:
    """The --search run (args: the canary's parsed arguments; geometry: the geometry options given;
    inputs: {option: path} no output may be; quiet_stdout: the canary's context for `--json -`)."""
    from qsa_lab.app.args import UsageError, blame, check_outputs, publish

    kernels = (args.kernels or []) + (args.kernel or [])
    if not kernels:
        raise UsageError("--search: name the kernel(s) to search (--kernels or --kernel)")
    if args.case:
        raise UsageError("--search: takes no --case (it builds its own cases)")
    for name, flag in NOT_PINNED.items():
        if getattr(args, name, None) is not None:
            raise UsageError(f"{flag}: not with --search (it draws the rows of each request; pin --query-len, "
                             "--requests or the other geometry options)")
    if args.report and len(kernels) > 1:
        raise UsageError("--report: one kernel per search report (name one kernel with --search --report)")
    outs = check_outputs(args, {"--json": None if args.json == "-" else args.json}, inputs)
    if args.report:
        from qsa_lab.canary.leak_search import NAMES
        from qsa_lab.support.outputs import check_new_folder

        with blame({"report": "--report"}, "--report"):
            check_new_folder(args.report, "report", args.force, NAMES, inputs, {"--json": outs.get("--json")})
    from qsa_lab.canary.leak_search import DEFAULT_BUDGET, search, search_json

    pins = {k: v for k, v in geometry.items() if k != "seed"}
    if args.kv_dtype:
        pins["kv_dtype"] = args.kv_dtype
    if args.attend:
        pins["attend"] = args.attend
    quiet = args.json == "-"
    found = []
    with blame({**flags, "budget": "--budget", "seed": "--seed"}, "canary --search"), quiet_stdout(quiet):
        for k in kernels:
            found.append(search(k, budget=args.budget or DEFAULT_BUDGET, seed=args.seed or 0, backend=args.backend,
                                regions=args.regions, planes=args.planes, payloads=args.payloads,
                                timeout=args.timeout, progress=None if quiet else sys.stderr, **pins))
    doc = search_json(found)
    publish(json.dumps(doc, indent=2) + "\n", args, outs.get("--json"),
            lambda: [print("\n".join(f.lines())) for f in found])
    if args.report:
        import shlex

        from qsa_lab.canary.leak_search import write_search_report

        with blame({"report": "--report"}, "--report"):
            replays = write_search_report(found[0], args.report, force=args.force, inputs=inputs,
                                          command=shlex.join(["qsa-lab", *getattr(args, "argv", ["canary", "..."])]))
        out = sys.stderr if quiet else sys.stdout
        for i, line in enumerate(replays, 1):
            print(f"# finding {i}: cd {args.report} && {line}", file=out)
        print(f"# wrote {args.report}/search.json (and cases/, one report folder per finding)", file=out)
    for f in found:
        if f.exit_code() == 3:
            print(f"qsa-lab: canary: {f.kernel}: search found no leak, and "
                  + (f"{len(f.failed())} case(s) failed" if f.failed() else "no case ran a check"), file=sys.stderr)
    codes = [f.exit_code() for f in found]
    return 3 if 3 in codes else max(codes)

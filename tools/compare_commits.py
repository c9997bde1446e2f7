"""Two commits' outputs on this machine, bit for bit (a developer tool; it does not ship).

    python tools/compare_commits.py BASE HEAD [--quick] [--repo PATH] [--verdict-map OLD=NEW,..]

Each commit of the repository (default: the one the current folder is in) is exported with `git
archive` into a temporary folder and run there by this Python (its torch, its thread count),
one commit after the other, through the same cases:
- bitid: the cases of the bit-identity test (this checkout's tests/bitid_cases.py: every repro
  case, the spread of small geometries) through the commit's own Python API, every route's output,
  the float64 reference, each grouped route's log-sum-exp, the plan, the selections, the kv cache
  and q;
- canary: `qsa-lab canary --backend emulate --json` (the default canary);
- diff: `qsa-lab diff ... --backend emulate --json --save` for each of the report's cases;
- repro: `qsa-lab repro --backend emulate --no-figures`, its table (stdout, CSV and JSON);
- scribble: `qsa-lab scribble --json` (transformers' engine, the default model and workload; where
  transformers is installed), and `qsa-lab scribble --engine vllm --json` where vLLM's environment is
  (VLLM_PYTHON, else .venv-vllm beside the repository or this tool);
- cross-request: `qsa-lab cross-request --backend emulate --json`.

Every output must be the same bits (the exit codes too; not a report's date); the first
differences are printed. The scribble and cross-request are compared by their verdicts and counts
(tools/compare_verdicts.py) and exit codes, not their timings, machine facts or wording;
--verdict-map renames BASE's verdicts there first (for a change that renames them on purpose).
Exit 0 identical, 1 they differ, 2 bad input (an unknown commit, a commit whose package this tool
cannot drive). --quick runs a subset (eight small cases, the canary of two routes, one diff, no
repro, the scribble on two regions with NaN, a small cross-request at 2 query heads with NaN, no
vLLM): a check while you work, not before a merge.

The bit-identity test allows each finite value a few ulps (other CPUs sum in other orders), so a
refactor that moves one value by one ulp passes it; run this where every bit must stay.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import compare_verdicts

CHECKOUT = Path(__file__).resolve().parents[1]     # this tool's own checkout: its tests/bitid_cases.py

#: the report's cases as `qsa-lab diff` lines (the first is --quick's)
DIFF_CASES = [
    "decode --poison targeted", "causal3 --poison targeted", "decode --poison random", "causal3 --poison random",
    "decode --poison fp16-state", "causal3 --poison stale-tail", "decode --poison targeted --plane k",
    "decode --poison targeted --kv-dtype fp16", "decode --poison zeros", "causal3 --poison none",
    "decode --poison attended-k", "decode --poison query", "decode --poison attended-v",
]
QUICK_SMALL = 8
QUICK_CANARY = "qsa:grouped,qsa:xqa"
SHOWN = 3           # differences shown per part or file
QUICK_SCRIBBLE = ["--regions", "read-trash,other-requests", "--payloads", "nan"]
QUICK_CROSS_REQUEST = ["--q-heads", "2", "--payloads", "nan", "--context", "403", "--head-dim", "64"]
#: the probes compared by verdicts and counts (their JSON), and their exit codes
VERDICT_PARTS = ("scribble", "cross-request")
VERDICT_FILES = ("scribble.json", "scribble_vllm.json", "cross_request.json")


class BadInput(Exception):
    """-> exit 2, `compare_commits.py: error: <argument>: <problem>`."""


# --------------------------------------------------------------------------- running one commit

def resolve(repo: Path, rev: str, argument: str) -> str:
    out = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise BadInput(f"{argument}: unknown commit {rev!r} in {repo}")
    return out.stdout.strip()


def export(repo: Path, sha: str, into: Path) -> Path:
    """The commit's files in a new folder under `into` (each run its own copy, the same commit too)."""
    tree = Path(tempfile.mkdtemp(prefix=f"{sha[:12]}-", dir=into))
    archive = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", sha], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    if not (tree / "qsa_lab" / "__init__.py").exists():
        raise BadInput(f"commit {sha[:12]}: no qsa_lab package in it")
    return tree


def engines(repo: Path, quick: bool) -> dict:
    """The scribble's engines this machine can run: {"transformers": bool, "vllm": its Python or None}."""
    from importlib.util import find_spec

    given = os.environ.get("VLLM_PYTHON")
    found = [Path(given)] if given else [repo / ".venv-vllm" / "bin" / "python", CHECKOUT / ".venv-vllm" / "bin" / "python"]
    vllm = next((str(p) for p in found if p.exists()), None)
    return {"transformers": find_spec("transformers") is not None, "vllm": None if quick else vllm}


def run_commit(tree: Path, sha: str, out: Path, quick: bool, engine: dict | None = None) -> dict:
    """Every part for the commit exported at `tree`, its files under `out`. -> part -> what ran
    ({"argv", "exit", "stdout", "stderr"} and the files it wrote)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]),
           "PYTHONDONTWRITEBYTECODE": "1", "QSA_LAB_FIGURES": str(out / "figures")}
    engine = engine or {}

    def run(name: str, argv: list[str], **more_env) -> dict:
        p = subprocess.run([sys.executable, *argv], cwd=out, env={**env, **more_env}, capture_output=True, text=True)
        return {"argv": " ".join(argv), "exit": p.returncode, "stdout": p.stdout, "stderr": p.stderr}

    out.mkdir()
    parts = {}
    where = run("where", ["-c", "import qsa_lab; print(qsa_lab.__file__)"])
    if where["exit"] != 0 or not where["stdout"].strip().startswith(str(tree)):
        raise BadInput(f"commit {sha[:12]}: its qsa_lab does not import from its own tree: "
                       f"{(where['stdout'] + where['stderr']).strip()[-300:]}")
    parts["bitid"] = run("bitid", [__file__, "--drive", str(out / "bitid"), *(["--quick"] if quick else [])])
    if parts["bitid"]["exit"] == 3:
        raise BadInput(f"commit {sha[:12]}: the bit-identity cases cannot be driven: "
                       f"{parts['bitid']['stderr'].strip().splitlines()[-1]}")
    canary = ["-m", "qsa_lab", "canary", "--backend", "emulate", "--json", "canary.json"]
    parts["canary"] = run("canary", canary + (["--kernels", QUICK_CANARY] if quick else []))
    for i, line in enumerate(DIFF_CASES[:1] if quick else DIFF_CASES):
        parts[f"diff {line}"] = run("diff", ["-m", "qsa_lab", "diff", *line.split(), "--backend", "emulate",
                                             "--json", f"diff{i}.json", "--save", f"diff{i}.safetensors"])
    if not quick:
        parts["repro"] = run("repro", ["-m", "qsa_lab", "repro", "--backend", "emulate", "--no-figures",
                                       "--quiet", "--out", "repro"])
    scribble = ["-m", "qsa_lab", "scribble", *(QUICK_SCRIBBLE if quick else [])]
    if engine.get("transformers"):
        parts["scribble"] = run("scribble", [*scribble, "--json", "scribble.json"])
    if engine.get("vllm"):
        parts["scribble vllm"] = run("scribble", [*scribble, "--engine", "vllm", "--json", "scribble_vllm.json"],
                                     VLLM_PYTHON=engine["vllm"])
    parts["cross-request"] = run("cross-request", ["-m", "qsa_lab", "cross-request", "--backend", "emulate",
                                                   *(QUICK_CROSS_REQUEST if quick else []), "--json", "cross_request.json"])
    return parts


# --------------------------------------------------------------------------- the driver (in a commit)

def drive(out: Path, quick: bool) -> int:
    """Runs with the commit's qsa_lab first on the path: the bit-identity cases through its Python
    API, written to out.npz (every array's bits) and out.json (poison records, errors)."""
    try:
        import torch

        sys.path.insert(0, str(CHECKOUT / "tests"))
        from bitid_cases import bits, make_case, small_specs
        from qsa_lab.model.plan import pad_fix
        from qsa_lab.report.repro import REPRO_CASES, run_case
        from qsa_lab.routes import emulate
        from qsa_lab.routes.run import GROUPED, run_routes
    except ImportError as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 3
    import inspect

    # the kv dtype keyword was kv_format before 6964de1
    kv_word = "kv_dtype" if "kv_dtype" in inspect.signature(emulate.grouped_forward).parameters else "kv_format"
    arrays, doc = {}, {}

    def members(plan):     # a plan's rows of each group: GroupedPlan.members, .group_rows before issue 45
        return plan.members if hasattr(plan, "members") else plan.group_rows

    def record(name: str, res) -> None:
        case, plan = res.case, res.plan
        for k in ("kv_cache", "q", "selected", "block_table", "seq_lens", "positions"):
            arrays[f"{name}/case/{k}"] = bits(getattr(case, k))
        for k in ("microblocks", "masks", "seq_len"):
            arrays[f"{name}/plan/{k}"] = bits(getattr(plan, k))
        arrays[f"{name}/plan/group_rows"] = bits(members(plan))
        for r, o in res.outputs.items():
            arrays[f"{name}/out/{r}"] = bits(o)
        arrays[f"{name}/reference64"] = bits(res.reference64)
        if plan.groups:
            fixed = pad_fix(plan)
            for route, (variant, fix) in GROUPED.items():
                p = fixed if fix else plan
                _, lse = emulate.grouped_forward(case.q, case.kv_cache, case.k_scale, case.v_scale, members(p),
                                                 p.microblocks, p.masks, p.seq_len, sm_scale=case.sm_scale,
                                                 variant=variant, return_lse=True,
                                                 **{kv_word: case.geometry.kv_dtype})
                arrays[f"{name}/lse/{route}"] = bits(lse)
        doc[name] = json.loads(json.dumps(case.poison, default=str))

    for rc in () if quick else REPRO_CASES:
        record(f"report/{rc.name}", run_case(rc, "emulate"))
    specs = small_specs()[:QUICK_SMALL] if quick else small_specs()
    for i, spec in enumerate(specs):
        record(f"small/{i}", run_routes(make_case(spec), backend="emulate"))
    np.savez(out.with_suffix(".npz"), **arrays)
    out.with_suffix(".json").write_text(json.dumps({"poison": doc, "threads": torch.get_num_threads()},
                                                   indent=1, sort_keys=True))
    return 0


# --------------------------------------------------------------------------- comparing

#: the exit codes of a part that ran (the canary's 1: it found a leak, which the default matrix has)
RAN = {"bitid": (0,), "canary": (0, 1), "diff": (0,), "repro": (0,), "scribble": (0, 1), "cross-request": (0, 1)}


def failed_in_both(parts_base: dict, parts_head: dict) -> list[str]:
    """Parts that failed for both commits: equal failures are no evidence of equal behaviour."""
    return [part for part in parts_base if part in parts_head
            and parts_base[part]["exit"] not in RAN[part.split()[0]]
            and parts_head[part]["exit"] not in RAN[part.split()[0]]]


def differences(base: Path, head: Path, parts_base: dict, parts_head: dict, verdict_map: dict | None = None) -> dict:
    """source (a part or a file it wrote) -> the differences found there, one line each; the
    scribble's and cross-request's by exit code and their JSON's verdicts and counts only."""
    found = {}
    for part in sorted(set(parts_base) | set(parts_head)):
        a, b = parts_base.get(part), parts_head.get(part)
        if a is None or b is None:
            found[part] = [f"ran only for {'HEAD' if a is None else 'BASE'}"]
            continue
        compared = ("exit",) if part.split()[0] in VERDICT_PARTS else ("exit", "stdout")
        lines = [f"{k} differs: {first_line_difference(str(a[k]), str(b[k]))}" for k in compared if a[k] != b[k]]
        if a["exit"] != b["exit"]:
            lines += [f"BASE stderr: {a['stderr'].strip()[-400:]}", f"HEAD stderr: {b['stderr'].strip()[-400:]}"]
        found[part] = lines
    files = sorted({p.relative_to(base) for p in base.rglob("*") if p.is_file()}
                   | {p.relative_to(head) for p in head.rglob("*") if p.is_file()})
    for f in files:
        a, b = base / f, head / f
        if not a.exists() or not b.exists():
            found[str(f)] = [f"written only by {'HEAD' if not a.exists() else 'BASE'}"]
        elif f.name in VERDICT_FILES:
            docs = [json.loads(x.read_text()) for x in (a, b)]
            found[str(f)] = [] if not compare_verdicts.differences(*docs, verdict_map) else \
                compare_verdicts.report(*docs, verdict_map)
        elif f.suffix == ".json":
            found[str(f)] = json_differences(*(without_volatile(json.loads(x.read_text())) for x in (a, b)))
        elif f.suffix in (".npz", ".safetensors"):
            found[str(f)] = array_differences(load_arrays(a), load_arrays(b))
        elif a.read_bytes() != b.read_bytes():
            found[str(f)] = [first_line_difference(a.read_text(errors="replace"), b.read_text(errors="replace"))]
    return {source: lines for source, lines in found.items() if lines}


#: header fields that differ from one run to the next (a report's date), not compared
VOLATILE = ("date",)


def without_volatile(doc):
    return {k: v for k, v in doc.items() if k not in VOLATILE} if isinstance(doc, dict) else doc


def first_line_difference(a: str, b: str) -> str:
    la, lb = a.splitlines(), b.splitlines()
    for i, (x, y) in enumerate(zip(la, lb)):
        if x != y:
            return f"line {i + 1}: {x.strip()[:160]!r} (BASE) vs {y.strip()[:160]!r} (HEAD)"
    return f"{len(la)} lines (BASE) vs {len(lb)} lines (HEAD)"


def json_differences(a, b, path: str = "") -> list[str]:
    """Leaves that differ (floats exactly: a JSON number is the float's shortest repr)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in list(a) + [k for k in b if k not in a]:
            if k not in a or k not in b:
                out.append(f"{path}/{k}: only in {'HEAD' if k not in a else 'BASE'}")
            else:
                out += json_differences(a[k], b[k], f"{path}/{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in json_differences(x, y, f"{path}[{i}]")]
    same = a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)
    return [] if same else [f"{path or '/'}: {json.dumps(a)[:160]} (BASE) vs {json.dumps(b)[:160]} (HEAD)"]


def load_arrays(path: Path) -> dict:
    """name -> (array of raw bits, metadata) for a .npz or .safetensors file."""
    if path.suffix == ".npz":
        with np.load(path) as z:
            return {k: z[k] for k in z.files}
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        meta = {k: v for k, v in (f.metadata() or {}).items() if k not in VOLATILE + ("qsa_lab_version",)}
        arrays = {k: f.get_tensor(k) for k in f.keys()}
    arrays["metadata"] = np.array(json.dumps(meta, sort_keys=True))
    return arrays


def array_differences(a: dict, b: dict) -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        if k not in a or k not in b:
            out.append(f"{k}: only in {'HEAD' if k not in a else 'BASE'}")
            continue
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            out.append(f"{k}: {x.dtype}{list(x.shape)} (BASE) vs {y.dtype}{list(y.shape)} (HEAD)")
            continue
        if x.dtype.kind in "US":
            if not np.array_equal(x, y):
                out.append(f"{k}: {str(x)[:160]} (BASE) vs {str(y)[:160]} (HEAD)")
            continue
        xb, yb = x.view(f"u{x.itemsize}"), y.view(f"u{y.itemsize}")
        if not np.array_equal(xb, yb):
            where = np.argwhere(xb != yb)
            i = tuple(int(j) for j in where[0])
            out.append(f"{k}: {len(where)} of {x.size} elements differ, first at {list(i)}: "
                       f"{x[i]!r} (BASE) vs {y[i]!r} (HEAD)")
    return out


# --------------------------------------------------------------------------- the command

class Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"compare_commits.py: error: {message}\n")


def parser() -> argparse.ArgumentParser:
    ap = Parser(prog="compare_commits.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("base", metavar="BASE", nargs="?", help="the commit compared against (e.g. main)")
    ap.add_argument("head", metavar="HEAD", nargs="?", help="the commit checked (e.g. HEAD)")
    ap.add_argument("--quick", action="store_true", help="a subset of the cases (default: all)")
    ap.add_argument("--repo", type=Path, help="the git repository (default: the one the current folder is in)")
    ap.add_argument("--verdict-map", type=compare_verdicts.parse_map, metavar="OLD=NEW,..",
                    help="the scribble's and cross-request's verdicts of BASE renamed first (default: none)")
    ap.add_argument("--drive", type=Path, help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.drive:
        return drive(args.drive, args.quick)
    for name in ("base", "head"):
        if not getattr(args, name):
            ap.error(f"{name.upper()}: required (a commit, branch or tag)")
    repo = args.repo or Path.cwd()
    top = subprocess.run(["git", "-C", str(repo), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if top.returncode != 0:
        ap.error(f"--repo: {repo} is not inside a git repository")
    repo = Path(top.stdout.strip())
    try:
        shas = [resolve(repo, args.base, "BASE"), resolve(repo, args.head, "HEAD")]
        engine = engines(repo, args.quick)
        if not engine["transformers"]:
            print("scribble: not compared (transformers is not installed here)")
        if not engine["vllm"]:
            print("scribble on vLLM: not compared " + ("(--quick)" if args.quick else
                  "(no vLLM environment: make vllm-env builds .venv-vllm, or set VLLM_PYTHON)"))
        with tempfile.TemporaryDirectory(prefix="compare_commits-") as tmp:
            tmp = Path(tmp)
            outs, parts = [], []
            for label, sha in zip(("BASE", "HEAD"), shas):
                print(f"{label} {sha[:12]}: running{' (quick)' if args.quick else ''}", flush=True)
                tree = export(repo, sha, tmp)
                outs.append(tmp / f"out-{label}")
                parts.append(run_commit(tree, sha, outs[-1], args.quick, engine))
            failed = failed_in_both(*parts)
            if failed:
                raise BadInput(f"{failed[0]}: failed for both commits (exit {parts[0][failed[0]]['exit']}): "
                               f"{parts[0][failed[0]]['stderr'].strip()[-300:]}")
            diffs = differences(*outs, *parts, args.verdict_map)
            arrays = sum(len(load_arrays(p)) for p in outs[0].rglob("*") if p.suffix in (".npz", ".safetensors"))
    except BadInput as e:
        ap.error(str(e))
    if diffs:
        print(f"DIFFER: {args.base} ({shas[0][:12]}) and {args.head} ({shas[1][:12]}) differ in "
              f"{len(diffs)} place(s); the first differences of each:")
        for source, lines in diffs.items():
            more = f" ({len(lines) - SHOWN} more)" if len(lines) > SHOWN else ""
            print(f"  {source}:{more}\n" + "\n".join(f"    {line}" for line in lines[:SHOWN]))
        return 1
    print(f"IDENTICAL: {args.base} ({shas[0][:12]}) and {args.head} ({shas[1][:12]}): every part "
          f"({', '.join(p for p in parts[0] if p.split()[0] not in VERDICT_PARTS)}) gave the same exit code, "
          f"output and {arrays} arrays, bit for bit; "
          f"{', '.join(p for p in parts[0] if p.split()[0] in VERDICT_PARTS)}: the same exit codes, verdicts and counts")
    return 0


if __name__ == "__main__":
    sys.exit(main())

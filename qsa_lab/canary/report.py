"""A leak report a kernel's maintainer can act on: `qsa-lab canary ... --report DIR`.

    from qsa_lab.canary import run_canary
    from qsa_lab.canary.report import write_report
    write_report(run_canary(["flashinfer:prefill-fa2"], attend="sparse", ...), "leak-report")

DIR/report.md and DIR/report.html hold the leak matrix figure, the versions (qsa_lab, torch,
CUDA, GPU, driver, the kernels' libraries), the case and its attention spec, every non-clean
cell, and for each leaking cell the smallest poisoned call found that still leaks: the
region's slots are halved while one half alone leaks (a few kernel calls per step), and the
result is saved as DIR/calls/<cell>.safetensors with a one-line replay command

    python -m qsa_lab.canary.replay DIR/calls/<cell>.safetensors

that re-runs the control and the poisoned call and prints the NaN (qsa_lab.canary.replay).
A call file is also a case file: `qsa-lab canary --case FILE` reads its control pool.
"""
from __future__ import annotations

import html
import json
import platform
import re
import subprocess
from pathlib import Path

import torch

from qsa_lab import __version__

SCHEMA = "qsa_lab.canary-call/1"
LEAKS = ("nan-leak", "inf-leak", "finite-leak")
MAX_STEPS = 24  # halving steps: enough for 2**24 slots


def environment(kernels=()) -> dict:
    """Versions a maintainer asks for first: qsa_lab, Python, torch, CUDA, GPU, driver, libraries."""
    from qsa_lab.plotting.export import gpu_name
    from qsa_lab.canary.adapters import versions

    out = {"qsa_lab": __version__, "python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda or "none", "gpu": gpu_name(), "driver": _driver()}
    out.update({lib: v or "not installed" for lib, v in versions(kernels).items()})
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception:  # noqa: BLE001 - optional
        pass
    return out


def _driver() -> str:
    if not torch.cuda.is_available():
        return "none"
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# -- the smallest leaking call -------------------------------------------------------------------

def _poisoned(case, slots: torch.Tensor, plane: str, payload: str, dims):
    from qsa_lab.canary.runner import PLANES, write_region

    out = case.clone()
    write_region(out.kv_cache, slots, PLANES[plane], case.kv_dtype, payload, dims,
                 case.v_head_dim if case.mla else None)
    return out


def kernel_runner(kernel, backend=None, timeout: float = 600.0):
    """The canary's own way of calling a kernel (qsa_lab.canary.runner): built-ins and callables
    in this process, `module:function` / `file.py:function` in a worker process; loaded."""
    from qsa_lab.canary.runner import _runner

    reason = None if backend else "the qsa routes did not run in this report's canary run"
    runner = _runner(kernel, backend, reason, timeout)
    runner.load()
    return runner


def _outputs(runner, case, device) -> torch.Tensor:
    """One call of `runner` on `case` (fresh copies of its tensors); the output on the CPU."""
    from qsa_lab.canary.execution import INPUTS
    from qsa_lab.canary.runner import _meta

    t = case.tensors()
    out = runner.call({k: t[k].detach().cpu() for k in INPUTS}, _meta(case), device)
    if out.kind != "ok":
        raise RuntimeError(f"the kernel {out.kind}: {out.error}")
    return out.output


def leaks_with(runner, case, slots, plane, payload, dims, device) -> tuple[str, dict, torch.Tensor]:
    """(verdict, counts, poisoned output) of one control + poisoned pair poisoning `slots`."""
    from qsa_lab.canary.runner import compare

    control = _outputs(runner, _poisoned(case, slots, plane, "zero", dims), device)
    out = _outputs(runner, _poisoned(case, slots, plane, payload, dims), device)
    verdict, counts, _ = compare(control, out)
    return verdict, counts, out


def smallest_leak(runner, case, region: str, plane: str, payload: str, dims=None, device="cpu"):
    """The fewest slots of `region` found whose poison still gives the same verdict: halve
    while one half alone does. -> (slots [pages, page_size] bool, verdict, counts)."""
    from qsa_lab.model.regions import region_slots

    full = region_slots(case, region)
    verdict, counts, _ = leaks_with(runner, case, full, plane, payload, dims, device)
    if verdict not in LEAKS:
        return full, verdict, counts
    coords = torch.nonzero(full)
    for _ in range(MAX_STEPS):
        if len(coords) <= 1:
            break
        half = len(coords) // 2
        for part in (coords[:half], coords[half:]):
            slots = torch.zeros_like(full)
            slots[part[:, 0], part[:, 1]] = True
            v, c, _ = leaks_with(runner, case, slots, plane, payload, dims, device)
            if v == verdict:
                coords, counts = part, c
                break
        else:
            break  # neither half alone leaks this way: the leak needs slots from both
    slots = torch.zeros_like(full)
    slots[coords[:, 0], coords[:, 1]] = True
    return slots, verdict, counts


# -- call files -------------------------------------------------------------------------------------

def save_call(path, case, kernel: str, region: str, plane: str, payload: str, slots: torch.Tensor, dims,
              verdict: str, counts: dict, env: dict) -> Path:
    """One poisoned call as safetensors: the control case (a case file: kv_cache holds the
    slots zero-filled), kv_cache_poisoned, the slots, and what was seen, in the metadata."""
    from safetensors.torch import save_file

    control = _poisoned(case, slots, plane, "zero", dims)
    poisoned = _poisoned(case, slots, plane, payload, dims)
    t = {k: v.contiguous().cpu() for k, v in control.tensors().items()}
    t["kv_cache_poisoned"] = poisoned.kv_cache.contiguous().cpu()
    t["poisoned_slots"] = slots.to(torch.uint8).cpu()
    t["query_lens"] = case.query_lens().to(torch.int32)
    if case.spec.kind == "mask":
        t["attend_mask"] = case.spec.mask.cpu()
    meta = {"schema": SCHEMA, "kernel": kernel, "region": region, "plane": plane, "payload": payload,
            "dims": json.dumps(None if dims is None else [int(d) for d in dims]), "verdict": verdict,
            "counts": json.dumps(counts), "kv_dtype": case.kv_dtype, "attend": str(case.spec),
            "k_scale": repr(float(case.k_scale)), "v_scale": repr(float(case.v_scale)),
            "sm_scale": repr(float(case.sm_scale)), "mla": json.dumps(bool(case.mla)),
            "v_head_dim": json.dumps(case.v_head_dim), "environment": json.dumps(env)}
    if case.geometry is not None:
        meta["geometry"] = json.dumps(case.geometry.to_dict())
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(t, str(path), metadata=meta)
    return path


def load_call(path) -> tuple:
    """A call file -> (control CanaryCase, poisoned CanaryCase, metadata dict)."""
    import dataclasses

    from safetensors import safe_open

    from qsa_lab.model.regions import AttentionSpec
    from qsa_lab.canary.case import load_case

    if not Path(path).is_file():   # a FIFO or a device would block the read
        raise ValueError(f"path: {path} is not a regular file")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            extra = {k: f.get_tensor(k) for k in ("kv_cache_poisoned", "attend_mask") if k in f.keys()}
    except Exception as e:  # noqa: BLE001 - any unreadable file is bad input
        raise ValueError(f"path: {path} is not a safetensors file ({type(e).__name__})") from None
    if meta.get("schema") != SCHEMA or "kv_cache_poisoned" not in extra or not {"attend", "mla", "v_head_dim"} <= set(meta):
        raise ValueError(f"path: {path} is not a {SCHEMA} call file (written by --report)")
    spec = meta["attend"]
    if spec.startswith("mask"):
        spec = AttentionSpec("mask", mask=extra["attend_mask"])
    control = load_case(path, attend=spec)   # scales and sm_scale from the metadata; MLA is the call file's own
    control = dataclasses.replace(control, mla=json.loads(meta["mla"]), v_head_dim=json.loads(meta["v_head_dim"]))
    poisoned = dataclasses.replace(control.clone(), kv_cache=extra["kv_cache_poisoned"].contiguous())
    return control, poisoned, meta


# -- the report -----------------------------------------------------------------------------------

def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[:80]


def _replay_command(path: Path, kernel: str) -> str:
    """The replay line. Replay runs a kernel that is not built in only when it is named on the
    command line (a call file is data), so the line names it; a kernel given as a Python callable
    has no name the replay can load."""
    import re as _re
    import shlex

    from qsa_lab.canary.replay import is_builtin

    cmd = f"python -m qsa_lab.canary.replay {shlex.quote(str(path))}"
    if is_builtin(kernel):
        return cmd
    loadable = _re.fullmatch(r"[\w.]+:[\w.]+|.+\.py:\w+", kernel)
    return cmd + (f" --kernel {shlex.quote(kernel)}" if loadable else " --kernel MODULE:FUNCTION")


def check_report_dir(out_dir, force: bool = False) -> Path:
    """The report folder, checked before any work: a folder that does not exist or is empty
    (with force: any folder; its report files are replaced)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"report: {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"report: {out} is not empty (add --force to replace the report in it)")
    return out


def write_report(report, out_dir, force: bool = False, minimize: bool = True, fns: dict | None = None,
                 progress=None) -> Path:
    """Write DIR/report.md, DIR/report.html, DIR/leak_matrix.png, DIR/canary.json and one call
    file per leaking cell (DIR/calls). `fns`: kernel name -> callable (default: resolved from
    the names; give it for kernels passed as callables). -> the Markdown file's path."""
    out = check_report_dir(out_dir, force)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(report.kernels)
    doc = report.to_json()
    (out / "canary.json").write_text(json.dumps(doc, indent=1) + "\n")
    figure = _figure(report, out / "leak_matrix.png")
    calls = _leak_calls(report, out, env, minimize, fns or {}, progress)
    blocks = _blocks(report, doc, env, figure, calls)
    (out / "report.md").write_text(_markdown(blocks))
    (out / "report.html").write_text(_html(blocks))
    return out / "report.md"


def _figure(report, path: Path) -> str | None:
    if not report.results:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from qsa_lab.canary.figures import leak_matrix, plot_leak_matrix

    fig = plot_leak_matrix(leak_matrix(report)).figure
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path.name


def _leak_calls(report, out: Path, env: dict, minimize: bool, fns: dict, progress) -> list:
    from qsa_lab.model.regions import region_slots

    leaking = [r for r in report.results if r.verdict in LEAKS]
    seen, calls, runners = set(), [], {}
    device = torch.device(report.device) if report.device else torch.device("cpu")
    try:
        for r in leaking:
            key = (r.kernel, r.region, r.plane, r.payload)
            if key in seen:
                continue
            seen.add(key)
            slots = region_slots(report.case, r.region)
            verdict, counts = r.verdict, {"nan": r.nan, "inf": r.inf, "finite_changed": r.finite_changed}
            if minimize:
                if progress:
                    progress(f"report: smallest leaking call of {r.kernel} {r.region}/{r.plane}/{r.payload}")
                try:
                    if r.kernel not in runners:
                        runners[r.kernel] = kernel_runner(fns.get(r.kernel, r.kernel), report.backend,
                                                          getattr(report, "timeout", 600.0))
                    slots, verdict, counts = smallest_leak(runners[r.kernel], report.case, r.region, r.plane,
                                                           r.payload, None, device)
                except Exception as e:  # noqa: BLE001 - keep the whole region; say why
                    counts = {**counts, "minimize_error": f"{type(e).__name__}: {e}"}
            name = _slug(f"{r.kernel}__{r.region}__{r.plane}__{r.payload}") + ".safetensors"
            path = save_call(out / "calls" / name, report.case, r.kernel, r.region, r.plane, r.payload, slots,
                             None, verdict, counts, env)
            calls.append({"kernel": r.kernel, "region": r.region, "plane": r.plane, "payload": r.payload,
                          "verdict": verdict, "counts": counts, "slots": torch.nonzero(slots).tolist(),
                          "file": f"calls/{name}", "replay": _replay_command(path, r.kernel),
                          "full_region": int(region_slots(report.case, r.region).sum())})
    finally:
        for runner in runners.values():
            runner.close()
    return calls


def _blocks(report, doc: dict, env: dict, figure, calls) -> list:
    c = report.case
    non_clean = [r for r in report.results if r.verdict not in ("clean", "n/a")]
    na = list(dict.fromkeys(f"{r.kernel} {r.region}" for r in report.results if r.verdict == "n/a"))
    b = [("h1", "qsa_lab canary leak report"),
         ("p", f"{len([r for r in report.results if r.verdict in LEAKS])} "
               f"leaking of {len(report.results)} checks; kernels: {', '.join(report.kernels)}."),
         ("h2", "Versions"), ("table", ["component", "version"], [[k, str(v)] for k, v in env.items()]),
         ("h2", "Case and attention spec"),
         ("p", c.describe()),
         ("p", f"Attention spec: {c.spec} (what each query row attends; every other byte the call can "
               "reach is poisoned, one region, plane and payload at a time, and compared bit for bit "
               "against a zero-filled control run of the same kernel)."),
         ("table", ["region", "slots"], [[k, str(v)] for k, v in doc.get("regions", {}).items()])]
    if figure:
        b += [("h2", "Leak matrix"), ("img", figure)]
    b += [("h2", "Cells that are not clean")]
    if non_clean:
        b.append(("table", ["kernel", "region", "plane", "payload", "verdict", "NaN", "Inf", "finite changed",
                            "note"],
                  [[r.kernel, r.region, r.plane, r.payload, r.verdict, str(r.nan), str(r.inf),
                    str(r.finite_changed), (r.error or r.note or ", ".join(r.modified))[:200]]
                   for r in non_clean]))
    else:
        b.append(("p", "None: every check ran clean."))
    if na:
        b.append(("p", "n/a (the call's inputs reference no byte of the region, so no leak can be drawn): "
                       + "; ".join(na) + "."))
    if report.skipped:
        b += [("h2", "Not run"),
              ("table", ["what", "reason"], [["/".join(str(s[k]) for k in ("kernel", "region", "plane", "payload")
                                                        if k in s) or "-", s.get("reason", "")]
                                               for s in report.skipped])]
    if calls:
        b.append(("h2", "Smallest leaking calls"))
        for call in calls:
            n = len(call["slots"])
            b += [("h3", f"{call['kernel']}: {call['region']} / {call['plane']} / {call['payload']}"),
                  ("p", f"{call['verdict']}: {call['counts'].get('nan', 0)} NaN, {call['counts'].get('inf', 0)} Inf, "
                        f"{call['counts'].get('finite_changed', 0)} finite outputs changed when {n} of the "
                        f"region's {call['full_region']} slots (physical [page, slot]: {call['slots'][:8]}"
                        f"{' ...' if n > 8 else ''}) hold {call['payload']} on the {call['plane'].upper()} plane "
                        "and nothing else differs from the control call."),
                  ("p", f"Call file: {call['file']} (safetensors; also a case file for qsa-lab canary --case). "
                        "Replay, from the folder the report was written from:"),
                  ("code", call["replay"])]
    return b


def _markdown(blocks) -> str:
    out = []
    for kind, *rest in blocks:
        if kind in ("h1", "h2", "h3"):
            out.append("#" * int(kind[1]) + " " + rest[0])
        elif kind == "p":
            out.append(rest[0])
        elif kind == "code":
            out.append("```\n" + rest[0] + "\n```")
        elif kind == "img":
            out.append(f"![leak matrix]({rest[0]})")
        elif kind == "table":
            head, rows = rest
            cell = lambda s: str(s).replace("|", "\\|")  # noqa: E731
            out.append("\n".join(["| " + " | ".join(map(cell, head)) + " |", "|" + " --- |" * len(head)]
                                 + ["| " + " | ".join(map(cell, r)) + " |" for r in rows]))
    return "\n\n".join(out) + "\n"


def _html(blocks) -> str:
    e = html.escape
    out = ["<!doctype html><html><head><meta charset='utf-8'><title>qsa_lab canary leak report</title>",
           "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse}"
           "td,th{border:1px solid #bbb;padding:2px 8px;text-align:left}pre{background:#f4f4f4;padding:6px}"
           "</style></head><body>"]
    for kind, *rest in blocks:
        if kind in ("h1", "h2", "h3"):
            out.append(f"<{kind}>{e(rest[0])}</{kind}>")
        elif kind == "p":
            out.append(f"<p>{e(rest[0])}</p>")
        elif kind == "code":
            out.append(f"<pre>{e(rest[0])}</pre>")
        elif kind == "img":
            out.append(f"<img src='{e(rest[0])}' alt='leak matrix'>")
        elif kind == "table":
            head, rows = rest
            out.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>"
                       + "".join("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in r) + "</tr>" for r in rows)
                       + "</table>")
    return "\n".join(out) + "\n</body></html>\n"

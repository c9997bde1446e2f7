"""Shrinking a standalone script's workload to the smallest that still leaks, by running the script.

    shrunk = shrink("transformers-other-requests", python="/path/to/.venv/bin/python")
    shrunk.params       # the smallest workload found; shrunk.size() / shrunk.before() / shrunk.smaller()

Greedy, one parameter at a time, each candidate judged by the script itself (exit 1: it still
leaks), in passes until a pass changes nothing: drop reader requests, then fewer layers, fewer new
tokens, shorter prompts, a smaller pool and smaller batches (each tried at its smallest value first,
then bisected between that and its present one: the smallest value that still leaks, taking leaking
as monotone in it). Then the result is checked again: exit 1 as written, exit 0 with --workaround,
or ShrinkError. Every run is a subprocess of `python -I` in an empty temporary folder, so nothing
of this checkout is on its path.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .scripts import DEFAULTS, EXIT_CLEAN, EXIT_LEAK, SHRINKABLE, script_text


class ShrinkError(RuntimeError):
    """The workload does not leak to begin with, or its shrunk form fails its re-check."""


@dataclass
class Shrunk:
    kind: str
    start: dict
    params: dict
    runs: list = field(default_factory=list)    # [{"params": changes from start, "exit": code, "seconds": s}]
    check: dict = field(default_factory=dict)   # the re-check: {"as_written": code, "workaround": code}

    def before(self) -> dict:
        return size(self.start)

    def size(self) -> dict:
        return size(self.params)

    def smaller(self) -> str:
        """'requests 6 -> 2, prompt tokens 156 -> 3, ...': every measure, before -> after."""
        a, b = self.before(), self.size()
        return ", ".join(f"{k} {a[k]} -> {b[k]}" for k in a)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "start": self.start, "params": self.params, "before": self.before(),
                "after": self.size(), "runs": self.runs, "check": self.check}


def size(params: dict) -> dict:
    """The measures a workload is smaller by: requests, prompt tokens, new tokens, generated tokens,
    layers, pool blocks, batch tokens."""
    lengths = params["prompt_lengths"]
    return {"requests": len(lengths), "prompt tokens": sum(lengths), "new tokens": params["new_tokens"],
            "generated tokens": len(lengths) * params["new_tokens"], "layers": params["layers"],
            "pool blocks": params["blocks"], "batch tokens": params["batch_tokens"]}


def run_script(python: str, script: Path, params: dict, workaround: bool = False, timeout: float = 600) -> int:
    """The script's exit code for `params` (124 when it ran past `timeout`)."""
    python = os.path.abspath(python) if os.sep in python else python     # it runs from another folder
    cmd = [python, "-I", str(Path(script).resolve()), "--params", json.dumps(params)] + (["--workaround"] if workaround else [])
    with tempfile.TemporaryDirectory(prefix="qsa_lab-shrink-") as cwd:
        try:
            return subprocess.run(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return 124


def shrink(kind: str, python: str, params: dict | None = None, timeout: float = 600, progress=None,
           runner=None) -> Shrunk:
    """The smallest leaking workload of `kind` from `params` (DEFAULTS[kind] when None), run with
    `python` (an environment with the engine). `runner(params, workaround) -> exit code` replaces the
    subprocess (tests). ShrinkError when the start does not leak or the result fails its re-check."""
    start = {**DEFAULTS[kind], **(params or {})}
    limits = SHRINKABLE[kind]
    with tempfile.TemporaryDirectory(prefix="qsa_lab-script-") as folder:
        script = Path(folder) / "script.py"
        script.write_text(script_text(kind, start))
        shrunk = Shrunk(kind, start, dict(start))
        seen = {}

        def leaks(p: dict, workaround: bool = False) -> bool:
            key = (json.dumps(p, sort_keys=True), workaround)
            if key not in seen:
                t0 = time.perf_counter()
                code = runner(p, workaround) if runner else run_script(python, script, p, workaround, timeout)
                seen[key] = code
                if not workaround:
                    shrunk.runs.append({"params": {k: v for k, v in p.items() if v != start[k]}, "exit": code,
                                        "seconds": round(time.perf_counter() - t0, 1)})
                if progress:
                    progress(f"shrink {kind}: {json.dumps(p)}{' --workaround' if workaround else ''} -> exit {code}")
            return seen[key] == EXIT_LEAK

        if not leaks(start):
            raise ShrinkError(f"{kind}: the starting workload does not leak (exit {seen[next(iter(seen))]})")
        p = shrunk.params
        while True:            # passes until one changes nothing: a later cut can free an earlier one
            before = p
            p = _one_pass(p, limits, leaks)
            if p == before:
                break
        shrunk.params = p
        # re-checked: the shrunk script itself, as a maintainer will run it (its PARAMS written in)
        script.write_text(script_text(kind, p))
        shrunk.check = {"as_written": runner(p, False) if runner else run_script(python, script, {}, False, timeout),
                        "workaround": runner(p, True) if runner else run_script(python, script, {}, True, timeout)}
    if shrunk.check != {"as_written": EXIT_LEAK, "workaround": EXIT_CLEAN}:
        raise ShrinkError(f"{kind}: the shrunk workload {json.dumps(p)} fails its re-check: exit "
                          f"{shrunk.check['as_written']} as written (want 1), {shrunk.check['workaround']} with "
                          "--workaround (want 0)")
    return shrunk


def _one_pass(p: dict, limits: dict, leaks) -> dict:
    """One greedy pass: fewer readers, layers, new tokens, prompt tokens, blocks, batch tokens."""
    # fewer readers: drop each in turn (the first request holds the bad token and stays)
    i = len(p["prompt_lengths"]) - 1
    while i >= 1 and len(p["prompt_lengths"]) > 2:
        trial = {**p, "prompt_lengths": p["prompt_lengths"][:i] + p["prompt_lengths"][i + 1:]}
        if leaks(trial):
            p = trial
        i -= 1
    for name in ("layers", "new_tokens"):
        p = _smallest(p, p[name], limits[name], _set(name), leaks)
    for j in range(len(p["prompt_lengths"])):
        p = _smallest(p, p["prompt_lengths"][j], limits["prompt_lengths"], _set_length(j), leaks)
    p = {**p, "bad_at": min(p["bad_at"], p["prompt_lengths"][0] - 1)}
    for name in ("blocks", "batch_tokens"):
        p = _smallest(p, p[name], limits[name], _set(name), leaks)
    return p


def _smallest(p: dict, value: int, lowest: int, put, leaks) -> dict:
    """p with one parameter (`put(p, v)` sets it; `value` is its present, leaking value) at the smallest
    value in [lowest, value] that still leaks: `lowest` first, then a bisection."""
    if lowest < value and leaks(put(p, lowest)):
        return put(p, lowest)
    lo, hi = lowest + 1, value
    while lo < hi:
        mid = (lo + hi) // 2
        if leaks(put(p, mid)):
            hi = mid
        else:
            lo = mid + 1
    return put(p, hi)


def _set(name: str):
    return lambda p, v: {**p, name: v}


def _set_length(j: int):
    return lambda p, v: {**p, "prompt_lengths": p["prompt_lengths"][:j] + [v] + p["prompt_lengths"][j + 1:]}

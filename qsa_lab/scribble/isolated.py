"""A scribble with a user's attention function, in a process of its own: the canary's rules for user code.

    report = scribble_attention("my_attn.py:attention", model="llama-gqa", workload="reuse")

The worker (`python -m qsa_lab.scribble.worker`) imports the function (`file.py:function` or
`package.module:function`), builds the model and the engine with the function in paged|eager's slot,
runs the whole matrix and sends the report back. Nothing the function prints reaches this process's
stdout (it goes to stderr, so `--json -` stays clean); the worker ignores Ctrl-C (the caller stops
it), dies with the caller, and is killed after `timeout` seconds: then every read check is `error`.
A function that cannot be imported is bad input: AttentionLoadError (a ValueError) naming `argument`.

Before the matrix the worker holds the function to its contract (attention_contract): called once on
the first step's clean input, the arguments paged|eager gets there, it must return what paged|eager
returns, `(output, weights or None)` with `output` of paged|eager's shape and dtype, finite wherever
paged|eager's is. A function that raises there or breaks the contract is bad input too (one line;
the traceback in AttentionLoadError.detail).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from qsa_lab.analysis.leaks import ERROR
from qsa_lab.support.loading import FILE, FunctionNameError, parse_function_name, user_function_kind
from qsa_lab.support.processes import MAX_WAIT, end, read_reply, send, spawn

from .regions import PAYLOADS, POOL_REGIONS, REGIONS

DEFAULT_TIMEOUT = 1800.0
#: what builds an engine, with its defaults (build_engine's keywords)
SETTINGS = {"model": "llama-gqa", "workload": "chunked-prefill", "pad": False, "cuda_graph": False,
            "dtype": "float32", "device": "cpu", "seed": 0}


def is_user_attention(attn) -> bool:
    """'file.py:function' or 'package.module:function' (not an implementation name such as paged|eager, nor a
    hub kernel 'org/repo:kernel'): qsa_lab.support.loading's grammar, the canary's kernel names' too."""
    return user_function_kind(attn) is not None


class AttentionLoadError(ValueError):
    """The user's attention function could not be imported, raised on a clean input or broke the contract (the
    message names the argument, one line); detail: the function's traceback, where it raised."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail


#: what a user's function must return: paged|eager's (transformers' eager_paged_attention_forward)
MUST_RETURN = ("(output, weights or None), output a tensor of paged|eager's shape [batch, query rows, heads, head dim] "
            "and dtype, finite wherever paged|eager's is")


def attention_contract(engine, spec: str, argument: str = "attn") -> tuple[str, str] | None:
    """Call engine's user attention function once, on the first step's clean input (the arguments paged|eager
    gets there, from one clean generation with paged|eager in the slot), beside paged|eager. -> None when it
    returns what paged|eager returns (MUST_RETURN), else (one line naming the function and what it returned vs
    what was expected, the traceback where it raised or '')."""
    import traceback

    import torch
    from transformers import AttentionInterface

    from .engines.base import NoHooks
    from .engines.transformers import USER_SLOT

    fn, reference = engine.user_attention, AttentionInterface._global_mapping[USER_SLOT]
    seen = {}

    class FirstStep(NoHooks):
        def before_step(self, view):
            seen["armed"] = view.step == 0

    def probe(module, *args, **kwargs):
        out = reference(module, *args, **kwargs)
        if seen.get("armed") and "expected" not in seen:
            seen["expected"] = out[0]
            try:
                seen["got"] = fn(module, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - the user's mistake is the answer
                seen["raised"] = (f"{type(e).__name__}: {e}".splitlines()[0], traceback.format_exc())
        return out

    engine.user_attention = probe
    try:
        gen = engine.generate(FirstStep())
    finally:
        engine.user_attention = fn
    where = f"{argument}: {spec}"
    if "raised" in seen:
        return f"{where} raised {seen['raised'][0]} on the first step's clean input; it must return {MUST_RETURN}", \
            seen["raised"][1]
    if "expected" not in seen:
        raise RuntimeError(f"the clean run with paged|eager never reached a first step: {gen.error or 'no steps'}")
    expected, got = seen["expected"], seen["got"]
    want = f"{_dtype(expected)} tensor of shape {list(expected.shape)}"
    out = got[0] if isinstance(got, (tuple, list)) and len(got) == 2 else None
    if not torch.is_tensor(out):
        what = (f"a {type(got).__name__} of {len(got)}" if isinstance(got, (tuple, list)) else type(got).__name__)
        return f"{where} returned {what} on the first step's clean input; expected (output, weights or None) " \
               f"with output a {want}, as paged|eager returns", ""
    if out.shape != expected.shape or out.dtype != expected.dtype:
        return f"{where} returned output a {_dtype(out)} tensor of shape {list(out.shape)} on the first step's clean " \
               f"input; paged|eager returns a {want} there ([batch, query rows, heads, head dim])", ""
    bad = int((~torch.isfinite(out) & torch.isfinite(expected)).sum())
    if bad:
        return f"{where} returned {bad} non-finite values of {out.numel()} on the first step's clean input, where " \
               f"paged|eager's output is finite; it must return {MUST_RETURN}", ""
    return None


def build_engine(attn="paged|eager", attn_name: str | None = None, **settings):
    """A TransformersEngine from plain settings (SETTINGS' keys): a built-in tiny model by name or a local
    checkpoint folder, a named workload, the dtype by name."""
    import torch

    from .engines.transformers import TransformersEngine
    from .models import MODELS, local_model, tiny_model, workload

    s = SETTINGS | settings
    dtype = getattr(torch, s["dtype"])
    model = (tiny_model(s["model"], seed=s["seed"], dtype=dtype, device=s["device"]) if s["model"] in MODELS
             else local_model(s["model"], dtype=dtype, device=s["device"]))
    return TransformersEngine(model, workload(s["workload"]), attn=attn, pad=s["pad"], cuda_graph=s["cuda_graph"],
                              attn_name=attn_name)


def scribble_attention(attn: str, regions=REGIONS, payloads=PAYLOADS, localise_leaks: bool = True,
                       timeout: float = DEFAULT_TIMEOUT, argument: str = "attn", **settings):
    """scribble() on an engine whose paged|eager is the user's function `attn` ('file.py:function' or
    'module:function'), run in a worker process. settings: SETTINGS' keys. -> ScribbleReport."""
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        raise TypeError(f"scribble_attention: unknown settings {sorted(unknown)}; choose from {sorted(SETTINGS)}")
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout < MAX_WAIT:
        raise ValueError(f"timeout: must be a number of seconds in (0, {MAX_WAIT:g}), got {timeout!r}")
    try:
        kind, path, _ = parse_function_name(attn)
    except FunctionNameError as e:
        raise AttentionLoadError(f"{argument}: {e}") from None
    if kind == FILE and not Path(path).is_file():        # told at once, before a worker starts
        raise AttentionLoadError(f"{argument}: {attn!r}: no file {path}")
    proc, kind = spawn("qsa_lab.scribble.worker"), None
    try:
        failed = _send(proc, ("run", attn, argument, os.getcwd(), [p for p in sys.path if isinstance(p, str)],
                              SETTINGS | settings, tuple(regions), tuple(payloads), localise_leaks))
        kind, reply = failed or read_reply(proc, time.monotonic() + timeout)
    finally:       # answered: it exits at the end of its input; otherwise (timeout, Ctrl-C) killed now
        end(proc, wait=2 if kind == "msg" else 0)
    if kind == "msg" and reply[0] == "ok":
        return reply[1]
    if kind == "msg" and reply[0] == "bad":
        raise AttentionLoadError(*reply[1:])
    problem = {"timeout": f"timed out after {timeout:g} s (its worker process was killed)",
               "eof": f"its worker process ended (exit code {reply}) before it answered"}.get(kind)
    return _failed_report(attn, SETTINGS | settings, regions, payloads, problem or reply[1])


def _dtype(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def _send(proc, msg):
    try:
        send(proc.stdin, msg)
    except (BrokenPipeError, OSError):
        return "eof", proc.wait()
    return None


def _failed_report(attn: str, settings: dict, regions, payloads, problem: str):
    """Every read check `error`, with the problem: what a run that never answered can report."""
    from .models import workload
    from .report import Cell, ScribbleReport

    padded = settings["pad"] or settings["cuda_graph"]
    cells = [Cell("read", r, p, ERROR, error=problem) for r in regions for p in payloads]
    cells += [Cell("write", r, "-", ERROR, error=problem) for r in regions if r in POOL_REGIONS]
    return ScribbleReport(engine=f"transformers:{attn} (in the paged|eager slot)",
                          reads_pool="padded-gather" if padded else "gather", graphs=settings["cuda_graph"],
                          model=settings["model"], workload=workload(settings["workload"]).to_dict(), cells=cells)

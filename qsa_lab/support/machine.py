"""The last line of `qsa-lab doctor`: can the compiled kernels run on the visible GPU, and if
not, why and what to do (for a pip install and for the conda env).

`verdict(info)` is pure: it reads the dict that `qsa_lab.routes.compiled.status()` returns, so every
state is testable with an injected dict. This module imports neither torch nor the rest of
the package: set-up (scripts/choose_torch.py) loads it by path to read `nvidia-smi` and to
check a torch's arch list before any torch is importable.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path
from typing import NamedTuple

MIN_CAPABILITY = (7, 0)          # the kernels use sm_70 tensor-core instructions
#: the last CUDA major whose nvcc can still target each old architecture (CUDA 13 dropped
#: Maxwell, Pascal and Volta: sm_5x, sm_6x, sm_70, sm_72)
LAST_CUDA_FOR = {(5, 0): 12, (5, 2): 12, (5, 3): 12, (6, 0): 12, (6, 1): 12, (6, 2): 12, (7, 0): 12, (7, 2): 12}
#: the newest gcc major each nvcc accepts as host compiler (newer: "#error -- unsupported GNU
#: version!" from its crt/host_config.h); only the versions checked here are listed
MAX_GCC_FOR_CUDA = {(12, 0): 12, (12, 1): 12, (12, 2): 12, (12, 3): 12, (12, 4): 13, (12, 5): 13, (12, 6): 13}

#: a torch with sm_70 kernels for a CUDA 12 driver: PyTorch 2.14 is the last release with CUDA 12
#: wheels and its cu126 build the last with sm_70 kernels. The exact local version is pinned:
#: with `torch==2.14.*` pip would prefer PyPI's 2.14.1 (CUDA 13, no sm_70) over 2.14.0+cu126.
CUDA12_TORCH = "torch==2.14.1+cu126"
CUDA12_INDEX = "https://download.pytorch.org/whl/cu126"
#: the newest PyPI default wheel with sm_70 kernels (+cu128): PyPI's default Linux wheels are
#: CUDA 13 builds without sm_70 from 2.11 on
PYPI_SM70_TORCH = "torch==2.10.0"
PIP_CUDA12 = f"pip install '{CUDA12_TORCH}' --extra-index-url {CUDA12_INDEX} (or PyPI's {PYPI_SM70_TORCH})"
CONDA_ENV = "conda env create -f environment.yml (torch 2.14.1+cu126, CUDA 12.6 nvcc, g++ 13)"
CONDA_HINT = f"conda: {CONDA_ENV}"
#: PyPI's nvidia-cuda-nvcc-cu12 holds ptxas and headers but no nvcc binary
PIP_NVCC = ("pip: a system CUDA {major}.x toolkit (e.g. `module load cuda/{major}.x`, then CUDA_HOME=its folder); "
            "PyPI's nvidia-cuda-nvcc-cu{major} has no nvcc")


def cuda_version(text: str | None) -> tuple[int, int] | None:
    """'Build cuda_12.6.r12.6/...' or 'Cuda compilation tools, release 13.0, V13.0.48' -> (12, 6)."""
    if not text:
        return None
    m = re.search(r"release (\d+)\.(\d+)", text) or re.search(r"cuda_(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def capability(text) -> tuple[int, int] | None:
    """'7.0' -> (7, 0); None / '' / junk -> None."""
    m = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", str(text or ""))
    return (int(m.group(1)), int(m.group(2))) if m else None


def sm(cap: tuple[int, int]) -> str:
    return f"sm_{cap[0]}{cap[1]}"


def arch_supported(cap: tuple[int, int], arch_list) -> bool:
    """Does a torch built for `arch_list` (torch.cuda.get_arch_list(): 'sm_80', 'compute_90',
    ...) run on a GPU of compute capability `cap`? A cubin runs on its own major at the same or
    a higher minor; PTX is JIT-compiled for any newer GPU."""
    for arch in arch_list or []:
        m = re.fullmatch(r"(sm|compute)_(\d+)(\d)([af]?)", arch)
        if not m:
            continue
        built = (int(m.group(2)), int(m.group(3)))
        if m.group(4):                    # sm_90a / sm_100f: that GPU family only
            ok = built == cap
        elif m.group(1) == "sm":
            ok = built[0] == cap[0] and built[1] <= cap[1]
        else:
            ok = built <= cap
        if ok:
            return True
    return False


# ---------------------------------------------------------------- nvidia-smi (no torch needed)

def parse_nvidia_smi(query: str, header: str = "") -> dict:
    """`nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader` and the
    plain `nvidia-smi` banner -> {"gpus": [{"name", "capability", "driver"}], "driver_cuda"}."""
    gpus = []
    for line in query.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3 and capability(parts[-2]):
            gpus.append({"name": ",".join(parts[:-2]), "capability": parts[-2], "driver": parts[-1]})
    m = re.search(r"CUDA Version:\s*(\d+\.\d+)", header)
    return {"gpus": gpus, "driver_cuda": m.group(1) if m else None}


def nvidia_smi(exe: str = "nvidia-smi", timeout: float = 30) -> dict | None:
    """What the NVIDIA driver sees (parse_nvidia_smi), or None without a driver / nvidia-smi."""
    exe = shutil.which(exe)
    if exe is None:
        return None
    try:
        query = subprocess.run([exe, "--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=timeout)
        header = subprocess.run([exe], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    if query.returncode != 0:
        return None
    smi = parse_nvidia_smi(query.stdout, header.stdout if header.returncode == 0 else "")
    # nvidia-smi lists every GPU; CUDA_VISIBLE_DEVICES= (or -1) hides them all from CUDA programs
    smi["hidden"] = os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1")
    return smi


def visible_gpu(smi: dict | None) -> dict | None:
    """The first GPU nvidia-smi lists that CUDA programs may use (None when CUDA_VISIBLE_DEVICES
    hides them)."""
    if not smi or smi.get("hidden") or not smi.get("gpus"):
        return None
    return smi["gpus"][0]


def describe_smi(smi: dict | None) -> str | None:
    """One line for doctor: 'Tesla V100-SXM2-32GB (7.0), driver 550.54.15 (CUDA 12.4)'."""
    if not smi or not smi.get("gpus"):
        return None
    g = smi["gpus"][0]
    more = f" (+{len(smi['gpus']) - 1} more)" if len(smi["gpus"]) > 1 else ""
    cuda = f" (CUDA {smi['driver_cuda']})" if smi.get("driver_cuda") else ""
    hidden = "; hidden by CUDA_VISIBLE_DEVICES" if smi.get("hidden") else ""
    return f"{g['name']} ({g['capability']}), driver {g['driver']}{cuda}{more}{hidden}"


# ---------------------------------------------------------------- what a report says about the machine

def package_version(distribution: str) -> str | None:
    """The installed version of a distribution, None when it is not installed (read from its metadata:
    nothing is imported)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpu_name() -> str:
    """The first visible CUDA GPU's name, or 'none (CPU)' (torch is imported here, not at module level;
    without torch, or with a broken CUDA install, the answer is 'none (CPU)')."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - a broken CUDA install still lets a report be written
        pass
    return "none (CPU)"


def machine_facts(*distributions: str, driver: bool = False) -> dict:
    """What every report says about where it ran, from this one function: qsa_lab, Python, torch and CUDA
    versions, the GPU and the date (UTC, to the second); with `driver`, the NVIDIA driver (nvidia-smi);
    then each named distribution's version (None: not installed) with the machine and the processor."""
    import time

    from qsa_lab.support.version import __version__

    try:
        import torch

        torch_version, cuda = torch.__version__, torch.version.cuda or "none"
    except ImportError:
        torch_version, cuda = "not installed", "none"
    out = {"qsa_lab_version": __version__, "python": platform.python_version(), "torch": torch_version,
           "cuda": cuda, "gpu": gpu_name(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if driver:
        gpu = visible_gpu(nvidia_smi()) if cuda != "none" else None
        out["driver"] = gpu["driver"] if gpu else "none"
    if distributions:
        out.update({d: package_version(d) for d in distributions})
        out.update(host_facts())
    return out


def host_facts(*distributions: str) -> dict:
    """What an engine's report adds to the header's machine facts: each named distribution's version, the
    machine and the processor. Torch-free."""
    return {**{d: package_version(d) for d in distributions}, "machine": platform.machine(),
            "processor": platform.processor() or platform.machine()}


# ---------------------------------------------------------------- CUDA 12 NVRTC wheels (no torch needed)

#: the sm_70 compile check of csrc/ is developer tooling (tools/, not shipped); its PyPI wheels are
#: pyproject.toml's `nvrtc` dependency group
NVRTC_HINT = "in a checkout: pip install --group nvrtc, then python tools/nvrtc_sm70.py"


class NvrtcToolkit(NamedTuple):   # not a dataclass: set-up loads this module by path, outside sys.modules
    nvrtc: Path            # libnvrtc.so.12
    builtins: Path         # libnvrtc-builtins.so.12.*
    include_dirs: list     # cuda_runtime/include (cuda_fp16.h, mma.h), cuda_nvcc/include (crt/mma.h)
    ptxas: Path | None     # for sm_70 register counts (optional)


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def find_nvrtc() -> NvrtcToolkit | None:
    """The files of the three NVRTC wheels (nvidia-cuda-nvrtc-cu12, -runtime-cu12, -nvcc-cu12),
    or None when one is missing. Doctor reports it; tools/nvrtc_sm70.py compiles with it."""
    try:
        nvrtc_dir = _package_dir("nvidia.cuda_nvrtc")
        runtime_dir = _package_dir("nvidia.cuda_runtime")
        nvcc_dir = _package_dir("nvidia.cuda_nvcc")
    except ModuleNotFoundError:
        return None
    if not (nvrtc_dir and runtime_dir and nvcc_dir):
        return None
    lib = nvrtc_dir / "lib"
    nvrtc = lib / "libnvrtc.so.12"
    builtins = sorted(lib.glob("libnvrtc-builtins.so.12*"))
    includes = [runtime_dir / "include", nvcc_dir / "include"]
    if not nvrtc.exists() or not builtins or not (includes[1] / "crt" / "mma.h").exists():
        return None
    ptxas = nvcc_dir / "bin" / "ptxas"
    return NvrtcToolkit(nvrtc, builtins[0], includes, ptxas if ptxas.exists() else None)


# ---------------------------------------------------------------- the report

#: status() keys that feed the verdict but are shown through other rows
HIDDEN = ("nvidia_smi", "sources_missing", "build_error")


def table(info: dict) -> list[str]:
    """`qsa-lab doctor`'s rows, 'key  value', one per status() entry."""
    shown = {k: v for k, v in info.items() if k not in HIDDEN}
    width = max(map(len, shown))
    return [f"{k:<{width}}  {v}" for k, v in shown.items()]


# ---------------------------------------------------------------- the verdict

def _gcc_major(text: str | None) -> int | None:
    m = re.match(r"\s*(\d+)", str(text or ""))
    return int(m.group(1)) if m else None


def verdict(info: dict) -> str:
    """One line: 'verdict: ...' saying which backend `auto` uses here and why, with the remedy
    for pip and for conda where the kernels cannot run."""
    smi = info.get("nvidia_smi") or {}
    smi_gpu = visible_gpu(smi)
    if info.get("sources_missing"):
        return (f"verdict: qsa_lab's kernel sources are missing ({', '.join(info['sources_missing'])} not in "
                f"{info.get('kernel_sources')}): this install is incomplete; pip: pip install --force-reinstall "
                "qsa_lab (or pip install -e . in a checkout); conda: the same inside the env")
    if not info.get("cuda_available"):
        driver = cuda_version(f"release {smi.get('driver_cuda')}") if smi.get("driver_cuda") else None
        old_gpu = smi_gpu is not None and (capability(smi_gpu["capability"]) or (0, 0)) < (7, 5)
        pip = (PIP_CUDA12 if old_gpu or (driver and driver[0] == 12)
               else "pip install torch (PyPI's default build, for a CUDA 13 driver)")
        if smi_gpu and info.get("torch_cuda"):
            return (f"verdict: nvidia-smi sees {smi_gpu['name']} (driver {smi_gpu['driver']}, CUDA "
                    f"{smi.get('driver_cuda') or '?'}) but torch {info.get('torch')} (built for CUDA "
                    f"{info.get('torch_cuda')}) does not: the driver is too old for this torch; pip: {pip}, or update "
                    f"the driver; {CONDA_HINT}; until then everything runs on the emulation")
        if smi_gpu:
            return (f"verdict: this torch {info.get('torch')} is a CPU build but nvidia-smi sees {smi_gpu['name']}: "
                    f"to use it, pip: {pip}; {CONDA_HINT}; until then everything runs on the emulation")
        why = "this torch is a CPU build" if not info.get("torch_cuda") else "no CUDA GPU is visible"
        return (f"verdict: {why}: everything runs on the PyTorch emulation (backend emulate), same results, "
                "slower; the kernels are built only where a GPU is visible")
    gpu = info.get("gpu") or "the GPU"
    cap = capability(info.get("capability")) or (0, 0)
    if cap < MIN_CAPABILITY:
        return f"verdict: {gpu} is {sm(cap)}: the kernels need sm_70 or newer; use backend emulate"
    arch_list = info.get("torch_arch_list") or []
    if arch_list and not arch_supported(cap, arch_list):
        fix = PIP_CUDA12 if cap < (7, 5) else "pip install torch (a build listing this arch)"
        return (f"verdict: this torch {info.get('torch')} (CUDA {info.get('torch_cuda')}) has no {sm(cap)} kernels "
                f"for {gpu} (it has {', '.join(arch_list)}); pip: {fix}; {CONDA_HINT}")
    if info.get("built"):
        return f"verdict: the kernels are built and loaded for {gpu} ({sm(cap)}): backend auto uses them"
    torch_cuda = cuda_version(f"release {info.get('torch_cuda')}") if info.get("torch_cuda") else None
    want = LAST_CUDA_FOR.get(cap) or (torch_cuda[0] if torch_cuda else 12)
    nvcc = cuda_version(info.get("nvcc_version"))
    if not info.get("nvcc") or nvcc is None:
        return (f"verdict: no nvcc found (CUDA_HOME unset?): the kernels cannot build for {gpu}; "
                f"{PIP_NVCC.format(major=want)}; {CONDA_HINT}")
    last = LAST_CUDA_FOR.get(cap)
    if last is not None and nvcc[0] > last:
        return (f"verdict: nvcc is CUDA {nvcc[0]}.{nvcc[1]}, which cannot target {sm(cap)} ({gpu}); CUDA {last} is the "
                f"last that can: {PIP_NVCC.format(major=last)}; {CONDA_HINT}")
    if torch_cuda and torch_cuda[0] != nvcc[0]:
        return (f"verdict: nvcc is CUDA {nvcc[0]}.{nvcc[1]} but this torch was built with CUDA "
                f"{info.get('torch_cuda')}: torch refuses to build extensions across CUDA majors; "
                f"{PIP_NVCC.format(major=torch_cuda[0])}; {CONDA_HINT}")
    if not info.get("host_compiler"):
        return (f"verdict: no host C++ compiler (c++ / $CXX) found: the kernels cannot build; pip: install g++ "
                f"(≤ {MAX_GCC_FOR_CUDA.get(nvcc, 'the newest your nvcc accepts')}); {CONDA_HINT}")
    gcc = _gcc_major(info.get("nvcc_host_compiler_version"))
    top = MAX_GCC_FOR_CUDA.get(nvcc)
    rejected = "unsupported GNU version" in str(info.get("error") or "")
    if rejected or (gcc is not None and top is not None and gcc > top):
        limit = f"g++ ≤ {top}" if top else "an older g++"
        return (f"verdict: nvcc {nvcc[0]}.{nvcc[1]} rejects the host compiler "
                f"{info.get('nvcc_host_compiler') or 'gcc'} {gcc if gcc is not None else ''}".rstrip()
                + f": the kernels cannot build for {gpu}; pip: install {limit} and set CC=gcc-N CXX=g++-N "
                  f"(torch passes $CC to nvcc as -ccbin); {CONDA_HINT}")
    if info.get("error"):
        first = info.get("build_error") or (str(info["error"]).strip().splitlines() or ["?"])[-1]
        return (f"verdict: the kernel build failed for {gpu} ({sm(cap)}): {first}; "
                "backend auto falls back to the emulation")
    return f"verdict: the kernels can build here for {gpu} ({sm(cap)}) with nvcc {nvcc[0]}.{nvcc[1]}"

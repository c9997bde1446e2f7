"""The last line of `qsa-lab doctor`: can the compiled kernels run on the visible GPU, and if
not, why and what to do. Pure: it reads the dict that `qsa_lab.kernels.status()` returns."""
from __future__ import annotations

import re

MIN_CAPABILITY = (7, 0)          # the kernels use sm_70 tensor-core instructions
#: the last CUDA major whose nvcc can still target each old architecture (CUDA 13 dropped
#: Maxwell, Pascal and Volta: sm_5x, sm_6x, sm_70, sm_72)
LAST_CUDA_FOR = {(5, 0): 12, (5, 2): 12, (5, 3): 12, (6, 0): 12, (6, 1): 12, (6, 2): 12, (7, 0): 12, (7, 2): 12}
CONDA_HINT = "use the CUDA 12.6 env from environment.yml (conda env create -f environment.yml)"


def cuda_version(text: str | None) -> tuple[int, int] | None:
    """'Build cuda_12.6.r12.6/...' or 'Cuda compilation tools, release 13.0, V13.0.48' -> (12, 6)."""
    if not text:
        return None
    m = re.search(r"release (\d+)\.(\d+)", text) or re.search(r"cuda_(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def verdict(info: dict) -> str:
    """One line: 'verdict: ...' saying which backend `auto` uses here and why."""
    if not info.get("cuda_available"):
        why = "this torch is a CPU build" if not info.get("torch_cuda") else "no CUDA GPU is visible"
        return (f"verdict: {why}: everything runs on the PyTorch emulation (backend emulate), same results, "
                "slower; the kernels are built only where a GPU is visible")
    gpu = info.get("gpu") or "the GPU"
    cap = tuple(int(x) for x in str(info.get("capability") or "0.0").split("."))
    sm = f"sm_{cap[0]}{cap[1]}"
    if cap < MIN_CAPABILITY:
        return f"verdict: {gpu} is {sm}: the kernels need sm_70 or newer; use backend emulate"
    arch_list = info.get("torch_arch_list") or []
    ptx = [int(re.sub(r"\D", "", a[8:]) or 0) for a in arch_list if a.startswith("compute_")]
    if arch_list and sm not in arch_list and not any(p <= cap[0] * 10 + cap[1] for p in ptx):
        return (f"verdict: this torch {info.get('torch')} (CUDA {info.get('torch_cuda')}) has no {sm} kernels "
                f"for {gpu}; {CONDA_HINT} (torch 2.14 cu126 is the last with sm_70)")
    if info.get("built"):
        return f"verdict: the kernels are built and loaded for {gpu} ({sm}): backend auto uses them"
    nvcc = cuda_version(info.get("nvcc_version"))
    if not info.get("nvcc") or nvcc is None:
        return f"verdict: no nvcc found (CUDA_HOME unset?): the kernels cannot build for {gpu}; {CONDA_HINT}"
    last = LAST_CUDA_FOR.get(cap)
    if last is not None and nvcc[0] > last:
        return (f"verdict: nvcc is CUDA {nvcc[0]}.{nvcc[1]}, which cannot target {sm} ({gpu}); CUDA {last} is the "
                f"last that can: {CONDA_HINT}")
    torch_cuda = cuda_version(f"release {info.get('torch_cuda')}") if info.get("torch_cuda") else None
    if torch_cuda and torch_cuda[0] != nvcc[0]:
        return (f"verdict: nvcc is CUDA {nvcc[0]}.{nvcc[1]} but this torch was built with CUDA "
                f"{info.get('torch_cuda')}: torch refuses to build extensions across CUDA majors; {CONDA_HINT}")
    if not info.get("host_compiler"):
        return f"verdict: no host C++ compiler (c++ / $CXX) found: the kernels cannot build; {CONDA_HINT}"
    if info.get("error"):
        first = str(info["error"]).strip().splitlines()
        return (f"verdict: the kernel build failed for {gpu} ({sm}): {first[-1] if first else '?'}; "
                "backend auto falls back to the emulation")
    return f"verdict: the kernels can build here for {gpu} ({sm}) with nvcc {nvcc[0]}.{nvcc[1]}"

"""Built-in third-party kernels: adapters from a `PagedCall` to FlashInfer's and vLLM's APIs.

    flashinfer:decode       BatchDecodeWithPagedKVCacheWrapper, CUDA-core decode
    flashinfer:decode-tc    the same with use_tensor_cores=True
    flashinfer:prefill      BatchPrefillWithPagedKVCacheWrapper, backend "auto"
    flashinfer:prefill-fa2  the same with backend "fa2"
    vllm:unified            vLLM's Triton unified attention (one pass over each row's tiles)
    vllm:unified-3d         the same kernel split into 16 KV segments and reduced, the launch
                            vLLM's Triton backend uses for small decode batches (decode only)

Each imports its library on first call and raises KernelSkipped with the reason when the
library is absent, no CUDA GPU is visible, or the call's spec cannot be expressed in the
library's API. vLLM's kernel comes from an installed vllm, or from a vLLM source checkout
named by QSA_LAB_VLLM_SRC (or `qsa-lab canary --vllm-src PATH`); see adapters.vllm.
"""
from __future__ import annotations

from typing import Callable

from qsa_lab.canary.names import KernelName
from qsa_lab.canary.adapters import flashinfer as _fi
from qsa_lab.canary.adapters import vllm as _vllm

#: name -> (library, kernel)
KERNELS: dict[str, tuple[str, Callable]] = {
    "flashinfer:decode": ("flashinfer", _fi.decode),
    "flashinfer:decode-tc": ("flashinfer", _fi.decode_tc),
    "flashinfer:prefill": ("flashinfer", _fi.prefill),
    "flashinfer:prefill-fa2": ("flashinfer", _fi.prefill_fa2),
    "vllm:unified": ("vllm", _vllm.unified),
    "vllm:unified-3d": ("vllm", _vllm.unified_3d),
}
LIBRARIES = {"flashinfer": _fi.version, "vllm": _vllm.version}


def resolve(name: KernelName) -> Callable:
    """The kernel callable of a built-in third-party kernel name (canary.names.parse_kernel);
    ValueError naming the option the name came from."""
    if name.text not in KERNELS:
        known = [k for k, (lib, _) in KERNELS.items() if lib == name.source]
        raise name.error(f"unknown {name.source} kernel {name.text!r}; choose from {tuple(known)}")
    return KERNELS[name.text][1]


def versions(names) -> dict:
    """{library: version string or None (not importable)} for the libraries `names` use."""
    libs = {KERNELS[n][0] for n in names if n in KERNELS}
    return {lib: LIBRARIES[lib]() for lib in sorted(libs)}

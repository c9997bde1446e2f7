"""Compile the device headers in ``csrc/`` with NVRTC from CUDA 12, without a GPU.

This is the proof that a V100 (sm_70) user can build the kernels: the headers
compile for ``compute_70`` and the PTX uses the tensor cores through WMMA. It needs
three PyPI wheels (the ``nvrtc`` dependency group: ``pip install --group nvrtc``):

- ``nvidia-cuda-nvrtc-cu12``   libnvrtc.so.12 and its builtins
- ``nvidia-cuda-runtime-cu12`` cuda_fp16.h, mma.h, vector types
- ``nvidia-cuda-nvcc-cu12``    crt/mma.h (included by mma.h) and ptxas

NVRTC is called through ctypes; nothing here needs torch or a CUDA driver. Developer tooling:
it works on the checkout it sits in and is not part of the wheel (`qsa-lab doctor` only says
whether the wheels are there, qsa_lab.support.machine.find_nvrtc).

    python tools/nvrtc_sm70.py        # compile for compute_70 and show ptxas -v for sm_70
"""

from __future__ import annotations

import ctypes
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from qsa_lab.support.machine import NvrtcToolkit, find_nvrtc

CSRC = Path(__file__).resolve().parents[1] / "csrc"   # this checkout's (tools/ ships with no install)
DEVICE_HEADERS = ("fp8_decode.cuh", "grouped_page4.cuh", "xqa_page4.cuh")

FORMATS = ("qsa::kE4M3", "qsa::kE5M2", "qsa::kFP16")
VARIANTS = ("qsa::kUnfixed", "qsa::kKernelFix", "qsa::kMaskedLoad", "qsa::kKernelFixNoLeadingBarrier", "qsa::kEarlyV",
            "qsa::kFinitePv")

# Instructions an SM70 build must not contain (WMMA and plain loads only: the V100 has nothing newer).
FORBIDDEN_PTX = ("cp.async", "ldmatrix", "wgmma", "cp.async.bulk", "cp.reduce.async", "redux.sync")
# Operand types an SM70 lacks (bf16, fp8 conversions), matched as PTX type suffixes.
FORBIDDEN_TYPES = (".bf16", ".bf16x2", ".e4m3x2", ".e5m2x2")


def instantiation_source() -> str:
    """A translation unit that includes every device header and instantiates every kernel
    entry point: decode_panel_kernel, xqa_partition_kernel and xqa_reduce_kernel per format,
    grouped_page4_forward per format and variant."""
    lines = [f'#include "{h}"' for h in DEVICE_HEADERS]
    for fmt in FORMATS:
        lines.append(
            f"template __global__ void qsa::decode_panel_kernel<{fmt}>("
            "const unsigned char*, const int*, int, int, int, int, __half*);"
        )
        lines.append(f"template __global__ void qsa::xqa_partition_kernel<{fmt}>(const qsa::XqaParams);")
        lines.append(f"template __global__ void qsa::xqa_reduce_kernel<{fmt}>(const qsa::XqaParams);")
        for variant in VARIANTS:
            lines.append(
                f"template __global__ void qsa::grouped_page4_forward<{fmt}, {variant}>(const qsa::GroupedParams);"
            )
    return "\n".join(lines) + "\n"


@dataclass
class NvrtcResult:
    ok: bool
    log: str
    ptx: str
    lowered: dict = field(default_factory=dict)   # name expression -> mangled entry name
    version: str = ""                              # NVRTC major.minor
    options: list = field(default_factory=list)


def compile_ptx(source: str, arch: str, toolkit: NvrtcToolkit, extra_options: tuple = (), *, name_expressions=(),
                include_dir: Path = CSRC, program: str = "qsa_lab_sm70_check.cu") -> NvrtcResult:
    """Compile `source` to PTX for `arch` (e.g. "compute_70") with NVRTC.

    name_expressions (e.g. "qsa::xqa_reduce_kernel<qsa::kFP16>") are registered before the
    compile and their lowered (mangled) names read back after it, into `lowered`."""
    # The builtins library is dlopen'ed by soname from libnvrtc; loading it first
    # (globally) lets that lookup find it without LD_LIBRARY_PATH.
    ctypes.CDLL(str(toolkit.builtins), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(toolkit.nvrtc), mode=ctypes.RTLD_GLOBAL)
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what}: {lib.nvrtcGetErrorString(status).decode()}")

    major, minor = ctypes.c_int(), ctypes.c_int()
    check(lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    prog = ctypes.c_void_p()
    check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), program.encode(), 0, None, None),
          "nvrtcCreateProgram")
    options = [f"--gpu-architecture={arch}", "--std=c++17", "-lineinfo", f"-I{include_dir}"]
    options += [f"-I{d}" for d in toolkit.include_dirs] + list(extra_options)
    try:
        for expr in name_expressions:
            check(lib.nvrtcAddNameExpression(prog, expr.encode()), f"nvrtcAddNameExpression({expr})")
        c_options = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        status = lib.nvrtcCompileProgram(prog, len(options), c_options)
        size = ctypes.c_size_t()
        check(lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
        buf = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        log = buf.value.decode(errors="replace")
        ptx, lowered = "", {}
        if status == 0:
            for expr in name_expressions:
                name = ctypes.c_char_p()
                check(lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(name)), f"nvrtcGetLoweredName({expr})")
                lowered[expr] = name.value.decode()
            check(lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
            buf = ctypes.create_string_buffer(size.value)
            check(lib.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
            ptx = buf.value.decode(errors="replace")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return NvrtcResult(status == 0, log, ptx, lowered, f"{major.value}.{minor.value}", options)


def forbidden_instructions(ptx: str) -> list[str]:
    """Forbidden instruction mnemonics and operand types that appear in `ptx`."""
    found = [ins for ins in FORBIDDEN_PTX if re.search(r"^\s*(@%?\w+\s+)?" + re.escape(ins) + r"\b", ptx, re.M)]
    return found + [t for t in FORBIDDEN_TYPES if re.search(re.escape(t) + r"\b", ptx)]


def ptxas_report(ptx: str, sm: str, toolkit: NvrtcToolkit, workdir: Path) -> str:
    """ptxas -v output (registers, spills, shared memory) for `sm` (e.g. "sm_70")."""
    if toolkit.ptxas is None:
        return "ptxas not available"
    src = workdir / "check.ptx"
    src.write_text(ptx)
    res = subprocess.run([str(toolkit.ptxas), f"-arch={sm}", "-v", "-warn-spills", str(src),
                          "-o", str(workdir / "check.cubin")], capture_output=True, text=True)
    return res.stdout + res.stderr


if __name__ == "__main__":  # python tools/nvrtc_sm70.py: compile for sm_70 and show ptxas -v
    import tempfile

    tk = find_nvrtc()
    if tk is None:
        raise SystemExit("NVRTC wheels missing: pip install --group nvrtc")
    result = compile_ptx(instantiation_source(), "compute_70", tk)
    print(result.log or "(no NVRTC messages)")
    if result.ok:
        with tempfile.TemporaryDirectory() as d:
            print(ptxas_report(result.ptx, "sm_70", tk, Path(d)))

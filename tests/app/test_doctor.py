"""`qsa-lab doctor` ends with a verdict for the visible GPU: which backend, and if the kernels
cannot build, why and what to do."""
from __future__ import annotations

import subprocess
import sys

import pytest

from qsa_lab.support.machine import cuda_version, verdict

V100 = {"cuda_available": True, "gpu": "Tesla V100-SXM2-32GB", "capability": "7.0", "torch": "2.14.0+cu126",
        "torch_cuda": "12.6", "torch_arch_list": ["sm_70", "sm_80", "sm_90"], "nvcc": "/usr/bin/nvcc",
        "nvcc_version": "Build cuda_12.6.r12.6/compiler.34841621_0", "host_compiler": "/usr/bin/c++",
        "built": False, "error": None}


def test_cuda_version_parses_both_nvcc_lines():
    assert cuda_version("Build cuda_12.6.r12.6/compiler.34841621_0") == (12, 6)
    assert cuda_version("Cuda compilation tools, release 13.0, V13.0.48") == (13, 0)
    assert cuda_version(None) is None and cuda_version("garbage") is None


def test_verdicts():
    assert "can build here for Tesla V100" in verdict(V100)
    assert "built and loaded" in verdict({**V100, "built": True})
    cuda13 = verdict({**V100, "nvcc_version": "Build cuda_13.0.r13.0/compiler.1_0", "torch_cuda": "13.0"})
    assert "CUDA 13.0, which cannot target sm_70" in cuda13 and "environment.yml" in cuda13
    assert "cannot target" not in verdict({**V100, "capability": "9.0", "gpu": "H200", "torch_cuda": "13.0",
                                           "nvcc_version": "Build cuda_13.0.r13.0/compiler.1_0"})
    assert "no sm_70 kernels" in verdict({**V100, "torch_arch_list": ["sm_80", "sm_90", "compute_90"]})
    assert "across CUDA majors" in verdict({**V100, "torch_cuda": "11.8"})
    assert "no nvcc" in verdict({**V100, "nvcc": None, "nvcc_version": None})
    assert "build failed" in verdict({**V100, "error": "building ... failed:\nptxas fatal: bad"})
    assert "emulation" in verdict({"cuda_available": False, "torch_cuda": None})
    assert "no CUDA GPU is visible" in verdict({"cuda_available": False, "torch_cuda": "12.6"})
    assert "sm_61" in verdict({**V100, "capability": "6.1"})


@pytest.fixture(scope="module")
def doctor_run():
    """`python -m qsa_lab doctor` run once, in a process of its own, for the tests that read it."""
    return subprocess.run([sys.executable, "-m", "qsa_lab", "doctor"], capture_output=True, text=True, timeout=300)


def test_doctor_command_ends_with_the_verdict(doctor_run):
    out = doctor_run
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1].startswith("verdict: ")


# -- every state the verdict names, injected ------------------------------------------------------

SMI_V100 = {"gpus": [{"name": "Tesla V100-SXM2-32GB", "capability": "7.0", "driver": "550.54.15"}],
            "driver_cuda": "12.4", "hidden": False}
PIP_AND_CONDA = ("pip", "conda env create -f environment.yml")


def _has_remedies(line: str) -> bool:
    return all(r in line for r in PIP_AND_CONDA)


def test_gpu_seen_by_nvidia_smi_but_not_by_torch():
    """A CUDA 13 torch on a CUDA 12 driver: torch sees no GPU, nvidia-smi does -- not 'no GPU'."""
    line = verdict({"cuda_available": False, "torch": "2.13.0", "torch_cuda": "13.0", "nvidia_smi": SMI_V100})
    assert "nvidia-smi sees Tesla V100-SXM2-32GB" in line and "driver is too old for this torch" in line
    assert "torch==2.14.1+cu126" in line and _has_remedies(line) and "no CUDA GPU is visible" not in line
    cpu = verdict({"cuda_available": False, "torch": "2.13.0+cpu", "torch_cuda": None, "nvidia_smi": SMI_V100})
    assert "CPU build but nvidia-smi sees Tesla V100" in cpu and _has_remedies(cpu)
    hidden = verdict({"cuda_available": False, "torch_cuda": "13.0", "nvidia_smi": {**SMI_V100, "hidden": True}})
    assert "no CUDA GPU is visible" in hidden        # CUDA_VISIBLE_DEVICES= is the user's choice


def test_torch_without_kernels_for_this_arch():
    line = verdict({**V100, "torch": "2.13.0", "torch_cuda": "13.0", "torch_arch_list": ["sm_75", "sm_80", "sm_90"]})
    assert "has no sm_70 kernels for Tesla V100" in line and "torch==2.14.1+cu126" in line and _has_remedies(line)
    # a cubin runs on a newer minor of its major, PTX on any newer GPU; nothing runs on an older one
    h100 = {**V100, "gpu": "H100", "capability": "9.0", "torch_cuda": "13.0",
            "nvcc_version": "Build cuda_13.0.r13.0/compiler.1_0"}
    assert "no sm_90" not in verdict({**h100, "torch_arch_list": ["sm_80", "compute_80"]})
    assert "no sm_86" not in verdict({**h100, "capability": "8.6", "torch_arch_list": ["sm_80"]})
    assert "no sm_80" in verdict({**h100, "capability": "8.0", "torch_arch_list": ["sm_86", "sm_90a"]})


def test_no_nvcc_names_a_system_toolkit_not_the_pip_wheel():
    line = verdict({**V100, "nvcc": None, "nvcc_version": None})
    assert "no nvcc found" in line and "CUDA 12.x toolkit" in line and "nvidia-cuda-nvcc-cu12 has no nvcc" in line
    assert _has_remedies(line)


def test_nvcc_that_cannot_target_this_arch():
    line = verdict({**V100, "nvcc_version": "Cuda compilation tools, release 13.0, V13.0.48"})
    assert "CUDA 13.0, which cannot target sm_70" in line and "CUDA 12 is the last" in line and _has_remedies(line)


def test_host_compiler_that_nvcc_rejects():
    gcc14 = verdict({**V100, "nvcc_host_compiler": "/usr/bin/gcc", "nvcc_host_compiler_version": "14.2.0"})
    assert "nvcc 12.6 rejects the host compiler /usr/bin/gcc 14" in gcc14 and "g++ ≤ 13" in gcc14
    assert _has_remedies(gcc14) and "CC=" in gcc14
    assert "rejects" not in verdict({**V100, "nvcc_host_compiler_version": "13.3.0"})
    # nvcc's own words in a failed build, whatever the version table knows
    seen = verdict({**V100, "nvcc_version": "Build cuda_12.9.r12.9/compiler.1_0", "error": "building ... failed: "
                    "host_config.h:143:2: error: #error -- unsupported GNU version! gcc versions later than 14"})
    assert "rejects the host compiler" in seen


def test_missing_kernel_sources_come_first():
    line = verdict({**V100, "sources_missing": ["bindings.cu"], "kernel_sources": "/x/site-packages/qsa_lab/csrc"})
    assert "kernel sources are missing (bindings.cu not in /x/site-packages/qsa_lab/csrc)" in line
    assert "reinstall" in line
    assert "missing" in verdict({"cuda_available": False, "sources_missing": ["grouped_page4.cuh"]})


def test_a_failed_build_names_the_compilers_first_error():
    from qsa_lab.routes.compiled import first_error

    log = ("Error building extension 'qsa_lab_kernels': [1/3] /usr/bin/nvcc -Werror ... bindings.cu\n"
           "FAILED: bindings.cuda.o\n"
           "/x/csrc/grouped_page4.cuh(120): error: identifier \"__shfl_sync2\" is undefined\n"
           "/x/csrc/grouped_page4.cuh(130): error: expected a \";\"\n"
           "2 errors detected in the compilation of \"/x/csrc/bindings.cu\".\n"
           "ninja: build stopped: subcommand failed.\n")
    first = first_error(log)
    assert first == "/x/csrc/grouped_page4.cuh(120): error: identifier \"__shfl_sync2\" is undefined"
    line = verdict({**V100, "error": log, "build_error": first})
    assert "build failed for Tesla V100" in line and "__shfl_sync2" in line
    assert first_error("nvcc fatal   : Unsupported gpu architecture 'compute_70'") .startswith("nvcc fatal")


def test_doctor_lists_what_nvidia_smi_sees_and_where_the_sources_are(doctor_run):
    out = doctor_run
    from test_wheel import doctor_rows

    rows = doctor_rows(out.stdout)
    assert "nvidia_smi_sees" in rows and "kernel_sources" in rows
    assert rows["kernel_sources"].endswith(("(checkout)", "(installed)"))

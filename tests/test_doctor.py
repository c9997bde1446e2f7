"""`qsa-lab doctor` ends with a verdict for the visible GPU: which backend, and if the kernels
cannot build, why and what to do."""
from __future__ import annotations

import subprocess
import sys

from qsa_lab.doctor import cuda_version, verdict

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


def test_doctor_command_ends_with_the_verdict():
    out = subprocess.run([sys.executable, "-m", "qsa_lab", "doctor"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1].startswith("verdict: ")

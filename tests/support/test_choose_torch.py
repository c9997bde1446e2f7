"""scripts/choose_torch.py (what `make setup` runs when no torch is importable) picks a torch with
kernels for the GPU that a fake `nvidia-smi` reports, never replaces a torch that is there, and
stops with one line when the torch cannot use the GPU."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "choose_torch.py"
spec = importlib.util.spec_from_file_location("choose_torch", SCRIPT)
ct = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ct)

V100 = ("Tesla V100-SXM2-32GB, 7.0, 550.54.15", "12.4")
H200_CUDA13 = ("NVIDIA H200, 9.0, 580.65.06", "13.0")
H200_CUDA12 = ("NVIDIA H200, 9.0, 550.54.15", "12.4")
OLD_DRIVER = ("Tesla V100-SXM2-32GB, 7.0, 470.82.01", "11.4")
CU126_ARCHS = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
CU130_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]


@pytest.fixture(autouse=True)
def _gpus_not_hidden(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def fake_smi(tmp_path: Path, gpu: tuple[str, str] | None) -> str:
    """An nvidia-smi that answers the query and prints the banner of `gpu` (None: no GPU, fails)."""
    exe = tmp_path / "nvidia-smi"
    if gpu is None:
        exe.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the "
                       "NVIDIA driver.' >&2\nexit 9\n")
    else:
        query, cuda = gpu
        exe.write_text(f"#!/bin/sh\ncase \"$1\" in\n  --query-gpu*) echo '{query}';;\n"
                       f"  *) echo '| NVIDIA-SMI 5xx   Driver Version: 5xx   CUDA Version: {cuda}     |';;\nesac\n")
    exe.chmod(0o755)
    return str(exe)


def smi(tmp_path, gpu):
    return ct.doctor.nvidia_smi(fake_smi(tmp_path, gpu))


def test_nvidia_smi_is_read(tmp_path):
    got = smi(tmp_path, V100)
    assert got["gpus"] == [{"name": "Tesla V100-SXM2-32GB", "capability": "7.0", "driver": "550.54.15"}]
    assert got["driver_cuda"] == "12.4"
    assert ct.doctor.nvidia_smi(str(tmp_path / "absent")) is None
    assert smi(tmp_path, None) is None          # the driver is not loaded: no GPU


@pytest.mark.parametrize("gpu, want, index", [
    (None, "torch==2.13.0", None),                                                     # no GPU
    (V100, "torch==2.14.1+cu126", "https://download.pytorch.org/whl/cu126"),          # sm_70
    (H200_CUDA13, "torch==2.13.0", None),                                              # sm_90, CUDA 13 driver
    (H200_CUDA12, "torch==2.14.1+cu126", "https://download.pytorch.org/whl/cu126"),   # CUDA 12 driver
])
def test_choice_follows_the_gpu(tmp_path, gpu, want, index):
    spec, idx, why = ct.choose(smi(tmp_path, gpu), env={})
    assert (spec, idx) == (want, index), why


def test_choices_can_be_overridden(tmp_path):
    env = {"TORCH_CUDA12": "torch==2.10.0", "TORCH_CUDA12_INDEX": "", "TORCH_FALLBACK": "torch==2.12.0"}
    assert ct.choose(smi(tmp_path, V100), env)[:2] == ("torch==2.10.0", None)
    assert ct.choose(smi(tmp_path, H200_CUDA13), env)[:2] == ("torch==2.12.0", None)


def test_a_driver_older_than_cuda_12_stops(tmp_path):
    with pytest.raises(ct.Stop, match="CUDA 11.4.*CUDA 12 driver"):
        ct.choose(smi(tmp_path, OLD_DRIVER), env={})


def test_check_wants_the_gpus_arch(tmp_path):
    v100 = smi(tmp_path, V100)
    ok = {"version": "2.14.1+cu126", "cuda": "12.6", "available": True, "arch_list": CU126_ARCHS}
    assert ct.check(v100, ok) is None
    no_sm70 = ct.check(v100, {**ok, "version": "2.13.0", "cuda": "13.0", "arch_list": CU130_ARCHS})
    assert "no kernels for Tesla V100-SXM2-32GB (sm_70" in no_sm70 and "\n" not in no_sm70
    too_old = ct.check(v100, {**ok, "available": False})
    assert "does not see Tesla V100" in too_old and "driver is too old" in too_old
    assert "CPU build" in ct.check(v100, {"version": "2.13.0+cpu", "cuda": None, "available": False, "arch_list": []})
    assert ct.check(smi(tmp_path, None), {"version": "2.13.0+cpu", "cuda": None}) is None   # no GPU: nothing to check
    h200 = smi(tmp_path, H200_CUDA13)
    assert ct.check(h200, {**ok, "version": "2.13.0", "cuda": "13.0", "arch_list": CU130_ARCHS}) is None


def _run(tmp_path, gpu, python, *extra, env=None):
    import os

    return subprocess.run([sys.executable, str(SCRIPT), "--nvidia-smi", fake_smi(tmp_path, gpu), "--python", python,
                           *extra], capture_output=True, text=True, timeout=600,
                          env={**{k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}, **(env or {})})


def test_cli_installs_the_choice_only_without_torch(tmp_path):
    no_torch = tmp_path / "python-without-torch"
    no_torch.write_text("#!/bin/sh\nexit 1\n")
    no_torch.chmod(0o755)
    out = _run(tmp_path, V100, str(no_torch), "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "pip install torch==2.14.1+cu126 --extra-index-url https://download.pytorch.org/whl/cu126" in out.stdout
    # a torch that imports is kept, and checked: this CPU torch cannot use the (fake) V100
    out = _run(tmp_path, V100, sys.executable, "--dry-run")
    assert "using the torch already installed" in out.stdout and "pip install" not in out.stdout
    assert out.returncode == 1 and out.stderr.strip().count("\n") == 0 and "cannot use Tesla V100" in out.stderr
    # no GPU: the CPU torch is fine
    assert _run(tmp_path, None, sys.executable, "--dry-run").returncode == 0
    # CUDA_VISIBLE_DEVICES= hides the GPU: the emulation is what the user asked for
    assert _run(tmp_path, V100, sys.executable, "--dry-run", env={"CUDA_VISIBLE_DEVICES": ""}).returncode == 0


def test_conda_env_pins_the_same_cuda12_build():
    text = (SCRIPT.parents[1] / "environment.yml").read_text()
    assert f"- {ct.doctor.CUDA12_TORCH}\n" in text and f"--extra-index-url {ct.doctor.CUDA12_INDEX}\n" in text

"""doctor's light NVRTC check (qsa_lab.support.machine.find_nvrtc): the three CUDA 12 wheels the
sm_70 compile check of tools/ runs on, found by their files, None when any is missing."""
from pathlib import Path

from qsa_lab.support import machine


def _wheels(root: Path, ptxas: bool = True) -> dict:
    """A fake install of the three wheels under `root`: package name -> folder."""
    dirs = {name: root / name.replace(".", "/") for name in
            ("nvidia.cuda_nvrtc", "nvidia.cuda_runtime", "nvidia.cuda_nvcc")}
    for f in ("lib/libnvrtc.so.12", "lib/libnvrtc-builtins.so.12.9"):
        (dirs["nvidia.cuda_nvrtc"] / f).parent.mkdir(parents=True, exist_ok=True)
        (dirs["nvidia.cuda_nvrtc"] / f).touch()
    (dirs["nvidia.cuda_runtime"] / "include").mkdir(parents=True)
    (dirs["nvidia.cuda_nvcc"] / "include" / "crt").mkdir(parents=True)
    (dirs["nvidia.cuda_nvcc"] / "include" / "crt" / "mma.h").touch()
    if ptxas:
        (dirs["nvidia.cuda_nvcc"] / "bin").mkdir()
        (dirs["nvidia.cuda_nvcc"] / "bin" / "ptxas").touch()
    return dirs


def test_the_three_wheels_are_found_by_their_files(tmp_path, monkeypatch):
    dirs = _wheels(tmp_path)
    monkeypatch.setattr(machine, "_package_dir", lambda name: dirs.get(name))
    tk = machine.find_nvrtc()
    assert tk.nvrtc == dirs["nvidia.cuda_nvrtc"] / "lib" / "libnvrtc.so.12"
    assert tk.builtins.name == "libnvrtc-builtins.so.12.9" and tk.ptxas.name == "ptxas"
    assert tk.include_dirs == [dirs["nvidia.cuda_runtime"] / "include", dirs["nvidia.cuda_nvcc"] / "include"]

    (dirs["nvidia.cuda_nvcc"] / "include" / "crt" / "mma.h").unlink()    # a wheel without crt/mma.h
    assert machine.find_nvrtc() is None


def test_a_missing_wheel_is_none_and_doctor_says_how_to_get_it(tmp_path, monkeypatch):
    dirs = _wheels(tmp_path, ptxas=False)
    monkeypatch.setattr(machine, "_package_dir", lambda name: dirs.get(name))
    assert machine.find_nvrtc().ptxas is None                             # ptxas is optional
    monkeypatch.setattr(machine, "_package_dir", lambda name: None if name == "nvidia.cuda_runtime" else dirs[name])
    assert machine.find_nvrtc() is None
    assert "--group nvrtc" in machine.NVRTC_HINT and "tools/nvrtc_sm70.py" in machine.NVRTC_HINT


def test_set_up_can_still_load_machine_by_path():
    """scripts/choose_torch.py loads machine.py by path, outside sys.modules, before any torch or
    package is importable: the toolkit record must not need its module registered (a dataclass does)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_machine_by_path", Path(machine.__file__))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.NvrtcToolkit._fields == ("nvrtc", "builtins", "include_dirs", "ptxas")

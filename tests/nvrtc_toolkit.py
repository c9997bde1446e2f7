"""Shared by the NVRTC test modules (a plain module: `conftest` names clash between test folders)."""
import os

import pytest

from run_once import once_per_run


def nvrtc_toolkit():
    """The CUDA 12 NVRTC wheels (the sm_70 compile checks), or skip the calling module;
    under CI=true a missing wheel is a failure, since `make test` installs them."""
    from qsa_lab.routes import nvrtc

    toolkit = nvrtc.find_toolkit()
    if toolkit is None:
        reason = "NVRTC wheels missing: pip install -r requirements-nvrtc.txt"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true: {reason}", pytrace=False)
        pytest.skip(reason, allow_module_level=True)
    return toolkit


def ptx70_folder(tmp_path_factory, toolkit):
    """The checkout's compute_70 folder (qsa_lab.routes.ptx70.generate: PTX + manifest), made
    once per test run. It is the run's one compute_70 compile of csrc/: ptx70.generate
    compiles nvrtc.instantiation_source() with the probe appended, and the three test modules
    that check compute_70 PTX (test_ptx70, test_nvrtc_sm70, test_wheel) read it."""
    from qsa_lab.routes import ptx70

    def generate(shared):
        ptx70.generate(shared / "ptx70", toolkit=toolkit)
        return shared / "ptx70"
    return once_per_run(tmp_path_factory, "ptx70", generate)

"""Shared by the NVRTC test modules (a plain module: `conftest` names clash between test folders)."""
import os

import pytest

from run_once import once_per_run


def nvrtc_toolkit():
    """The CUDA 12 NVRTC wheels (the sm_70 compile checks), or skip the calling module;
    under CI=true a missing wheel is a failure, since `make test` installs them."""
    from qsa_lab.support.machine import find_nvrtc

    toolkit = find_nvrtc()
    if toolkit is None:
        reason = "NVRTC wheels missing: pip install --group nvrtc"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true: {reason}", pytrace=False)
        pytest.skip(reason, allow_module_level=True)
    return toolkit


def ptx70_folder(tmp_path_factory, toolkit):
    """The checkout's compute_70 folder (tools/ptx70.py's generate: PTX + manifest), made
    once per test run. It is the run's one compute_70 compile of csrc/: ptx70.generate
    compiles nvrtc_sm70.instantiation_source() with the probe appended, and the two test
    modules that check compute_70 PTX (test_ptx70, test_nvrtc_sm70) read it."""
    import ptx70

    def generate(shared):
        ptx70.generate(shared / "ptx70", toolkit=toolkit)
        return shared / "ptx70"
    return once_per_run(tmp_path_factory, "ptx70", generate)

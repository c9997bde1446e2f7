"""Shared by the NVRTC test modules (a plain module: `conftest` names clash between test folders)."""
import os

import pytest


def nvrtc_toolkit():
    """The CUDA 12 NVRTC wheels (the sm_70 compile checks), or skip the calling module;
    under CI=true a missing wheel is a failure, since `make test` installs them."""
    from qsa_lab.kernels import nvrtc

    toolkit = nvrtc.find_toolkit()
    if toolkit is None:
        reason = "NVRTC wheels missing: pip install -r requirements-nvrtc.txt"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true: {reason}", pytrace=False)
        pytest.skip(reason, allow_module_level=True)
    return toolkit

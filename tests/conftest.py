import os

import pytest
import torch

from qsa_lab.case import Geometry, build_case
from qsa_lab.poison import REPORT_DIMS, apply_poison
from qsa_lab.routes import run_routes


if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # `make test` runs the tests in parallel processes (pytest-xdist): their torch threads share
    # the cores instead of each taking them all (outputs do not depend on the thread count:
    # tests/test_bit_identity.py runs under this too)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(scope="session")
def report_result():
    """The report's decode-like case, targeted V poison, every route on the emulation."""
    case = apply_poison(build_case(Geometry()), "targeted", dims=list(REPORT_DIMS))
    return run_routes(case, backend="emulate")


def small_geometry(**kw):
    """A geometry small enough for property tests (a few hundred ms per case)."""
    base = dict(rows=16, requests=2, context=300, topk=48, head_dim=32, q_heads=6, page_size=16)
    base.update(kw)
    return Geometry(**base)

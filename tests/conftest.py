import os
import sys

import pytest

# pytest keeps each test module, its asserts rewritten, as bytecode in tests/__pycache__ unless
# bytecode writing is off (PYTHONDONTWRITEBYTECODE); then every run and every xdist worker
# rewrites and compiles all of them again (~4 s of CPU each). The test modules are written while
# they are collected; writing is back as the user set it once collection is done.
_DONT_WRITE_BYTECODE, sys.dont_write_bytecode = sys.dont_write_bytecode, False


def pytest_collection_finish(session):
    sys.dont_write_bytecode = _DONT_WRITE_BYTECODE


import torch  # noqa: E402

from qsa_lab.model.case import Geometry, build_case  # noqa: E402
from qsa_lab.model.poison import REPORT_DIMS, apply_poison  # noqa: E402
from qsa_lab.routes.run import run_routes  # noqa: E402


if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # `make test` runs the tests in parallel processes (pytest-xdist): their torch threads share
    # the cores instead of each taking them all (outputs do not depend on the thread count: 1 and
    # 2 threads gave the same bits in every bit-identity case, evidence/bitid_cpu_paths.json)
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

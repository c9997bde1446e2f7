import pytest

from qsa_lab.case import Geometry, build_case
from qsa_lab.poison import REPORT_DIMS, apply_poison
from qsa_lab.routes import run_routes


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

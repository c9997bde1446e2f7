"""The reference and XQA emulation run a large case one row at a time on one torch thread and a
small one as a whole batch (qsa_lab.routes.reference.by_rows): both ways give the same bits."""
import pytest

from bitid_cases import bits, make_case, small_specs
from qsa_lab.model.case import Geometry, build_case
from qsa_lab.model.plan import xqa_tokens
from qsa_lab.model.poison import apply_poison
from qsa_lab.routes import emulate, reference
from qsa_lab.routes.run import run_routes

ROUTES = ("reference", "xqa")
REFERENCE_WEIGHTS = reference.reference_weights   # the real one, before any test wraps it


def _gathered(case) -> int:
    """Elements of K as the routes gather it for every row (as reference.every_row counts them)."""
    index, _ = xqa_tokens(case)
    return case.q.shape[0] * emulate.xqa_width(index.shape[1], case.kv_dtype) * case.q.shape[-1]


def _run(case, monkeypatch, batch_bytes):
    """-> (route output bits, reference64 bits, rows per reference_weights call) with BATCH_BYTES set."""
    monkeypatch.setattr(reference, "BATCH_BYTES", batch_bytes)
    seen, real = [], REFERENCE_WEIGHTS
    monkeypatch.setattr(reference, "reference_weights",
                        lambda case, q, *a: seen.append(q.shape[0]) or real(case, q, *a))
    res = run_routes(case, ROUTES, backend="emulate")
    return {r: bits(res.outputs[r]) for r in ROUTES}, bits(res.reference64), seen


@pytest.mark.parametrize("geometry", [
    Geometry(context=2048, topk=128),                                           # 19 rows, head dim 256, e4m3
    Geometry(rows=24, requests=3, layout="scatter", context=2048, topk=128, kv_dtype="fp16"),
], ids=["decode-like-2048", "causal3-2048-fp16"])
def test_row_by_row_gives_the_batched_bits(geometry, monkeypatch):
    case = apply_poison(build_case(geometry), "targeted", "v")
    rows = case.q.shape[0]
    batched, ref_batched, calls_batched = _run(case, monkeypatch, 1 << 62)
    one_by_one, ref_rows, calls_rows = _run(case, monkeypatch, 0)
    assert calls_batched == [rows] and calls_rows == [1] * rows     # the two ways were taken
    assert (ref_rows == ref_batched).all()
    for r in ROUTES:
        assert (one_by_one[r] == batched[r]).all(), r


def test_the_bit_identity_cases_take_both_ways():
    """tests/test_bit_identity.py checks both ways against its records: the report's cases go row
    by row, its small geometries as one batch."""
    report = [build_case(Geometry()), build_case(Geometry(rows=24, requests=3, layout="scatter", seed=63))]
    assert all(reference.by_rows(c.q.device, _gathered(c)) for c in report)
    small = [make_case(s) for s in small_specs()[:8]]
    assert not any(reference.by_rows(c.q.device, _gathered(c)) for c in small)

"""Clean units (qsa_lab.routes.reuse): runs of poisoned copies of one case that take every unit
reading no poisoned byte from the units give each route's output and the reference bit for bit as
a run of their own does."""
import pytest
import torch

from bitid_cases import bits
from qsa_lab.model.case import build_case
from qsa_lab.model.geometry import MIXES
from qsa_lab.model.plan import plan_groups
from qsa_lab.model.poison import poison_request
from qsa_lab.routes import emulate, reference
from qsa_lab.routes.reuse import CleanUnits
from qsa_lab.routes.run import ROUTES, run_routes, run_routes_planned

SMALL = dict(context=300, head_dim=64, topk=48, q_heads=6)


def _bits(result):
    return {**{r: bits(o) for r, o in result.outputs.items()}, "reference64": bits(result.reference64)}


@pytest.mark.parametrize("kv_dtype, plane, batch_bytes, chunk_elems", [
    ("e4m3", "v", 1 << 62, 1 << 24),     # the reference and XQA batched; chunks of several groups
    ("fp16", "v", 0, 1),                 # row by row; a chunk per group; Inf payloads too
    ("e4m3", "k", 0, 1 << 24),           # K poisoned: the softmax state is computed again
], ids=["e4m3-batched", "fp16-rows", "k-plane"])
def test_runs_with_clean_units_give_each_runs_own_bits(kv_dtype, plane, batch_bytes, chunk_elems, monkeypatch):
    monkeypatch.setattr(reference, "BATCH_BYTES", batch_bytes)
    monkeypatch.setattr(emulate, "_CHUNK_ELEMS", chunk_elems)
    base = build_case(MIXES["upstream-mix"].replace(kv_dtype=kv_dtype, **SMALL))
    plan = plan_groups(base)
    memo = {"units": CleanUnits(base)}
    payloads = ("nan", "inf", "max") if kv_dtype == "fp16" else ("nan", "max")
    k_sides = []     # calls of the reference's and XQA's K side (softmax weights) in each shared run

    def counted(real):
        def k_side(*args, **kwargs):
            k_sides[-1] += 1
            return real(*args, **kwargs)
        return k_side

    for name in ("reference_weights", "xqa_weights"):
        monkeypatch.setattr(reference, name, counted(getattr(reference, name)))
    for payload in payloads:
        for r in range(base.geometry.requests):
            case = poison_request(base, r, payload, plane=plane)
            k_sides.append(0)
            shared = run_routes_planned(case, ROUTES, "emulate", plan, memo=memo)
            k_sides.append(0)   # the run alone below counts here, and is dropped
            alone = run_routes(case, ROUTES, "emulate")
            k_sides.pop()
            got, want = _bits(shared), _bits(alone)
            for k in want:
                assert (got[k] == want[k]).all(), (payload, r, k)
    units = memo["units"]
    assert units.reused > 0 and units.computed > 0   # both ways were taken
    # V poisoned: every K side is computed in the first run and taken from the units after it;
    # K poisoned: the poisoned request's rows compute theirs again in each run
    assert k_sides[0] > 0 and (not any(k_sides[1:]) if plane == "v" else all(k_sides[1:])), k_sides


def test_a_case_that_differs_in_q_is_refused():
    base = build_case(MIXES["upstream-mix"].replace(**SMALL))
    other = base.clone()
    other.q = base.q.clone()
    other.q[0, 0, 0] += 1
    with pytest.raises(ValueError, match="case: differs"):
        CleanUnits(base).bind(other)


def test_a_unit_before_bind_is_refused():
    base = build_case(MIXES["upstream-mix"].replace(**SMALL))
    with pytest.raises(RuntimeError, match="bind"):
        CleanUnits(base)(("x",), torch.zeros(1, dtype=torch.long), lambda: 0)

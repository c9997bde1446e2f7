"""One record of a paged call (qsa_lab.model.paged): Case, CanaryCase and PagedCall are views of
it, never copies of its field list; converting one view into another shares the tensors; the
attention spec is parsed once, where a case is made; every view is checked by the same rules."""
import dataclasses

import pytest
import torch

from qsa_lab.canary.call import PagedCall
from qsa_lab.canary.case import CANARY_GEOMETRY, CanaryCase, as_canary_case, canary_case, validate
from qsa_lab.model.case import Case, build_case, validate_case
from qsa_lab.model.paged import FIELDS, SCALES, TENSORS, PagedTensors
from qsa_lab.model.regions import AttentionSpec

VIEWS = (Case, CanaryCase, PagedCall)


def test_the_record_is_declared_once():
    assert TENSORS == ("q", "kv_cache", "block_table", "seq_lens", "token_to_req", "positions", "selected")
    assert SCALES == ("k_scale", "v_scale") and set(FIELDS) == set(TENSORS + SCALES)
    for view in VIEWS:
        assert issubclass(view, PagedTensors)
        # a view that declared q, kv_cache, ... again would carry them in its own annotations
        assert not set(view.__dict__.get("__annotations__", {})) & set(FIELDS), view.__name__
        assert tuple(f.name for f in dataclasses.fields(view))[:len(FIELDS)] == FIELDS, view.__name__


def test_every_view_exposes_the_same_tensors_and_shape():
    case = build_case(CANARY_GEOMETRY)
    views = [case, CanaryCase.from_case(case), PagedCall.from_case(case)]
    for v in views:
        assert tuple(v.tensors()) == TENSORS
        assert all(t is getattr(case, k) for k, t in v.tensors().items())
        g = CANARY_GEOMETRY
        assert (v.rows, v.q_heads, v.requests, v.page_size, v.kv_heads, v.head_dim, v.device) == \
            (g.rows, g.q_heads, g.requests, g.page_size, 1, g.head_dim, torch.device("cpu"))


def test_round_trip_shares_the_tensors():
    """Case -> CanaryCase -> PagedCall -> Case: the same tensor objects, not copies."""
    case = build_case(CANARY_GEOMETRY)
    canary = CanaryCase.from_case(case, "dense")  # = sparse here: topk covers every prefix
    call = PagedCall.from_case(canary, memo={"kept": 1})
    back = call.to_case()
    assert type(canary) is CanaryCase and type(call) is PagedCall and type(back) is Case
    for name in TENSORS:
        assert getattr(canary, name) is getattr(case, name)
        assert getattr(call, name) is getattr(case, name)
        assert getattr(back, name) is getattr(case, name), name
    assert (back.k_scale, back.v_scale, back.geometry) == (case.k_scale, case.v_scale, case.geometry)
    assert (call.kv_dtype, str(call.spec), call.sm_scale, call.memo) == ("fp16", "dense", case.sm_scale,
                                                                         {"kept": 1})
    assert str(call.case.spec) == "dense" and call.case.q is case.q and type(call.case) is CanaryCase


def test_to_and_clone_of_the_record():
    canary = canary_case()
    assert all(t is canary.tensors()[k] for k, t in canary.to("cpu").tensors().items())
    copy = canary.clone()
    for k, t in copy.tensors().items():
        assert t is not canary.tensors()[k] and torch.equal(t, canary.tensors()[k])
    # a Case copies only what poison writes (the pool); q stays shared (the playground's `q is` test)
    case = build_case(CANARY_GEOMETRY)
    copy = case.clone()
    assert copy.kv_cache is not case.kv_cache and copy.q is case.q and copy.poison is not case.poison


def test_the_spec_is_parsed_once_where_the_case_is_made(monkeypatch):
    texts = []
    parse = AttentionSpec.parse.__func__

    def counting(cls, text):
        if not isinstance(text, AttentionSpec):
            texts.append(text)
        return parse(cls, text)
    monkeypatch.setattr(AttentionSpec, "parse", classmethod(counting))
    case = canary_case(attend="window:6,sink:2")
    assert texts == ["window:6,sink:2"] and case.spec == AttentionSpec("window", window=6, sink=2)
    call = PagedCall.from_case(as_canary_case(case))
    assert call.case.spec is case.spec and call.clone().spec is case.spec
    assert texts == ["window:6,sink:2"]
    assert case.with_spec("dense").spec.kind == "dense" and texts[-1] == "dense" and len(texts) == 2


def _page_twice(case):
    bt = case.block_table.clone()
    bt[1, 0] = bt[0, 0]
    return dataclasses.replace(case, block_table=bt)


def test_every_view_is_checked_by_the_same_rules():
    case = build_case(CANARY_GEOMETRY)
    with pytest.raises(ValueError) as qsa:
        validate_case(_page_twice(case))
    with pytest.raises(ValueError) as canary:
        validate(_page_twice(CanaryCase.from_case(case)))
    assert str(qsa.value) == str(canary.value)
    assert str(qsa.value).startswith("block_table: expected each physical page at most once inside seq_len")
    for check, view in ((validate_case, case), (validate, CanaryCase.from_case(case))):
        with pytest.raises(TypeError, match="^kv_cache: expected a torch.Tensor, got list"):
            check(dataclasses.replace(view, kv_cache=[1]))


def test_a_call_under_another_spec_gets_its_own_memo():
    call = PagedCall.from_case(canary_case(), memo={})
    dense = call.attend()
    window = call.with_spec("window:2")
    assert type(window) is PagedCall and window.memo is not call.memo
    assert not torch.equal(window.attend(), dense) and torch.equal(call.attend(), dense)

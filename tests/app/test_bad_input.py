"""Bad input gets a clear error naming the argument, from the API and the CLI (acceptance 8)."""
import dataclasses

import pytest

from qsa_lab.model.case import Geometry, build_case
from qsa_lab.app.cli import main
from qsa_lab.model.poison import apply_poison
from qsa_lab.routes.run import run_routes

SMALL = dict(rows=8, context=64, topk=8, head_dim=32)


@pytest.mark.parametrize("kw,arg", [
    (dict(page_size=30), "page_size"), (dict(head_dim=40), "head_dim"), (dict(rows=0), "rows"),
    (dict(kv_dtype="int8"), "kv_dtype"), (dict(layout="random"), "layout"), (dict(q_heads=0), "q_heads"),
    (dict(context=5), "context"), (dict(topk=0), "topk"), (dict(group_rows="x"), "group_rows"),
])
def test_geometry_errors_name_the_argument(kw, arg):
    with pytest.raises(ValueError, match=arg):
        Geometry(**kw)


CASE = build_case(Geometry(**SMALL))


@pytest.mark.parametrize("field,value,arg", [
    ("q", CASE.q.float(), "q"), ("q", CASE.q[:, :, :16], "q"),
    ("kv_cache", CASE.kv_cache.half(), "kv_cache"), ("kv_cache", CASE.kv_cache[:, :1], "kv_cache"),
    ("block_table", CASE.block_table + 10_000, "block_table"), ("seq_lens", CASE.seq_lens.long(), "seq_lens"),
    ("positions", CASE.positions.int(), "positions"), ("selected", CASE.selected + 1000, "selected"),
    ("token_to_req", CASE.token_to_req + 3, "token_to_req"), ("k_scale", float("nan"), "k_scale"),
])
def test_bad_case_tensors_are_refused_before_any_route(field, value, arg):
    bad = dataclasses.replace(CASE, **{field: value})
    with pytest.raises(ValueError, match=arg):
        run_routes(bad, backend="emulate")


def test_duplicate_selection_and_unsorted_rows_are_refused():
    sel = CASE.selected.clone()
    sel[0, 1] = sel[0, 0]              # would add a mask nibble twice and corrupt the next query's bits
    with pytest.raises(ValueError, match="selected"):
        run_routes(dataclasses.replace(CASE, selected=sel), backend="emulate")
    two = build_case(Geometry(**{**SMALL, "requests": 2}))
    with pytest.raises(ValueError, match="token_to_req"):
        run_routes(dataclasses.replace(two, token_to_req=two.token_to_req.flip(0)), backend="emulate")


def test_bad_poison_and_route_arguments():
    with pytest.raises(ValueError, match="dims"):
        apply_poison(CASE, "targeted", dims=[32])
    with pytest.raises(ValueError, match="site"):
        apply_poison(CASE, "everywhere")
    with pytest.raises(ValueError, match="plane"):
        apply_poison(CASE, "random", plane="q")
    with pytest.raises(ValueError, match="site 'stale-tail'"):
        apply_poison(CASE, "stale-tail")           # one request of 64 tokens: no partial microblock
    with pytest.raises(ValueError, match="routes"):
        run_routes(CASE, routes=["grouped+magic"], backend="emulate")
    with pytest.raises(ValueError, match="backend"):
        run_routes(CASE, backend="tpu")


@pytest.mark.parametrize("argv,needle", [
    (["diff", "--page-size", "30"], "--page-size"), (["diff", "--head-dim", "40"], "--head-dim"),
    (["diff", "--rows", "0"], "--rows"), (["diff", "--poison", "targeted", "--dims", "300"], "--dims"),
    (["diff", "--poison", "nowhere"], "--poison"), (["diff", "--rows", "x"], "--rows"),
    (["diff", "--backend", "tpu"], "--backend"), (["diff", "--dims", "1,a"], "--dims"),
    (["frobnicate"], "frobnicate"),
    (["diff", "--json", "/nonexistent-folder/x.json"], "--json"), (["diff", "--save", "/"], "--save"),
    (["diff", "--load", "x.safetensors", "--rows", "3"], "--load"),
])
def test_cli_exits_2_with_one_line(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and err.startswith("qsa-lab: error:")

"""The report's decode-like case (acceptance 2-4): the NaN, its fingerprint, the fixes, the controls."""
import pytest
import torch

from qsa_lab.analysis import fingerprints as analysis
from qsa_lab.model.case import Geometry, build_case
from qsa_lab.model.poison import REPORT_DIMS, apply_poison
from qsa_lab.routes.run import GROUPED, run_routes

FIXED = ["grouped+kernel_fix", "grouped+pad_fix", "grouped+both_fixes", "grouped+masked_load", "grouped+request_groups",
         "grouped+finite_pv"]


def test_grouped_nan_exactly_on_the_poisoned_dims(report_result):
    out = report_result.outputs["grouped"]
    assert int(torch.isnan(out).sum()) == 480            # 2 groups x 3 M-tiles x 16 rows x 5 dims
    assert analysis.nan_dims(out) == list(REPORT_DIMS)
    # the 3 XQA remainder rows are clean; every grouped row is NaN on every poisoned dim
    assert not torch.isnan(out[16:]).any()
    assert torch.isnan(out[:16][:, :, list(REPORT_DIMS)]).all()


@pytest.mark.parametrize("route", ["reference", "xqa"] + FIXED)
def test_clean_routes_are_finite_and_match_the_reference(report_result, route):
    out = report_result.outputs[route]
    assert int(torch.isnan(out).sum()) == 0
    assert analysis.within_tolerance(out, report_result.reference64, "e4m3")


def test_fixes_do_not_change_the_finite_answer(report_result):
    """Where the unfixed route is finite, every fix returns the very same fp16 bits."""
    unfixed = report_result.outputs["grouped"]
    finite = ~torch.isnan(unfixed)
    for route in FIXED:
        assert torch.equal(report_result.outputs[route][finite], unfixed[finite])


def test_fingerprint_identical_across_rows_and_heads_and_only_on_padded_categories(report_result):
    fp = analysis.fingerprint(report_result)
    hit = fp[fp.nan_count > 0]
    assert len(hit) == 6
    assert hit.identical_across_rows.all()
    assert all(d == list(REPORT_DIMS) for d in hit.nan_dims)
    assert (fp.nan_count > 0).tolist() == fp.padded_category.tolist()


def test_attribution_points_at_the_null_block_bytes(report_result):
    att = analysis.attribute(report_result)
    assert set(att.dim) == set(REPORT_DIMS)
    assert (att.page == 0).all() and (att.microblock == 0).all() and att.padding.all()
    assert set(att.token) == {0, 1, 2, 3} and (att.byte == 0x7F).all()


def test_prediction_from_the_plan_equals_the_emulated_nan_mask(report_result):
    pred = analysis.predict_nan(report_result.case, report_result.plan)
    assert torch.equal(pred, torch.isnan(report_result.outputs["grouped"]))


def test_zero_page0_is_clean():
    r = run_routes(apply_poison(build_case(Geometry()), "zeros"), backend="emulate")
    assert all(int(torch.isnan(o).sum()) == 0 for o in r.outputs.values())


def test_fp16_kv_with_the_same_poison_is_clean():
    r = run_routes(apply_poison(build_case(Geometry(kv_dtype="fp16")), "targeted"), backend="emulate")
    assert r.case.poison["nan_bytes"] == 0
    for route, out in r.outputs.items():
        assert int(torch.isnan(out).sum()) == 0, route
        assert analysis.within_tolerance(out, r.reference64, "fp16"), route


def test_k_plane_poison_is_clean_everywhere():
    r = run_routes(apply_poison(build_case(Geometry()), "targeted", plane="k"), backend="emulate")
    assert r.case.poison["nan_bytes"] == 20
    for route, out in r.outputs.items():
        assert int(torch.isnan(out).sum()) == 0, route


def test_stale_tail_leaks_through_unfixed_and_pad_fix_only():
    g = Geometry(rows=24, requests=3, layout="scatter")
    r = run_routes(apply_poison(build_case(g), "stale-tail", dims=[7, 99]), backend="emulate")
    nan = {route: int(torch.isnan(o).sum()) for route, o in r.outputs.items()}
    assert nan["grouped"] > 0 and nan["grouped+pad_fix"] > 0
    assert analysis.nan_dims(r.outputs["grouped+pad_fix"]) == [7, 99]
    for route in ("reference", "xqa", "grouped+kernel_fix", "grouped+masked_load", "grouped+both_fixes",
                  "grouped+request_groups", "grouped+finite_pv"):
        assert nan[route] == 0, route
    att = analysis.attribute(r, "grouped+pad_fix")
    assert len(att) and not att.padding.any() and (att.page != 0).all()


def test_grouped_routes_are_all_declared():
    assert set(GROUPED) == {"grouped"} | set(FIXED)

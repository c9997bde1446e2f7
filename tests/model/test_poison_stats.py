"""Byte statistics of the poison sites (acceptance 5), with the sampling error computed."""
import math

import pytest
import torch

from qsa_lab.model import fp8
from qsa_lab.model.case import Geometry, build_case
from qsa_lab.model.poison import apply_poison

CASE = build_case(Geometry(rows=8, context=64, topk=16))


@pytest.mark.parametrize("site,p", [("random", 2 / 256), ("fp16-state", 1 / 256)])
def test_nan_byte_fraction_over_page0(site, p):
    n_bytes, n_nan = 0, 0
    for seed in range(16):
        c = apply_poison(CASE, site, plane="kv", seed=seed)
        page0 = c.kv_cache[0]
        n_bytes += page0.numel()
        n_nan += int(fp8.is_nan_code(page0, "e4m3").sum())
        assert c.poison["nan_bytes"] == int(fp8.is_nan_code(page0, "e4m3").sum())
    sigma = math.sqrt(p * (1 - p) / n_bytes)
    assert abs(n_nan / n_bytes - p) < 4 * sigma, (n_nan / n_bytes, p, sigma)


def test_targeted_writes_exactly_the_dims_on_the_plane():
    c = apply_poison(CASE, "targeted", plane="v", dims=[3, 17])
    nan = fp8.is_nan_code(c.kv_cache, "e4m3")
    assert int(nan.sum()) == 8 and c.poison["poisoned_dims"] == [3, 17]
    assert nan[0, 1, :4, 0][:, [3, 17]].all() and not nan[:, 0].any() and not nan[1:].any()


def test_poison_does_not_touch_the_input_case():
    before = CASE.kv_cache.clone()
    apply_poison(CASE, "random", plane="kv")
    assert torch.equal(before, CASE.kv_cache)


def test_cache_write_path_never_produces_nan():
    c = build_case(Geometry(rows=8, context=256, topk=16, kv_dtype="e4m3"))
    assert not fp8.is_nan_code(c.kv_cache, "e4m3").any()


def test_e5m2_inf_codes_are_recorded_beside_nan():
    """0 * Inf = NaN leaks like NaN: Inf codes are counted and their dims listed."""
    c = build_case(Geometry(rows=8, context=64, topk=16, kv_dtype="e5m2"))
    for seed in range(8):
        p = apply_poison(c, "random", plane="v", seed=seed).poison
        vals = fp8.decode(apply_poison(c, "random", plane="v", seed=seed).kv_cache[0, 1, :, 0, :], "e5m2")
        assert p["inf_bytes"] == int(torch.isinf(vals).sum()) and p["nan_bytes"] == int(torch.isnan(vals).sum())
        bad = torch.nonzero(~torch.isfinite(vals))[:, 1].unique().tolist()
        assert p["nonfinite_dims"] == sorted(bad)

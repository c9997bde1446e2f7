"""The indexer's calibration table: the presets' entries are what the calibration computes."""
import pytest

from qsa_lab.model import selection as S
from qsa_lab.model.case import Geometry, build_case


@pytest.mark.parametrize("key", sorted(S.CALIBRATED))
def test_every_entry_is_what_the_calibration_computes(key):
    S._calibrated_rho.cache_clear()
    assert S._calibrated_rho(*key) == S.CALIBRATED[key]


def test_the_table_covers_the_presets_and_is_used(monkeypatch):
    """Building every geometry preset asks only for tabled keys; and the table's value, not a
    computed one, is what a case of such a key is built with."""
    from qsa_lab.report.repro import REPRO_CASES
    from qsa_lab.analysis.playground import PRESETS

    asked = []
    monkeypatch.setattr(S, "_calibrated_rho", lambda *key: asked.append(key) or 0.5)
    for g in dict.fromkeys(list(PRESETS.values()) + [rc.geometry for rc in REPRO_CASES]):
        build_case(g)
    assert asked == []
    # an untabled key is computed
    S.indexer_correlation(0.8, 1000, 100)
    assert asked == [(0.8, 1000, 100)]


def test_a_tabled_value_changes_the_case(monkeypatch):
    """The table is not decoration: a different value there gives different selections."""
    g = Geometry(context=2048, topk=128)
    before = build_case(g).selected.clone()
    for key in list(S.CALIBRATED):
        monkeypatch.setitem(S.CALIBRATED, key, 0.2)
    after = build_case(g).selected
    assert not bool((before == after).all())

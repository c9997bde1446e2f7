"""One name for the grouping parameter: Geometry.group_rows; the old name ('grouping', as older
files wrote it) read through model.geometry.RENAMED_FIELDS, the one map of old names."""
import json

import pytest

from qsa_lab.model.case import geometry_from_json
from qsa_lab.model.geometry import RENAMED_FIELDS, Geometry


def test_from_dict_reads_old_names():
    assert RENAMED_FIELDS == {"grouping": "group_rows"}
    g = Geometry(rows=24, requests=3, group_rows="request")
    assert Geometry.from_dict(g.to_dict()) == g
    old = {("grouping" if k == "group_rows" else k): v for k, v in g.to_dict().items()}
    assert Geometry.from_dict(old) == g and geometry_from_json(json.dumps(old)) == g
    assert "grouping" in old and "group_rows" not in old                       # from_dict leaves its argument be


def test_from_dict_refuses_what_is_wrong_naming_it():
    with pytest.raises(ValueError, match="^group_rows: given twice"):
        Geometry.from_dict({"grouping": "request", "group_rows": "consecutive"})
    with pytest.raises(ValueError, match="^group_rows: must be one of"):
        Geometry.from_dict({"grouping": "spiral"})
    with pytest.raises(TypeError, match="unexpected keyword argument 'groups'"):
        Geometry.from_dict({"groups": "request"})
    with pytest.raises(TypeError, match="^geometry: expected a dict"):
        Geometry.from_dict([("rows", 3)])

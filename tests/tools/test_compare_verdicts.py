"""tools/compare_verdicts.py: two leak-check documents, the same verdicts and counts or not."""
import json

import pytest

import compare_verdicts

CANARY = {"schema": "qsa_lab.canary/1", "date": "2026-01-01T00:00:00Z",
          "counts": {"cells": 2, "checks": 2, "leaking": 1}, "results": [{"kernel": "k", "region": "null-block", "plane": "v", "payload": "nan", "verdict": "nan-leak",
                       "nan": 4, "inf": 0, "finite_changed": 0, "note": "x"},
                      {"kernel": "k", "region": "null-block", "plane": "k", "payload": "nan", "verdict": "clean",
                       "nan": 0, "inf": 0, "finite_changed": 0}]}


def _write(tmp_path, name, doc):
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def test_the_same_verdicts_and_counts_are_identical_whatever_the_date_and_notes(tmp_path, capsys):
    other = json.loads(json.dumps(CANARY))
    other["date"], other["results"][0]["note"] = "2027-01-01T00:00:00Z", "y"
    assert compare_verdicts.main([_write(tmp_path, "a.json", CANARY), _write(tmp_path, "b.json", other)]) == 0
    assert capsys.readouterr().out == "2 and 2 cells: identical verdicts and counts\n"


def test_a_changed_verdict_or_count_is_named(tmp_path, capsys):
    other = json.loads(json.dumps(CANARY))
    other["results"][0]["nan"] = 5
    assert compare_verdicts.main([_write(tmp_path, "a.json", CANARY), _write(tmp_path, "b.json", other)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == ["k/null-block/v/nan: ('nan-leak', 4, 0, 0, 0) -> ('nan-leak', 5, 0, 0, 0)",
                   "2 and 2 cells: 1 difference(s)"]


def test_not_a_leak_check_document_is_exit_2(tmp_path, capsys):
    diff = _write(tmp_path, "diff.json", {"schema": "qsa_lab.diff/1"})
    assert compare_verdicts.main([diff, _write(tmp_path, "a.json", CANARY)]) == 2
    assert "diff.json: not a qsa_lab.canary/1 or qsa_lab.scribble/1 or qsa_lab.cross_request/1 or qsa_lab.cross_request/2 document" \
        in capsys.readouterr().err
    assert compare_verdicts.main([str(tmp_path / "missing.json"), diff]) == 2


CROSS = {"schema": "qsa_lab.cross_request/1", "backend": "emulate", "must_be_clean_leaks": 0, "runs": [],
         "records": [{"q_heads": 2, "kv_dtype": "e4m3", "route": "grouped", "payload": "nan", "poisoned_request": 0,
                      "request": 1, "rows": [46], "elements": 256, "verdict": "leak", "as_reference": False},
                     {"q_heads": 2, "kv_dtype": "e4m3", "route": "xqa", "payload": "nan", "poisoned_request": 0,
                      "request": 1, "rows": [46], "elements": 0, "verdict": "clean", "as_reference": True}]}


def test_cross_request_records_are_compared_by_verdict_rows_and_elements(tmp_path, capsys):
    same = json.loads(json.dumps(CROSS))
    same["backend"] = "cuda"                                 # not a verdict or a count
    assert compare_verdicts.main([_write(tmp_path, "a.json", CROSS), _write(tmp_path, "b.json", same)]) == 0
    assert capsys.readouterr().out == "2 and 2 cells: identical verdicts and counts\n"
    moved = json.loads(json.dumps(CROSS))
    moved["records"][0]["rows"], moved["must_be_clean_leaks"] = [45, 46], 1
    assert compare_verdicts.main([_write(tmp_path, "a.json", CROSS), _write(tmp_path, "c.json", moved)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "2/e4m3/grouped/nan/0/1: ('leak', 256, '[46]', False) -> ('leak', 256, '[45, 46]', False)",
        "must_be_clean_leaks: 0 -> 1", "2 and 2 cells: 2 difference(s)"]


def test_a_renamed_verdict_is_counted_and_a_verdict_map_accepts_it(tmp_path, capsys):
    renamed = json.loads(json.dumps(CROSS))
    renamed["records"][0]["verdict"] = "nan-leak"
    a, b = _write(tmp_path, "a.json", CROSS), _write(tmp_path, "b.json", renamed)
    assert compare_verdicts.main([a, b]) == 1
    assert capsys.readouterr().out.splitlines()[-2:] == ["verdict changes: leak -> nan-leak (1)",
                                                         "2 and 2 cells: 1 difference(s)"]
    assert compare_verdicts.main([a, b, "--verdict-map", "leak=nan-leak"]) == 0
    assert compare_verdicts.main([a, b, "--verdict-map", "leak=inf-leak"]) == 1
    capsys.readouterr()
    for bad in ("leak", "leak=", "=x"):
        with pytest.raises(SystemExit) as e:
            compare_verdicts.main([a, b, "--verdict-map", bad])
        assert e.value.code == 2 and "--verdict-map: expected OLD=NEW" in capsys.readouterr().err

"""The playground is wiring only: each control redraws through the pure data and render
functions, the widget figure equals the static one, Export writes all three formats with
metadata, and bad input shows a message while keeping the previous state (issue 4, acc. 2)."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("ipywidgets")
import matplotlib  # noqa: E402

matplotlib.use("Agg")

from qsa_lab import widgets as W  # noqa: E402
from qsa_lab.export import read_png_meta  # noqa: E402

CACHE = W.RunCache(size=32)


@pytest.fixture
def pg(tmp_path):
    return W.Playground(cache=CACHE, out_dir=str(tmp_path / "figs"))


def pixels(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba()).copy()


CHANGES = [
    ("dims", "102,152", lambda p: p.dims == (102, 152)),
    ("site", "random", lambda p: p.site == "random"),
    ("plane", "k", lambda p: p.plane == "k"),
    ("seed", 3, lambda p: p.seed == 3),
    ("kv_dtype", "fp16", lambda p: p.kv_dtype == "fp16"),
    ("geometry", "3-req scatter causal, 24 rows, ctx 2048", lambda p: p.geometry.rows == 24),
    ("backend", "auto", lambda p: p.backend == "auto"),
    ("nan_map", "grouped+pad_fix", lambda p: p.nan_map == "grouped+pad_fix"),
    ("kernel_fix", False, lambda p: "kernel_fix" not in p.fixes),
    ("pad_fix", False, lambda p: "pad_fix" not in p.fixes),
    ("both_fixes", False, lambda p: "both_fixes" not in p.fixes),
    ("masked_load", False, lambda p: "masked_load" not in p.fixes),
]


@pytest.mark.parametrize("name,value,check", CHANGES, ids=[c[0] for c in CHANGES])
def test_each_control_redraws(pg, name, value, check):
    before, n = pg.last_data, pg.redraws
    assert pg.set(**{name: value}), pg.message.value
    assert pg.redraws == n + 1
    assert pg.last_data is not before and check(pg.last_data["params"])
    assert pg.last_data["params"] == pg.read_params()


def test_fix_toggle_changes_routes_drawn(pg):
    assert "grouped+kernel_fix" in pg.last_data["table"].index
    pg.set(kernel_fix=False)
    assert "grouped+kernel_fix" not in pg.last_data["table"].index
    assert "grouped+kernel_fix" not in pg.last_data["routes"]["routes"]


def test_default_is_the_report_fingerprint(pg):
    t = pg.last_data["table"]
    assert t.loc["grouped", "nan_count"] == 480 and list(t.loc["grouped", "nan_dims"]) == [102, 152, 168, 170, 230]
    assert (t.drop(index="grouped")["nan_count"] == 0).all()
    pg.set(dims="7")
    assert list(pg.last_data["table"].loc["grouped", "nan_dims"]) == [7]


def test_widget_figure_equals_static_figure(pg):
    pg.set(dims="3,200", pad_fix=False)
    static = W.render_playground(W.playground_data(pg.last_data["params"], W.RunCache()))
    assert np.array_equal(pixels(pg.figure), pixels(static))
    again = W.render_playground(pg.last_data)
    assert np.array_equal(pixels(pg.figure), pixels(again))


@pytest.mark.parametrize("name,bad,word", [("dims", "abc", "dims"), ("dims", "12,999", "dims"),
                                           ("dims", "", "dims"), ("seed", -1, "seed"),
                                           ("backend", "cuda", "")])
def test_bad_input_shows_message_and_keeps_state(pg, name, bad, word):
    import torch

    if name == "backend" and torch.cuda.is_available():
        pytest.skip("cuda backend is valid here")
    data, fig, n = pg.last_data, pg.figure, pg.redraws
    assert not pg.set(**{name: bad})
    assert "&#9888;" in pg.message.value and word in pg.message.value
    assert pg.last_data is data and pg.figure is fig and pg.redraws == n
    assert pg.set(**{name: {"dims": "102", "seed": 0, "backend": "emulate"}[name]})  # recovers
    assert pg.last_data is not data


def test_export_writes_three_formats_with_metadata(pg, tmp_path):
    paths = pg.export()
    assert [p.suffix for p in paths] == [".png", ".svg", ".pdf"] and all(p.stat().st_size > 1000 for p in paths)
    meta = read_png_meta(paths[0])
    assert meta["backend"] == "emulate" and "rows 19" in meta["case"] and meta["qsa_lab_version"]
    assert meta["gpu"]
    assert "rows 19" in paths[1].read_text() and b"qsa_lab_version" in paths[2].read_bytes()
    again = pg.export()
    assert again[0] != paths[0] and again[0].stem.endswith("-1")       # never overwrites silently
    assert "exported" in pg.message.value


def test_export_button_uses_env_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("QSA_LAB_FIGURES", str(tmp_path / "envfigs"))
    pg = W.Playground(cache=CACHE)
    pg.export_button.click()
    assert len(list((tmp_path / "envfigs").glob("*.png"))) == 1 and pg.last_export


def test_widget_descriptions_are_stable(pg):
    labels = {w.description for w in list(pg.controls.values()) + list(pg.toggles.values())}
    assert labels == {"site", "plane", "dims", "seed", "kv_dtype", "geometry", "backend", "nan_map",
                      "kernel_fix", "pad_fix", "both_fixes", "masked_load"}
    assert pg.export_button.description == "Export"

"""export.show_png: a notebook shows the PNG export_figure wrote, at the figure's inline size, and
the figure itself is closed in pyplot (the inline backend does not render it again)."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")


def test_show_png_displays_the_written_file_and_closes_the_figure(tmp_path, monkeypatch):
    import IPython.display
    import matplotlib.pyplot as plt

    from qsa_lab.plotting.export import export_figure, show_png

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(obj))
    fig, ax = plt.subplots(figsize=(4, 2), layout="constrained")
    ax.plot([0, 1], [1, 0])
    png = export_figure(fig, "line", out_dir=tmp_path)[0]
    show_png(png, fig)
    assert not plt.fignum_exists(fig.number)
    (img,) = shown
    assert img.data == png.read_bytes() and img.format == "png" and img.width == round(4 * fig.dpi)

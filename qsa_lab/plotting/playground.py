"""The poison playground's figure: render_playground(data, fig=None) draws
qsa_lab.analysis.playground.playground_data's dict (the NaN map on top, the routes side by side
below), figure_png repaints only what a redraw changed, export_view writes it named and tagged
with what it shows. No widgets: report figure 03 draws the same figure statically.

Why a redraw is fast: a figure drawn before with the same layout only gets its data replaced
(render_playground), and the new image repaints only the parts of the figure that changed (the
NaN map, its dims, the counts that moved), pixel for pixel what a full draw gives (`_draw_changes`).
The first draw's figure can be built and drawn for a blank case of the same layout while the
routes are computed (figure_ahead): the data then repaints only what it changes.
"""
from __future__ import annotations

import contextlib
import platform
from pathlib import Path

from qsa_lab.analysis.playground import SEEDED_SITES, Base, Params, check_params
from qsa_lab.model.poison import DIM_SITES
from qsa_lab.routes.labels import slug

# 1300 px wide, sharp at a cell's full width; 10 inches keep 9-10 pt text >= 11 px on a laptop screen
FIGSIZE, DPI = (10.0, 6.3), 130


def figure_ahead(p: Params, base: Base):
    """The playground's figure for `p` before its routes are computed: every artist made for the
    layout (shapes, routes) the data will have, holding a blank case (no NaN, zero outputs), and
    drawn. render_playground then gives it the data as to a figure it drew before and
    figure_png repaints the parts that changed: the same pixels as a new figure's full draw
    (tests/widgets/test_widgets.py compares them). None for invalid Params."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    try:
        check_params(p)
    except ValueError:
        return None         # redraw shows the error
    plan, g = base.plan, p.geometry
    rows = ((plan.members.numel() if plan.groups else 0) + plan.xqa_rows.numel()) * g.q_heads
    nan_map = {"values": np.zeros((rows, g.head_dim), np.float32), "dropped": np.zeros((rows, g.head_dim), bool),
               "groups": plan.groups, "q_heads": g.q_heads, "m_tiles": plan.m_tiles,
               "xqa_rows": plan.xqa_rows.tolist(), "route": p.nan_map, "nan_count": 0, "dropped_count": 0, "title": ""}
    shape = (len(p.routes), g.head_dim)
    routes = {"routes": list(p.routes), "per_dim": np.zeros(shape, np.int64),
              "dropped_per_dim": np.zeros(shape, np.int64),
              "rows": [{"route": r, "nan_count": 0, "max_abs_diff_vs_xqa": 0.0, "finite_where_ref_nan": 0}
                       for r in p.routes], "title": ""}
    fig = render_playground({"nan_map": nan_map, "routes": routes})
    _draw_changes(fig, FigureCanvasAgg(fig))   # drawn once: the first figure_png repaints what the data changes
    return fig



def render_playground(data: dict, fig=None):
    """data -> Figure: NaN map on top, routes side by side below, head dims aligned. A new Figure
    unless `fig` is given; a `fig` this function drew before with the same layout (shapes, routes)
    gets only its data replaced, which draws exactly what a new one would at a fraction of the
    time. No pyplot state, so it draws the same inside and outside widgets."""
    from matplotlib.figure import Figure

    from qsa_lab.plotting import plots as plotting

    layout = (plotting.nan_map_layout(data["nan_map"]), plotting.route_comparison_layout(data["routes"]))
    if fig is not None and getattr(fig, "qsa_layout", None) == layout:
        top, bottom = fig.axes[:2]
        plotting.update_nan_map(top, data["nan_map"])
        plotting.update_route_comparison(bottom, data["routes"])
        return fig
    if fig is None:
        fig = Figure(figsize=FIGSIZE, dpi=DPI)
    else:
        fig.clear()
        fig.qsa_drawn = None   # what figure_png drew last is gone with the axes
    # fixed margins, not constrained layout (layout solving was a third of the redraw time); the
    # right quarter holds the NaN map's colour bar and legend and each route's counts
    top, bottom = fig.subplots(2, 1, height_ratios=[2.5, 1.3],
                               gridspec_kw=dict(left=0.2, right=0.74, top=0.8, bottom=0.075, hspace=0.32))
    # no minor ticks: each is an artist to build and draw, and the majors every 32 dims suffice here
    plotting.plot_nan_map(data["nan_map"], ax=top, minor=False)
    plotting.plot_route_comparison(data["routes"], ax=bottom, minor=False, mark_dims=False)
    fig.qsa_layout = layout
    return fig


def figure_png(fig) -> bytes:
    """The figure as PNG bytes at its own dpi: its pixels exactly as canvas.draw() makes them
    (a redraw of a figure drawn before repaints only what changed, see `_draw_changes`)."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    if getattr(fig, "qsa_layout", None) is None:   # not drawn by render_playground: nothing to compare with
        canvas.draw()
        return png_bytes(np.asarray(canvas.buffer_rgba())[..., :3])
    return png_bytes(_draw_changes(fig, canvas)[..., :3])


def png_bytes(rgb) -> bytes:
    """[h, w, 3] uint8 -> PNG (no row filter, fast zlib level: on screen the time matters more than
    the size, and plots compress well unfiltered)."""
    import struct
    import zlib

    import numpy as np

    h, w, _ = rgb.shape
    rows = np.empty((h, 1 + 3 * w), np.uint8)
    rows[:, 0] = 0                              # filter type 0 (none) on every row
    rows[:, 1:] = rgb.reshape(h, 3 * w)

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows.tobytes(), 1)) + chunk(b"IEND", b""))


# -- a redraw repaints only what changed -------------------------------------------------------------
# A same-layout redraw (render_playground's update path) changes only the "parts" below; the
# rest (tick labels, axis labels, legend) is static. The canvas is drawn with every static or
# unchanged artist hidden whose footprint stays clear of the changed parts' footprints (old and
# new), and only those footprints are copied from it onto the previous image: every pixel
# outside them is touched by unchanged artists alone, every pixel inside by artists drawn. A
# fully transparent image draws nothing and is always left out. Anything that breaks the rule
# (footprints that meet after the draw, a new canvas size) falls back to a full draw.
PAD_PX = 3  # antialiasing and glyph overhang reach a pixel or two past an extent


def _image_state(im) -> tuple:
    import numpy as np

    a = im.get_array()
    return (a.shape, a.dtype.str, np.asarray(a).tobytes(), np.ma.getmaskarray(a).tobytes(),
            im.get_clim() if a.ndim == 2 else None, im.get_visible())


def _text_state(t) -> tuple:
    return t.get_text(), str(t.get_color()), t.get_visible()


def _parts(fig) -> dict:
    """name -> (artists, state) for everything a same-layout redraw can change: equal states
    draw the same pixels in the same place (state None: never taken as unchanged)."""
    top, bottom = fig.axes[:2]
    parts = {"map": ([top.qsa_image], _image_state(top.qsa_image)),
             "map dropped": ([top.qsa_dropped], _image_state(top.qsa_dropped)),
             "nan dims": ([top.qsa_top[0]], (top.qsa_top[0].get_visible(), top.qsa_dims)),
             "colour bar": ([top.qsa_cax], top.qsa_image.get_clim()),
             "map title": ([top.title], None),    # None: moves with the NaN dims above it, always redrawn
             "routes": ([bottom.qsa_image], _image_state(bottom.qsa_image)),
             "routes dropped": ([bottom.qsa_dropped], _image_state(bottom.qsa_dropped)),
             "routes title": ([bottom.title], _text_state(bottom.title))}
    for i, t in enumerate(bottom.qsa_texts):
        parts[f"route {i}"] = ([t], _text_state(t))
    return parts


def _static(fig) -> list:
    """The artists a same-layout redraw never changes and that are worth not drawing."""
    top, bottom = fig.axes[:2]
    out = [top.get_legend()]
    for ax in (top, bottom):
        for axis in (ax.xaxis, ax.yaxis):
            out += [t.label1 for t in axis.get_major_ticks()] + [axis.label]
    return [a for a in out if a is not None and a.get_visible()]


def _box(artists, renderer):
    """Pixel rectangle (x0, y0, x1, y1), padded, around what the visible `artists` draw, or None."""
    boxes = [b for b in (a.get_tightbbox(renderer) for a in artists if a.get_visible()) if b is not None]
    if not boxes:
        return None
    return (min(b.x0 for b in boxes) - PAD_PX, min(b.y0 for b in boxes) - PAD_PX,
            max(b.x1 for b in boxes) + PAD_PX, max(b.y1 for b in boxes) + PAD_PX)


def _meets(a, b) -> bool:
    return a is not None and b is not None and a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _transparent(artist) -> bool:
    """An RGBA image with alpha 0 everywhere: drawing it leaves every pixel as it is."""
    a = artist.get_array()
    return a.ndim == 3 and a.shape[-1] == 4 and not a[..., 3].any()


def _draw_changes(fig, canvas):
    """Draw `fig` on `canvas` -> its RGBA pixels, exactly canvas.draw()'s, repainting only the
    changed parts when the figure was drawn here before with the same layout (see above)."""
    import numpy as np

    parts, size = _parts(fig), (canvas.get_width_height(), fig.dpi)
    blank = [a for artists, _ in parts.values() for a in artists if hasattr(a, "get_array") and _transparent(a)]
    last = getattr(fig, "qsa_drawn", None)

    def full():
        with _hidden(blank):
            canvas.draw()
        return _remember(fig, canvas, parts, size, np.asarray(canvas.buffer_rgba()).copy())

    if last is None or (last["size"], last["layout"], last["axes"]) != (size, fig.qsa_layout, fig.axes[:2]):
        return full()
    changed = [n for n, (_, state) in parts.items() if state is None or state != last["parts"][n][1]]
    old = [last["boxes"][n] for n in changed]
    # left out: unchanged parts and static artists clear of every changed part's old footprint
    out = [(artists, last["boxes"][n]) for n, (artists, _) in parts.items() if n not in changed]
    out = [(artists, box) for artists, box in out + [([a], b) for a, b in zip(last["static"], last["static boxes"])]
           if not any(_meets(box, o) for o in old)]
    with _hidden([a for artists, _ in out for a in artists] + blank):
        canvas.draw()
        new = [_box(parts[n][0], canvas.get_renderer()) for n in changed]
    if any(_meets(box, b) for _, box in out for b in new):
        return full()           # a part grew into something left out: draw it all
    image, fresh = last["image"], np.asarray(canvas.buffer_rgba())
    height, width = image.shape[:2]
    for box in [b for b in old + new if b is not None]:
        x0, x1 = max(int(box[0]), 0), min(int(np.ceil(box[2])), width)
        r0, r1 = max(height - int(np.ceil(box[3])), 0), min(height - int(box[1]), height)
        image[r0:r1, x0:x1] = fresh[r0:r1, x0:x1]
    last.update(parts=parts, boxes=dict(last["boxes"], **dict(zip(changed, new))), repainted=changed)
    return image


@contextlib.contextmanager
def _hidden(artists):
    """The visible ones of `artists` hidden inside."""
    hidden = [a for a in dict.fromkeys(artists) if a.get_visible()]
    try:
        for a in hidden:
            a.set_visible(False)
        yield
    finally:
        for a in hidden:
            a.set_visible(True)


def _remember(fig, canvas, parts, size, image):
    """After a full draw: what the next redraw compares with -> image."""
    renderer, static = canvas.get_renderer(), _static(fig)
    fig.qsa_drawn = {"size": size, "layout": fig.qsa_layout, "axes": fig.axes[:2], "image": image, "parts": parts,
                     "boxes": {n: _box(artists, renderer) for n, (artists, _) in parts.items()},
                     "static": static, "static boxes": [_box([a], renderer) for a in static],
                     "repainted": None}   # None: drawn whole; else the parts the last redraw repainted
    return image


def figures_dir() -> Path:
    """Where figures go (the one folder; see qsa_lab.plotting.export.figures_dir)."""
    from qsa_lab.plotting.export import figures_dir as where

    return where()


def export_meta(data: dict) -> dict:
    """Everything needed to redraw an exported figure: geometry with its seed, poison site,
    plane, dims and seed, the fixes shown, backend and versions (export adds the GPU)."""
    import matplotlib
    import torch

    from qsa_lab.support.version import __version__

    p = data["params"]
    return {"case": data["case"], "backend": data["backend"], "preset": p.preset,
            "geometry": ", ".join(f"{k}={v}" for k, v in data["geometry"].items()),
            "geometry_seed": str(data["geometry"]["seed"]),
            "site": p.site, "plane": p.plane,
            "dims": ",".join(map(str, p.dims)) if p.site in DIM_SITES else "",
            "poison_seed": str(p.seed) if p.site in SEEDED_SITES else "", "fixes": ",".join(p.fixes) or "none", "routes": ",".join(p.routes),
            "nan_map_route": p.nan_map,
            "versions": f"qsa_lab {__version__}, torch {torch.__version__}, matplotlib {matplotlib.__version__}, "
                        f"python {platform.python_version()}"}


def export_name(data: dict) -> str:
    """A file stem that says what the figure shows, e.g.
    playground_targeted-v_d102-152-168-170-230_r19x1-ctx2048-k128-e4m3-gs0_fixes-kernel_fix+pad_fix+both_fixes+masked_load+request_groups+finite_pv_emulate
    (a poison seed `_psN` only for the sites whose bytes depend on it: random, fp16-state)."""
    p, g = data["params"], data["geometry"]
    dims = ""
    if p.site in DIM_SITES:
        d = list(p.dims)
        dims = "_d" + ("-".join(map(str, d)) if len(d) <= 8 else f"{d[0]}-to-{d[-1]}-n{len(d)}")
    seed = f"_ps{p.seed}" if p.site in SEEDED_SITES else ""
    return (f"playground_{p.site}-{p.plane}{dims}{seed}_r{g['rows']}x{g['requests']}-ctx{g['context']}"
            f"-k{g['topk']}-{g['kv_dtype']}-gs{g['seed']}_fixes-{slug(p.fixes)}_{data['backend']}")


def export_view(fig, data: dict, out_dir=None, name: str | None = None) -> list:
    """Write a playground figure (PNG, SVG, PDF) to out_dir (default figures_dir()), named and
    tagged with what it shows (export_name, export_meta) -> the absolute paths."""
    from qsa_lab.plotting.export import export_figure

    out = Path(out_dir).expanduser().resolve() if out_dir else figures_dir()
    # tight: the fixed margins leave room for NaN dims above the map; a clean view has none
    return [Path(x).resolve() for x in export_figure(fig, name or export_name(data), export_meta(data), out_dir=out,
                                                     tight=True)]

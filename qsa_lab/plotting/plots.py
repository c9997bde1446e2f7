"""Figure functions: `fn(data, ax=None) -> ax`, drawing only.

`data` is what the matching function of qsa_lab.analysis.figure_data (or analysis / repro) returns,
so every figure can be redrawn from its data outside a notebook. One colour means
NaN everywhere: NAN_COLOR, a loud magenta-red that no finite value uses.
"""
from __future__ import annotations

import math

import numpy as np

NAN_COLOR = "#ff0055"
CLEAN_COLOR = "#2b8a3e"
#: a value the route returns finite where the float64 reference is NaN: a NaN it silently lost
DROPPED_COLOR = "#f59f00"
DIM_MAJOR = 32   # head-dim tick spacing: readable at 256 dims
DIM_MINOR = 8


def _ax(ax, figsize):
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=figsize, layout="constrained")
    return ax


def _cmap(name: str):
    import matplotlib

    return matplotlib.colormaps[name].with_extremes(bad=NAN_COLOR)


def dim_label_groups(dims, min_gap: float) -> list[tuple[float, str]]:
    """Sorted NaN dims -> (x, label) with labels at least `min_gap` dims apart: dims closer than
    that share one label ("168,170", or "a-b (n)" for more than three)."""
    out, run = [], []
    for d in sorted(set(int(x) for x in dims)):
        if run and d - run[-1] < min_gap:
            run.append(d)
            continue
        if run:
            out.append(run)
        run = [d]
    if run:
        out.append(run)
    # a label sits at its run's centre; runs are >= min_gap apart end to end, but centres of
    # long runs must also be: merge neighbours until they are
    def centre(r):
        return (r[0] + r[-1]) / 2

    merged = out
    while True:
        i = next((i for i in range(1, len(merged)) if centre(merged[i]) - centre(merged[i - 1]) < min_gap), None)
        if i is None:
            break
        merged = merged[:i - 1] + [merged[i - 1] + merged[i]] + merged[i + 1:]
    return [((r[0] + r[-1]) / 2, ",".join(map(str, r)) if len(r) <= 3 else f"{r[0]}-{r[-1]} ({len(r)})")
            for r in merged]


def _dim_axis(ax, head_dim: int, nan_dims=(), minor: bool = True, fontsize: float = 7, marks: bool = True):
    """Head dims on x: majors every 32, minors every 8; NaN dims marked on a top axis (kept
    on `ax` so set_nan_dims can change them without rebuilding the axes; marks=False: none,
    ax.qsa_top None)."""
    major = DIM_MAJOR if head_dim >= 128 else 8 if head_dim > 32 else 4 if head_dim > 16 else 1
    ax.set_xticks(np.arange(0, head_dim, major))
    if minor and major > 1:
        ax.set_xticks(np.arange(0, head_dim, DIM_MINOR if major == DIM_MAJOR else 1), minor=True)
    ax.set_xlabel("head dim")
    if not marks:
        ax.qsa_top = None
        return
    top = ax.secondary_xaxis("top")
    top.xaxis.remove_overlapping_locs = False  # a label (minor) often sits on its dim's mark (major)
    top.tick_params(axis="x", which="major", colors=NAN_COLOR, length=6, width=1.5, labelsize=fontsize)
    top.tick_params(axis="x", which="minor", length=0, labelsize=fontsize, labelcolor=NAN_COLOR,
                    labelrotation=90, pad=8)
    ax.qsa_top = (top, head_dim, fontsize)
    set_nan_dims(ax, nan_dims)


def set_nan_dims(ax, nan_dims):
    """Mark `nan_dims` on the top axis that _dim_axis made; labels grouped so that none overlaps
    (dims closer than a label's height share one)."""
    top, head_dim, fontsize = ax.qsa_top
    nan_dims = sorted(set(int(d) for d in nan_dims))
    top.set_xticks(nan_dims, [""] * len(nan_dims))
    width_pt = ax.get_position().width * ax.figure.get_figwidth() * 72
    gap = 1.6 * fontsize / max(width_pt / max(head_dim, 1), 1e-6)   # dims per label height, with air
    groups = dim_label_groups(nan_dims, gap)
    top.set_xticks([x for x, _ in groups], [t for _, t in groups], minor=True)
    top.set_xlabel(f"NaN dims ({len(nan_dims)})" if nan_dims else "", color=NAN_COLOR, fontsize=8)
    top.set_visible(bool(nan_dims))
    ax.qsa_dims = tuple(nan_dims)   # what the top axis shows (a redraw compares it)


def _nan_legend(ax, label="NaN"):
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=NAN_COLOR, label=label)], loc="lower right", fontsize=8, framealpha=0.9)


# -- FP8 -------------------------------------------------------------------------------------------

def plot_code_table(table, ax=None):
    """table: fp8.code_table(fmt) DataFrame (256 rows). A 16 x 16 grid, high nibble down,
    low nibble across; finite codes shaded by log2|value|, NaN codes in NAN_COLOR."""
    import matplotlib.colors as mcolors

    ax = _ax(ax, (9, 8.5))
    vals = table["value"].to_numpy(dtype=float).reshape(16, 16)
    kinds = table["kind"].to_numpy().reshape(16, 16)
    mag = np.where(np.isfinite(vals) & (vals != 0), np.log2(np.abs(np.where(vals == 0, 1, vals))), np.nan)
    finite = mag[np.isfinite(mag)]
    shade = np.where(np.isnan(vals), np.nan, np.where(vals == 0, finite.min(), mag))
    im = ax.imshow(shade, cmap=_cmap("YlGnBu"), norm=mcolors.Normalize(finite.min(), finite.max()))
    for (i, j), v in np.ndenumerate(vals):
        kind = kinds[i, j]
        if kind == "nan":
            txt, kw = "NaN", dict(color="white", fontweight="bold", fontsize=8)
        elif kind == "inf":
            txt, kw = ("-inf" if v < 0 else "inf"), dict(color="black", fontweight="bold", fontsize=7)
        else:
            txt = f"{v:.3g}" if abs(v) >= 0.01 or v == 0 else f"{v:.0e}".replace("e-0", "e-")
            kw = dict(color="white" if (not np.isnan(shade[i, j]) and shade[i, j] > np.median(finite)) else "black",
                      fontsize=5.5)
        ax.text(j, i, txt, ha="center", va="center", **kw)
    nan_codes = table.loc[table["kind"] == "nan", "code"].tolist()
    for c in nan_codes:
        ax.add_patch(_rect(c % 16, c // 16, edge="black", lw=2))
    ax.set_xticks(range(16), [f"_{j:X}" for j in range(16)])
    ax.set_yticks(range(16), [f"{i:X}_" for i in range(16)])
    ax.set_xlabel("low nibble")
    ax.set_ylabel("high nibble (0x8_-0xF_ negative)")
    fmt = table.attrs.get("fmt", "e4m3" if len(nan_codes) == 2 else "e5m2")
    ax.set_title(f"{fmt.upper()} codes: NaN = {', '.join(f'0x{c:02X}' for c in nan_codes)} "
                 f"({len(nan_codes)}/256 = {len(nan_codes) / 256:.2%} of codes)")
    ax.figure.colorbar(im, ax=ax, shrink=0.7, label="log2 |value|")
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=NAN_COLOR, label="NaN code")], loc="upper center", bbox_to_anchor=(0.5, -0.07),
              fontsize=8)
    return ax


def _rect(x, y, edge, lw):
    from matplotlib.patches import Rectangle

    return Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor=edge, lw=lw)


def plot_byte_nan_rates(rates: dict, ax=None):
    """rates: {source: {"low": f, "high": f, "all": f}} (figure_data.fp16_state_rates).
    Bars per source and byte, with the 2/256 (uniform) and 1/256 (fp16 low byte only) lines."""
    ax = _ax(ax, (7.5, 4))
    parts = ["low", "high", "all"]
    colors = {"low": "#4c72b0", "high": "#dd8452", "all": "#555555"}
    width = 0.8 / len(parts)
    for i, (src, r) in enumerate(rates.items()):
        for k, p in enumerate(parts):
            x = i + (k - 1) * width
            ax.bar(x, 100 * r[p], width, color=colors[p], label=f"{p} bytes" if i == 0 else None)
            ax.text(x, 100 * r[p] + 0.02, f"{100 * r[p]:.2f}%", ha="center", va="bottom", fontsize=8)
    ax.axhline(100 * 2 / 256, color=NAN_COLOR, ls="--", lw=1)
    ax.text(1.0, 100 * 2 / 256, " 2/256 = 0.78%", color=NAN_COLOR, va="center", ha="left", fontsize=8,
            transform=ax.get_yaxis_transform())
    ax.axhline(100 * 1 / 256, color="grey", ls=":", lw=1)
    ax.text(1.0, 100 * 1 / 256, " 1/256 = 0.39%", color="grey", va="center", ha="left", fontsize=8,
            transform=ax.get_yaxis_transform())
    ax.set_xticks(range(len(rates)), list(rates))
    ax.set_ylabel("bytes on an E4M3 NaN code (%)")
    ax.set_ylim(0, 100 * max(max(r.values()) for r in rates.values()) * 1.3 + 0.1)
    ax.set_title("E4M3 NaN-code rate by byte: fp16 low bytes ~uniform, high bytes ~never 0x7F/0xFF")
    ax.legend(fontsize=8, loc="upper left")
    return ax


def plot_page_bytes(data: dict, ax=None):
    """data: figure_data.page_bytes (codes, nan [page_size, D]). Byte values in grey, bytes that
    decode to NaN in NAN_COLOR and ringed; tokens 0-3 (the null microblock) bracketed."""
    ax = _ax(ax, (10, 3))
    codes, nan = data["codes"].astype(float), data["nan"]
    shown = np.where(nan, np.nan, codes)
    im = ax.imshow(shown, cmap=_cmap("Greys"), vmin=0, vmax=255, aspect="auto", interpolation="nearest")
    ys, xs = np.nonzero(nan)
    if len(xs) and len(xs) <= 400:  # one NaN byte is one pixel: ring it so it cannot be missed
        # clip_on False: a byte of the first or last token or dim is ringed whole, not cut at the edge
        ax.scatter(xs, ys, s=40, facecolors="none", edgecolors=NAN_COLOR, linewidths=1.2, clip_on=False)
    # the key of the grey shading (NaN bytes are NAN_COLOR, named in the title)
    ax.qsa_cbar = ax.figure.colorbar(im, ax=ax, ticks=[0, 0x7F, 0xFF], fraction=0.03, pad=0.01)
    ax.qsa_cbar.ax.set_yticklabels(["0x00", "0x7F", "0xFF"], fontsize=7)
    ax.qsa_cbar.set_label("byte", fontsize=8)
    if data["page"] == 0:
        from matplotlib.patches import Rectangle

        ax.add_patch(Rectangle((-0.5, -0.5), codes.shape[1], 4, fill=False, edgecolor="#1f77b4", lw=1.5, ls="--"))
    _dim_axis(ax, codes.shape[1], data["nan_dims"])
    ax.set_ylabel("token in page")
    ax.set_yticks(sorted({codes.shape[0] - 1} | set(range(0, codes.shape[0], 8))))
    what = data.get("what", "null block" if data["page"] == 0 else "page holding stale tail tokens")
    ax.set_title(f"site {data['site']}: page {data['page']} ({what}), {data['plane'].upper()} plane, "
                 f"{data['kv_dtype']}: {data['nan_bytes']} NaN bytes", fontsize=9)
    return ax


def plot_attribution(data: dict, ax=None):
    """data: figure_data.attribution_map. The null microblock's V bytes (tokens 0-3 x dims) with
    NaN bytes in NAN_COLOR and ringed, and below them a black triangle under every dim the
    route's output has NaN on: where the two line up, each NaN dim has its byte."""
    ax = _ax(ax, (10, 2.6))
    sub = dict(data, codes=data["codes"][:4], nan=data["nan"][:4])
    sub["nan_dims"] = sorted(set(np.nonzero(sub["nan"])[1].tolist()))
    plot_page_bytes(sub, ax=ax)
    out = list(data["output_nan_dims"])
    ax.set_ylim(4.3, -0.5)                       # a strip below the bytes for the output's NaN dims
    ax.axhline(3.5, color="black", lw=0.8)
    ax.scatter(out, [3.95] * len(out), marker="^", s=36, color="black")
    ax.set_yticks(range(4))
    same = sub["nan_dims"] == out
    ax.set_title(f"null microblock (page 0, tokens 0-3) V bytes, NaN ringed, vs {data['route']} output NaN dims "
                 f"(▲ below): {'identical' if same else 'DIFFERENT'}", fontsize=10)
    return ax


# -- plan and fingerprints ---------------------------------------------------------------------------

def plot_plan(table, ax=None):
    """table: figure_data.plan_table DataFrame (group, category, real, padded). Per category,
    one pair of bars per group: real entries and null-block padding (log scale)."""
    ax = _ax(ax, (9, 4))
    groups = sorted(table["group"].unique())
    cats = sorted(table["category"].unique())
    m_tiles = table.attrs.get("m_tiles", max(int(c).bit_length() for c in cats))
    width = 0.8 / max(2 * len(groups), 1)
    for gi, g in enumerate(groups):
        t = table[table["group"] == g].set_index("category").reindex(cats, fill_value=0)
        for k, (col, color) in enumerate((("real", "#8c9fb5"), ("padded", NAN_COLOR))):
            x = np.arange(len(cats)) + (2 * gi + k - len(groups) + 0.5) * width
            vals = t[col].to_numpy()
            # log scale: a count of 0 gets no bar (there is no log 0), only its "0" label
            ax.bar(x, np.where(vals > 0, vals, np.nan), width, color=color, edgecolor="black", lw=0.4,
                   hatch="//" if col == "padded" and gi % 2 else None,
                   alpha=1.0 if col == "padded" else 0.5 + 0.5 * (gi % 2),
                   label=f"g{g} {col}")
            for xi, v in zip(x, vals):
                ax.text(xi, max(v, 0.8) * 1.05, str(v), ha="center", va="bottom", fontsize=6.5,
                        color=NAN_COLOR if col == "padded" and v else "black")
    ax.set_yscale("log")
    ax.set_ylim(0.7, table["real"].max() * 4 + 10)
    ax.set_xticks(range(len(cats)), [f"{c}\n" + "+".join(f"m{m}" for m in range(m_tiles) if (c >> m) & 1)
                                     for c in cats], fontsize=8)
    ax.set_xlabel("category (M-tiles its queries touch)")
    ax.set_ylabel("plan entries (microblocks)")
    pad = int(table["padded"].sum())
    title = f"grouped plan: {len(groups)} groups, {pad} padding entries -> (microblock 0, mask 0)"
    if "tiles_per_group" in table.attrs:  # what the selections' overlap costs: tiles each group walks
        title += f"\ntiles per group {table.attrs['tiles_per_group']}"
        if "selection" in table.attrs:
            title += f"; {table.attrs['selection']}"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=len(groups), loc="upper left")
    return ax


def plot_nan_map(data: dict, ax=None, minor: bool = True):
    """data: figure_data.nan_map. Score rows (group x M-tile blocks, then XQA rows) x head dims:
    |output| in grey (colour bar beside it), NaN in NAN_COLOR, values finite where the reference
    is NaN in DROPPED_COLOR; lines between M-tiles (thin) and groups (thick)."""
    from matplotlib.patches import Patch

    from qsa_lab.analysis.figure_data import group_row_labels

    vals = data["values"]
    ax = _ax(ax, (11, max(3.0, 0.045 * vals.shape[0] + 1.2)))
    ax.qsa_image = ax.imshow(np.zeros(vals.shape), cmap=_cmap("Greys"), aspect="auto", interpolation="nearest")
    ax.qsa_dropped = ax.imshow(np.zeros(vals.shape + (4,)), aspect="auto", interpolation="nearest")
    R = 8 * data["q_heads"]
    for g in range(data["groups"]):
        for m in range(1, data["m_tiles"]):
            ax.axhline(g * R + 16 * m - 0.5, color="#1f77b4", lw=0.6, ls="--")
        ax.axhline((g + 1) * R - 0.5, color="black", lw=1.6)
    labels = group_row_labels(data["groups"], data["q_heads"], data["m_tiles"], data["xqa_rows"])
    ax.set_yticks([y for y, _ in labels], [t for _, t in labels], fontsize=9)
    ax.set_ylabel("group g, M-tile m\n(16 score rows each)", fontsize=9)
    _dim_axis(ax, vals.shape[1], minor=minor, fontsize=8)
    cax = ax.qsa_cax = ax.inset_axes([1.02, 0.42, 0.025, 0.58])
    ax.figure.colorbar(ax.qsa_image, cax=cax)
    cax.set_ylabel("|output| (grey, to its 99th pct)", fontsize=8)
    cax.tick_params(labelsize=8)
    ax.legend(handles=[Patch(color=NAN_COLOR, label="NaN"),
                       Patch(color=DROPPED_COLOR, label="finite where\nreference NaN")],
              loc="upper left", bbox_to_anchor=(1.01, 0.36), fontsize=8, framealpha=0.9, borderaxespad=0)
    update_nan_map(ax, data)
    return ax


def nan_map_layout(data: dict) -> tuple:
    """What plot_nan_map draws once; update_nan_map changes everything else."""
    return data["values"].shape, data["groups"], data["q_heads"], data["m_tiles"], tuple(data["xqa_rows"])


def _overlay(mask, color) -> np.ndarray:
    """[rows, D] bool -> RGBA image: `color` where True, transparent elsewhere."""
    import matplotlib.colors as mcolors

    rgba = np.zeros(mask.shape + (4,))
    rgba[mask] = mcolors.to_rgba(color)
    return rgba


def update_nan_map(ax, data: dict):
    """Redraw the data of an Axes plot_nan_map drew for the same nan_map_layout."""
    vals = data["values"]
    finite = np.abs(vals[np.isfinite(vals)])
    vmax = float(np.percentile(finite, 99)) if finite.size else 1.0
    ax.qsa_image.set_data(np.abs(vals))
    ax.qsa_image.set_clim(0, vmax or 1.0)
    dropped = data.get("dropped", np.zeros(vals.shape, dtype=bool))
    ax.qsa_dropped.set_data(_overlay(dropped, DROPPED_COLOR))
    dims = sorted(set(np.nonzero(np.isnan(vals).any(axis=0))[0].tolist()))
    set_nan_dims(ax, dims)
    lost = f", {int(dropped.sum())} finite where the reference is NaN" if dropped.any() else ""
    ax.set_title(f"{data['title']}\n{data['nan_count']} NaN on {len(dims)} dims{lost}", fontsize=10)
    return ax


def plot_route_comparison(data: dict, ax=None, minor: bool = True, mark_dims: bool = True):
    """data: figure_data.route_nans. One strip per route over head dims: a dim is NAN_COLOR where the
    route has NaN, DROPPED_COLOR where it is finite on elements the reference has NaN (a NaN
    silently lost: this wins, so it is never hidden behind NaN rows); on the right the route's
    NaN count and max |route - xqa|, or its count of such values when any. mark_dims: name the
    NaN dims on a top axis."""
    ax = _ax(ax, (11, 0.42 * len(data["routes"]) + 1.6))
    n = len(data["routes"])
    ax.qsa_image = ax.imshow(np.zeros(data["per_dim"].shape), cmap=_cmap("Greys"), vmin=0, vmax=4, aspect="auto",
                             interpolation="nearest")
    ax.qsa_dropped = ax.imshow(np.zeros(data["per_dim"].shape + (4,)), aspect="auto", interpolation="nearest")
    ax.qsa_texts = [ax.text(1.01, 1 - (i + 0.5) / n, "", transform=ax.transAxes, va="center", fontsize=8.5,
                            family="monospace") for i in range(n)]
    ax.set_yticks(range(n), data["routes"], fontsize=9)
    for y in range(n - 1):
        ax.axhline(y + 0.5, color="white", lw=1)
    # mark_dims=False (the playground): the NaN map above marks them, and no top axis is built here
    _dim_axis(ax, data["per_dim"].shape[1], minor=minor, fontsize=8, marks=mark_dims)
    update_route_comparison(ax, data)
    return ax


def route_comparison_layout(data: dict) -> tuple:
    return tuple(data["routes"]), data["per_dim"].shape


def update_route_comparison(ax, data: dict):
    """Redraw the data of an Axes plot_route_comparison drew for the same route_comparison_layout."""
    per_dim = data["per_dim"].astype(float)
    dropped = np.asarray(data.get("dropped_per_dim", np.zeros(per_dim.shape))) > 0
    ax.qsa_image.set_data(np.where(per_dim > 0, np.nan, 0.0))
    ax.qsa_dropped.set_data(_overlay(dropped, DROPPED_COLOR))
    for text, row in zip(ax.qsa_texts, data["rows"]):
        d = row["max_abs_diff_vs_xqa"]
        d = "-" if d is None or (isinstance(d, float) and math.isnan(d)) else f"{d:.1e}"   # undefined: a NaN in it
        n, lost = int(row["nan_count"]), int(row.get("finite_where_ref_nan", 0) or 0)
        # the count first ("0 NaN"): "NaN 0" read as a value; "dropped": finite where the reference is NaN
        text.set_text(f"{n:>5d} NaN  " + (f"{lost} dropped" if lost else f"|Δxqa| {d:>7s}"))
        text.set_color("#c77700" if lost else NAN_COLOR if n else CLEAN_COLOR)
    if ax.qsa_top is not None:
        set_nan_dims(ax, np.nonzero(per_dim.sum(axis=0))[0].tolist())
    amber = " (amber, dropped: finite where the reference is NaN)" if dropped.any() else ""
    ax.set_title(f"routes side by side: {data['title']}{amber}", fontsize=10)
    return ax


# -- tables and timings ------------------------------------------------------------------------------

SAME_COLOR, DIFF_COLOR, EXPECTED_DIFF_COLOR = "#d3f9d8", "#ffd6e0", "#fff3bf"


def _text_inches(text: str, size: float, weight: str = "normal") -> float:
    """The width of one line of `text` drawn at `size` points, in inches."""
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import TextToPath

    w, _, _ = TextToPath().get_text_width_height_descent(text, FontProperties(size=size, weight=weight), ismath=False)
    return w / 72


#: the repro table's fonts (points): cells, headers; a cell's text keeps CELL_PAD of its width free each side
#: (matplotlib's Cell.PAD), the case names, left-aligned, CASE_PAD
REPRO_CELL_PT, REPRO_HEAD_PT, CELL_PAD, CASE_PAD = 8.5, 8, 0.1, 0.02


def _repro_cells(table) -> dict:
    """What plot_repro_table draws: routes, header, cells, colours, and each column's width in
    inches (as wide as its widest header line or cell, measured in its font)."""
    from qsa_lab.routes.labels import ROUTES, SHORT, heading, short_routes

    routes = [r for r in ROUTES if f"nan[{r}]" in table.columns]
    cols = [f"nan[{r}]" for r in routes]
    diff_cols = [c for c in table.columns if c.startswith("max|grouped+")]
    header = (["case", "poisoned dims"] + [heading(r).replace(" ", "\n") for r in routes]
              + ["expected\nto differ", "as\nexpected", "max |fix - xqa|\n(fixes with NaN)", "repeat\nidentical"])
    cells, colors = [], []
    for _, r in table.iterrows():
        dims = list(r.get("poisoned_dims", []))
        dtxt = ",".join(map(str, dims[:5])) + ("…" if len(dims) > 5 else "") if dims else "-"
        diffs = [r[c] for c in diff_cols if r[c] is not None and not (isinstance(r[c], float) and math.isnan(r[c]))]
        worst = f"{max(diffs):.1e}" if diffs else "-"
        if len(diffs) < len(diff_cols):
            worst += f" ({len(diff_cols) - len(diffs)} NaN)"
        rep = r.get("bit_identical_repeat", None)
        rep = None if rep is None or (isinstance(rep, float) and math.isnan(rep)) else bool(rep)
        differ = set(str(r.get("differs_from_reference", "")).split(",")) - {""}
        expected = set(str(r.get("expected_to_differ", "")).split(",")) - {""}
        ok = r.get("as_expected", None)
        route_colors = [SAME_COLOR if c[4:-1] not in differ else
                        EXPECTED_DIFF_COLOR if c[4:-1] in expected else DIFF_COLOR for c in cols]
        cells.append([str(r["case"]), dtxt] + [str(int(r[c])) for c in cols]
                     + [short_routes(",".join(sorted(expected, key=list(SHORT).index))),
                        "-" if ok is None else ("yes" if ok else "NO"), worst, "-" if rep is None else str(rep)])
        colors.append(["white", "white"] + route_colors
                      + ["white", "white" if ok is None else SAME_COLOR if ok else DIFF_COLOR, "white",
                         "white" if rep is None else SAME_COLOR if rep else DIFF_COLOR])

    def fit(j, pad=CELL_PAD):
        text = max([_text_inches(line, REPRO_HEAD_PT, "bold") for line in header[j].split("\n")]
                   + [_text_inches(row[j], REPRO_CELL_PT) for row in cells])
        return (text + 0.06) / (1 - 2 * pad)

    widths = [max(0.6, fit(j, CASE_PAD if j == 0 else CELL_PAD)) for j in range(len(header))]
    return {"routes": routes, "header": header, "cells": cells, "colors": colors, "widths": widths}


def repro_table_figsize(table) -> tuple:
    """The size (inches) plot_repro_table draws `table` at: every header and cell inside its cell."""
    return sum(_repro_cells(table)["widths"]) + 0.3, 0.32 * len(table) + 1.9


def plot_repro_table(table, ax=None):
    """table: repro.run_repro DataFrame. Cases x NaN elements per route, the float64 reference
    first. A count is green when the route's NaN mask equals the reference's, yellow when it
    differs as the mechanism predicts (the 'expected to differ' column), red when it differs
    unexpectedly; then the worst max |fix - xqa| and whether repeated runs were bit-identical.
    Drawn at repro_table_figsize(table) (a given `ax` should be in a figure of that size)."""
    import textwrap

    from matplotlib.patches import Patch

    from qsa_lab.routes.labels import short_key

    t = _repro_cells(table)
    header, cells, widths = t["header"], t["cells"], t["widths"]
    ax = _ax(ax, repro_table_figsize(table))
    ax.axis("off")
    tab = ax.table(cellText=cells, colLabels=header, cellColours=t["colors"], bbox=[0, 0, 1, 1], cellLoc="center")
    tab.auto_set_font_size(False)
    tab.set_fontsize(REPRO_CELL_PT)
    for (i, j), cell in tab.get_celld().items():
        cell.set_width(widths[j] / sum(widths))
    for j in range(len(header)):
        tab[0, j].set_text_props(fontweight="bold", fontsize=REPRO_HEAD_PT)
    for i in range(len(cells)):
        tab[i + 1, 0].set_text_props(ha="left")
        tab[i + 1, 0].PAD = CASE_PAD
    # the key on as many lines as the figure's width needs (10 pt: about 0.075 in a character)
    chars = max(40, int(ax.figure.get_figwidth() / 0.08))
    key = textwrap.fill(f"expected to differ: {short_key(t['routes'])}", chars)
    title = table.attrs.get("title", "differential harness: NaN elements per route (reference = float64)\n" + key)
    ax.set_title(title, fontsize=10)
    ax.legend(handles=[Patch(color=SAME_COLOR, label="NaN mask = the reference's"),
                       Patch(color=EXPECTED_DIFF_COLOR, label="differs, as the mechanism predicts"),
                       Patch(color=DIFF_COLOR, label="differs unexpectedly")],
              loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=8.5, frameon=False)
    note = ("max |fix - xqa|: the largest |fixed route - xqa| over the fixes whose output holds no NaN; (n NaN): n "
            "fixes held NaN and are left out of it (-: every fix did). repeat identical: a second run gave the same bits.")
    ax.text(0.5, -0.075, textwrap.fill(note, chars + 10), transform=ax.transAxes, ha="center", va="top", fontsize=8)
    return ax


def plot_bench(data, ax=None):
    """data: (records DataFrame, meta) from bench_data.load_bench or routes.bench. Median ms per
    route, grouped by (context, rows), on a log axis (the routes span 100x). The fixes' cost is
    plot_fix_cost's question."""
    df, meta = data
    ax = _ax(ax, (10, 4.5))
    keys = ["context", "rows"] if {"context", "rows"} <= set(df.columns) else ["context"] \
        if "context" in df.columns else []
    groups = list(df.groupby(keys, sort=True)) if keys else [((), df)]
    routes = list(dict.fromkeys(df["route"]))
    width = 0.8 / max(len(routes), 1)
    import matplotlib

    palette = matplotlib.colormaps["tab10"]
    for gi, (_, sub) in enumerate(groups):
        for k, r in enumerate(routes):
            s = sub[sub["route"] == r]
            if s.empty:
                continue
            x = gi + (k - (len(routes) - 1) / 2) * width
            ms = float(s["median_ms"].iloc[0])
            ax.bar(x, ms, width, color=palette(k % 10), label=r if gi == 0 else None)
    labels = []
    for key, _ in groups:
        key = key if isinstance(key, tuple) else (key,)
        labels.append("\n".join(f"ctx {v // 1024}k" if k == "context" and v % 1024 == 0 else
                                f"{v} {k}" if k == "rows" else f"{k} {v}" for k, v in zip(keys, key)) or "all")
    ax.set_xticks(range(len(groups)), labels, fontsize=8)
    ax.set_ylabel("median time per call (ms, log)")
    ax.set_yscale("log")
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    ax.set_title(f"route and fix timings on {meta.get('gpu', 'unknown GPU')} ({meta.get('source', '')})",
                 fontsize=9)
    return ax


#: bench variant (unfixed or a fix of routes.labels) -> its colour in the fix-cost figure
#: (both_fixes purple: two oranges for kernel_fix and both_fixes could not be told apart)
FIX_COLORS = {"unfixed": "#8c9fb5", "kernel_fix": "#d9480f", "pad_fix": "#74b816", "both_fixes": "#9c36b5",
              "masked_load": "#1c7ed6", "request_groups": "#0ca678", "finite_pv": "#e64980"}


def plot_fix_cost(data: dict, fig=None):
    """data: figure_data.fix_cost. Three panels, one question each, all horizontal (no rotated label):
    (1) µs per 32-token tile of every variant with its extra µs; (2) its ratio to unfixed, the
    sweep's range as a whisker, the report's V100 ratio as a dashed line; (3) upstream's own
    kernel beside ours on the same GPU: unfixed and kernel_fix µs per tile per row count. -> Figure"""
    import matplotlib.pyplot as plt

    from qsa_lab.routes.labels import fix_label

    if fig is None:
        fig = plt.figure(figsize=(14, 4.6), layout="constrained")
    up = data.get("upstream")
    axes = fig.subplots(1, 3 if up else 2, width_ratios=[1, 1, 1.1][:3 if up else 2])
    names = list(data["variants"])
    y = np.arange(len(names))[::-1]
    v = data["variants"]
    colors = [FIX_COLORS.get(n, "#888888") for n in names]
    ax = axes[0]
    us = [v[n]["us_per_tile"] for n in names]
    ax.barh(y, us, color=colors, height=0.6)
    for yi, n, u in zip(y, names, us):
        extra = v[n]["extra_us"]
        ax.text(u * 1.01, yi, f"{u:.2f} µs" + ("" if n == "unfixed" else f"  ({extra:+.2f})"), va="center", fontsize=9)
    ax.set_yticks(y, [fix_label(n) for n in names], fontsize=9)
    ax.set_xlim(0, max(us) * 1.45)
    ax.set_xlabel("µs per 32-token tile")
    ax.set_title(f"cost per tile, {data['gpu']}", fontsize=10)
    ax = axes[1]
    ratios = [v[n]["ratio"] for n in names]
    ax.barh(y, [r - 1 for r in ratios], left=1, color=colors, height=0.6)
    for yi, n, r in zip(y, names, ratios):
        rng = v[n]["sweep_ratio"]
        if rng and n != "unfixed":
            ax.plot(rng, [yi, yi], color="black", lw=1.2)
            ax.plot(rng, [yi, yi], "|", color="black", ms=8)
        ax.text(max(r, rng[1] if rng else r) + 0.008, yi, f"×{r:.3f}", va="center", fontsize=9)
    rep = data.get("report_v100_ratio")
    hi = max([1.1] + ratios + ([rep] if rep else []))
    if rep:
        ax.axvline(rep, color="black", ls="--", lw=1.2)
        # right of its line, where no bar's label reaches (every ratio label ends left of it)
        ax.text(rep + 0.006, y[-1] - 0.45, f"report, V100:\n{fix_label('kernel_fix')} ×{rep:.2f}\n(ms per iteration)", ha="left",
                va="bottom", fontsize=8.5)
    ax.axvline(1, color="grey", lw=0.8)
    ax.set_xlim(0.9, max(hi + 0.06, (rep or 0) + 0.2))
    ax.set_yticks(y, [""] * len(names))
    ax.set_xlabel("time ÷ unfixed (whisker: range over the sweep)")
    ax.set_title("ratio to the unfixed kernel", fontsize=10)
    if up:
        ax = axes[2]
        rows = [r["rows"] for r in up["rows"]]
        yy = np.arange(len(rows))[::-1]
        h = 0.2
        series = [("upstream unfixed", "upstream_unfixed_us_per_tile", None, "#adb5bd"),
                  (f"upstream {fix_label('kernel_fix')}", "upstream_unfixed_us_per_tile", "upstream_kernel_fix_ratio",
                   "#868e96"),
                  ("qsa_lab unfixed", "qsa_lab_unfixed_us_per_tile", None, "#8c9fb5"),
                  (f"qsa_lab {fix_label('kernel_fix')}", "qsa_lab_unfixed_us_per_tile", "qsa_lab_kernel_fix_ratio",
                   FIX_COLORS["kernel_fix"])]
        for k, (label, base, ratio, color) in enumerate(series):
            vals = [r[base] * (r[ratio] if ratio else 1) for r in up["rows"]]
            pos = yy + (1.5 - k) * h
            ax.barh(pos, vals, height=h, color=color, label=label)
            if ratio:
                for p_, r in zip(pos, up["rows"]):
                    ax.text(r[base] * r[ratio] + 0.1, p_, f"×{r[ratio]:.3f} (+{r[base] * (r[ratio] - 1):.2f} µs)",
                            va="center", fontsize=8)
        ax.set_yticks(yy, [f"{r} rows" for r in rows], fontsize=9)
        ax.set_xlim(0, max(r["upstream_unfixed_us_per_tile"] for r in up["rows"]) * 1.6)
        ax.set_xlabel("µs per 32-token tile")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
        ax.set_title(f"upstream's kernel beside ours, {up['gpu']}", fontsize=10)
    # the source on a line of its own: one line of both outgrew a 14-inch figure at both ends
    src = f"\n{data['source']}" if data.get("source") else ""
    fig.suptitle(f"What the fix costs: per tile at the report's geometry ({data['geometry']}, "
                 f"{data['tiles_per_group']:.0f} tiles per group){src}", fontsize=11)
    return fig


def small_multiples(fn, datas, ncols: int = 1, panel=(10, 2.6)):
    """Draw fn(d, ax) for every d into one figure (a grid of `ncols` columns) -> Figure."""
    import matplotlib.pyplot as plt

    datas = list(datas)
    nrows = -(-len(datas) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(panel[0] * ncols, panel[1] * nrows), layout="constrained",
                             squeeze=False)
    for d, ax in zip(datas, axes.flat):
        fn(d, ax=ax)
    for ax in list(axes.flat)[len(datas):]:
        ax.axis("off")
    return fig


#: plot_cross_request's cell colours: a clean row, a row of the poisoned request (its own value:
#: expected), a row of ANOTHER request (the leak)
OWN_COLOR = "#495057"
CROSS_REQUEST_COLORS = ("#f1f3f5", OWN_COLOR, NAN_COLOR)


def plot_cross_request(data: dict, ax=None):
    """One poisoned run of a mixed batch (analysis.cross_request.row_map): a route per line, a
    query row per column; dark = a non-finite row of the poisoned request (its own value), red =
    a non-finite row of another request (the leak). Requests are shaded under the axis, the
    groups of 8 consecutive rows that upstream's host route forms are drawn as thin lines, the rows
    after them go to XQA."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    from qsa_lab.routes.labels import label

    routes, owner = data["routes"], np.asarray(data["request_of_row"])
    n = owner.size
    ax = _ax(ax, (max(6.0, 0.16 * n + 2.5), 0.32 * len(routes) + 1.6))
    grid = np.zeros((len(routes), n))
    for i, route in enumerate(routes):
        for row in data["nonfinite"][route]:
            grid[i, row] = 1 if owner[row] == data["poisoned_request"] else 2
    ax.imshow(grid, cmap=ListedColormap(CROSS_REQUEST_COLORS), vmin=0, vmax=2, aspect="auto", interpolation="nearest",
              extent=(-0.5, n - 0.5, len(routes) - 0.5, -0.5))
    for x in range(8, data["grouped_rows"] + 1, 8):     # group boundaries (the XQA rows follow the last)
        ax.axvline(x - 0.5, color="#868e96", lw=0.8)
    starts = [0] + [r for r in range(1, n) if owner[r] != owner[r - 1]]
    band = ax.get_xaxis_transform()                     # x in rows, y in axes coordinates
    for k, s in enumerate(starts):                      # one band per request above the rows, alternating shades
        e = starts[k + 1] if k + 1 < len(starts) else n
        ax.axvspan(s - 0.5, e - 0.5, ymin=1.01, ymax=1.05, color="#a5d8ff" if k % 2 else "#1c7ed6", clip_on=False)
        ax.text((s + e - 1) / 2, 1.06 + 0.04 * (k % 2 if e - s < 3 else 0), f"r{owner[s]}", transform=band,
                ha="center", va="bottom", fontsize=7)
    if data["grouped_rows"] < n:
        ax.text((data["grouped_rows"] + n - 1) / 2, -0.02, "XQA", transform=band, ha="center", va="top", fontsize=7)
    ax.set_yticks(range(len(routes)), [label(r) for r in routes], fontsize=8)
    ax.set_xlabel("query row (requests r0, r1, ... above; lines: the groups of 8 rows upstream forms)", labelpad=10)
    ax.set_title(f"{data['payload']} in request {data['poisoned_request']}'s attended V"
                 + (f", {data['q_heads']} query heads" if data.get("q_heads") else ""), fontsize=10, pad=26)
    ax.legend(handles=[Patch(color=CROSS_REQUEST_COLORS[1], label="non-finite: the poisoned request's row"),
                       Patch(color=CROSS_REQUEST_COLORS[2], label="non-finite: ANOTHER request's row (leak)")],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return ax


def plot_complete_fix_cost(data: dict | None, ax=None):
    """Each route's time per call as a ratio to kernel_fix (A) (analysis.bench_data.complete_fix_data),
    one block of bars per shape, whiskers from the 10th to the 90th percentile; the line at 1 is
    kernel_fix. None (no GPU run committed yet) draws that note instead."""
    ax = _ax(ax, (9.5, 6.5))
    if data is None:
        ax.text(0.5, 0.5, "the complete fixes' cost is not measured yet:\nbash benchmarks/gpu_check.sh complete-fix on a GPU "
                "writes data/complete_fix_h200.json", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return ax
    routes, shapes = data["routes"], data["shapes"]
    colors = {"grouped": FIX_COLORS["unfixed"], "grouped+masked_load": FIX_COLORS["masked_load"],
              "grouped+request_groups": FIX_COLORS["request_groups"], "grouped+finite_pv": FIX_COLORS["finite_pv"],
              "grouped+finite_pv, NaN in V": "#f783ac", "xqa": "#adb5bd"}
    height = 0.8 / len(routes)
    for i, s in enumerate(shapes):
        for j, r in enumerate(routes):
            mid, lo, hi = s["ratios"][r]
            y = i + (j - (len(routes) - 1) / 2) * height
            ax.barh(y, mid, height=height * 0.9, color=colors.get(r, "#888888"),
                    label=data["labels"][r] if i == 0 else None)
            ax.plot([lo, hi], [y, y], color="#212529", lw=0.8)
    ax.axvline(1.0, color=FIX_COLORS["kernel_fix"], lw=1.2, ls="--", label="kernel_fix (A) = 1")
    ax.set_yticks(range(len(shapes)), [s["name"] for s in shapes], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time per call / kernel_fix (A)'s (median; whiskers: 10th-90th percentile)")
    ax.set_title(f"The complete fixes' cost, {data['gpu']}: the grouped kernel + XQA over the remainder rows",
                 fontsize=10)
    # below the axes: inside, it hid the ends of the bars that reach furthest
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=3, frameon=False)
    return ax

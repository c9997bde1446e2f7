"""Figure functions: `fn(data, ax=None) -> ax`, drawing only.

`data` is what the matching function of qsa_lab.figdata (or analysis / repro) returns,
so every figure can be redrawn from its data outside a notebook. One colour means
NaN everywhere: NAN_COLOR, a loud magenta-red that no finite value uses.
"""
from __future__ import annotations

import math

import numpy as np

NAN_COLOR = "#ff0055"
CLEAN_COLOR = "#2b8a3e"
DIM_MAJOR = 32   # head-dim tick spacing: readable at 256 dims
DIM_MINOR = 8
MAX_DIM_LABELS = 24


def _ax(ax, figsize):
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=figsize, layout="constrained")
    return ax


def _cmap(name: str):
    import matplotlib

    return matplotlib.colormaps[name].with_extremes(bad=NAN_COLOR)


def _dim_axis(ax, head_dim: int, nan_dims=()):
    """Head dims on x: majors every 32, minors every 8; NaN dims named on the top axis."""
    ax.set_xticks(np.arange(0, head_dim, DIM_MAJOR if head_dim >= 64 else 8))
    ax.set_xticks(np.arange(0, head_dim, DIM_MINOR if head_dim >= 64 else 1), minor=True)
    ax.set_xlabel("head dim")
    nan_dims = list(nan_dims)
    if nan_dims:
        top = ax.secondary_xaxis("top")
        shown = nan_dims if len(nan_dims) <= MAX_DIM_LABELS else nan_dims[:MAX_DIM_LABELS]
        top.set_xticks(shown)
        top.set_xticklabels([str(d) for d in shown], rotation=90, fontsize=7, color=NAN_COLOR)
        top.tick_params(axis="x", colors=NAN_COLOR, length=6, width=1.5)
        more = "" if len(nan_dims) <= MAX_DIM_LABELS else f" (first {MAX_DIM_LABELS} of {len(nan_dims)})"
        top.set_xlabel(f"NaN dims{more}", color=NAN_COLOR, fontsize=8)


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
    """rates: {source: {"low": f, "high": f, "all": f}} (figdata.fp16_state_rates).
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
    """data: figdata.page_bytes (codes, nan [page_size, D]). Byte values in grey, bytes that
    decode to NaN in NAN_COLOR and ringed; tokens 0-3 (the null microblock) bracketed."""
    ax = _ax(ax, (10, 3))
    codes, nan = data["codes"].astype(float), data["nan"]
    shown = np.where(nan, np.nan, codes)
    ax.imshow(shown, cmap=_cmap("Greys"), vmin=0, vmax=255, aspect="auto", interpolation="nearest")
    ys, xs = np.nonzero(nan)
    if len(xs) and len(xs) <= 400:  # one NaN byte is one pixel: ring it so it cannot be missed
        ax.scatter(xs, ys, s=40, facecolors="none", edgecolors=NAN_COLOR, linewidths=1.2)
    if data["page"] == 0:
        from matplotlib.patches import Rectangle

        ax.add_patch(Rectangle((-0.5, -0.5), codes.shape[1], 4, fill=False, edgecolor="#1f77b4", lw=1.5, ls="--"))
    _dim_axis(ax, codes.shape[1], data["nan_dims"])
    ax.set_ylabel("token in page")
    ax.set_yticks(sorted({codes.shape[0] - 1} | set(range(0, codes.shape[0], 8))))
    what = "null block" if data["page"] == 0 else "page holding stale tail tokens"
    ax.set_title(f"site {data['site']}: page {data['page']} ({what}) {data['plane'].upper()} plane, "
                 f"{data['kv_dtype']} - {data['nan_bytes']} NaN bytes", fontsize=10)
    return ax


def plot_attribution(data: dict, ax=None):
    """data: figdata.attribution_map. The null microblock's V bytes (tokens 0-3 x dims) with
    NaN bytes marked, and a band over every dim the route's output has NaN on."""
    ax = _ax(ax, (10, 2.6))
    sub = dict(data, codes=data["codes"][:4], nan=data["nan"][:4])
    sub["nan_dims"] = sorted(set(np.nonzero(sub["nan"])[1].tolist()))
    plot_page_bytes(sub, ax=ax)
    for d in data["output_nan_dims"]:
        ax.axvspan(d - 0.5, d + 0.5, color=NAN_COLOR, alpha=0.18, lw=0)
    ax.set_yticks(range(4))
    same = sub["nan_dims"] == list(data["output_nan_dims"])
    ax.set_title(f"null microblock (page 0, tokens 0-3) V bytes vs {data['route']} NaN dims "
                 f"(shaded): {'identical' if same else 'DIFFERENT'}", fontsize=10)
    return ax


# -- plan and fingerprints ---------------------------------------------------------------------------

def plot_plan(table, ax=None):
    """table: figdata.plan_table DataFrame (group, category, real, padded). Per category,
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
            ax.bar(x, np.maximum(vals, 0.8), width, color=color, edgecolor="black", lw=0.4,
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


def plot_nan_map(data: dict, ax=None):
    """data: figdata.nan_map. Score rows (group x M-tile blocks, then XQA rows) x head dims:
    |output| in grey, NaN in NAN_COLOR; lines between M-tiles (thin) and groups (thick)."""
    from .figdata import group_row_labels

    vals = data["values"]
    ax = _ax(ax, (11, max(3.0, 0.045 * vals.shape[0] + 1.2)))
    finite = np.abs(vals[np.isfinite(vals)])
    vmax = float(np.percentile(finite, 99)) if finite.size else 1.0
    ax.imshow(np.abs(vals), cmap=_cmap("Greys"), vmin=0, vmax=vmax or 1.0, aspect="auto", interpolation="nearest")
    R = 8 * data["q_heads"]
    for g in range(data["groups"]):
        for m in range(1, data["m_tiles"]):
            ax.axhline(g * R + 16 * m - 0.5, color="#1f77b4", lw=0.6, ls="--")
        ax.axhline((g + 1) * R - 0.5, color="black", lw=1.6)
    labels = group_row_labels(data["groups"], data["q_heads"], data["m_tiles"], data["xqa_rows"])
    ax.set_yticks([y for y, _ in labels], [t for _, t in labels], fontsize=8)
    dims = sorted(set(np.nonzero(np.isnan(vals).any(axis=0))[0].tolist()))
    _dim_axis(ax, vals.shape[1], dims)
    ax.set_title(f"{data['title']}\n{data['nan_count']} NaN on {len(dims)} dims", fontsize=9)
    _nan_legend(ax)
    return ax


def plot_route_comparison(data: dict, ax=None):
    """data: figdata.route_nans. One strip per route over head dims (NaN dims in NAN_COLOR),
    with the route's NaN count and max |route - xqa| on the right."""
    ax = _ax(ax, (11, 0.42 * len(data["routes"]) + 1.6))
    per_dim = data["per_dim"].astype(float)
    img = np.where(per_dim > 0, np.nan, 0.0)
    ax.imshow(img, cmap=_cmap("Greys"), vmin=0, vmax=4, aspect="auto", interpolation="nearest")
    table = data["table"]
    for i, r in enumerate(data["routes"]):
        row = table.loc[r]
        d = row["max_abs_diff_vs_xqa"]
        d = "n/a (NaN)" if d is None or (isinstance(d, float) and math.isnan(d)) else f"{d:.1e}"
        n = int(row["nan_count"])
        ax.text(1.01, 1 - (i + 0.5) / len(data["routes"]), f"NaN {n:>4d}   max|Δ xqa| {d}",
                transform=ax.transAxes, va="center", fontsize=8, family="monospace",
                color=NAN_COLOR if n else CLEAN_COLOR)
    ax.set_yticks(range(len(data["routes"])), data["routes"], fontsize=8)
    for y in range(len(data["routes"]) - 1):
        ax.axhline(y + 0.5, color="white", lw=1)
    dims = sorted(set(np.nonzero(per_dim.sum(axis=0))[0].tolist()))
    _dim_axis(ax, per_dim.shape[1], dims)
    ax.set_title(f"routes side by side: {data['title']}", fontsize=9)
    return ax


# -- tables and timings ------------------------------------------------------------------------------

REPRO_COLUMNS = [("nan[xqa]", "xqa"), ("nan[grouped]", "grouped"), ("nan[grouped+kernel_fix]", "kernel_fix"),
                 ("nan[grouped+pad_fix]", "pad_fix"), ("nan[grouped+both_fixes]", "both"),
                 ("nan[grouped+masked_load]", "masked")]


def plot_repro_table(table, ax=None):
    """table: repro.run_repro DataFrame. Cases x NaN count per route (red when > 0, green when 0),
    poisoned dims, the worst max |fix - xqa| and whether repeated runs were bit-identical."""
    ax = _ax(ax, (12, 0.3 * len(table) + 0.9))
    ax.axis("off")
    cols = [c for c, _ in REPRO_COLUMNS if c in table.columns]
    diff_cols = [c for c in table.columns if c.startswith("max|grouped+")]
    header = ["case", "poisoned dims"] + [dict(REPRO_COLUMNS)[c] for c in cols] + ["max|fix-xqa|", "repeat ="]
    cells, colors = [], []
    for _, r in table.iterrows():
        dims = list(r.get("poisoned_dims", []))
        dtxt = ",".join(map(str, dims[:6])) + ("..." if len(dims) > 6 else "") if dims else "-"
        diffs = [r[c] for c in diff_cols if r[c] is not None and not (isinstance(r[c], float) and math.isnan(r[c]))]
        worst = f"{max(diffs):.1e}" if diffs else "-"
        if len(diffs) < len(diff_cols):
            worst += f" ({len(diff_cols) - len(diffs)} NaN)"
        rep = r.get("bit_identical_repeat", None)
        row = [str(r["case"])[:44], dtxt] + [str(int(r[c])) for c in cols] + [worst,
                                                                              "-" if rep is None else str(bool(rep))]
        cells.append(row)
        colors.append(["white", "white"] + ["#ffd6e0" if int(r[c]) else "#d3f9d8" for c in cols]
                      + ["white", "#d3f9d8" if rep else ("white" if rep is None else "#ffd6e0")])
    tab = ax.table(cellText=cells, colLabels=header, cellColours=colors, bbox=[0, 0, 1, 1], cellLoc="center")
    tab.auto_set_font_size(False)
    tab.set_fontsize(8)
    widths = [0.3, 0.17] + [0.06] * len(cols) + [0.1, 0.07]
    for (i, j), cell in tab.get_celld().items():
        cell.set_width(widths[j] / sum(widths))
    for j in range(len(header)):
        tab[0, j].set_text_props(fontweight="bold")
    for i in range(len(cells)):
        tab[i + 1, 0].set_text_props(ha="left")
        tab[i + 1, 0].PAD = 0.02
    title = table.attrs.get("title", "differential harness: NaN elements per route")
    ax.set_title(title, fontsize=10)
    return ax


def plot_bench(data, ax=None):
    """data: (records DataFrame, meta) from figdata.load_bench or kernels.bench. Median ms per
    route, grouped by (context, rows); the ratio to the unfixed grouped route on top."""
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
            ratio = s["ratio_to_unfixed"].iloc[0] if "ratio_to_unfixed" in s.columns else None
            if ratio is not None and not (isinstance(ratio, float) and math.isnan(ratio)):
                ax.text(x, ms, f"x{float(ratio):.2f}", ha="center", va="bottom", fontsize=7, rotation=90)
    labels = []
    for key, _ in groups:
        key = key if isinstance(key, tuple) else (key,)
        labels.append("\n".join(f"{k} {v}" for k, v in zip(keys, key)) or "all")
    ax.set_xticks(range(len(groups)), labels, fontsize=8)
    ax.set_ylabel("median time per call (ms)")
    ax.set_ylim(0, float(df["median_ms"].max()) * 1.3)
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    ax.set_title(f"route and fix timings on {meta.get('gpu', 'unknown GPU')} ({meta.get('source', '')})",
                 fontsize=9)
    return ax


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

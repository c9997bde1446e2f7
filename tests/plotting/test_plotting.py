"""Figure functions draw what their data says (NaN where the data has NaN, in NAN_COLOR),
return their Axes, and the exporter writes PNG/SVG/PDF with metadata without overwriting."""
from __future__ import annotations

import os
import signal

import matplotlib

matplotlib.use("Agg")
import matplotlib.colors as mcolors  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import qsa_lab as q  # noqa: E402
from qsa_lab.analysis import figure_data as figdata  # noqa: E402
from qsa_lab.model import fp8
from qsa_lab.model.poison import SITES
from qsa_lab.plotting import plots as plotting
from qsa_lab.plotting.export import export_figure, read_png_meta  # noqa: E402

SMALL = q.Geometry(context=512, topk=32)


@pytest.fixture(scope="module")
def result():
    return q.run_routes(q.apply_poison(q.build_case(SMALL), "targeted"), backend="emulate")


def new_ax():
    return Figure(figsize=(8, 4)).add_subplot()


def nan_rgba():
    return np.array(mcolors.to_rgba(plotting.NAN_COLOR))


def image_nan_columns(ax):
    """Columns of the Axes' first image whose every pixel... any pixel is NAN_COLOR."""
    im = ax.get_images()[0]
    rgba = im.to_rgba(im.get_array())
    is_nan = np.all(np.isclose(rgba, nan_rgba(), atol=1e-3), axis=-1)
    return sorted(set(np.nonzero(is_nan)[1].tolist())), is_nan


def test_nan_map_marks_exactly_the_nan_cells(result):
    data = figdata.nan_map(result, "grouped")
    ax = plotting.plot_nan_map(data, ax=new_ax())
    cols, is_nan = image_nan_columns(ax)
    assert cols == [102, 152, 168, 170, 230]
    assert np.array_equal(is_nan, np.isnan(data["values"]))
    assert data["values"].shape[0] == 19 * 6 and is_nan.sum() == 480
    assert "backend emulate" in ax.get_title() and ax.get_xlabel() == "head dim"
    assert len(ax.get_xticks()) >= 8                     # readable ticks at 256 dims: every 32


def test_nan_map_of_fixed_route_is_clean(result):
    ax = plotting.plot_nan_map(figdata.nan_map(result, "grouped+kernel_fix"), ax=new_ax())
    assert image_nan_columns(ax)[0] == []


def test_route_comparison_marks_only_grouped(result):
    data = figdata.route_nans(result)
    ax = plotting.plot_route_comparison(data, ax=new_ax())
    _, is_nan = image_nan_columns(ax)
    assert [r for r, row in zip(data["routes"], is_nan) if row.any()] == ["grouped"]


def test_page_bytes_and_attribution(result):
    d = figdata.page_bytes(result.case, "v")
    assert d["nan_bytes"] == 20 and d["nan_dims"] == [102, 152, 168, 170, 230]
    ax = plotting.plot_page_bytes(d, ax=new_ax())
    assert image_nan_columns(ax)[0] == [102, 152, 168, 170, 230]
    ax = plotting.plot_attribution(figdata.attribution_map(result), ax=new_ax())
    assert "identical" in ax.get_title() and "shaded" not in ax.get_title() and "▲" in ax.get_title()
    marks = ax.collections[-1].get_offsets()[:, 0].tolist()       # the ▲ under each output NaN dim
    assert marks == [102, 152, 168, 170, 230]


def test_page_byte_maps_every_site():
    maps = figdata.page_byte_maps(sites=SITES)
    assert [m["site"] for m in maps] == list(SITES)
    by = {m["site"]: m for m in maps}
    assert by["zeros"]["nan_bytes"] == 0 and by["none"]["nan_bytes"] == 0 and by["targeted"]["nan_bytes"] == 20
    assert by["stale-tail"]["page"] != 0 and by["stale-tail"]["nan_bytes"] > 0


def test_code_table_marks_nan_codes():
    ax = plotting.plot_code_table(fp8.code_table("e4m3"), ax=new_ax())
    _, is_nan = image_nan_columns(ax)
    assert sorted((np.nonzero(is_nan.flatten())[0]).tolist()) == [0x7F, 0xFF]
    assert sum(t.get_text() == "NaN" for t in ax.texts) == 2


def test_byte_rates_and_plan(result):
    rates = figdata.fp16_state_rates(n=1 << 16)
    ax = plotting.plot_byte_nan_rates(rates, ax=new_ax())
    assert len(ax.patches) == 6 and "%" in ax.get_ylabel()
    table = figdata.plan_table(result.plan)
    assert int(table.padded.sum()) == int(result.plan.padding().sum())
    ax = plotting.plot_plan(table, ax=new_ax())
    assert str(int(table.padded.sum())) in ax.get_title()


def test_repro_table_and_bench_figures():
    import pandas as pd

    from qsa_lab.report.repro import REPRO_CASES, run_repro

    table, _ = run_repro(backend="emulate", cases=REPRO_CASES[:1], progress=False, repeat=False,
                         geometry_overrides=dict(context=512, topk=32))
    ax = plotting.plot_repro_table(table, ax=new_ax())
    cells = ax.tables[0].get_celld()
    header = [cells[0, j].get_text().get_text().replace("\n", " ") for j in range(max(j for _, j in cells) + 1)]
    assert header[2] == "reference" and "expected to differ" in header and "as expected" in header
    row = {h: cells[1, j] for j, h in enumerate(header)}
    assert row["grouped"].get_text().get_text() == "480" and row["expected to differ"].get_text().get_text() == "grp"
    # the unfixed route differs as predicted (yellow), the fixes equal the reference (green)
    assert mcolors.to_hex(row["grouped"].get_facecolor()) == plotting.EXPECTED_DIFF_COLOR
    assert mcolors.to_hex(row["kernel_fix (A)"].get_facecolor()) == plotting.SAME_COLOR
    assert row["as expected"].get_text().get_text() == "yes"
    df, meta = figdata.bench_frame([{"variant": "grouped", "context": 8192, "rows": 16, "median_ms": 0.19,
                                     "ratio_to_unfixed": 1.0},
                                    {"variant": "grouped+kernel_fix", "context": 8192, "rows": 16,
                                     "median_ms": 0.23, "ratio_to_unfixed": 1.23}], "test")
    ax = plotting.plot_bench((df, {**meta, "gpu": "Tesla V100"}), ax=new_ax())
    assert len(ax.patches) == 2 and "Tesla V100" in ax.get_title()
    assert isinstance(df, pd.DataFrame)


def test_export_metadata_and_no_silent_overwrite(tmp_path):
    fig = Figure()
    fig.add_subplot().plot([0, 1])
    meta = {"case": "rows 19 test", "backend": "emulate"}
    first = export_figure(fig, "demo", meta, out_dir=tmp_path)
    assert [p.name for p in first] == ["demo.png", "demo.svg", "demo.pdf"]
    m = read_png_meta(first[0])
    assert m["case"] == "rows 19 test" and m["backend"] == "emulate" and m["gpu"] and \
        m["qsa_lab_version"] == q.__version__
    assert "rows 19 test" in first[1].read_text() and b"rows 19 test" in first[2].read_bytes()
    assert export_figure(fig, "demo", meta, out_dir=tmp_path) == first     # the same bytes: no copy
    assert len(list(tmp_path.iterdir())) == 3
    assert len(m["git_commit"]) >= 40 and len(m["csrc_sha256"]) == 16    # which code drew it
    fig.axes[0].plot([1, 0])
    second = export_figure(fig, "demo", meta, out_dir=tmp_path)       # a different figure: numbered
    assert [p.name for p in second] == ["demo-1.png", "demo-1.svg", "demo-1.pdf"]
    before = first[0].stat().st_mtime_ns
    third = export_figure(fig, "demo", meta, out_dir=tmp_path, overwrite=True)
    assert third == first and first[0].stat().st_mtime_ns >= before
    with pytest.raises(ValueError, match="name"):
        export_figure(fig, "../evil", meta, out_dir=tmp_path)


def test_export_lays_out_once_and_gives_the_figure_back(tmp_path):
    fig = Figure(figsize=(4, 3), layout="constrained")
    ax = fig.add_subplot()
    ax.plot([0, 1])
    ax.set_ylabel("a long label that moves the axes")
    engine = fig.get_layout_engine()
    export_figure(fig, "laid", out_dir=tmp_path)
    assert fig.get_layout_engine() is engine     # the caller's figure keeps its layout engine
    fresh = Figure(figsize=(4, 3))
    fresh.add_subplot().plot([0, 1])
    assert ax.get_position().bounds != fresh.axes[0].get_position().bounds   # and was laid out


def test_write_repro_figures(tmp_path, request):
    from qsa_lab.report import figures
    from qsa_lab.report.figures import write_repro_figures
    from qsa_lab.report.repro import REPRO_CASES, run_repro
    from qsa_lab.support.executor import SecondProcess

    second = SecondProcess("qsa_lab.report.figures")   # the second process `qsa-lab repro` starts
    request.addfinalizer(second.close)
    ahead = figures.draw_ahead(second, "emulate")      # rendering beside this test's cases
    cases = [c for c in REPRO_CASES if c.report_key == "rows19-targeted" or c.poison.get("site") == "stale-tail"]
    table, results = run_repro(backend="emulate", cases=cases, progress=False, repeat=False,
                               geometry_overrides=dict(context=512, topk=32))
    figs = tmp_path / "figs"
    paths = write_repro_figures(results, figs, table=table)      # all of them here
    stems = {p.stem for p in paths}
    assert {"01_e4m3_code_table", "01_fp16_byte_nan_rates", "01_page0_byte_maps", "02_plan", "02_nan_maps",
            "02_attribution", "02_routes", "03_playground_default", "04_repro_table",
            "04_stale_tail_routes", "05_fix_cost"} <= stems
    assert all(p.exists() for p in paths) and len(paths) == 3 * len(stems)
    meta = read_png_meta(figs / "05_fix_cost.png")
    assert "committed NVIDIA H200 run, data/bench_h200.json" in meta["timings_from"] and meta["git_commit"]
    one = {p.name: p.read_bytes() for p in paths}
    # a second run into the same folder with the second process: its figures (01, 03, 05, then 04
    # handed to it) are the one-process bytes, this process renders only the others, and no
    # numbered copy appears
    want = set(figures.INDEPENDENT + figures.HANDED)
    for name in figures.INDEPENDENT:
        assert ahead.result(name, timeout=600) is not None, name      # rendered there, before the run below
    here = []
    render = figures.render_spec
    figures.render_spec = lambda spec: here.append(spec.name) or render(spec)
    try:
        again = write_repro_figures(results, figs, table=table, ahead=ahead)
    finally:
        figures.render_spec = render
    assert not set(here) & set(figures.INDEPENDENT) and set(here) >= stems - want
    theirs = {name: ahead.result(name) for name in want}
    assert all(r is not None for n, r in theirs.items() if n not in here)   # what it did not answer, here
    assert all(blob == one[f"{r.name}.{f}"] for r in theirs.values() if r is not None for f, blob in r.blobs.items())
    assert again == paths
    assert sorted(p.name for p in figs.iterdir()) == sorted(p.name for p in paths)
    assert {p.name: p.read_bytes() for p in paths} == one


def overlapping_texts(fig) -> list:
    """Pairs of visible texts of `fig` whose boxes overlap (each legend counts as one box)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.legend import Legend
    from matplotlib.text import Text

    FigureCanvasAgg(fig).draw()
    r = fig.canvas.get_renderer()
    legends = fig.findobj(Legend)
    inside = {id(t) for lg in legends for t in lg.findobj(Text)}
    ticks, drawn = set(), set()   # tick labels exist beyond the view limits too; only drawn ones count
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                ticks |= {id(tick.label1), id(tick.label2)}
            for tick in axis._update_ticks():
                drawn |= {id(tick.label1), id(tick.label2)}
    boxes = [(t.get_text(), t.get_window_extent(r)) for t in fig.findobj(Text)
             if t.get_visible() and t.get_text().strip() and id(t) not in inside
             and (id(t) not in ticks or id(t) in drawn)]
    boxes += [("<legend>", lg.get_window_extent(r)) for lg in legends]
    return [(a, b) for i, (a, x) in enumerate(boxes) for b, y in boxes[i + 1:]
            if x.overlaps(y) and x.width and y.width]


def test_fix_cost_figure_says_what_it_asks_and_labels_do_not_overlap():
    from qsa_lab.report.figures import fix_cost_figure

    fig, meta = fix_cost_figure()
    assert overlapping_texts(fig) == []
    per_tile, ratio, upstream = fig.axes[:3]
    labels = [t.get_text() for t in per_tile.get_yticklabels()]
    cost = figdata.fix_cost(figdata.bench_doc(False), figdata.load_upstream())
    v = cost["variants"]
    assert labels[:5] == ["unfixed", "kernel_fix (A)", "pad_fix (B)", "both_fixes (A+B)", "masked_load (C)"]
    assert labels == [x["label"] for x in v.values()]      # every variant the committed bench measured
    texts = " ".join(t.get_text() for ax in fig.axes for t in ax.texts)
    a = v["kernel_fix"]                                     # ratio and µs per tile, as the data has them
    assert f"×{a['ratio']:.3f}" in texts and f"({a['extra_us']:+.2f})" in texts
    assert f"{v['unfixed']['us_per_tile']:.2f} µs" in texts
    assert any(abs(line.get_xdata()[0] - 1.246) < 1e-9 for line in ratio.lines)    # the report's V100 ratio
    assert "×1.25" in texts and "V100" in texts
    for r in cost["upstream"]["rows"]:                      # upstream beside ours
        k = r["upstream_kernel_fix_ratio"]
        assert f"×{k:.3f} (+{r['upstream_unfixed_us_per_tile'] * (k - 1):.2f} µs)" in texts
    assert "committed NVIDIA H200 run" in fig._suptitle.get_text() and "H200" in meta["timings_from"]
    for ax in fig.axes:                          # horizontal bars: no rotated label anywhere
        assert all(t.get_rotation() == 0 for t in ax.get_xticklabels() + ax.get_yticklabels() + ax.texts)


def test_bench_sweep_figure_is_readable():
    df, meta = figdata.load_bench()
    ax = plotting.plot_bench((df, meta), ax=Figure(figsize=(10, 4.5)).add_subplot())
    assert ax.get_yscale() == "log" and not ax.texts and overlapping_texts(ax.figure) == []


def test_page_byte_maps_show_the_page_each_site_writes():
    maps = figdata.page_byte_maps()
    assert [m["site"] for m in maps] == list(figdata.BYTE_MAP_SITES) and all(m["nan_bytes"] for m in maps)
    by = {m["site"]: m for m in maps}
    assert by["targeted"]["page"] == 0 and by["targeted"]["nan_bytes"] == 20        # 5 dims x 4 tokens
    assert by["attended-k"]["plane"] == "k" and by["attended-k"]["page"] != 0
    assert "most-attended" in by["attended-v"]["what"] and "null block" not in by["attended-v"]["what"]
    fig = Figure(figsize=(15, 7.5), layout="constrained")
    for d, ax in zip(maps, fig.subplots(3, 2).flat):
        plotting.plot_page_bytes(d, ax=ax)
    assert all(ax.get_title().startswith(f"site {m['site']}: page {m['page']} (") for m, ax in zip(maps, fig.axes))
    assert fig.get_size_inches()[1] * 150 < 1200                                    # not 3120 px tall


def test_nan_map_has_a_colour_bar_and_dim_ticks_fit_small_heads(result):
    ax = plotting.plot_nan_map(figdata.nan_map(result, "grouped"), ax=Figure(figsize=(11, 5)).add_subplot())
    cbar = [a for a in ax.child_axes if "|output|" in a.get_ylabel()]
    assert cbar and ax.get_legend() is not None
    ax = Figure().add_subplot()
    plotting._dim_axis(ax, 16)
    assert list(ax.get_xticks()) == list(range(16))                                 # not just 0 and 8


def _label_boxes(ax):
    """Window extents of the NaN-dim labels (minor tick labels of the top secondary axis)."""
    fig = ax.figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()
    r = fig.canvas.get_renderer()
    top = [c for c in ax.child_axes]
    assert top, "no secondary axis with NaN dims"
    labels = [t for t in top[0].xaxis.get_ticklabels(minor=True) if t.get_text()]
    return labels, [t.get_window_extent(r) for t in labels]


@pytest.mark.parametrize("dims", [[102, 152, 168, 170, 230], list(range(0, 256, 3)),
                                  [0, 1, 2, 3, 50, 52, 54, 56, 58, 60, 255]])
def test_nan_dim_labels_never_overlap(dims):
    values = np.zeros((96, 256), dtype=np.float32)
    values[:, dims] = np.nan
    data = {"values": values, "groups": 2, "q_heads": 6, "m_tiles": 3, "xqa_rows": [], "route": "grouped",
            "nan_count": int(np.isnan(values).sum()), "title": "test"}
    ax = plotting.plot_nan_map(data, ax=Figure(figsize=(12, 5)).add_subplot())
    labels, boxes = _label_boxes(ax)
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            assert not boxes[i].overlaps(boxes[j]), (labels[i].get_text(), labels[j].get_text())
    named = set()
    for t in labels:  # every NaN dim is named by some label, singly, in a list or in a range
        text = t.get_text()
        if "(" in text:
            lo, hi = map(int, text.split(" ")[0].split("-"))
            named |= {d for d in dims if lo <= d <= hi}
        else:
            named |= set(map(int, text.split(",")))
    assert named == set(dims)
    if dims[:5] == [102, 152, 168, 170, 230]:
        assert "168,170" in [t.get_text() for t in labels]   # the report's close pair shares a label


def test_plan_draws_no_bar_for_zero_on_log_scale():
    import pandas as pd

    table = pd.DataFrame({"group": [0, 0, 1, 1], "category": [1, 2, 1, 2], "real": [40, 0, 12, 30],
                          "padded": [0, 7, 4, 0]})
    table.attrs["m_tiles"] = 2
    ax = plotting.plot_plan(table, ax=new_ax())
    heights = [p.get_height() for p in ax.patches if np.isfinite(p.get_height())]
    assert sorted(heights) == [4, 7, 12, 30, 40]          # the three zeros drew nothing
    assert sum(t.get_text() == "0" for t in ax.texts) == 3  # but are still labelled


class _Answers:
    """A stand-in for the second process: each call sent answers `answers[name]` (an exception is
    raised there), or never while `hold` (a slow process); the calls sent, in order."""

    def __init__(self, answers, hold=()):
        self.answers, self.hold, self.sent = answers, hold, []

    def submit(self, fn, name, *args):
        from concurrent.futures import Future

        self.sent.append(name)
        f = Future()
        if name not in self.hold:
            a = self.answers.get(name, RuntimeError("no answer"))
            f.set_exception(a) if isinstance(a, Exception) else f.set_result(a)
        return f


def _ahead(answers, names, hold=()):
    from qsa_lab.support.executor import Relay

    relay = Relay(_Answers(answers, hold))
    for n in names:
        relay.add(n, None, n)
    return relay


def test_the_second_process_answers_are_used_only_from_this_code_and_whole():
    from qsa_lab.plotting.export import Rendered, full_meta
    from qsa_lab.report.figures import Spec, collect

    meta = full_meta({"case": "c", "backend": "emulate"})
    a, b = (Rendered(n, meta, {"png": n.encode(), "svg": b"", "pdf": b""}) for n in ("a", "b"))
    other = Rendered("b", {**meta, "git_commit": "0" * 40}, b.blobs)
    specs = [Spec("a", plotting.plot_plan), Spec("b", plotting.plot_plan)]
    rendered, busy = [], []

    def here(spec):
        rendered.append(spec.name)
        if busy and spec.name == "b":
            busy.pop().set_result(a)    # the second process answers its call while this one renders b
        return ("here", spec.name)

    from qsa_lab.report import figures

    real = figures.render_spec
    figures.render_spec = here
    try:
        assert collect(_ahead({"a": a, "b": b}, "ab"), specs) == {"a": a, "b": b} and rendered == []
        for answers in ({},                                      # ended before answering
                        {"a": RuntimeError("Traceback ...")},    # failed part-way
                        {"a": other, "b": other},                # drawn by another commit
                        {"a": "not a figure", "b": a}):          # not a figure, or another figure
            rendered.clear()
            assert collect(_ahead(answers, "ab"), specs) == {"a": ("here", "a"), "b": ("here", "b")}, answers
            assert sorted(rendered) == ["a", "b"]
        # a slow process, busy with its first call: this one renders, from the last one back, what
        # was not sent to it yet (it never gets those), and takes the answer of the one it had
        rendered.clear()
        ahead = _ahead({}, "abc", hold="a")
        busy.append(ahead._sent["a"])
        assert collect(ahead, specs + [Spec("c", plotting.plot_plan)]) == {"a": a, "b": ("here", "b"),
                                                                           "c": ("here", "c")}
        assert rendered == ["c", "b"] and ahead._second.sent == ["a"]
    finally:
        figures.render_spec = real


def test_write_repro_figures_renders_what_the_second_process_did_not(tmp_path, monkeypatch):
    """A second process that failed: every figure rendered here, the bytes export_figure writes."""
    from qsa_lab.report import figures

    def tiny(name):
        fig = Figure(figsize=(2, 2))
        fig.add_subplot().plot([0, len(name)])
        return fig, {"case": name, "backend": "none"}

    names = ["01_e4m3_code_table", "02_plan", "04_repro_table", "05_fix_cost"]
    monkeypatch.setattr(figures, "figure_specs", lambda results, table, backend: [
        figures.Spec(n, lambda n=n: tiny(n)) for n in names])
    ahead = _ahead({n: RuntimeError("Traceback ...") for n in names}, [n for n in names if n in figures.INDEPENDENT])
    paths = figures.write_repro_figures([], tmp_path / "figs", ahead=ahead)
    assert [p.name for p in paths[::3]] == [f"{n}.png" for n in names]
    for n, p in zip(names, paths[::3]):
        assert p.read_bytes() == export_figure(tiny(n)[0], n, tiny(n)[1], out_dir=tmp_path / "direct")[0].read_bytes()


@pytest.mark.parametrize("argv,idle,started", [([], True, True), ([], False, False),
                                               (["--no-figures"], True, False), (["--backend", "cuda"], True, False)])
def test_repro_starts_the_second_process_only_for_figures_and_an_idle_core(monkeypatch, tmp_path, argv, idle,
                                                                            started):
    from qsa_lab.app import cli
    from qsa_lab.support import executor, processes as procs

    monkeypatch.setattr(procs, "idle_core", lambda others=None: idle)
    seen = []
    monkeypatch.setattr(cli, "_repro", lambda args, out, files, second: seen.append(second) or 0)
    assert cli.main(["repro", "--out", str(tmp_path / "r"), "--figures", str(tmp_path / "f"), *argv]) == 0
    assert (seen[0] is not None) == started
    if started:
        assert isinstance(seen[0], executor.SecondProcess) and seen[0]._pool is None    # ended with the command
        assert not os.path.exists(f"/proc/{seen[0].pid}") or _ended(seen[0].pid)


SIGNAL_WRAPPER = r'''
import runpy, sys, time
import qsa_lab.support.executor as executor, qsa_lab.support.outputs as outputs, qsa_lab.support.processes as procs
mode, argv = sys.argv[1], sys.argv[2:]
procs.idle_core = lambda others=None: True        # a core to spare, whatever the test machine runs
init = executor.SecondProcess.__init__
def started(self, *warm):
    init(self, *warm)
    sys.stderr.write(f"PID {self.pid}\n")
executor.SecondProcess.__init__ = started

def mark(text):
    sys.stderr.write(f"MARK {text}\n")
    sys.stderr.flush()

import qsa_lab.report.repro as repro        # one small case (the full table takes minutes)
real = repro.run_repro
def small(backend="auto", progress=True, beside=0):
    kw = dict(cases=repro.REPRO_CASES[:1], progress=False, repeat=False, beside=beside,
              geometry_overrides=dict(context=256, topk=16, head_dim=32))
    if mode == "compute":            # the second process is rendering: the signal comes now
        mark("computing")
        while True:
            real(backend=backend, **kw)
    done = real(backend=backend, **kw)
    if mode == "write":              # three figures: one of the second process's, one handed to it, one of this
        import qsa_lab.report.figures as figures        # process's (all of them take seconds to render)
        specs, few = figures.figure_specs, ("01_fp16_byte_nan_rates", "02_attribution", "04_repro_table")
        figures.figure_specs = lambda *a: [s for s in specs(*a) if s.name in few]
    return done
repro.run_repro = small
if mode == "write":                  # a figure's temporary file, written whole, waits to be published
    def publish(tmp, path, force, arg):
        mark(f"writing {tmp}")
        while True:
            time.sleep(0.05)
    outputs._publish = publish
sys.argv = ["qsa-lab", *argv]
runpy.run_module("qsa_lab", run_name="__main__", alter_sys=True)
'''


def _ended(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
@pytest.mark.parametrize("mode,signum,code,line", [
    ("compute", signal.SIGINT, 130, "qsa-lab: interrupted"),
    ("compute", signal.SIGTERM, 143, "qsa-lab: terminated (SIGTERM)"),
    ("write", signal.SIGTERM, 143, "qsa-lab: terminated (SIGTERM)")])
def test_a_signal_ends_repro_and_its_second_process_and_publishes_nothing(tmp_path, mode, signum, code, line):
    import subprocess
    import sys
    import time

    def default_signals():
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    p = subprocess.Popen([sys.executable, "-c", SIGNAL_WRAPPER, mode, "repro", "--backend", "emulate", "--out",
                          "results", "--figures", "figures", "--quiet"], cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, preexec_fn=default_signals)
    try:
        pid = None
        for ln in iter(p.stderr.readline, ""):
            pid = int(ln.split()[1]) if ln.startswith("PID") else pid
            if ln.startswith("MARK"):
                break
        assert pid is not None and p.poll() is None, "no second process, or no marker"
        p.send_signal(signum)
        out, err = p.communicate(timeout=600)
    finally:
        if p.poll() is None:
            p.kill()
    assert (p.returncode, err.splitlines()) == (code, [line]), err
    deadline = time.monotonic() + 60
    while not _ended(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _ended(pid), "the second process outlived the command"
    left = sorted(str(f.relative_to(tmp_path)) for f in tmp_path.rglob("*") if f.is_file())
    assert not any(".tmp" in f or f.startswith("results") for f in left), left


def _inside(box, bounds, tol=0.5) -> bool:
    return (box.x0 >= bounds.x0 - tol and box.x1 <= bounds.x1 + tol and box.y0 >= bounds.y0 - tol
            and box.y1 <= bounds.y1 + tol)


def test_fix_cost_title_lies_inside_the_figure():
    """The title was one line wider than the 14-inch figure, clipped at both ends (issue 31)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from qsa_lab.report.figures import fix_cost_figure

    fig, _ = fix_cost_figure()
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    texts = [fig._suptitle] + [ax.title for ax in fig.axes]
    assert all(_inside(t.get_window_extent(renderer), fig.bbox) for t in texts), \
        [(t.get_text(), t.get_window_extent(renderer)) for t in texts]


def test_fix_colours_are_told_apart():
    """kernel_fix and both_fixes were two oranges 0.07 apart in RGB (issue 31)."""
    from itertools import combinations

    rgb = {k: np.array(mcolors.to_rgb(c)) for k, c in plotting.FIX_COLORS.items()}
    close = [(a, b, round(float(np.linalg.norm(rgb[a] - rgb[b])), 2)) for a, b in combinations(rgb, 2)
             if np.linalg.norm(rgb[a] - rgb[b]) < 0.35]
    assert not close, close


def test_byte_map_rings_are_drawn_whole_and_the_grey_has_a_key():
    """Stale-tail rings sit on the page's last token: clipped at the axis edge they were half
    rings; the grey shading had no key (issue 31)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PathCollection

    maps = figdata.page_byte_maps()
    fig = Figure(figsize=(15, 7.5), layout="constrained")
    axes = list(fig.subplots(3, 2).flat)
    for d, ax in zip(maps, axes):
        plotting.plot_page_bytes(d, ax=ax)
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    tail = axes[[m["site"] for m in maps].index("stale-tail")]
    assert tail.collections and max(tail.collections[0].get_offsets()[:, 1]) == maps[3]["codes"].shape[0] - 1
    for ax in axes:
        for rings in [c for c in ax.collections if isinstance(c, PathCollection)]:
            if rings.get_clip_on():   # clipped: every ring, its radius and line included, inside the axes
                r = (np.sqrt(rings.get_sizes().max()) / 2 + rings.get_linewidths().max()) * fig.dpi / 72
                xy = ax.transData.transform(rings.get_offsets())
                box = ax.get_window_extent(renderer)
                assert ((xy - r >= [box.x0, box.y0]) & (xy + r <= [box.x1, box.y1])).all(), ax.get_title()
        cbar = getattr(ax, "qsa_cbar", None)
        assert cbar is not None and "byte" in cbar.ax.get_ylabel(), ax.get_title()
        assert [t.get_text() for t in cbar.ax.get_yticklabels()] == ["0x00", "0x7F", "0xFF"]


def test_route_annotations_put_the_count_before_nan(result):
    """"NaN 0 |Δxqa| ..." read as a value NaN; the count comes first (issue 31)."""
    import re

    ax = plotting.plot_route_comparison(figdata.route_nans(result), ax=new_ax())
    texts = [t.get_text() for t in ax.qsa_texts]
    assert texts and all(re.match(r"\s*\d+ NaN  (\|Δxqa\| +(-|\d\.\de[+-]\d\d)|\d+ dropped)$", t) for t in texts), texts
    assert not any(t.lstrip().startswith("NaN") for t in texts), texts
    grouped = texts[figdata.route_nans(result)["routes"].index("grouped")]
    assert re.match(r"\s*480 NaN  \|Δxqa\| +-$", grouped), grouped


def test_fix_cost_table_is_rounded():
    """Notebook 05's table printed raw floats (3.488375; issue 31)."""
    cost = figdata.fix_cost(figdata.bench_doc(False), figdata.load_upstream())
    from qsa_lab.analysis.bench_data import fix_cost_frame

    t = fix_cost_frame(cost)
    raw = cost["variants"]["unfixed"]["us_per_tile"]
    assert raw != round(raw, 2)                        # the committed figure has more digits than shown
    assert list(t.index)[:2] == ["unfixed", "kernel_fix (A)"] and t.loc["unfixed", "µs per tile"] == round(raw, 2)
    for col, places in (("µs per tile", 2), ("extra µs", 2), ("× unfixed", 3)):
        assert t[col].dtype == float and (t[col] == t[col].round(places)).all(), t[col]
    lo, hi = cost["variants"]["kernel_fix"]["sweep_ratio"]
    assert t.loc["kernel_fix (A)", "× over the sweep"] == f"{lo:.3f}–{hi:.3f}"
    assert repr(raw) not in t.to_string() and f"{raw:.4f}" not in t.to_string()


def test_leak_matrix_tick_labels_are_readable():
    """The committed H200 matrix was drawn with 7 pt tick labels, ~7 px in a notebook (issue 31)."""
    from qsa_lab.canary import figures as cf
    from qsa_lab.canary import load_canary
    from qsa_lab.support.package_data import locate

    ax = cf.plot_leak_matrix(cf.leak_matrix(load_canary(locate("data") / "canary_h200.json")), ax=new_ax())
    labels = ax.get_xticklabels() + ax.get_yticklabels() + [t for c in ax.child_axes for t in c.get_xticklabels()]
    assert labels and min(t.get_fontsize() for t in labels) >= 9, sorted({t.get_fontsize() for t in labels})


def test_the_repro_table_figure_clips_no_cell_and_says_what_a_nan_count_beside_a_difference_means():
    """Every header and cell text inside its cell, with the longest case names, five-digit counts and
    '(n NaN)' beside a difference; the figure explains that note."""
    import pandas as pd

    from qsa_lab.report.repro import REPRO_CASES
    from qsa_lab.routes import labels

    rows = []
    for i, c in enumerate(REPRO_CASES):
        row = {"case": c.name, "poisoned_dims": [102, 152, 168, 170, 230, 1], "as_expected": True,
               "differs_from_reference": "grouped", "expected_to_differ": ",".join(labels.ROUTES[2:]),
               "bit_identical_repeat": False}
        row.update({f"nan[{r}]": 29184 for r in labels.ROUTES})
        row.update({f"max|{r}-xqa|": None if i % 2 else 6.1e-5 for r in labels.FIXED_ROUTES})
        rows.append(row)
    ax = plotting.plot_repro_table(pd.DataFrame(rows))
    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    clipped = []
    for (i, j), cell in ax.tables[0].get_celld().items():
        box, text = cell.get_window_extent(renderer), cell.get_text().get_window_extent(renderer)
        if text.x0 < box.x0 - 0.5 or text.x1 > box.x1 + 0.5 or text.y0 < box.y0 - 0.5 or text.y1 > box.y1 + 0.5:
            clipped.append((i, j, cell.get_text().get_text()))
    assert not clipped, clipped
    assert any(c.get_text().get_text() == "6.1e-05 (4 NaN)" or c.get_text().get_text().endswith(" NaN)")
               for c in ax.tables[0].get_celld().values())
    notes = " ".join(t.get_text() for t in ax.texts)
    assert "(n NaN): n fixes held NaN and are left out" in notes


@pytest.mark.parametrize("seed", [0, 3])
def test_notebook_01s_byte_maps_draw_no_text_over_another(seed):
    """The byte-map panels as notebook 01 draws them: no NaN-dim label, title, axis label or tick
    label overlaps another text of the figure (dims too close for two labels share one)."""
    import itertools

    maps = figdata.page_byte_maps(seed=seed)
    fig = plotting.small_multiples(plotting.plot_page_bytes, maps, ncols=2, panel=(7.5, 2.5))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = [(t.get_text(), t.get_window_extent(renderer)) for t in fig.findobj(matplotlib.text.Text)
             if t.get_visible() and t.get_text().strip()]
    assert sum("NaN dims" in t for t, _ in texts) == len(maps)        # every panel has its NaN-dim axis
    overlaps = [(a, b) for (a, box_a), (b, box_b) in itertools.combinations(texts, 2) if box_a.overlaps(box_b)]
    assert not overlaps, overlaps[:5]

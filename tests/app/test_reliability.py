"""Reliability: the CLI error contract, loading anything, writing safely, resource limits,
API validation and byte-identical outputs. Tiny geometries; a subprocess only where the
process-level contract (one stderr line, no traceback) is what is tested."""
import argparse
import dataclasses
import json
import os
import stat
import subprocess
import sys
import threading
import time

import pytest
import torch

import qsa_lab.report.figures  # noqa: F401 - imported (binding the real run_routes) before any test patches it
import qsa_lab.report.repro  # noqa: F401
from qsa_lab.app import cli, case_file as io
from qsa_lab.support import outputs
from qsa_lab.model import memory as resources
from qsa_lab.model.case import RANGES, Geometry, build_case
from qsa_lab.app.cli import main
from qsa_lab.model.plan import plan_groups
from qsa_lab.model.poison import apply_poison
from qsa_lab.routes.run import ROUTES, grouped_output, run_routes
from qsa_lab.routes import emulate

TINY = ["--rows", "8", "--context", "64", "--topk", "8", "--head-dim", "16", "--backend", "emulate"]
GEOMETRY = Geometry(rows=8, context=64, topk=8, head_dim=16)
CASE = build_case(GEOMETRY)


def run_cli(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err, needle):
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"qsa-lab: error: {needle}"), lines[0]
    assert "Traceback" not in err


# ---------------------------------------------------------------- the CLI contract

def test_bad_input_in_a_real_process_is_one_line_and_exit_2():
    p = subprocess.run([sys.executable, "-m", "qsa_lab", "diff", "--head-dim", "17"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    one_error_line(p.stderr, "--head-dim: must be a multiple of 16")


def test_internal_failure_is_exit_3_and_the_traceback_needs_debug(monkeypatch, capsys):
    def broken(*a, **kw):
        raise RuntimeError("kernel exploded\nsecond line")

    monkeypatch.setattr("qsa_lab.routes.run.run_routes", broken)
    code, _, err = run_cli(["diff", *TINY], capsys)
    assert code == 3 and err.strip().splitlines() == [
        "qsa-lab: failed: RuntimeError: kernel exploded (run with --debug for the traceback)"]
    code, _, err = run_cli(["diff", *TINY, "--debug"], capsys)
    assert code == 3 and "Traceback (most recent call last)" in err and "broken" in err
    assert err.strip().splitlines()[-1] == "qsa-lab: failed: RuntimeError: kernel exploded"


@pytest.mark.parametrize("argv,needle", [
    (["diff", "--ro", "5"], "--ro"), (["diff", "--rows", "1_0"], "--rows: expected an integer"),
    (["diff", "--rows", "\u0663"], "--rows: expected an integer"),       # an Arabic-Indic 3
    (["diff", "--seed", str(1 << 64)], "--seed: must be in"), (["diff", "--poison-seed", "-2"], "--poison-seed"),
    (["diff", "--group-rows", "x"], "--group-rows"), (["diff", "--grouping", "x"], "--grouping"),   # its old name
    (["diff", "--max-memory", "lots"], "--max-memory"),
    (["diff", "--poison", "zeros", "--dims", "1"], "--dims"), ([], "command: required"),
    (["diff", "--json", "a\nb/"], "--json"),
])
def test_every_bad_argument_is_named(argv, needle, capsys):
    code, out, err = run_cli(argv, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qsa-lab: error: ") and needle in lines[0], err


def test_every_option_has_help_with_its_default():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "cmd")
    for name, p in sub.choices.items():
        for a in p._actions:
            if a.dest in ("help",) or (name, a.dest) == ("canary", "fail_on_leak") or a.help == argparse.SUPPRESS:
                continue    # removed, or an old name (--grouping): in no help
            assert a.help and "default" in a.help, (name, a.option_strings, a.help)


# ---------------------------------------------------------------- loading

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("saved") / "case.safetensors"
    io.save(run_routes(apply_poison(CASE, "targeted", dims=[3]), backend="emulate"), path)
    return path


def _rewrite(src, dst, drop=(), add=None, change=None, meta=None):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k not in drop}
        m = dict(f.metadata())
    tensors.update(add or {})
    tensors.update(change or {})
    m.update(meta or {})
    save_file(tensors, str(dst), metadata={k: v for k, v in m.items() if v is not None})
    return dst


def _put(path, data: bytes):
    path.write_bytes(data)
    return path


CORRUPTIONS = {
    "empty": (lambda s, d: _put(d, b""), "is empty"),
    "truncated": (lambda s, d: _put(d, s.read_bytes()[:-100]), "truncated"),
    "header only": (lambda s, d: _put(d, s.read_bytes()[:300]), "not a safetensors file"),
    "another format": (lambda s, d: _put(d, b"\x89PNG\r\n\x1a\n" + bytes(200)), "not a safetensors"),
    "json": (lambda s, d: _put(d, json.dumps({"q": [1, 2]}).encode()), "not a safetensors"),
    "missing tensor": (lambda s, d: _rewrite(s, d, drop=["kv_cache"]), "missing tensor kv_cache"),
    "extra tensor": (lambda s, d: _rewrite(s, d, add={"evil": torch.zeros(1)}), "unexpected tensor"),
    "wrong dtype": (lambda s, d: _rewrite(s, d, change={"q": torch.zeros(8, 6, 16)}), "tensor q: expected"),
    "wrong shape": (lambda s, d: _rewrite(s, d, change={"out.grouped": torch.zeros(3, dtype=torch.float16)}),
                    "out.grouped must be"),
    "plan shape": (lambda s, d: _rewrite(s, d, change={"plan.masks": torch.zeros(1, 8, dtype=torch.int32)}),
                   "plan.masks must be"),
    "geometry not json": (lambda s, d: _rewrite(s, d, meta={"geometry": "{rows: 8"}), "'geometry' is not JSON"),
    "geometry out of range": (lambda s, d: _rewrite(s, d, meta={"geometry": json.dumps(
        {**GEOMETRY.to_dict(), "rows": -3})}), "rows: must be in"),
    "geometry unknown key": (lambda s, d: _rewrite(s, d, meta={"geometry": json.dumps(
        {**GEOMETRY.to_dict(), "color": 1})}), "metadata 'geometry'"),
    "contradicting kv_dtype": (lambda s, d: _rewrite(s, d, meta={"kv_dtype": "e5m2"}), "contradicts"),
    "contradicting scale": (lambda s, d: _rewrite(s, d, meta={"v_scale": "0.5"}), "contradicts"),
    "bad scale": (lambda s, d: _rewrite(s, d, meta={"k_scale": "nan"}), "finite number"),
    "no geometry": (lambda s, d: _rewrite(s, d, meta={"geometry": None}), "missing metadata 'geometry'"),
    "no route outputs": (lambda s, d: _rewrite(s, d, drop=[f"out.{r}" for r in ROUTES]), "no route outputs"),
    "null block in the table": (lambda s, d: _rewrite(s, d, change={"block_table": torch.zeros(1, 2,
                                                                                             dtype=torch.int32)}),
                                "null block"),
    "a folder": (lambda s, d: d.mkdir() or d, "is a folder"),
    "missing": (lambda s, d: d, "does not exist"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_load_of_anything_but_a_saved_case_is_exit_2_naming_the_problem(kind, saved, tmp_path, capsys):
    make, needle = CORRUPTIONS[kind]
    path = make(saved, tmp_path / "x.safetensors")
    code, out, err = run_cli(["diff", "--load", str(path), "--backend", "emulate"], capsys)
    assert code == 2
    one_error_line(err, "--load: ")
    assert needle in err, err


def test_load_of_a_fifo_does_not_hang(tmp_path, capsys):
    fifo = tmp_path / "case.safetensors"
    os.mkfifo(fifo)
    box = {}
    # a reader that opened the FIFO would block for ever (no writer): a generous join tells
    # a hang from a slow machine
    t = threading.Thread(target=lambda: box.update(r=run_cli(["diff", "--load", str(fifo)], capsys)), daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "--load of a FIFO blocked"
    code, _, err = box["r"]
    assert code == 2 and "special file" in err


def test_a_saved_case_replays(saved, capsys):
    code, out, _ = run_cli(["diff", "--load", str(saved), "--backend", "emulate"], capsys)
    assert code == 0 and "bit-identical" in out


# ---------------------------------------------------------------- writing

@pytest.mark.parametrize("make,needle", [
    (lambda d: "", "empty path"), (lambda d: str(d) + "/", "names a folder"), (lambda d: str(d), "is a folder"),
    (lambda d: str(d / "no" / "x.json"), "does not exist"),
    (lambda d: (os.mkfifo(d / "f"), str(d / "f"))[1], "special file"),
    (lambda d: ((d / "t").write_text("mine"), str(d / "t"))[1], "exists"),
    (lambda d: ((d / "l").symlink_to(d / "nowhere"), str(d / "l"))[1], "exists as a symlink"),
])
def test_bad_output_paths_are_refused_before_any_work(make, needle, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("qsa_lab.model.case.build_case", lambda *a, **k: pytest.fail("built a case"))
    target = make(tmp_path)
    code, _, err = run_cli(["diff", *TINY, "--json", target], capsys)
    assert code == 2 and needle in err
    one_error_line(err, "--json: ")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_an_unwritable_folder_is_refused(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    code, _, err = run_cli(["diff", *TINY, "--save", str(ro / "c.safetensors")], capsys)
    assert code == 2 and "cannot write" in err


def test_two_outputs_on_one_path_are_refused(tmp_path, capsys):
    code, _, err = run_cli(["diff", *TINY, "--json", str(tmp_path / "a"), "--save", str(tmp_path / "." / "a")],
                           capsys)
    assert code == 2 and "--save: same file as --json" in err and not list(tmp_path.iterdir())


def test_a_file_created_during_the_run_survives_it(tmp_path, monkeypatch, capsys):
    """The path check passes, then (while the routes run) the user saves a file there."""
    target = tmp_path / "report.json"
    real = run_routes

    def slow_run(*a, **kw):
        target.write_text("the user's own notes")
        return real(*a, **kw)

    monkeypatch.setattr("qsa_lab.routes.run.run_routes", slow_run)
    code, _, err = run_cli(["diff", *TINY, "--json", str(target)], capsys)
    assert code == 2 and "appeared during the run" in err
    assert target.read_text() == "the user's own notes"
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # no temporary file left


def test_force_replaces_whole_and_a_symlink_is_replaced_not_written_through(tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text("not yours to touch")
    link = tmp_path / "link.json"
    link.symlink_to(elsewhere)
    code, _, _ = run_cli(["diff", *TINY, "--json", str(link), "--force"], capsys)
    assert code == 0 and elsewhere.read_text() == "not yours to touch"
    assert not link.is_symlink() and json.loads(link.read_text())["schema"] == "qsa_lab.diff/1"


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_outputs_honour_the_umask(umask, tmp_path):
    old = os.umask(umask)
    try:
        outputs.write_text(tmp_path / "x.json", "{}", "--json")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "x.json").stat().st_mode) == 0o666 & ~umask


def test_nothing_is_written_when_the_run_fails(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("qsa_lab.routes.run.run_routes", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("x")))
    code, _, _ = run_cli(["diff", *TINY, "--json", str(tmp_path / "a.json"), "--save", str(tmp_path / "c")],
                         capsys)
    assert code == 3 and not list(tmp_path.iterdir())


def test_writing_is_all_or_nothing(tmp_path):
    with pytest.raises(ZeroDivisionError):
        with outputs.writing(tmp_path / "x.csv") as tmp:
            tmp.write_text("half")
            1 / 0
    assert not list(tmp_path.iterdir())


def test_repro_output_folders_are_checked_first(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    code, _, err = run_cli(["repro", "--out", str(tmp_path / "file")], capsys)
    assert code == 2 and "--out: " in err and "not a folder" in err
    code, _, err = run_cli(["repro", "--out", str(tmp_path), "--figures", str(tmp_path / "a" / "b")], capsys)
    assert code == 2 and "--figures: folder" in err and "does not exist" in err


# ---------------------------------------------------------------- resources

@pytest.mark.parametrize("argv,needle", [
    (["--rows", "65536", "--context", "1048576", "--topk", "65536"], "--rows x --topk x --head-dim"),
    (["--requests", "4096", "--rows", "4096", "--context", "1048576"], "--requests x --context x --head-dim"),
    (["--topk", str(1 << 40)], "--topk: must be in"), (["--page-size", str(1 << 30)], "--page-size: must be in"),
    (["--head-dim", str(1 << 30)], "--head-dim: must be in"), (["--rows", str(10 ** 18)], "--rows: must be in"),
    (["--context", "1048576", "--max-memory", "100M"], "--requests x --context x --head-dim"),
])
def test_memory_bombs_are_refused_before_any_allocation(argv, needle, monkeypatch, capsys):
    monkeypatch.setattr("qsa_lab.model.case.build_case", lambda *a, **k: pytest.fail("allocated"))
    code, _, err = run_cli(["diff", *argv], capsys)
    assert code == 2
    one_error_line(err, needle)
    if "estimated" in err:
        assert "budget" in err and "--max-memory" in err


def test_max_memory_raises_and_lowers_the_budget(capsys):
    est = resources.estimate(GEOMETRY)
    assert run_cli(["diff", *TINY, "--max-memory", str(est.bytes - 1)], capsys)[0] == 2
    assert run_cli(["diff", *TINY, "--max-memory", str(est.bytes)], capsys)[0] == 0
    with pytest.raises(ValueError, match="budget"):
        build_case(GEOMETRY, max_memory=est.bytes - 1)
    assert resources.parse_bytes("1.5GiB") == 3 << 29 and resources.parse_bytes("512M") == 512 << 20


def test_the_estimate_covers_a_real_run():
    """Peak RSS of a process running one case stays under its estimate. The peak is reset
    (/proc/self/clear_refs) after imports and a tiny warm-up run, so their transient peaks are
    not counted against the case."""
    code = ("import os, torch; from qsa_lab import *; from qsa_lab.model.memory import estimate;"
            "run_routes(build_case(Geometry(rows=8, context=64, topk=8, head_dim=16)), backend='emulate');"
            "g = Geometry(rows=16, context=4096, topk=256, head_dim=128);"
            "kib = lambda key: int(open('/proc/self/status').read().split(key + ':')[1].split()[0]);"
            "now = kib('VmRSS'); open('/proc/self/clear_refs', 'w').write('5');"
            "run_routes(apply_poison(build_case(g), 'random'), backend='emulate');"
            "print((kib('VmHWM') - now) * 1024, estimate(g).bytes)")
    used, est = map(int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                        timeout=120, check=True).stdout.split())
    assert 0 < used <= est


def test_every_geometry_field_has_a_range():
    ints = {f.name for f in dataclasses.fields(Geometry) if f.type in (int, "int")}
    assert ints <= set(RANGES)
    for name, (lo, hi) in RANGES.items():
        for bad in (lo - 1, hi + 1):
            with pytest.raises(ValueError, match=f"^{name}: must be in"):
                Geometry(**{name: bad})
        with pytest.raises(TypeError, match=name):
            Geometry(**{name: str(lo)})


# ---------------------------------------------------------------- the Python API

def test_selection_with_minus_one_before_a_real_id_is_refused():
    case = build_case(GEOMETRY.replace(topk=32))       # 16 visible blocks at most: -1 padded rows
    sel = case.selected.clone()
    row = sel[0]
    sel[0] = torch.cat([row[row < 0], row[row >= 0]])  # same ids, -1 first
    assert sel[0, 0] == -1 and sel[0, -1] >= 0
    with pytest.raises(ValueError, match="selected: .*-1 before a real id"):
        run_routes(dataclasses.replace(case, selected=sel), backend="emulate")


def test_null_block_inside_seq_len_is_refused():
    bt = CASE.block_table.clone()
    bt[0, 1] = 0
    with pytest.raises(ValueError, match="block_table: .*null block.*request 0, logical page 1"):
        run_routes(dataclasses.replace(CASE, block_table=bt), backend="emulate")


@pytest.mark.parametrize("dims,err", [("12", TypeError), ([1.5], TypeError), ([True], TypeError),
                                      ([16], ValueError), (None, None)])
def test_dims_must_be_integers(dims, err):
    if err is None:
        assert apply_poison(CASE, "targeted", dims=[torch.tensor(3)]).poison["dims"] == [3]
        return
    with pytest.raises(err, match="dims"):
        apply_poison(CASE, "targeted", dims=dims)


@pytest.mark.parametrize("seed,err", [(-1, ValueError), (1 << 64, ValueError), (1.0, TypeError),
                                      ("3", TypeError), (True, TypeError)])
def test_poison_seed_range_and_type(seed, err):
    with pytest.raises(err, match="seed"):
        apply_poison(CASE, "random", seed=seed)


def test_unknown_variant_and_a_plan_of_another_case_are_refused():
    plan = plan_groups(CASE)
    with pytest.raises(ValueError, match="variant"):
        grouped_output(CASE, plan, "fastest", emulate)
    other = build_case(GEOMETRY.replace(seed=1))
    with pytest.raises(ValueError, match="plan: does not belong"):
        run_routes(CASE, backend="emulate", plan=plan_groups(other))
    same = run_routes(CASE, routes=["grouped"], backend="emulate", plan=plan)
    assert torch.equal(same.outputs["grouped"].view(torch.int16),
                       run_routes(CASE, routes=["grouped"], backend="emulate").outputs["grouped"].view(torch.int16))


def test_tensors_on_devices_the_code_cannot_use_are_refused():
    with pytest.raises(ValueError, match="device"):
        run_routes(CASE.to("meta"), backend="emulate")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device"):
            run_routes(dataclasses.replace(CASE, q=torch.empty(0, device="meta")), backend="emulate")


def test_routes_given_as_one_string_are_refused_or_taken_whole():
    assert list(run_routes(CASE, routes="xqa", backend="emulate").outputs) == ["xqa"]


# ---------------------------------------------------------------- reproducibility

def test_same_inputs_give_byte_identical_json_and_safetensors(tmp_path, capsys):
    for n in (1, 2):
        assert main(["diff", *TINY, "--poison", "random", "--json", str(tmp_path / f"{n}.json"),
                     "--save", str(tmp_path / f"{n}.st")]) == 0
    assert (tmp_path / "1.json").read_bytes() == (tmp_path / "2.json").read_bytes()
    assert (tmp_path / "1.st").read_bytes() == (tmp_path / "2.st").read_bytes()


def test_exports_are_byte_identical(tmp_path):
    from matplotlib.figure import Figure

    from qsa_lab.plotting.export import export_figure

    def fig():
        f = Figure(figsize=(2, 2))
        f.add_subplot().plot([0, 1], [1, 0], label="x")
        return f

    a = export_figure(fig(), "f", {"case": "tiny"}, out_dir=tmp_path / "a")
    time.sleep(1.1)  # a timestamp would now differ
    b = export_figure(fig(), "f", {"case": "tiny"}, out_dir=tmp_path / "b")
    for pa, pb in zip(a, b):
        assert pa.read_bytes() == pb.read_bytes(), pa.suffix
    again = export_figure(fig(), "f", {"case": "tiny"}, out_dir=tmp_path / "a")   # the same bytes: reused
    assert [p.name for p in again] == ["f.png", "f.svg", "f.pdf"]
    assert all(pa.read_bytes() == pb.read_bytes() for pa, pb in zip(a, again))
    other = export_figure(fig(), "f", {"case": "other"}, out_dir=tmp_path / "a")  # different: never overwrites
    assert [p.name for p in other] == ["f-1.png", "f-1.svg", "f-1.pdf"]
    assert all(p.read_bytes() == q.read_bytes() for p, q in zip(a, b))              # the first export kept
    (tmp_path / "a" / "g.svg").symlink_to(tmp_path / "b" / "f.svg")          # a link counts as taken
    assert export_figure(fig(), "g", out_dir=tmp_path / "a")[1].name == "g-1.svg"
    with pytest.raises(ValueError, match="out_dir: .* not a folder"):
        export_figure(fig(), "f", out_dir=a[0])


def test_grouped_output_refuses_a_plan_that_would_read_outside_this_case():
    wide = build_case(GEOMETRY.replace(context=128, seed=1))     # more pages than CASE has
    with pytest.raises(ValueError, match="plan: does not belong"):
        grouped_output(CASE, plan_groups(wide), "unfixed", emulate)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_bench_without_a_gpu_is_a_one_line_failure_not_bad_input(tmp_path, capsys):
    code, _, err = run_cli(["bench", "--json", str(tmp_path / "b.json")], capsys)
    assert code == 3 and err.strip().splitlines() == [
        "qsa-lab: failed: bench: no CUDA GPU visible; timings need one (committed H200 numbers: "
        "data/bench_h200.json)"]
    assert not list(tmp_path.iterdir())

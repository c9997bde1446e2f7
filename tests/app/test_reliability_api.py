"""Reliability II: the Python API, replays and the playground hold the CLI's contract: bad
input is a ValueError / TypeError naming the argument, nothing is silently wrong, and a saved
file is replayed only when it is what it says it is. Tiny geometries throughout."""
import dataclasses
import json
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from qsa_lab.analysis import fingerprints as analysis
from qsa_lab.analysis.cross_request import cross_request, leak_records, pivot_frame
from qsa_lab.app import case_file as io
from qsa_lab.model.case import Geometry, build_case
from qsa_lab.app.cli import main
from qsa_lab.model.plan import form_groups, pad_fix, plan_groups
from qsa_lab.model.poison import apply_poison
from qsa_lab.routes.run import NonFiniteQueryWarning, run_routes

GEOMETRY = Geometry(rows=8, context=64, topk=8, head_dim=16)
TINY = ["--rows", "8", "--context", "64", "--topk", "8", "--head-dim", "16", "--backend", "emulate"]
CASE = build_case(GEOMETRY)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def result():
    return run_routes(apply_poison(CASE, "targeted", dims=[3]), backend="emulate")


def _figure():
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2, 2))
    fig.add_subplot().plot([0, 1])
    return fig


def _case_with(**change):
    return dataclasses.replace(CASE, **change)


def _table_twice():            # logical pages 0 and 1 of request 0 on one physical page
    bt = CASE.block_table.clone()
    bt[0, 1] = bt[0, 0]
    return bt


def _canary(dims):
    from qsa_lab.canary import run_canary

    return run_canary(["qsa:xqa"], regions=["null-block"], payloads=["nan"], backend="emulate", dims=dims)


def _playground(**kw):
    from qsa_lab.analysis.playground import Params
    from qsa_lab.widgets import Playground

    return Playground(Params(**kw))


# (name, call, exception type, the argument the message must start with)
API_CASES = [
    ("fingerprint without a grouped route",
     lambda r: analysis.fingerprint(run_routes(CASE, routes=["xqa"], backend="emulate")), ValueError, "route"),
    ("fingerprint of an unknown route", lambda r: analysis.fingerprint(r, "grouped+magic"), ValueError, "route"),
    ("attribute without a grouped route",
     lambda r: analysis.attribute(run_routes(CASE, routes=["reference"], backend="emulate")), ValueError, "route"),
    ("attribute of an unknown route", lambda r: analysis.attribute(r, 3), ValueError, "route"),
    ("attribute of not a result", lambda r: analysis.attribute(r.outputs), TypeError, "result"),
    ("within_tolerance with an unknown dtype",
     lambda r: analysis.within_tolerance(r.outputs["xqa"], r.reference64, "int8"), ValueError, "kv_dtype"),
    ("within_tolerance of mismatched shapes",
     lambda r: analysis.within_tolerance(r.outputs["xqa"][:2], r.reference64, "e4m3"), ValueError, "ref"),
    ("max_abs_diff of mismatched shapes",
     lambda r: analysis.max_abs_diff(r.outputs["xqa"], r.outputs["xqa"][:, :1]), ValueError, "b"),
    ("max_abs_diff of a list", lambda r: analysis.max_abs_diff([1.0], r.outputs["xqa"]), TypeError, "a"),
    ("build_case on a TPU", lambda r: build_case(GEOMETRY, device="tpu"), ValueError, "device"),
    ("build_case on a device that is not a name", lambda r: build_case(GEOMETRY, device="warp9"), ValueError,
     "device"),
    ("apply_poison on a meta-device case", lambda r: apply_poison(CASE.to("meta"), "targeted"), ValueError,
     "device"),
    ("predict_nan with another case's plan",
     lambda r: analysis.predict_nan(CASE, plan_groups(build_case(GEOMETRY.replace(seed=1)))), ValueError, "plan"),
    ("predict_nan with an unknown variant",
     lambda r: analysis.predict_nan(CASE, plan_groups(CASE), "fastest"), ValueError, "variant"),
    ("a block table mapping two logical pages to one physical page",
     lambda r: run_routes(_case_with(block_table=_table_twice()), backend="emulate"), ValueError, "block_table"),
    ("a position beyond seq_len",
     lambda r: run_routes(_case_with(positions=CASE.positions + 5), backend="emulate"), ValueError, "positions"),
    ("v_scale=1e300 (XQA would overflow to Inf)",
     lambda r: run_routes(_case_with(v_scale=1e300), backend="emulate"), ValueError, "v_scale"),
    ("v_scale=1e5 (fp16 outputs would overflow)",
     lambda r: run_routes(_case_with(v_scale=1e5), backend="emulate"), ValueError, "v_scale"),
    ("k_scale=1e300", lambda r: run_routes(_case_with(k_scale=1e300), backend="emulate"), ValueError, "k_scale"),
    ("k_scale=1e-300 (0 in fp32)", lambda r: run_routes(_case_with(k_scale=1e-300), backend="emulate"), ValueError,
     "k_scale"),
    ("a route named twice", lambda r: run_routes(CASE, routes=["xqa", "xqa"], backend="emulate"), ValueError,
     "routes"),
    ("no route at all", lambda r: run_routes(CASE, routes=[], backend="emulate"), ValueError, "routes"),
    ("run_canary(dims='12')", lambda r: _canary("12"), TypeError, "dims"),
    ("run_canary(dims=[5.9])", lambda r: _canary([5.9]), TypeError, "dims"),
    ("run_canary(dims=[True])", lambda r: _canary([True]), TypeError, "dims"),
    ("export_figure(name='..')", lambda r: _export(".."), ValueError, "name"),
    ("export_figure(name='.hidden')", lambda r: _export(".hidden"), ValueError, "name"),
    ("Playground(Params(preset='bogus'))", lambda r: _playground(preset="bogus"), ValueError, "preset"),
    ("Playground(Params(site='x'))", lambda r: _playground(site="x"), ValueError, "site"),
    ("Playground(Params(backend='CUDA'))", lambda r: _playground(backend="CUDA"), ValueError, "backend"),
    ("form_groups(None)", lambda r: form_groups(None), TypeError, "case"),
    ("leak_records(None)", lambda r: leak_records(None), TypeError, "records"),
    ("pivot_frame(None, 2)", lambda r: pivot_frame(None, 2), TypeError, "records"),
    ("pivot_frame(q_heads=99): no record has it", lambda r: pivot_frame(_cross_records(), q_heads=99), ValueError,
     "q_heads"),
    ("cross_request(requests=[])", lambda r: cross_request(GEOMETRY, requests=[]), ValueError, "requests"),
    ("cross_request(requests=5)", lambda r: cross_request(GEOMETRY, requests=5), TypeError, "requests"),
    ("TransformersEngine('str')", lambda r: _transformers_engine("str"), TypeError, "model"),
    ("TransformersEngine(None)", lambda r: _transformers_engine(None), TypeError, "model"),
    ("TransformersEngine(model, workload=None)", lambda r: _transformers_engine(..., None), TypeError, "workload"),
]
if not torch.cuda.is_available():
    API_CASES.append(("build_case(device='cuda') without CUDA", lambda r: build_case(GEOMETRY, device="cuda"),
                      ValueError, "device"))

_EXPORT_DIR = {}


def _cross_records():
    return cross_request(GEOMETRY, payloads=("nan",), requests=[0], routes=("xqa",), backend="emulate")


def _transformers_engine(model, wl="chunked-prefill"):
    pytest.importorskip("transformers")
    from qsa_lab.scribble.engines.transformers import TransformersEngine
    from qsa_lab.scribble.models import tiny_model, workload

    return TransformersEngine(tiny_model() if model is ... else model, workload(wl) if isinstance(wl, str) else wl)


def _export(name):
    from qsa_lab.plotting.export import export_figure

    return export_figure(_figure(), name, out_dir=_EXPORT_DIR["dir"])


@pytest.mark.parametrize("name,call,kind,arg", API_CASES, ids=[c[0] for c in API_CASES])
def test_api_errors_name_the_argument(name, call, kind, arg, result, tmp_path):
    _EXPORT_DIR["dir"] = tmp_path
    with pytest.raises(kind) as e:
        call(result)
    msg = str(e.value)
    assert type(e.value) is kind or isinstance(e.value, kind)
    assert len(msg.splitlines()) == 1 and msg.startswith(f"{arg}:"), msg
    assert list(tmp_path.iterdir()) == []                   # nothing written, no hidden file either


def test_scales_inside_the_limits_are_accepted():
    g = CASE.geometry
    v_limit = 65504.0 / float(analysis.token_values(CASE.kv_cache, torch.arange(CASE.kv_cache.shape[0] * g.page_size),
                                                    1, g.kv_dtype).abs().max())
    run_routes(_case_with(v_scale=v_limit * 0.99), routes=["xqa"], backend="emulate")
    with pytest.raises(ValueError, match="^v_scale:"):
        run_routes(_case_with(v_scale=v_limit * 1.01), routes=["xqa"], backend="emulate")


# ---------------------------------------------------------------- a NaN or Inf in the query

@pytest.mark.parametrize("payload", ["nan", "inf"])
def test_a_non_finite_query_is_a_poison_site_and_its_divergence_shows(payload):
    g = Geometry(rows=19, context=256, topk=16, head_dim=32)
    case = apply_poison(build_case(g), "query", dims=[3, 7], payload=payload)
    assert case.poison["site"] == "query" and case.poison["plane"] == "q"
    assert case.poison["nonfinite_dims"] == [3, 7] and case.poison[f"{payload}_bytes"] == 19 * 6 * 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonFiniteQueryWarning)   # a deliberate poison: no warning
        r = run_routes(case, backend="emulate")
    everything = g.rows * g.q_heads * g.head_dim
    assert int(torch.isnan(r.outputs["xqa"]).sum()) == everything
    assert int(torch.isnan(r.reference64).sum()) == everything
    grouped_rows = r.plan.members.flatten()
    for route in ("grouped", "grouped+kernel_fix", "grouped+pad_fix", "grouped+masked_load"):
        out = r.outputs[route]
        # the grouped rows come back exactly 0 (every probability exp(-80), 0 in fp16); the remainder NaN
        assert torch.equal(out[grouped_rows], torch.zeros_like(out[grouped_rows])), route
        assert bool(torch.isnan(out[r.plan.xqa_rows]).all()), route
    for route, variant, plan in [("grouped", "unfixed", r.plan), ("grouped+kernel_fix", "kernel_fix", r.plan),
                                 ("grouped+pad_fix", "unfixed", pad_fix(r.plan))]:
        assert torch.equal(analysis.predict_nan(case, plan, variant), torch.isnan(r.outputs[route])), route
    doc = analysis.diff_json(r)
    assert doc["poison"]["site"] == "query" and doc["routes"]["grouped"]["nan_count"] == 3 * 6 * 32


def test_a_query_poison_on_top_of_page_0_keeps_the_null_block_nan_predicted():
    g = Geometry(rows=19, context=256, topk=16, head_dim=32)
    case = apply_poison(apply_poison(build_case(g), "targeted", dims=[1, 2]), "query", dims=[5])
    r = run_routes(case, backend="emulate")
    assert torch.equal(analysis.predict_nan(case, r.plan), torch.isnan(r.outputs["grouped"]))


def test_a_non_finite_query_no_poison_explains_is_warned():
    q = CASE.q.clone()
    q[2, 0, 5] = float("inf")
    with pytest.warns(NonFiniteQueryWarning, match=r"q: rows \[2\]"):
        run_routes(_case_with(q=q), routes=["xqa"], backend="emulate")


def test_diff_and_repro_show_the_query_divergence(capsys):
    assert main(["diff", *TINY, "--poison", "query", "--dims", "3", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["poison"]["site"] == "query"
    assert doc["routes"]["xqa"]["nan_count"] == 8 * 6 * 16 and doc["routes"]["grouped"]["nan_count"] == 0
    from qsa_lab.report.repro import REPRO_CASES, run_repro

    cases = [c for c in REPRO_CASES if c.poison.get("site") == "query"]
    table, _ = run_repro(backend="emulate", cases=cases, progress=False, repeat=False,
                         geometry_overrides=dict(context=256, topk=16, head_dim=32))
    row = table.iloc[0]
    assert row["nan[grouped]"] == 3 * 6 * 32 and row["grouped_finite_where_xqa_nan"] == 16 * 6 * 32


# ---------------------------------------------------------------- replays

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("saved") / "case.safetensors"
    assert main([*(["diff"] + TINY), "--poison", "targeted", "--dims", "3", "--save", str(path)]) == 0
    return path


def _edit(src: Path, dst: Path, meta: dict, resign: bool) -> Path:
    """src with metadata changed; re-signed (a deliberate forgery) or as an old file (no checksum, no origin)."""
    from safetensors import safe_open
    from safetensors.torch import save as save_bytes

    with safe_open(str(src), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        m = {**f.metadata(), **meta}
    m.pop("checksum", None)
    if not resign and "origin" not in meta:
        m.pop("origin", None)
    blob = save_bytes(tensors, metadata={k: v for k, v in m.items() if v is not None})
    dst.write_bytes(io.sign(blob) if resign else blob)
    return dst


def _load(path, capsys):
    code = main(["diff", "--load", str(path), "--backend", "emulate"])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("resign", [True, False], ids=["re-signed", "no checksum"])
@pytest.mark.parametrize("meta,needle", [
    (lambda m: {"geometry": json.dumps({**json.loads(m["geometry"]), "seed": 12345})}, "q, kv_cache"),
    (lambda m: {"poison": json.dumps({**json.loads(m["poison"]), "site": "x"})}, "'poison' site"),
    (lambda m: {"poison": json.dumps({**json.loads(m["poison"]), "dims": [4]})}, "kv_cache, poison differ"),
    (lambda m: {"poison": json.dumps({**json.loads(m["poison"]), "site": "random"})}, "differ"),
    (lambda m: {"origin": "handmade"}, "'origin'"),
], ids=["geometry seed", "poison site x", "poison dims", "poison site random", "origin"])
def test_load_checks_the_metadata_against_the_tensors(saved, meta, needle, resign, tmp_path, capsys):
    from safetensors import safe_open

    with safe_open(str(saved), framework="pt") as f:
        m = f.metadata()
    path = _edit(saved, tmp_path / "edited.safetensors", meta(m), resign)
    code, out, err = _load(path, capsys)
    assert code == 2 and "replay" not in out, (out, err)
    assert err.strip().splitlines()[-1].startswith("qsa-lab: error: --load: ") and needle in err, err


def test_a_damaged_checksum_or_metadata_key_is_refused(saved, tmp_path, capsys):
    blob = saved.read_bytes()
    for old, new in ((b'"checksum"', b'"checksuX"'), (b'"origin"', b'"originX"')):
        path = tmp_path / "damaged.safetensors"
        path.write_bytes(blob.replace(old, new, 1))
        code, out, err = _load(path, capsys)
        assert code == 2 and err.startswith("qsa-lab: error: --load: ") and "damaged" in err, err
    path = _edit(saved, tmp_path / "half.safetensors", {"origin": "geometry"}, resign=False)  # origin, no checksum
    code, out, err = _load(path, capsys)
    assert code == 2 and "'checksum' is missing" in err, err


def test_a_file_without_checksum_is_said_so_and_still_replays(saved, tmp_path, capsys):
    path = _edit(saved, tmp_path / "old.safetensors", {}, resign=False)
    code, out, err = _load(path, capsys)
    assert code == 0 and "bit-identical" in out
    assert err.strip().splitlines() == [err.strip()] and "no checksum" in err


def test_a_custom_case_replays_when_saved_as_custom(tmp_path, capsys):
    from qsa_lab.model.case import relocate_pages

    r = run_routes(apply_poison(relocate_pages(CASE), "targeted", dims=[2]), backend="emulate")
    path = io.save(r, tmp_path / "mine.safetensors")          # origin found by rebuilding: custom
    code, out, _ = _load(path, capsys)
    assert code == 0 and "bit-identical" in out


def test_a_torn_file_is_refused_never_reported_as_a_differing_replay(tmp_path, capsys):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    main(["diff", *TINY, "--poison", "random", "--save", str(a)])
    main(["diff", *TINY, "--poison", "random", "--poison-seed", "1", "--save", str(b)])
    blob_a, blob_b = a.read_bytes(), b.read_bytes()
    for cut in (len(blob_a) // 3, len(blob_a) // 2, len(blob_a) - 64):   # what a reader sees mid-rewrite
        torn = tmp_path / "torn.safetensors"
        torn.write_bytes(blob_b[:cut] + blob_a[cut:])
        code, _, err = _load(torn, capsys)
        assert code == 2 and ("checksum mismatch" in err or "--load: " in err), err


def test_a_file_rewritten_under_a_running_load_is_refused_or_replayed_never_differs(tmp_path, capsys):
    """A writer thread rewrites the file in place, in small chunks, for as long as each --load runs
    (in this process, as a second program would: the reads release the GIL): every load either read
    one whole version (exit 0) or is refused (exit 2); none reports exit 1, none raises."""
    g = ["--rows", "8", "--context", "4096", "--topk", "8", "--head-dim", "256", "--backend", "emulate"]
    a, b, target = (tmp_path / n for n in ("a.safetensors", "b.safetensors", "target.safetensors"))
    assert main(["diff", *g, "--poison", "random", "--save", str(a)]) == 0
    assert main(["diff", *g, "--poison", "random", "--poison-seed", "1", "--save", str(b)]) == 0
    versions = [a.read_bytes(), b.read_bytes()]
    target.write_bytes(versions[0])
    stop = threading.Event()

    def writer():
        i = 0
        while not stop.is_set():
            blob = versions[i % 2]
            with open(target, "r+b") as f:          # in place, as an editor or a second save would
                for k in range(0, len(blob), 1 << 16):
                    f.write(blob[k:k + (1 << 16)])
                    f.flush()
                    time.sleep(0.001)               # mid-rewrite nearly always, without taking a core
                f.truncate()
            i += 1

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    codes = []
    try:
        capsys.readouterr()
        for _ in range(6):
            code, out, err = _load(target, capsys)
            codes.append(code)
            assert code in (0, 2), out + err
            assert "DIFFERS" not in out and "Traceback" not in err
            if code == 2:
                assert err.strip().startswith("qsa-lab: error: --load: "), err
    finally:
        stop.set()
        t.join(30)


# ---------------------------------------------------------------- notebooks' backend

@pytest.mark.parametrize("value", ["bogus", "", "CUDA"] + ([] if torch.cuda.is_available() else ["cuda"]))
def test_notebook_backend_falls_back_to_the_emulation_in_one_line(value, capsys):
    from qsa_lab.analysis.notebook import notebook_backend

    assert notebook_backend(value) == "emulate"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("QSA_LAB_BACKEND: ") and err[0].endswith("using the emulation")


def test_notebook_03_runs_on_the_emulation_with_a_bad_backend(tmp_path):
    """Notebook 03's code, run as a script once per bad QSA_LAB_BACKEND value: one line each, the
    playground on the emulation, no traceback."""
    values = ["bogus", "", "CUDA"] + ([] if torch.cuda.is_available() else ["cuda"])
    script = (
        "import json, os, sys\n"
        f"sys.path.insert(0, {str(REPO / 'scripts')!r})\n"
        "from run_notebook_code import code_of\n"
        f"code = code_of({str(REPO / 'notebooks' / '03_poison_playground.ipynb')!r})\n"
        f"for v in {values!r}:\n"
        "    os.environ['QSA_LAB_BACKEND'] = v\n"
        "    ns = {'__name__': '__notebook__'}\n"
        "    exec(compile(code, 'nb03', 'exec'), ns)\n"
        "    print('RESULT', json.dumps(ns['key_results']['backend']), flush=True)\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env={**__import__("os").environ, "QSA_LAB_SMALL": "1", "MPLBACKEND": "Agg",
                            "QSA_LAB_FIGURES": str(tmp_path / "figures")})
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("QSA_LAB_BACKEND")]
    assert len(lines) == len(values) and all(ln.endswith("using the emulation") for ln in lines), p.stderr
    assert [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")] == ['RESULT "emulate"'] * len(values)


def test_a_loaded_case_whose_q_holds_nan_is_warned_in_one_line(tmp_path, capsys):
    q = CASE.q.clone()
    q[1, 2, 3] = float("nan")
    with pytest.warns(NonFiniteQueryWarning):
        r = run_routes(_case_with(q=q), backend="emulate")
    path = io.save(r, tmp_path / "nan_q.safetensors")       # not what its geometry builds: origin custom
    code, out, err = _load(path, capsys)
    assert code == 0 and "bit-identical" in out
    assert err.strip().splitlines() == [err.strip()] and err.startswith("qsa-lab: warning: q: rows [1]"), err

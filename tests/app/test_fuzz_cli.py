"""Fuzz the CLI: hostile arguments and corrupted saved files. Whatever comes in, the command
exits 0 (or 1 for a replay whose saved outputs were altered) or 2 with exactly one error line,
never a traceback, within a bounded time, and writes nothing when it fails."""
import contextlib
import io as _io
import os
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qsa_lab.app import case_file as io
from qsa_lab.model.case import Geometry, build_case
from qsa_lab.app.cli import main
from qsa_lab.model.poison import apply_poison
from qsa_lab.routes.run import run_routes

TIME_LIMIT_S = 20  # a tiny case runs in ~1 s on a busy 2-core machine; a refusal in milliseconds
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def run(argv):
    out, err = _io.StringIO(), _io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue(), time.perf_counter() - t0


def check(code, err, seconds, allowed=(0, 2)):
    assert code in allowed, err
    assert "Traceback" not in err and seconds < TIME_LIMIT_S
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("qsa-lab: error: "), err
        arg = lines[0][len("qsa-lab: error: "):].split(":")[0]
        assert arg, lines[0]   # names an argument


# small valid values keep every accepted case tiny; the rest are hostile
def ints(valid):
    return st.one_of(st.sampled_from(valid), st.integers(-3, 3), st.sampled_from([2 ** 31, 2 ** 63, 10 ** 30]))


TEXT = st.one_of(st.sampled_from(["", " ", "-1", "1e3", "0x10", "nan", "1_0", "\u0663", "a\nb", "--rows", "1,2,,",
                                  "99999999999999999999999", "☃"]), st.text(max_size=8))
OPTIONS = {
    "--rows": ints(["8", "9", "16"]), "--requests": ints(["1", "2"]), "--context": ints(["64", "70", "128"]),
    "--topk": ints(["8", "16"]), "--page-size": ints(["16", "32", "12"]), "--q-heads": ints(["1", "6", "8"]),
    "--head-dim": ints(["16", "32"]), "--seed": ints(["0", "5"]), "--poison-seed": ints(["0", "7"]),
    "--layout": st.sampled_from(["contiguous", "scatter", "spiral"]),
    "--kv-dtype": st.sampled_from(["e4m3", "e5m2", "fp16", "int4"]),
    "--group-rows": st.sampled_from(["consecutive", "request", "x"]),
    "--poison": st.sampled_from(["none", "zeros", "targeted", "random", "fp16-state", "stale-tail", "all"]),
    "--dims": st.sampled_from(["1,2", "15", "16", "-1", "a", "1,,2", ""]),
    "--plane": st.sampled_from(["v", "k", "kv", "q"]), "--max-memory": st.sampled_from(["1K", "2G", "x", "0"]),
    "--backend": st.sampled_from(["emulate", "emulate", "tpu"]),
}
BASE = {"--rows": "8", "--context": "64", "--topk": "8", "--head-dim": "16", "--backend": "emulate"}


@st.composite
def argvs(draw):
    opts = dict(BASE)
    for name in draw(st.lists(st.sampled_from(sorted(OPTIONS)), max_size=4, unique=True)):
        opts[name] = str(draw(st.one_of(OPTIONS[name].map(str), TEXT)))
    argv = ["diff"]
    for k, v in opts.items():
        argv += [k, v]
    if draw(st.booleans()):
        argv.insert(1, draw(st.sampled_from(["decode", "causal3", "bogus", "--frobnicate", "--debug"])))
    return argv


@SETTINGS
@given(argv=argvs(), out_kind=st.sampled_from(["none", "new", "existing", "folder", "slash", "missing-parent"]))
def test_fuzzed_arguments(argv, out_kind):
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        (d / "mine.json").write_text("mine")
        target = {"none": None, "new": d / "new.json", "existing": d / "mine.json", "folder": d,
                  "slash": f"{d}/x/", "missing-parent": d / "no" / "x.json"}[out_kind]
        if target is not None:
            argv = argv + ["--json", str(target)]
        before = sorted(os.listdir(d))
        code, err, seconds = run(argv)
        check(code, err, seconds)
        assert (d / "mine.json").read_text() == "mine"
        if code != 0:
            assert sorted(os.listdir(d)) == before      # nothing written on failure


@pytest.fixture(scope="module")
def saved_bytes(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "case.safetensors"
    case = apply_poison(build_case(Geometry(rows=8, context=64, topk=8, head_dim=16)), "targeted", dims=[3])
    io.save(run_routes(case, backend="emulate"), path)
    return path.read_bytes()


@SETTINGS
@given(data=st.data())
def test_fuzzed_saved_files(saved_bytes, data):
    blob = bytearray(saved_bytes)
    header_end = 8 + int.from_bytes(blob[:8], "little")
    kind = data.draw(st.sampled_from(["truncate", "header", "length", "data"]))
    if kind == "truncate":
        blob = blob[:data.draw(st.integers(0, len(blob) - 1))]
    elif kind == "header":      # flip bytes of the JSON header: names, dtypes, shapes, offsets, metadata
        for _ in range(data.draw(st.integers(1, 4))):
            blob[data.draw(st.integers(8, header_end - 1))] = data.draw(st.integers(0, 255))
    elif kind == "length":
        blob[:8] = data.draw(st.integers(0, 2 ** 64 - 1)).to_bytes(8, "little")
    else:                       # tensor bytes: a valid file whose replay may differ (exit 1)
        for _ in range(data.draw(st.integers(1, 4))):
            blob[data.draw(st.integers(header_end, len(blob) - 1))] = data.draw(st.integers(0, 255))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "case.safetensors"
        path.write_bytes(bytes(blob))
        code, err, seconds = run(["diff", "--load", str(path), "--backend", "emulate"])
        check(code, err, seconds, allowed=(0, 1, 2) if kind == "data" else (0, 2))
        if code == 2:
            assert "--load: " in err

"""The canary's call from elsewhere (a `diff --save` file, an engine's own dump), the qsa routes at
the report's geometry, MLA, the backend choice, and Ctrl-C."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import canary_kernels as K
from qsa_lab.canary import canary_case, load_case, run_canary
from qsa_lab.app.cli import main

HERE = Path(__file__).resolve().parents[1]   # tests/: canary_kernels.py


def cli(capsys, *argv):
    rc = main(["canary", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_a_diff_save_file_is_a_case(capsys, tmp_path):
    saved = tmp_path / "case.safetensors"
    assert main(["diff", "--rows", "10", "--requests", "3", "--context", "33", "--topk", "16", "--page-size", "16",
                 "--q-heads", "2", "--head-dim", "16", "--kv-dtype", "fp16", "--backend", "emulate",
                 "--save", str(saved)]) == 0
    capsys.readouterr()
    rc, out, _ = cli(capsys, "--case", str(saved), "--kernels", "qsa:grouped,qsa:grouped+kernel_fix",
                     "--regions", "null-block,stale-tail", "--payloads", "nan", "--backend", "emulate", "--json", "-")
    doc = json.loads(out)
    got = {(r["kernel"], r["region"], r["plane"]): r["verdict"] for r in doc["results"]}
    assert rc == 1 and doc["geometry"]["source"] == str(saved)
    assert got[("qsa:grouped", "null-block", "v")] == got[("qsa:grouped", "stale-tail", "v")] == "nan-leak"
    assert {v for (k, _, _), v in got.items() if k == "qsa:grouped+kernel_fix"} == {"clean"}


def _dump(case, path, four_d=False):
    kv = case.kv_cache[:, :, :, 0] if four_d else case.kv_cache
    tensors = {"q": case.q, "kv_cache": kv, "block_table": case.block_table, "seq_lens": case.seq_lens,
               "query_lens": case.query_lens()}
    if path.suffix == ".pt":
        torch.save(tensors, path)
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


@pytest.mark.parametrize("name", ["dump.pt", "dump.safetensors"])
def test_an_engines_own_dump_is_a_case(capsys, tmp_path, name):
    case = canary_case(q_heads=8, kv_heads=2, head_dim=128, query_len=2, context=40)
    path = _dump(case, tmp_path / name)
    loaded = load_case(path)
    assert str(loaded.spec) == "dense" and loaded.kv_heads == 2 and loaded.geometry is None
    assert torch.equal(loaded.positions, case.positions) and torch.equal(loaded.kv_cache, case.kv_cache)
    rc, out, _ = cli(capsys, "--case", str(path), "--kernel", "canary_kernels:zero_times_v", "--kernel",
                     "canary_kernels:reference", "--payloads", "nan", "--backend", "emulate", "--json", "-")
    doc = json.loads(out)
    got = {(r["kernel"].split(":")[1], r["region"], r["plane"]): r["verdict"] for r in doc["results"]}
    assert rc == 1 and doc["attend"] == "dense" and doc["regions"]["free-pages"] == 2 * 16
    assert got[("zero_times_v", "stale-tail", "v")] == "nan-leak"
    assert got[("zero_times_v", "stale-tail", "k")] == "clean"
    # three pages for every request: no padding entry, so no input references the null block either
    assert {r for (k, r, _), v in got.items() if k == "reference" and v == "n/a"} == {"null-block", "free-pages"}
    assert {v for (k, r, _), v in got.items() if k == "reference" and r.startswith("stale")} == {"clean"}


def test_a_dump_with_one_kv_head_may_drop_the_head_dim(tmp_path):
    case = canary_case()
    loaded = load_case(_dump(case, tmp_path / "d.pt", four_d=True), attend="window:8")
    assert tuple(loaded.kv_cache.shape[3:]) == (1, 16) and str(loaded.spec) == "window:8"


def test_a_bad_dump_names_what_is_wrong(capsys, tmp_path):
    torch.save({"q": torch.zeros(2, 2, 16, dtype=torch.float16)}, tmp_path / "bad.pt")
    rc, _, err = cli(capsys, "--case", str(tmp_path / "bad.pt"), "--kernels", "torch:sdpa-math")
    assert rc == 2 and err.startswith("qsa-lab: error: --case: ") and "lacks tensor(s)" in err
    (tmp_path / "junk.safetensors").write_bytes(b"not a file of tensors")
    rc, _, err = cli(capsys, "--case", str(tmp_path / "junk.safetensors"), "--kernels", "torch:sdpa-math")
    assert rc == 2 and "is not a safetensors file" in err


REPORT = ["--rows", "19", "--requests", "1", "--context", "8192", "--topk", "512", "--page-size", "32",
          "--q-heads", "6", "--head-dim", "256", "--kv-dtype", "e4m3"]


def test_the_qsa_routes_keep_their_verdicts_at_the_reports_geometry(capsys):
    rc, out, _ = cli(capsys, *REPORT, "--kernels", "qsa:grouped,qsa:grouped+kernel_fix", "--regions", "null-block",
                     "--payloads", "nan", "--planes", "v", "--backend", "emulate", "--json", "-")
    doc = json.loads(out)
    got = {r["kernel"]: r for r in doc["results"]}
    assert rc == 1 and doc["geometry"]["context"] == 8192 and doc["geometry"]["head_dim"] == 256
    assert got["qsa:grouped"]["verdict"] == "nan-leak" and got["qsa:grouped+kernel_fix"]["verdict"] == "clean"
    assert got["qsa:grouped"]["rows"] == list(range(16))              # the grouped rows; 16..18 go to XQA


def test_mla_latent_read_as_k_and_v():
    case = canary_case(mla=True, head_dim=576, v_head_dim=512, q_heads=4, free_pages=0)

    def mla_reference(call):
        keep = call.attend_mask()
        drop = ~keep.view(*keep.shape, 1, 1)
        k = call.pages("k", heads="q").float().masked_fill(drop, 0.0)
        v = call.pages("v", heads="q").float().masked_fill(drop, 0.0)
        return K._attention(call, keep, k, v).to(torch.float16)

    def mla_zero_times_v(call):
        keep = call.attend_mask()
        k = call.pages("k", heads="q").float().masked_fill(~keep.view(*keep.shape, 1, 1), 0.0)
        return K._attention(call, keep, k, call.pages("v", heads="q").float()).to(torch.float16)

    rep = run_canary({"ref": mla_reference, "leaky": mla_zero_times_v}, regions=["stale-tail"], payloads=["nan"],
                     backend="emulate", case=case, dims=[600 - 100])
    assert rep.find("ref", "stale-tail", "k", "nan").verdict == "clean"
    assert rep.find("ref", "stale-tail", "v", "nan").verdict == "clean"
    leak = rep.find("leaky", "stale-tail", "v", "nan")
    assert leak.verdict == "nan-leak" and leak.where()["dims"] == [500]   # V is the latent's first 512 dims
    assert rep.find("leaky", "stale-tail", "k", "nan").verdict == "nan-leak"   # the same bytes, read as V too
    assert tuple(rep.results[0].output.shape) == (case.rows, 4, 512)


def test_user_and_torch_kernels_never_touch_qsa_labs_extension(monkeypatch):
    from qsa_lab.routes import compiled as kernels

    def refuse(*a, **k):
        raise AssertionError("the compiled extension was consulted")

    monkeypatch.setattr(kernels, "available", refuse)
    monkeypatch.setattr(kernels, "load", refuse)
    rep = run_canary(["torch:sdpa-math", K.reference], regions=["null-block"], payloads=["nan"], backend="auto")
    assert rep.backend is None and rep.checks("torch:sdpa-math") == 2


def _default_sigint():
    # a runner started in the background (nohup, `cmd &` without job control) passes SIGINT on
    # ignored; a terminal's Ctrl-C reaches a process that has it at its default
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _spawn(*argv):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=HERE, preexec_fn=_default_sigint)


def _interrupt_when_hanging(p):
    for line in p.stderr:
        if "hanging" in line:
            break
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    return p.returncode, out, err


def test_ctrl_c_stops_a_run_held_by_a_hung_user_kernel():
    p = _spawn("-m", "qsa_lab", "canary", "--kernel", "canary_kernels:hangs", "--regions", "null-block",
               "--payloads", "nan", "--backend", "emulate")
    rc, _, err = _interrupt_when_hanging(p)
    assert rc == 130 and "qsa-lab: interrupted" in err


def test_ctrl_c_stops_a_python_run_held_by_a_hung_callable():
    p = _spawn("-c", "import canary_kernels as K\nfrom qsa_lab.canary import run_canary\n"
                     "run_canary([K.hangs], regions=['null-block'], payloads=['nan'], backend='emulate')\n"
                     "print('finished')")
    rc, out, err = _interrupt_when_hanging(p)
    assert rc != 0 and "KeyboardInterrupt" in err and "finished" not in out

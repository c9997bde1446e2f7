"""The canary at the geometries real models use (issue 40): query heads up to 128 and beyond, GQA
ratios up to 16, head dims 64-256, MLA's 576 / 512, with the ranges in `canary --help`; the qsa:
kernels keep their own limits and say so per kernel (skipped, never a crash); memory is the limit
through the budget (--max-memory), which says so before anything is allocated."""
import pytest
import torch

import canary_kernels as ck
from qsa_lab.app.cli import main
from qsa_lab.canary import run_canary
from qsa_lab.canary.case import canary_case
from qsa_lab.model.memory import MemoryBudgetError

REAL = [dict(q_heads=32, kv_heads=8, head_dim=128),       # Llama-3 8B
        dict(q_heads=64, kv_heads=8, head_dim=128),       # Llama-3 70B
        dict(q_heads=128, kv_heads=8, head_dim=128),      # Llama-3 405B: GQA 16
        dict(q_heads=16, kv_heads=1, head_dim=256),       # Gemma-style MQA, head dim 256
        dict(q_heads=32, kv_heads=32, head_dim=64)]       # MHA, head dim 64


def run_cli(argv, capsys):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("geometry", REAL, ids=lambda g: "{q_heads}q{kv_heads}kv{head_dim}d".format(**g))
def test_real_geometries_build_and_judge(geometry):
    rep = run_canary({"ref": ck.reference, "zero_times_v": ck.zero_times_v}, regions=["stale-tail"],
                     payloads=["nan"], planes=["v"], attend="dense", backend="emulate", **geometry)
    c = rep.case
    assert (c.q_heads, c.kv_heads, c.head_dim) == (geometry["q_heads"], geometry["kv_heads"], geometry["head_dim"])
    assert tuple(c.kv_cache.shape[3:]) == (geometry["kv_heads"], geometry["head_dim"])
    assert rep.find("ref", "stale-tail", "v", "nan").verdict == "clean"
    leak = rep.find("zero_times_v", "stale-tail", "v", "nan")
    assert leak.verdict == "nan-leak" and leak.where()["heads"] == list(range(geometry["q_heads"]))


def test_mla_at_deepseek_v3_heads():
    case = canary_case(mla=True, head_dim=576, v_head_dim=512, q_heads=128, attend="dense", free_pages=0)
    assert tuple(case.q.shape[1:]) == (128, 576) and case.out_dim == 512
    rep = run_canary({"zero_times_v": ck.zero_times_v}, case=case, regions=["stale-tail"], payloads=["nan"],
                     planes=["v"], backend="emulate")
    r = rep.results[0]
    assert r.verdict == "nan-leak" and max(r.where()["dims"]) < 512


def test_more_query_heads_than_the_qsa_routes_take_skips_them_saying_why(capsys):
    code, out, err = run_cli(["canary", "--kernels", "qsa:grouped,torch:sdpa-math", "--attend", "dense",
                              "--q-heads", "32", "--kv-heads", "8", "--head-dim", "128", "--payloads", "nan",
                              "--planes", "v", "--regions", "null-block", "--backend", "emulate"], capsys)
    assert code == 3           # a requested kernel that could not run fails the run, it never passes
    assert "skipped qsa:grouped: the qsa routes take 1..16 query heads; this case has 32" in out
    assert err.strip() == ("qsa-lab: canary: qsa:grouped: no leak check ran (skipped: the qsa routes take 1..16 "
                           "query heads; this case has 32 (--q-heads))")
    assert "torch:sdpa-math" in out and "N" in out.split("torch:sdpa-math")[1].splitlines()[0]


def test_the_readme_command_runs(tmp_path, monkeypatch, capsys):
    kernel = tmp_path / "mykernels.py"
    kernel.write_text("import canary_kernels\n\ndef paged_decode(call):\n    return canary_kernels.reference(call)\n")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["canary", "--kernel", "mykernels.py:paged_decode", "--attend", "dense",
                              "--q-heads", "32", "--kv-heads", "8", "--head-dim", "128"], capsys)
    assert code == 0, out + err
    assert "Hq 32, Hkv 8, D 128" in out and "0 leaking of 24 checks (30 cells)" in out


def test_help_states_the_ranges_and_an_error_repeats_them(capsys):
    code, out, _ = run_cli(["canary", "--help"], capsys)
    text = " ".join(out.split())
    assert code == 0
    assert "query heads (default 2; 1..256" in text and "the qsa: kernels take 1..16" in text
    assert "(default 1; 1..256)" in text and "head dimension, a multiple of 16 (default 16; 16..1024" in text
    assert "--max-memory SIZE" in text
    for argv, line in ((["--q-heads", "512"], "--q-heads: must be in 1..256, got 512"),
                       (["--q-heads", "32", "--kv-heads", "5"], "--kv-heads: must divide q_heads (32), got 5"),
                       (["--head-dim", "100"], "--head-dim: must be a multiple of 16")):
        code, _, err = run_cli(["canary", *argv], capsys)
        assert code == 2 and err.startswith(f"qsa-lab: error: {line}") and len(err.splitlines()) == 1, err


def test_memory_is_refused_by_the_budget_before_anything_is_allocated(capsys):
    with pytest.raises(MemoryBudgetError, match=r"^free_pages: the canary's case needs an estimated .* TiB, above "
                                                r"the memory budget of .*raise the budget \(max_memory"):
        canary_case(free_pages=10 ** 9)
    code, _, err = run_cli(["canary", "--free-pages", str(10 ** 9)], capsys)
    assert code == 2 and err.startswith("qsa-lab: error: --free-pages: the canary's case needs an estimated")
    assert "--max-memory" in err and len(err.splitlines()) == 1
    with pytest.raises(MemoryBudgetError, match="^max_memory: "):
        canary_case(max_memory="1M")


def test_a_kernel_past_the_budget_is_skipped_saying_so_and_a_run_that_checked_nothing_fails(capsys):
    rep = run_canary(["torch:sdpa-math"], attend="dense", q_heads=32, kv_heads=8, head_dim=128, regions=["null-block"],
                     payloads=["nan"], planes=["v"], backend="emulate", max_memory="300M")
    (why,) = [s["reason"] for s in rep.skipped if s.get("kernel") == "torch:sdpa-math"]
    assert why.startswith("torch:sdpa-math (K and V of each row's pages for every query head) needs an estimated")
    assert "above the memory budget of 300.0 MiB" in why and rep.exit_code() == 3
    # the default kernels, none requested by name: every one skipped is still no pass
    code, out, err = run_cli(["canary", "--attend", "dense", "--q-heads", "32", "--kv-heads", "8", "--head-dim", "128",
                              "--max-memory", "300M", "--regions", "null-block", "--payloads", "nan", "--planes", "v",
                              "--backend", "emulate"], capsys)
    assert code == 3 and "no leak check ran" in err, out + err


@pytest.mark.parametrize("value,kind", [(float("nan"), ValueError), (-1, ValueError), (0, ValueError),
                                        (True, TypeError), ("lots", ValueError), ([1], TypeError)])
def test_a_bad_budget_names_max_memory(value, kind):
    from qsa_lab.model.case import build_case

    for make in (lambda: build_case(max_memory=value), lambda: canary_case(max_memory=value)):
        with pytest.raises(kind, match="^max_memory: "):
            make()
    with pytest.raises(MemoryBudgetError):
        build_case(max_memory="1M")            # text is a size, as on the command line
    assert torch.is_tensor(build_case(rows=8, context=64, topk=8, head_dim=16, max_memory="4G").q)

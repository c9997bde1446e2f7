"""The canary on a CUDA GPU: the measured facts for SDPA's fused backends and compiled
FlexAttention (one NaN / Inf dim in an unattended slot of the null block). Skips without CUDA."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DIM = 5
ALL_DIMS = list(range(16))


@pytest.fixture(scope="module")
def report():
    from qsa_lab.canary import run_canary

    return run_canary(["torch:sdpa-math", "torch:sdpa-efficient", "torch:sdpa-cudnn", "torch:sdpa-cut", "torch:flex",
                       "qsa:grouped", "qsa:grouped+kernel_fix"], regions=["null-block"], payloads=["nan", "inf"],
                      backend="auto", dims=[DIM])


def _ran(report, kernel):
    why = [s["reason"] for s in report.skipped if s.get("kernel") == kernel]
    if why:
        pytest.skip(f"{kernel}: {why[0]}")


@pytest.mark.parametrize("kernel", ["torch:sdpa-math", "torch:sdpa-efficient", "torch:sdpa-cudnn"])
def test_sdpa_with_a_boolean_mask_leaks_k_over_the_row_and_v_on_its_dim(report, kernel):
    _ran(report, kernel)
    k = report.find(kernel, "null-block", "k", "nan")
    assert k.verdict == "nan-leak" and k.where()["dims"] == ALL_DIMS
    for payload in ("nan", "inf"):
        v = report.find(kernel, "null-block", "v", payload)
        assert v.verdict == "nan-leak" and v.where()["dims"] == [DIM]


def test_compiled_flex_is_clean_for_k_and_leaks_v(report):
    _ran(report, "torch:flex")
    assert report.find("torch:flex", "null-block", "k", "nan").verdict == "clean"
    v = report.find("torch:flex", "null-block", "v", "nan")
    assert v.verdict == "nan-leak" and v.where()["dims"] == [DIM]


def test_keys_cut_at_the_valid_length_are_clean(report):
    _ran(report, "torch:sdpa-cut")
    assert {r.verdict for r in report.results if r.kernel == "torch:sdpa-cut"} == {"clean"}


def test_grouped_leaks_and_the_kernel_fix_is_clean(report):
    _ran(report, "qsa:grouped")
    assert report.find("qsa:grouped", "null-block", "v", "nan").verdict == "nan-leak"
    assert {r.verdict for r in report.results if r.kernel == "qsa:grouped+kernel_fix"} == {"clean"}


def test_flex_in_the_second_process_gives_the_same_report_on_the_gpu(monkeypatch):
    """`qsa-lab canary` on a GPU runs FlexAttention's compiled kernels in a second process (overlap)
    beside the others: the report is the one this process gives alone, bit for bit."""
    from qsa_lab.canary import overlap, run_canary
    from qsa_lab.canary.execution import same_bits

    kernels = ["qsa:grouped", "torch:flex", "torch:sdpa-math", "torch:flex-paged"]
    matrix = dict(regions=["null-block", "free-pages", "stale-tail"], backend="cuda")
    alone = run_canary(kernels, **matrix)
    taken, take = [], overlap.take
    monkeypatch.setattr("qsa_lab.canary.runner.take_overlap", lambda *a: taken.append(take(*a)) or taken[-1])
    beside = run_canary(kernels, **matrix, second=overlap.start())
    assert taken[0].answered and taken[0].names == ["torch:flex", "torch:flex-paged"]
    assert [r.to_dict() for r in beside.results] == [r.to_dict() for r in alone.results]
    assert beside.skipped == alone.skipped
    for x, y in zip(beside.results, alone.results):
        assert (x.output is None) == (y.output is None)
        if x.output is not None:
            assert same_bits(x.output, y.output), f"{x.kernel} {x.region}/{x.plane}/{x.payload}"
    assert {r.verdict for r in beside.results if r.kernel == "torch:flex"} >= {"nan-leak", "clean"}

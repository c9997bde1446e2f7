"""The bench JSON's per-tile summary (no GPU needed): kernel_fix (A) beside the report's V100 figure
and the performance targets, computed from a bench point's numbers."""
import pytest

from qsa_lab.routes.compiled import BARRIERS_PER_TILE, VARIANTS
from qsa_lab.routes.bench import KERNEL_OF, REPORT_KERNEL_FIX_MS, kernel_fix_vs_report, targets


def point(rows, context, unfixed_ms, xqa_ms, tiles=100, kernel_fix=1.2, masked_load=1.02):
    ms = {"unfixed": unfixed_ms, "kernel_fix": unfixed_ms * kernel_fix, "masked_load": unfixed_ms * masked_load,
          "xqa": xqa_ms}
    grouped = [v for v in ms if v in KERNEL_OF]
    return {"geometry": {"rows": rows, "context": context}, "ms": ms, "tiles_per_group_mean": tiles,
            "ratio_to_unfixed": {v: t / unfixed_ms for v, t in ms.items()},
            "us_per_tile": {v: ms[v] * 1e3 / tiles for v in grouped},
            "barriers_per_tile": {v: BARRIERS_PER_TILE[KERNEL_OF[v]] for v in grouped}}


def test_every_kernel_variant_has_a_barrier_count():
    assert set(BARRIERS_PER_TILE) == set(VARIANTS)
    assert set(KERNEL_OF.values()) <= set(VARIANTS)


def test_kernel_fix_beside_the_report():
    rep = point(16, 8192, unfixed_ms=0.3, xqa_ms=0.2, tiles=150, kernel_fix=1.25)
    out = kernel_fix_vs_report(rep, "Some GPU")
    assert out["report_v100_ratio"] == round(REPORT_KERNEL_FIX_MS[1] / REPORT_KERNEL_FIX_MS[0], 4) == 1.246
    assert abs(out["here_ratio"] - 1.25) < 1e-12
    assert abs(out["here_us_per_tile"]["kernel_fix_minus_unfixed"] - 0.5) < 1e-9  # 0.075 ms / 150 tiles
    assert out["here_barriers_per_tile"] == {"unfixed": 5, "kernel_fix": 7}
    assert "150 tiles per group" in out["differs"] and out["here_gpu"] == "Some GPU"


def test_targets_pass_and_fail():
    rep = point(16, 8192, unfixed_ms=0.19, xqa_ms=0.2, tiles=100, masked_load=1.02)   # 1.9 us per tile
    sweep = [point(64, 8192, 0.19, 0.2), point(64, 32768, 0.25, 0.2), point(256, 8192, 0.3, 0.5)]
    t = targets(rep, sweep)
    assert t["unfixed_us_per_tile_le_2"] and t["masked_load_ratio_le_1.03"]
    assert t["grouped_le_xqa_rows_64"] == {"8192": True, "32768": False}
    assert t["grouped_le_xqa_rows_256"] == {"8192": True}
    slow = targets(point(16, 8192, 0.21, 0.2, tiles=100, masked_load=1.05), sweep)
    assert not slow["unfixed_us_per_tile_le_2"] and not slow["masked_load_ratio_le_1.03"]


@pytest.mark.gpu
def test_a_captured_graph_keeps_alive_what_it_reads():
    """A replay after the captured function's own tensors went out of scope and their memory was
    handed out again still reads the captured inputs (the graph holds the function)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from qsa_lab.routes.bench import capture_graph

    out = torch.zeros(4096, device="cuda")

    def make():
        x = torch.full((4096,), 3.0, device="cuda")
        return lambda: out.copy_(x * 2)

    graph = capture_graph(make())
    junk = [torch.full((4096,), 7.0, device="cuda") for _ in range(16)]   # would take a freed x's block
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(out, 6.0)), out[:4]
    del junk

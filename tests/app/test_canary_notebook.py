"""Notebook 06 runs headless on the CPU (emulation) and finds what the canary claims."""
import pytest

pytest.importorskip("nbclient")
from test_notebooks import NB_DIR, run_notebook  # noqa: E402


def test_06_canary_headless(tmp_path, tmp_path_factory):
    run = run_notebook(NB_DIR / "06_canary_any_kernel.ipynb", tmp_path, tmp_path_factory)
    r = run["results"]
    assert r["backend"] == "emulate"
    assert r["grouped_null_v_nan"] == "nan-leak" and r["sdpa_math_null_k_nan"] == "nan-leak"
    assert r["kernel_fix_verdicts"] == ["clean", "n/a", "nan-leak"]   # n/a: the free pages, which no input references
    assert r["kernel_fix_leak_regions"] == ["other-requests"]      # mixed-request groups: the fix covers no request's own bytes
    assert "nan-leak" in r["dense_told_sparse"] and r["dense_told_dense"] == ["clean", "n/a"]
    assert r["leak_maps"] > 0
    assert sorted(p.name for p in (run["folder"] / "figures").iterdir()) == [
        f"canary_leak_{n}.{ext}" for n in ("maps", "matrix") for ext in ("pdf", "png", "svg")]

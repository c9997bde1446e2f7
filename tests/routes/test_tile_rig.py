"""benchmarks/tile_rig.py, the kernel-tuning rig: its leave-one-out copies still patch the
current kernel, its cases describe the report's geometry, and it compiles against csrc/."""
import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def rig():
    spec = importlib.util.spec_from_file_location("tile_rig", ROOT / "benchmarks" / "tile_rig.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_whatif_copies_differ_from_the_kernel_only_where_named(tmp_path):
    r = rig()
    r.whatif(tmp_path)
    kernel = (ROOT / "csrc" / "grouped_page4.cuh").read_text()
    assert (tmp_path / "base" / "grouped_page4.cuh").read_text() == kernel
    for name, old, new in r.LEAVE_OUT:
        text = (tmp_path / name / "grouped_page4.cuh").read_text()
        assert text != kernel and new in text and old not in text, name
        assert text.replace(new, old) == kernel, name
    with pytest.raises(SystemExit, match="exists"):
        r.whatif(tmp_path)  # never overwrites an earlier set of copies


def test_cases_hold_the_report_geometry(tmp_path):
    rig().write_cases(tmp_path, copies=1)
    meta = (tmp_path / "case0" / "meta.txt").read_text().split()
    rows, hq, d, groups, cap, page_size, pages = map(int, meta[:7])
    assert (rows, hq, d, page_size) == (16, 6, 256, 32) and groups == 2
    assert (tmp_path / "case0" / "kv.bin").stat().st_size == pages * 2 * page_size * d
    assert (tmp_path / "case0" / "q.bin").stat().st_size == rows * hq * d * 2
    assert (tmp_path / "case0" / "microblocks.bin").stat().st_size == groups * cap * 4
    seq = np.fromfile(tmp_path / "case0" / "seq_len.bin", dtype=np.int32)
    assert seq.shape == (groups,) and (seq % 32 == 0).all() and (seq > 0).all()
    mbs = np.fromfile(tmp_path / "case0" / "microblocks.bin", dtype=np.int32)
    assert mbs.min() >= 0 and mbs.max() < pages * page_size // 4


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_rig_compiles_against_the_kernel(tmp_path):
    rig().build(ROOT / "csrc", tmp_path / "rig")
    assert (tmp_path / "rig").stat().st_size > 0

"""Every device header in csrc/ compiles for sm_70, sm_80 and sm_90 with NVRTC from CUDA 12,
uses the tensor cores (WMMA -> `wmma.mma.sync` / `mma.sync` in the PTX) and nothing an SM70
lacks. This is the proof, on a machine without a GPU or nvcc, that a V100 user can build
the kernels. Needs the `nvrtc` dependency group (pip install --group nvrtc); under CI=true a
missing wheel fails the test instead of skipping it.
"""
import json
import re
import tempfile
from pathlib import Path

import pytest

from run_once import once_per_run
import nvrtc_sm70
import ptx70
from nvrtc_toolkit import nvrtc_toolkit, ptx70_folder

TOOLKIT = nvrtc_toolkit()  # skips the module without the wheels (fails under CI=true)


def test_every_header_is_in_the_check():
    headers = sorted(p.name for p in nvrtc_sm70.CSRC.glob("*.cuh"))
    assert headers == sorted(nvrtc_sm70.DEVICE_HEADERS), "a new csrc/*.cuh must be added to DEVICE_HEADERS"


def _compile(arch):
    def make(_folder) -> str:
        res = nvrtc_sm70.compile_ptx(nvrtc_sm70.instantiation_source(), arch, TOOLKIT)
        assert res.ok, f"NVRTC {arch} failed:\n{res.log}"
        assert "error" not in res.log.lower(), res.log
        return res.ptx
    return make


def _compute_70(tmp_path_factory) -> str:
    """The compute_70 PTX is the one of test_ptx70.py's folder, compiled once per run:
    the same nvrtc_sm70.instantiation_source() through the same compile_ptx options, with
    ptx70's probe appended (one extern "C" kernel, qsa_ptx70_smem_probe, and two constant
    arrays) and another program name. Every header entry point comes out with the same
    instructions as from instantiation_source() alone (compared on NVRTC 12.9: the 24 entries
    equal up to branch-label numbers, .loc lines and the program-name hash in internal
    names), and each check below looks at entries by name, or at what no entry may hold,
    which the probe only adds to. ptx70.generate raises on a failed compile."""
    folder = ptx70_folder(tmp_path_factory, TOOLKIT)
    log = json.loads((folder / ptx70.MANIFEST_FILE).read_text())["nvrtc_log"]
    assert "error" not in log.lower(), log
    return (folder / ptx70.PTX_FILE).read_text()


@pytest.fixture(scope="module")
def ptx(tmp_path_factory):
    """arch -> PTX, each compiled once per run and only when a test asks for it (xdist's
    workers then wait only on the compile they need)."""
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = _compute_70(tmp_path_factory) if arch == "compute_70" else \
                once_per_run(tmp_path_factory, f"nvrtc-{arch}", _compile(arch))
        return cache[arch]
    return get


@pytest.mark.parametrize("arch", ["compute_70", "compute_80", "compute_90"])
def test_headers_compile_with_tensor_cores(ptx, arch):
    text = ptx(arch)
    assert re.search(r"\b(wmma\.mma\.sync|mma\.sync)\b", text), "no tensor-core MMA in the PTX"
    assert nvrtc_sm70.forbidden_instructions(text) == []
    # every entry point was instantiated: the grouped forward per format and variant,
    # the XQA partition and reduce kernels and the decoder per format
    entries = re.findall(r"^\.(?:visible|weak) \.entry (\w+)", text, re.M)
    n_variants = len(nvrtc_sm70.VARIANTS)
    assert n_variants == 6
    assert sum("grouped_page4_forward" in e for e in entries) == 3 * n_variants
    assert sum("xqa_partition_kernel" in e for e in entries) == 3
    assert sum("xqa_reduce_kernel" in e for e in entries) == 3
    assert sum("decode_panel_kernel" in e for e in entries) == 3


def test_every_variant_of_the_binding_is_instantiated():
    """The NVRTC check covers each kernel variant the Python side can launch."""
    from qsa_lab.routes.compiled import BARRIERS_PER_TILE, VARIANTS

    assert len(nvrtc_sm70.VARIANTS) == len(VARIANTS) == len(BARRIERS_PER_TILE)


def test_forbidden_instruction_check_can_fail():
    """The forbidden-instruction scan finds what it looks for (it is not vacuous)."""
    sample = ("\tcp.async.ca.shared.global [%r1], [%rd2], 16;\n\t@%p1 ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r1}, [%r2];\n"
              "\tcvt.rn.bf16.f32 %rs1, %f1;\n")
    assert nvrtc_sm70.forbidden_instructions(sample) == ["cp.async", "ldmatrix", ".bf16"]


def test_sm70_machine_code_fits_a_v100(ptx):
    """ptxas for sm_70: every kernel fits a V100 without spilling; the grouped forward runs
    512 threads, so it must fit 128 registers (64K registers per SM)."""
    if TOOLKIT.ptxas is None:
        pytest.skip("ptxas not in the nvcc wheel")
    with tempfile.TemporaryDirectory() as d:
        report = nvrtc_sm70.ptxas_report(ptx("compute_70"), "sm_70", TOOLKIT, Path(d))
    assert "error" not in report.lower(), report
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", report)]
    assert regs and max(regs) <= 128, report
    # No spills, except in the measurement-only early_v variant (variant 4), which holds
    # a tile's V bytes in registers through QK and the softmax: its fp16 build may spill
    # a few bytes on sm_70. The upstream-structured variants must not spill.
    spills = re.findall(r"Compiling entry function '(\w+)' for 'sm_70'\n.*\n\s+\d+ bytes stack frame, (\d+) bytes spill stores",
                        report)
    assert spills, report
    for name, nbytes in spills:
        limit = 16 if "grouped_page4_forward" in name and name.endswith("Li4EEEvNS_13GroupedParamsE") else 0
        assert int(nbytes) <= limit, f"{name} spills {nbytes} bytes on sm_70"


def test_barriers_per_tile_as_documented(ptx):
    """The PTX of each grouped entry holds the documented per-tile barriers plus the three
    outside the tile loop (two while setting up, one before the output): fix A 7, its
    racecheck demo without the leading barrier 6, every other variant 5 (finite_pv's fifth a
    bar.red, __syncthreads_or) and finite_pv's two more on a tile whose V holds a NaN or Inf."""
    from qsa_lab.routes.compiled import BARRIERS_PER_TILE, SLOW_TILE_BARRIERS, VARIANTS

    by_number = {str(n): name for name, n in VARIANTS.items()}
    entries = re.split(r"^\.(?:visible|weak) \.entry ", ptx("compute_70"), flags=re.M)[1:]
    seen = 0
    for body in entries:
        found = re.match(r"_ZN3qsa21grouped_page4_forwardILi(\d)ELi(\d)E", body)
        if not found:
            continue
        variant = by_number[found.group(2)]
        n_bar = len(re.findall(r"\b(?:bar|barrier)\.(?:sync|red)\b", body))
        assert n_bar == BARRIERS_PER_TILE[variant] + SLOW_TILE_BARRIERS.get(variant, 0) + 3, \
            f"{variant} (format {found.group(1)}): {n_bar} barriers"
        seen += 1
    assert seen == 3 * len(VARIANTS)
    assert BARRIERS_PER_TILE["kernel_fix"] - BARRIERS_PER_TILE["unfixed"] == 2
    assert BARRIERS_PER_TILE["masked_load"] == BARRIERS_PER_TILE["unfixed"]

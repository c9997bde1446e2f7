"""The CPU half of the compute_70 run check (tools/ptx70.py, tools/ptx70_check.py):
PTX of every entry point with NVRTC's own lowered names, ctypes mirrors of the parameter
structs equal to the PTX's parameter sizes, the binding's launch mirrored, stale folders
refused, broken PTX actually broken. The GPU half runs in tools/ptx70_check.py check.
Needs the `nvrtc` dependency group, like test_nvrtc_sm70.py.
"""
import ctypes
import importlib.util
import json
import re
import shutil
import subprocess

import pytest
import torch

from qsa_lab.routes import compiled as kernels
import nvrtc_sm70
import ptx70
from nvrtc_toolkit import nvrtc_toolkit, ptx70_folder

TOOLKIT = nvrtc_toolkit()  # skips the module without the wheels (fails under CI=true)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return ptx70_folder(tmp_path_factory, TOOLKIT)


@pytest.fixture(scope="module")
def built(folder):
    return json.loads((folder / ptx70.MANIFEST_FILE).read_text()), (folder / ptx70.PTX_FILE).read_text()


def script():
    spec = importlib.util.spec_from_file_location("ptx70_check", ptx70.ROOT / "tools" / "ptx70_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_entry_point_is_in_the_ptx_under_nvrtcs_name(built):
    manifest, ptx = built
    entries = manifest["entry_points"]
    grouped = [e for e in entries if e["kind"] == "grouped"]
    assert len(grouped) == len(nvrtc_sm70.FORMATS) * len(nvrtc_sm70.VARIANTS)
    assert sum(e["kind"] == "xqa_partition" for e in entries) == len(nvrtc_sm70.FORMATS)
    per_format = manifest["features"]["reduce_per_format"]
    assert sum(e["kind"] == "xqa_reduce" for e in entries) == (len(nvrtc_sm70.FORMATS) if per_format else 1)
    assert len({e["lowered"] for e in entries}) == len(entries)
    for e in entries:
        assert re.search(rf"^\.(?:visible|weak) \.entry {re.escape(e['lowered'])}\(", ptx, re.M), e["label"]
        if e["fmt"]:
            assert e["fmt"] in kernels.KV_DTYPE_CODES
        if e["variant"]:
            assert e["variant"] in kernels.VARIANTS  # the extension can run each variant the PTX has
    assert manifest["arch"] == "compute_70" and re.search(r"^\.target sm_70\b", ptx, re.M)
    assert manifest["formats"] == list(nvrtc_sm70.FORMATS) and manifest["variants"] == list(nvrtc_sm70.VARIANTS)


def test_names_follow_the_enumerators():
    assert ptx70.format_key("qsa::kFP16") == "fp16"
    assert ptx70.variant_key("qsa::kKernelFixNoLeadingBarrier") == "kernel_fix_no_leading_barrier"
    with pytest.raises(ValueError, match="qsa::kName"):
        ptx70.variant_key("kUnfixed")


def test_ctypes_mirrors_equal_the_ptx_parameter_sizes(built):
    manifest, ptx = built
    header = ptx70.header_text(ptx70.ROOT / "csrc", nvrtc_sm70)
    for e in manifest["entry_points"]:
        info = ptx70.entry_params(ptx, e["lowered"])
        if e["params"] is None:
            assert info.size is None and info.count == 5  # the probe: (n, q_heads, head_dims, grouped, xqa)
            continue
        cls = ptx70.struct_class(e["params"], ptx70.parse_struct(header, e["params"]))
        assert info.count == 1
        assert (info.size, info.align) == (ctypes.sizeof(cls), ctypes.alignment(cls)), e["label"]
        assert info.maxntid == manifest["constants"]["grouped_threads" if e["kind"] == "grouped" else "xqa_threads"]
    fields = [f for f, _ in manifest["structs"]["GroupedParams"]["fields"]]
    assert sorted(fields) == sorted(ptx70.GROUPED_FIELDS)
    assert sorted(f for f, _ in manifest["structs"]["XqaParams"]["fields"]) == sorted(ptx70.XQA_FIELDS)


def test_a_struct_change_is_caught(built):
    manifest, ptx = built
    header = ptx70.header_text(ptx70.ROOT / "csrc", nvrtc_sm70)
    eps = ptx70.expected_entry_points(ptx70.ROOT / "csrc", nvrtc_sm70)
    lowered = {e["expression"]: e["lowered"] for e in manifest["entry_points"]}
    ptx70.mirror_structs(header, ptx, eps, lowered)  # the real header passes
    grown = header.replace("float v_scale;\n};", "float v_scale;\n  int extra;\n};", 1)
    assert grown != header
    with pytest.raises(ptx70.StaleError, match=r"\[104\].*\[112\]"):
        ptx70.mirror_structs(grown, ptx, eps, lowered)
    with pytest.raises(ptx70.StaleError, match="half2"):
        ptx70.parse_struct("struct P { half2 x; };", "P")
    with pytest.raises(ptx70.StaleError, match="cannot read"):
        ptx70.parse_struct("struct P { int x[4]; };", "P")


def test_parse_struct_reads_the_declarations_in_order():
    text = """struct P {
      const __half* q;   // a comment; with a semicolon
      int a, b,c;
      long long n;       /* block */
      unsigned int m;
      float* f, *g;
    };"""
    assert ptx70.parse_struct(text, "P") == [("q", "__half*"), ("a", "int"), ("b", "int"), ("c", "int"),
                                             ("n", "long long"), ("m", "unsigned int"), ("f", "float*"),
                                             ("g", "float*")]
    cls = ptx70.struct_class("P", ptx70.parse_struct(text, "P"))
    assert ctypes.sizeof(cls) == 8 + 12 + 4 + 8 + 4 + 4 + 16  # int c pads to 8 before n, m pads before f
    with pytest.raises(ptx70.StaleError, match=r"header only: \['g'\]"):
        ptx70.fill(cls, dict(q=0, a=1, b=2, c=3, n=4, m=5, f=0))


def test_the_bindings_launch_mirror():
    real = (ptx70.ROOT / "csrc" / "bindings.cu").read_text()
    assert ptx70.check_bindings_mirror(real) == []
    moved = real.replace("kernel<<<groups, qsa::grouped::kThreads, smem, stream>>>(p);",
                         "kernel<<<dim3(groups, 2), qsa::grouped::kThreads, smem, stream>>>(p);")
    assert moved != real and any("<<<groups" in p for p in ptx70.check_bindings_mirror(moved))
    fewer = re.sub(r"^\s*p\.cap = .*$", "", real, flags=re.M)
    assert fewer != real and any("grouped_forward" in p for p in ptx70.check_bindings_mirror(fewer))


SMALL_LAYOUT = """
namespace grouped {
constexpr int kTile = 32;          // tokens
constexpr int kPad = kTile / 4;    // 8
template <int F> struct T { static constexpr int kNo = F * 2; };
struct SmemLayout { int ld, m_tiles; unsigned int q, kv, total; };
__host__ __device__ inline unsigned int align128(unsigned int x) { return (x + 127u) & ~127u; }
__host__ __device__ inline SmemLayout smem_layout(int heads, int dim) {
  SmemLayout L;
  L.ld = dim + kPad;
  L.m_tiles = (8 * heads + 15) / 16;
  const unsigned int rows = (unsigned int)L.m_tiles * 16;
  unsigned int off = 0;
  L.q = off;  off = align128(off + rows * L.ld * 2);
  L.kv = off; off = align128(off + kTile * L.ld * 2u);
  L.total = off;
  return L;
}
}"""


def test_the_smem_formula_is_read_from_the_header():
    total = ptx70.grouped_smem_formula(SMALL_LAYOUT)
    # heads 3 -> 2 M-tiles, 32 rows; dim 40 -> ld 48: Q 3072, panel 3072
    assert total(3, 40) == 3072 + 3072
    assert total(1, 16) == 768 + 1536  # 1 M-tile of 16 rows, ld 24
    assert total(1, 24) == 1024 + 2048  # ld 32: Q 1024 (aligned), panel 2048
    with pytest.raises(ptx70.StaleError, match="cannot read|not plain"):
        ptx70.grouped_smem_formula(SMALL_LAYOUT.replace("L.total = off;", "L.total = max(off, 4096);"))
    with pytest.raises(ptx70.StaleError, match="not found"):
        ptx70.grouped_smem_formula(SMALL_LAYOUT.replace("smem_layout(int heads", "layout(int heads"))


def test_shared_memory_tables(built):
    manifest, _ptx = built
    grouped = manifest["smem"]["grouped"]
    assert len(grouped) == 8 * 16 and all(v % 128 == 0 for v in grouped.values())
    assert grouped["1,16"] < grouped["8,16"] < grouped["8,256"] and grouped["8,128"] < grouped["8,256"]
    # the largest geometry needs the opt-in above 48 KB and fits what a V100 allows
    assert ptx70.DEFAULT_SMEM_LIMIT < max(grouped.values()) <= ptx70.V100_MAX_SMEM_OPTIN
    if manifest["features"]["smem_layout_constexpr"]:  # NVRTC's own evaluation, read from the PTX
        assert ptx70.ptx_int_array(_ptx, ptx70.SMEM_TABLE) == list(grouped.values())
    for f, part in manifest["constants"]["xqa_partition"].items():
        assert manifest["smem"]["xqa"][f"8,256,{f}"] == part * 8 + 8 * 256 * 4 + 8 * part * 4


def test_constants_come_from_the_headers(built):
    manifest, ptx = built
    c = manifest["constants"]
    # the launch bounds of every kernel are the same constants the binding launches with
    for e in manifest["entry_points"]:
        if e["kind"] != "probe":
            assert e["maxntid"] == c["grouped_threads" if e["kind"] == "grouped" else "xqa_threads"], e["label"]
    assert c["grouped_threads"] % 32 == 0 and set(c["xqa_partition"]) == set(kernels.KV_DTYPE_CODES)
    assert set(c["xqa_partial_bytes"].values()) <= {2, 4}
    n = 2 + 2 * len(nvrtc_sm70.FORMATS)
    swapped = re.sub(rf"({ptx70.CONSTANTS}\[{4 * n}\] = \{{)[^}}]*", r"\g<1>0, 2", ptx)
    assert swapped != ptx and ptx70.ptx_constants(swapped, nvrtc_sm70.FORMATS)["grouped_threads"] == 512


@pytest.mark.parametrize("mutation", ptx70.MUTATIONS, ids=lambda m: m.name)
def test_broken_ptx_differs_only_in_its_entry(built, mutation):
    manifest, ptx = built
    expr = f"qsa::grouped_page4_forward<{mutation.fmt}, {mutation.variant}>"
    lowered = next(e["lowered"] for e in manifest["entry_points"] if e["expression"] == expr)
    broken, n = ptx70.mutate(ptx, lowered, mutation.old, mutation.new)
    assert n > 0 and broken != ptx
    start, end = ptx70.entry_span(ptx, lowered)
    b_start, b_end = ptx70.entry_span(broken, lowered)
    assert broken[:b_start] == ptx[:start] and broken[b_end:] == ptx[end:]
    assert str(mutation.old) in ptx[start:end] and str(mutation.old) not in broken[b_start:b_end]
    assert broken[b_start:b_end].count(str(mutation.new)) >= n


def test_single_entry_module_assembles(built, tmp_path):
    """The small module the broken-PTX runs JIT is complete PTX (ptxas, sm_70)."""
    if TOOLKIT.ptxas is None:
        pytest.skip("ptxas not in the nvcc wheel")
    manifest, ptx = built
    mu = ptx70.MUTATIONS[0]
    expr = f"qsa::grouped_page4_forward<{mu.fmt}, {mu.variant}>"
    lowered = next(e["lowered"] for e in manifest["entry_points"] if e["expression"] == expr)
    single = ptx70.single_entry_module(ptx70.mutate(ptx, lowered, mu.old, mu.new)[0], lowered)
    assert len(_ENTRIES.findall(single)) == 1
    src = tmp_path / "single.ptx"
    src.write_text(single)
    res = subprocess.run([str(TOOLKIT.ptxas), "-arch=sm_70", str(src), "-o", str(tmp_path / "single.cubin")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]


_ENTRIES = re.compile(r"^\.(?:visible|weak) \.entry ", re.M)


def copy_checkout(dst):
    shutil.copytree(ptx70.ROOT / "csrc", dst / "csrc")
    (dst / "tools").mkdir(parents=True)
    shutil.copy(ptx70.ROOT / "tools" / "nvrtc_sm70.py", dst / "tools" / "nvrtc_sm70.py")


def test_stale_folders_are_refused(folder, tmp_path):
    ptx70.read_folder(folder)  # fresh: accepted
    root = tmp_path / "checkout"
    copy_checkout(root)
    ptx70.read_folder(folder, root)
    header = root / "csrc" / "xqa_page4.cuh"
    header.write_text(header.read_text() + "\n// edited\n")
    with pytest.raises(ptx70.StaleError, match=r"stale PTX: csrc/ differs .*xqa_page4\.cuh"):
        ptx70.read_folder(folder, root)
    copy = tmp_path / "tampered"
    shutil.copytree(folder, copy)
    text = (copy / ptx70.PTX_FILE).read_text()
    (copy / ptx70.PTX_FILE).write_text(text.replace("286331153", "286331152", 1))
    with pytest.raises(ptx70.StaleError, match="sha256"):
        ptx70.read_folder(copy)


class FakeDriver:
    """Records what Ptx70 would hand the CUDA driver."""

    def __init__(self):
        self.calls = []

    def opt_in_smem(self, fn, smem):
        self.calls.append(("opt_in", fn, smem))

    def launch(self, fn, grid, threads, smem, args):
        self.calls.append(("launch", fn, grid, threads, smem, [type(a).from_buffer_copy(a) for a in args]))

    def synchronize(self):
        self.calls.append(("sync",))


def fake_loaded(folder):
    p = ptx70.Ptx70.__new__(ptx70.Ptx70)
    p.manifest, p.ptx = ptx70.read_folder(folder)
    p.driver = FakeDriver()
    p.entries = {(e["kind"], e["fmt"], e["variant"]): e for e in p.manifest["entry_points"]}
    p.functions = {k: e["label"] for k, e in p.entries.items()}  # stand-ins for CUfunction handles
    p.structs = {n: ptx70.struct_class(n, [tuple(f) for f in s["fields"]]) for n, s in p.manifest["structs"].items()}
    p.const = p.manifest["constants"]
    p.smem = p.manifest["smem"]
    return p


def test_launches_mirror_the_binding(folder):
    from qsa_lab.model.case import Geometry, build_case
    from qsa_lab.model.plan import plan_groups, xqa_tokens

    p = fake_loaded(folder)
    case = build_case(Geometry(rows=19, requests=2, context=600, topk=32, q_heads=5, head_dim=64, page_size=16))
    plan = plan_groups(case)
    out = p.grouped_forward(case.q, case.kv_cache, case.k_scale, case.v_scale, plan.members, plan.microblocks,
                            plan.masks, plan.seq_len, kv_dtype="e4m3", sm_scale=case.sm_scale, variant="masked_load")
    (_, fn0, smem0), (_, fn, grid, threads, smem, (s,)), _ = p.driver.calls
    assert fn0 == fn == "grouped_page4_forward<e4m3,masked_load>"
    assert grid == (plan.groups,) and threads == p.const["grouped_threads"]
    assert smem == smem0 == p.smem["grouped"]["5,64"]
    assert out.shape == (plan.groups, 8, 5, 64) and s.out == out.data_ptr()
    assert (s.q, s.kv, s.microblocks, s.masks, s.seq_len) == (
        case.q.data_ptr(), case.kv_cache.data_ptr(), plan.microblocks.data_ptr(), plan.masks.data_ptr(),
        plan.seq_len.data_ptr())
    assert s.lse is None and (s.q_heads, s.head_dim, s.page_size, s.cap, s.q_rows) == (5, 64, 16, plan.cap, 19)
    assert s.n_microblocks == case.kv_cache.shape[0] * 4
    assert s.qk_scale == pytest.approx(case.sm_scale * case.k_scale, rel=1e-7) and s.v_scale == pytest.approx(case.v_scale)

    p.driver.calls.clear()
    rows = torch.arange(19)
    ti, tc = xqa_tokens(case, rows)
    p.xqa_forward(case.q[rows], case.kv_cache, case.k_scale, case.v_scale, ti, tc, kv_dtype="fp16",
                  sm_scale=case.sm_scale)
    (_, fn_a, smem_a), (_, fn1, grid1, t1, smem1, (x,)), (_, fn2, grid2, t2, smem2, (x2,)), _ = p.driver.calls
    part = p.const["xqa_partition"]["fp16"]
    parts = -(-ti.shape[1] // part)
    assert fn_a == fn1 == "xqa_partition_kernel<fp16>"
    assert fn2 == ("xqa_reduce_kernel<fp16>" if p.manifest["features"]["reduce_per_format"] else "xqa_reduce_kernel")
    assert (grid1, t1, smem1) == ((parts, 19), 256, p.smem["xqa"]["5,64,fp16"]) and smem_a == smem1
    assert (grid2, t2, smem2) == ((19,), 256, 0)
    assert bytes(x) == bytes(x2)  # both kernels get the same arguments
    assert (x.T, x.parts, x.n_tokens, x.token_index) == (ti.shape[1], parts, case.kv_cache.shape[0] * 16, ti.data_ptr())
    assert x.part_l - x.part_m == 19 * parts * 5 * 4  # part_ml[1] follows part_ml[0]


def test_generate_refuses_to_overwrite(folder):
    with pytest.raises(FileExistsError, match="force"):
        ptx70.generate(folder, toolkit=TOOLKIT)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_check_without_a_gpu_says_so(folder, capsys):
    assert script().main(["check", "--ptx", str(folder)]) == 2
    assert "no CUDA GPU visible" in capsys.readouterr().err


def test_check_arguments(folder, tmp_path, capsys):
    mod = script()
    with pytest.raises(SystemExit) as e:
        mod.main(["check", "--ptx", str(tmp_path)])
    assert e.value.code == 2 and "--ptx" in capsys.readouterr().err
    log = tmp_path / "kept.log"
    log.write_text("a user's log")
    with pytest.raises(SystemExit):
        mod.main(["check", "--ptx", str(folder), "--log", str(log)])
    assert "--log" in capsys.readouterr().err and log.read_text() == "a user's log"


def test_case_list_covers_every_kv_dtype_site_and_shape():
    mod = script()
    from qsa_lab.model.poison import SITES

    class T:
        KV_DTYPES = ("e4m3", "e5m2", "fp16")

    specs = [s for _, s in mod.case_specs(T, quick=False)]
    assert {(s["kv_dtype"], s["site"]) for s in specs if "plane" not in s} >= {(k, s) for k in T.KV_DTYPES for s in SITES}
    assert {s.get("plane") for s in specs} == {None, "k"}
    assert {(s.get("q_heads"), s.get("head_dim")) for s in specs} >= {(1, 16), (8, 256), (2, 48)}


def test_the_racy_variant_is_held_to_its_bounds():
    """Fix A without its leading barrier may bring NaN back only where the unfixed kernel
    has NaN, and must otherwise give fix A's values."""
    mod = script()
    t = mod.gpu_tests()
    nan = float("nan")
    fixed = torch.tensor([1.0, 2.0, 3.0, nan])
    unfixed = torch.tensor([nan, 2.0, nan, nan])
    assert mod.compare_racy(t, torch.tensor([nan, 2.0, 3.0, nan]), fixed, unfixed, "x") is None
    assert mod.compare_racy(t, fixed.clone(), fixed, unfixed, "x") is None
    assert "unfixed kernel has none" in mod.compare_racy(t, torch.tensor([1.0, nan, 3.0, nan]), fixed, unfixed, "x")
    assert "finite where fix A has NaN" in mod.compare_racy(t, torch.tensor([1.0, 2.0, 3.0, 4.0]), fixed, unfixed, "x")
    assert "over tolerance" in mod.compare_racy(t, torch.tensor([1.0, 2.5, 3.0, nan]), fixed, unfixed, "x")

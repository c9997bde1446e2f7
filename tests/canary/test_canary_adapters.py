"""The built-in third-party kernels (qsa_lab.canary.adapters): they skip cleanly without their
library, and their mapping from PagedCall to the library's API is right, checked through
stand-in libraries that implement the documented semantics in torch on the CPU."""
import sys
import types

import pytest
import torch

from qsa_lab.canary import run_canary
from qsa_lab.canary.adapters import KERNELS
from qsa_lab.canary.adapters import flashinfer as fi_adapter
from qsa_lab.canary.adapters import vllm as vllm_adapter
from qsa_lab.canary.case import canary_case
from qsa_lab.model.regions import AttentionSpec

GQA = dict(q_heads=8, kv_heads=2, head_dim=32, page_size=16, requests=3, context=40)
LEAKS = ("nan-leak", "inf-leak", "finite-leak")


def case(spec="dense", query_len=1, kv_dtype="fp16", **kw):
    return canary_case(kv_dtype, attend=spec, query_len=query_len, **dict(GQA, topk=4 if spec == "sparse" else 16,
                                                                           **kw))


# -- no library ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(KERNELS))
def test_every_thirdparty_kernel_skips_cleanly_without_its_library(name, monkeypatch):
    lib = KERNELS[name][0]
    monkeypatch.setitem(sys.modules, lib, None)          # import flashinfer / vllm raises ImportError
    monkeypatch.delenv(vllm_adapter.ENV, raising=False)
    vllm_adapter._load.cache_clear()
    report = run_canary([name], case=case(), backend="emulate")
    assert report.results == []
    reasons = [s["reason"] for s in report.skipped if s.get("kernel") == name]
    assert reasons and all(f"{lib} is not installed" in r for r in reasons), report.skipped


def test_unknown_thirdparty_kernel_is_bad_input():
    with pytest.raises(ValueError, match="kernels: unknown flashinfer kernel 'flashinfer:nope'"):
        run_canary(["flashinfer:nope"], case=case(), backend="emulate")


# -- a stand-in FlashInfer: the documented semantics, computed in torch -------------------------------

def _attend(q, keys, vals, allowed, sm_scale, group, read_all=False):
    """q [n, Hq, D]; keys/vals [S, Hkv, D] float; allowed [n, S] bool. A correct kernel reads only
    allowed tokens; read_all multiplies exp(-inf) = 0 into every token's V (the 0 * V hazard)."""
    k = keys.repeat_interleave(group, dim=1)
    v = vals.repeat_interleave(group, dim=1)
    if not read_all:
        out = []
        for i in range(q.shape[0]):
            idx = torch.nonzero(allowed[i]).flatten()
            s = torch.einsum("hd,shd->hs", q[i].float(), k[idx]) * sm_scale
            out.append(torch.einsum("hs,shd->hd", torch.softmax(s, -1), v[idx]))
        return torch.stack(out)
    s = torch.einsum("nhd,shd->nhs", q.float(), torch.nan_to_num(k)) * sm_scale
    s = s.masked_fill(~allowed[:, None, :], float("-inf"))
    return torch.einsum("nhs,shd->nhd", torch.softmax(s, -1), v)


def fake_flashinfer(read_all_decode=False):
    calls = []

    class _Wrapper:
        def __init__(self, workspace, layout, use_tensor_cores=False, backend="auto"):
            assert layout == "NHD" and workspace.dtype == torch.uint8
            self.tc = use_tensor_cores

        def _tokens(self, kv, b):
            pages = self.indices[self.indptr[b]:self.indptr[b + 1]].long()
            n = (len(pages) - 1) * self.ps + int(self.last[b])
            dec = kv.float()
            return [dec[pages, p].flatten(0, 1)[:n] for p in (0, 1)], n

        def run(self, q, kv, k_scale=None, v_scale=None):
            out = torch.empty(q.shape, dtype=torch.float16)
            for b in range(len(self.indptr) - 1):
                (keys, vals), n = self._tokens(kv, b)
                keys, vals = keys * (k_scale or 1.0), vals * (v_scale or 1.0)
                lo, hi = self.qo[b], self.qo[b + 1]
                pos = torch.arange(n - (hi - lo), n)
                tok = torch.arange(n)
                if self.mask is not None:
                    allowed = self.mask[self.mask_start[b]:self.mask_start[b] + (hi - lo) * n].view(hi - lo, n)
                else:
                    allowed = tok[None, :] <= pos[:, None]
                    if self.window_left >= 0:
                        allowed &= tok[None, :] >= pos[:, None] - self.window_left
                out[lo:hi] = _attend(q[lo:hi], keys, vals, allowed, self.sm_scale, self.hq // self.hkv,
                                     read_all=self.read_all).half()
            return out

    class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
        def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                 window_left=-1, q_data_type=None, kv_data_type=None, o_data_type=None, sm_scale=None):
            calls.append(("decode", dict(window_left=window_left, kv_data_type=kv_data_type, tc=self.tc)))
            self.indptr, self.indices, self.last = indptr.tolist(), indices, last_page_len
            self.hq, self.hkv, self.ps, self.window_left, self.sm_scale = (num_qo_heads, num_kv_heads, page_size,
                                                                           window_left, sm_scale)
            self.qo, self.mask, self.read_all = list(range(len(self.indptr))), None, read_all_decode

    class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
        def plan(self, qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                 custom_mask=None, causal=False, window_left=-1, q_data_type=None, kv_data_type=None,
                 o_data_type=None, sm_scale=None):
            assert causal or custom_mask is not None
            calls.append(("prefill", dict(window_left=window_left, causal=causal, mask=custom_mask is not None)))
            self.indptr, self.indices, self.last = indptr.tolist(), indices, last_page_len
            self.hq, self.hkv, self.ps, self.window_left, self.sm_scale = (num_qo_heads, num_kv_heads, page_size,
                                                                           window_left, sm_scale)
            self.qo, self.mask, self.read_all = qo_indptr.tolist(), custom_mask, False
            if custom_mask is not None:
                n = [(indptr[b + 1] - indptr[b] - 1) * page_size + last_page_len[b] for b in range(len(self.qo) - 1)]
                sizes = [(self.qo[b + 1] - self.qo[b]) * int(n[b]) for b in range(len(n))]
                assert custom_mask.numel() == sum(sizes), "custom_mask is not sum(q_len * kv_len) long"
                self.mask_start = [sum(sizes[:b]) for b in range(len(sizes))]

    mod = types.ModuleType("flashinfer")
    mod.__version__ = "0.0-test"
    mod.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    mod.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    return mod, calls


@pytest.fixture
def flashinfer_cpu(monkeypatch):
    def install(**kw):
        mod, calls = fake_flashinfer(**kw)
        monkeypatch.setitem(sys.modules, "flashinfer", mod)
        monkeypatch.setattr(fi_adapter, "CPU_OK", True)
        return calls
    return install


def _verdicts(report, region=None):
    return {r.verdict for r in report.results if region is None or r.region == region}


@pytest.mark.parametrize("kernel,spec,query_len,want_window", [
    ("flashinfer:decode", "dense", 1, -1), ("flashinfer:decode-tc", "window:8", 1, 7),
    ("flashinfer:prefill", "window:8", 4, 7), ("flashinfer:prefill-fa2", "dense", 4, -1)])
def test_flashinfer_adapter_maps_dense_and_window_to_window_left(flashinfer_cpu, kernel, spec, query_len,
                                                                 want_window):
    calls = flashinfer_cpu()
    report = run_canary([kernel], case=case(spec, query_len), backend="emulate", payloads=["nan", "max"])
    assert report.results and _verdicts(report) <= {"clean", "n/a"}, [r.describe() for r in report.leaks()]
    assert calls and all(c[1]["window_left"] == want_window for c in calls)
    if spec.startswith("window"):  # the out-of-window region was really checked, and clean
        assert "clean" in _verdicts(report, "out-of-window")


@pytest.mark.parametrize("spec", ["sparse", "window:8,sink:4"])
def test_flashinfer_prefill_maps_sparse_and_sink_to_custom_mask(flashinfer_cpu, spec):
    calls = flashinfer_cpu()
    report = run_canary(["flashinfer:prefill-fa2"], case=case(spec, 4), backend="emulate", payloads=["nan", "max"])
    assert calls and all(c[1]["mask"] and not c[1]["causal"] for c in calls)
    region = AttentionSpec.parse(spec).in_range_region
    assert "clean" in _verdicts(report, region) and _verdicts(report) <= {"clean", "n/a"}


def test_flashinfer_custom_mask_follows_an_explicit_mask_spec(flashinfer_cpu):
    flashinfer_cpu()
    base = case("dense", 4)
    mask = torch.arange(base.kv_cache.shape[2] * base.block_table.shape[1])[None, :] <= base.positions[:, None]
    mask[:, 5] = False                                          # nobody attends token 5
    c = base.with_spec(AttentionSpec("mask", mask=mask))
    report = run_canary(["flashinfer:prefill-fa2"], case=c, backend="emulate", payloads=["max"])
    assert "clean" in _verdicts(report, "masked") and _verdicts(report) <= {"clean", "n/a"}


def test_flashinfer_decode_refuses_what_it_cannot_express(flashinfer_cpu):
    flashinfer_cpu()
    for c, why in ((case("sparse"), "takes no custom mask"), (case("dense", 4), "one query row per request")):
        report = run_canary(["flashinfer:decode"], case=c, backend="emulate")
        assert report.results == [] and any(why in s["reason"] for s in report.skipped), report.skipped


def test_a_decode_that_multiplies_zero_by_out_of_window_v_leaks_nan_there(flashinfer_cpu):
    flashinfer_cpu(read_all_decode=True)
    report = run_canary(["flashinfer:decode"], case=case("window:8"), backend="emulate", payloads=["nan"])
    leaks = {(r.region, r.plane) for r in report.leaks()}
    assert ("out-of-window", "v") in leaks and all(pl == "v" for _, pl in leaks), leaks


def test_flashinfer_fp8_pool_is_viewed_as_torch_fp8_with_scales(flashinfer_cpu):
    calls = flashinfer_cpu()
    report = run_canary(["flashinfer:decode"], case=case("dense", kv_dtype="e4m3"), backend="emulate",
                        payloads=["nan"])
    assert calls[0][1]["kv_data_type"] == torch.float8_e4m3fn
    assert report.results and _verdicts(report) <= {"clean", "n/a"}


# -- a stand-in vLLM checkout: the kernel file and its imports, semantics in torch --------------------

FAKE_KERNEL = '''
import torch
import vllm.envs as envs
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.triton_utils import tl, triton
from vllm.v1.attention.ops.triton_quant_kv._helpers import helper_value
from vllm.v1.kv_cache_interface import KVQuantMode

assert envs.VLLM_BATCH_INVARIANT is False and current_platform.fp8_dtype() == torch.float8_e4m3fn
SEEN = []


def unified_attention(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale, causal,
                      window_size, block_table, softcap, q_descale, k_descale, v_descale, seq_threshold_3D=None,
                      num_par_softmax_segments=None, softmax_segm_output=None, softmax_segm_max=None,
                      softmax_segm_expsum=None, alibi_slopes=None, output_scale=None, qq_bias=None, sinks=None,
                      mm_prefix_range=None, use_alibi_sqrt=False, kv_quant_mode=KVQuantMode.NONE,
                      k_scale_cache=None, v_scale_cache=None):
    assert causal and helper_value == 42
    SEEN.append(dict(window_size=window_size, mode=int(kv_quant_mode), split=softmax_segm_output is not None))
    ps, group = k.shape[1], q.shape[1] // k.shape[2]
    scale = [float(s) if kv_quant_mode == KVQuantMode.FP8_PER_TENSOR else 1.0 for s in (k_descale, v_descale)]
    for b in range(len(seqused_k)):
        n, lo, hi = int(seqused_k[b]), int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        pages = block_table[b, :-(-n // ps)].long()
        keys = k[pages].float().flatten(0, 1)[:n].repeat_interleave(group, 1) * scale[0]
        vals = v[pages].float().flatten(0, 1)[:n].repeat_interleave(group, 1) * scale[1]
        for i in range(hi - lo):
            pos = n - (hi - lo) + i
            first = 0 if window_size[0] < 0 else max(0, pos - window_size[0])
            s = torch.einsum("hd,shd->hs", q[lo + i].float(), keys[first:pos + 1]) * softmax_scale
            out[lo + i] = torch.einsum("hs,shd->hd", torch.softmax(s, -1), vals[first:pos + 1]).to(out.dtype)
'''


@pytest.fixture
def vllm_cpu(tmp_path, monkeypatch):
    ops = tmp_path / "vllm" / "v1" / "attention" / "ops"
    (ops / "triton_quant_kv").mkdir(parents=True)
    (ops / "triton_unified_attention.py").write_text(FAKE_KERNEL)
    (ops / "triton_quant_kv" / "_helpers.py").write_text("from vllm.triton_utils import tl, triton\nhelper_value = 42\n")
    triton = types.ModuleType("triton")
    triton.language = types.ModuleType("triton.language")
    monkeypatch.setitem(sys.modules, "triton", triton)
    monkeypatch.setitem(sys.modules, "triton.language", triton.language)
    monkeypatch.setenv(vllm_adapter.ENV, str(tmp_path))
    monkeypatch.setattr(vllm_adapter, "CPU_OK", True)
    vllm_adapter._load.cache_clear()
    yield tmp_path
    vllm_adapter._load.cache_clear()


def test_vllm_loads_from_a_checkout_through_the_shim_and_leaves_no_vllm_module(vllm_cpu):
    report = run_canary(["vllm:unified"], case=case("window:8", 4), backend="emulate", payloads=["nan", "max"])
    mod, where = vllm_adapter._load(str(vllm_cpu))
    assert mod.SEEN and all(s["window_size"] == (7, 0) and s["mode"] == 0 and not s["split"] for s in mod.SEEN)
    assert "clean" in _verdicts(report, "out-of-window") and _verdicts(report) <= {"clean", "n/a"}
    assert where.startswith(f"source {vllm_cpu}") and "sha256" in where
    assert not any(k == "vllm" or k.startswith("vllm.") for k in sys.modules)


def test_vllm_3d_split_is_decode_only_and_fp8_uses_per_tensor_scales(vllm_cpu):
    report = run_canary(["vllm:unified-3d"], case=case("dense", kv_dtype="e4m3"), backend="emulate",
                        payloads=["nan"])
    mod, _ = vllm_adapter._load(str(vllm_cpu))
    assert mod.SEEN[-1] == {"window_size": (-1, -1), "mode": 1, "split": True}
    assert report.results and _verdicts(report) <= {"clean", "n/a"}
    chunk = run_canary(["vllm:unified-3d"], case=case("dense", 4), backend="emulate")
    assert chunk.results == [] and "decode path" in chunk.skipped[0]["reason"]


@pytest.mark.parametrize("spec,why", [("window:8,sink:4", "sink tokens"), ("sparse", "a sparse spec")])
def test_vllm_refuses_sinks_and_masks_with_the_reason(vllm_cpu, spec, why):
    report = run_canary(["vllm:unified"], case=case(spec, 4), backend="emulate")
    assert report.results == [] and why in report.skipped[0]["reason"]


def test_vllm_src_that_is_not_a_checkout_is_refused(tmp_path):
    with pytest.raises(ValueError, match="path: .* is not a vLLM checkout"):
        vllm_adapter.set_source(tmp_path)


# -- how an adapter reads the pool decides n/a -----------------------------------------------------------

PADDED = dict(context=33)   # 33, 32, 31 tokens on 16-token pages: 3, 2, 2 pages, so block-table rows carry padding


def _attend_all_pages(call):
    """A correct dense kernel over each row's whole block table (padding entries masked)."""
    mask = call.attend_mask()
    k, v = call.pages("k", heads="q").float(), call.pages("v", heads="q").float()
    v = v.masked_fill(~mask[:, :, None, None], 0.0)
    s = torch.einsum("rhd,rshd->rhs", call.q.float(), torch.nan_to_num(k)) * call.sm_scale
    return torch.einsum("rhs,rshd->rhd", torch.softmax(s.masked_fill(~mask[:, None, :], float("-inf")), -1), v)


@pytest.mark.parametrize("reads,want", [("page_table", "n/a"), ("block_table", "clean")])
def test_a_kernel_that_reads_a_page_list_gets_n_a_on_the_null_block(reads, want):
    def kernel(call):
        return _attend_all_pages(call)
    kernel.paged_inputs = reads
    report = run_canary({"fake:kernel": kernel}, case=case("dense", **PADDED), backend="emulate",
                        regions=["null-block"], payloads=["nan"])
    assert report.results and _verdicts(report) == {want}, [r.describe() for r in report.results]


@pytest.mark.parametrize("name", ["flashinfer:decode", "flashinfer:decode-tc", "flashinfer:prefill",
                                  "flashinfer:prefill-fa2"])
def test_flashinfer_kernels_declare_a_page_list_so_their_null_block_cells_are_n_a(flashinfer_cpu, name):
    flashinfer_cpu()
    assert KERNELS[name][1].paged_inputs == "page_table"
    report = run_canary([name], case=case("dense", 1, **PADDED), backend="emulate", regions=["null-block"],
                        payloads=["nan"])
    assert report.results and _verdicts(report) == {"n/a"}, [r.describe() for r in report.results]


def test_vllm_kernels_declare_the_padded_block_table():
    assert {KERNELS[n][1].paged_inputs for n in ("vllm:unified", "vllm:unified-3d")} == {"block_table"}

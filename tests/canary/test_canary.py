"""The canary: regions, payloads, verdicts and kernels, each against a case whose answer is
known by construction. The user kernels below are also run through the CLI (test_canary_cli.py)."""
import pytest
import torch

from qsa_lab.model import fp8
from qsa_lab.canary import KernelSkipped, PagedCall, assert_no_leak, canary_case, compare, run_canary
from qsa_lab.model.poison import PAYLOADS, payload_bits, write_payload
from qsa_lab.model.regions import attended_slots, region_parts, region_slots, regions_of, with_free_pages

CASE = canary_case()                       # 3 requests of 33, 32, 31 tokens on 16-token pages, 2 free pages
ROWS = CASE.geometry.rows


# -- user kernels of known behaviour (fn(PagedCall) -> [rows, q_heads, head_dim]) ---------------------

def _scores(call, k):
    """k [rows, S, q_heads, D] -> [rows, q_heads, S]."""
    return torch.einsum("rhd,rshd->rhs", call.q.float(), k) * call.sm_scale


def _kv(call, plane):
    return call.pages(plane, heads="q").float()                                     # [rows, S, q_heads, D]


def _pv(p, v):
    return torch.einsum("rhs,rshd->rhd", p, v)


def honest_kernel(call):
    """Reads whole pages but drops unattended slots before any arithmetic: clean by construction."""
    attend = call.attend().unsqueeze(1)
    keep = call.attend().view(*call.attend().shape, 1, 1)
    k = torch.where(keep, _kv(call, "k"), 0.0)
    v = torch.where(keep, _kv(call, "v"), 0.0)
    p = torch.softmax(torch.where(attend, _scores(call, k), -torch.inf), dim=-1)
    return _pv(p, v).to(torch.float16)


def masked_pv_kernel(call):
    """Masks scores (select), then P @ V over whole pages: 0 * NaN and 0 * Inf leak from V only."""
    attend = call.attend().unsqueeze(1)
    p = torch.softmax(torch.where(attend, _scores(call, _kv(call, "k")), -torch.inf), dim=-1)
    return _pv(p, _kv(call, "v")).to(torch.float16)


def inf_leak_kernel(call):
    """The honest output plus 1e-30 x the sum of every V slot it read: invisible for finite
    bytes, Inf for an Inf byte, NaN for a NaN byte."""
    spill = _kv(call, "v").sum(dim=1) * 1e-30                                       # [rows, q_heads, D]
    return (honest_kernel(call).float() + spill).to(torch.float16)


def finite_leak_kernel(call):
    """Sanitises non-finite bytes with nan_to_num and masks with a -8 bias instead of -inf:
    unattended slots keep weight e^-8. NaN -> 0 (as in the control): clean; Inf -> 65504: finite leak."""
    k = torch.nan_to_num(call.pages("k", heads="q")).float()         # in fp16: Inf -> 65504
    v = torch.nan_to_num(call.pages("v", heads="q")).float()
    bias = torch.where(call.attend().unsqueeze(1), 0.0, -8.0)
    p = torch.softmax(_scores(call, k) + bias, dim=-1)
    return _pv(p, v).to(torch.float16)


def broken_kernel(call):
    raise RuntimeError("no kernel image for this device")


def gpu_only_kernel(call):
    raise KernelSkipped("needs a GPU")


# -- regions: where the unattended bytes are --------------------------------------------------------

def test_regions_of_the_canary_case():
    ps = CASE.geometry.page_size
    assert CASE.seq_lens.tolist() == [33, 32, 31] and CASE.kv_cache.shape[0] == 8 + 2
    bt = CASE.block_table
    null = region_slots(CASE, "null-block")
    assert null[0].all() and int(null.sum()) == ps
    tail = region_slots(CASE, "stale-tail")
    # request 0 holds 33 tokens: its third page has slots 1..15 unwritten; request 2 (31) slot 15
    want = torch.zeros_like(tail)
    want[int(bt[0, 2]), 1:] = True
    want[int(bt[2, 1]), 15] = True
    assert torch.equal(tail, want)
    micro = region_slots(CASE, "stale-microblock")
    assert int(micro.sum()) == 4 and micro[int(bt[0, 2]), 1:4].all() and micro[int(bt[2, 1]), 15]
    free = region_slots(CASE, "free-pages")
    assert free[-2:].all() and int(free.sum()) == 2 * ps
    assert not region_slots(CASE, "unselected").any()         # dense case: every row attends its prefix


@pytest.mark.parametrize("geometry", [{}, {"topk": 2, "context": 65}])
def test_regions_are_never_attended(geometry):
    case = canary_case(**geometry)
    slots = {r: region_slots(case, r) for r in regions_of(case.spec)}
    for r in slots:   # other-requests: each part's pages are never attended by the rows it judges
        for s, rows in region_parts(case, r):
            assert not (s & attended_slots(case, rows)).any(), r
    assert not (slots["stale-microblock"] & ~slots["stale-tail"]).any()
    if geometry:                                              # sparse selections leave written slots unread
        assert slots["unselected"].any()


def test_with_free_pages_checks_its_argument():
    with pytest.raises(ValueError, match="free_pages"):
        with_free_pages(CASE, -1)
    with pytest.raises(ValueError, match="region"):
        region_slots(CASE, "tail")


# -- payloads in the storage dtype --------------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype,payload,check", [
    ("fp16", "nan", torch.isnan), ("fp16", "inf", torch.isinf), ("e5m2", "nan", torch.isnan),
    ("e5m2", "inf", torch.isinf), ("e4m3", "nan", torch.isnan)])
def test_payload_decodes_to_what_it_says(kv_dtype, payload, check):
    case = canary_case(kv_dtype)
    kv = case.kv_cache.clone()
    slots = region_slots(case, "null-block")
    written = write_payload(kv, slots, (1,), kv_dtype, payload, dims=[3])
    assert int(written.sum()) == 16 and written[0, 1, :, 3].all()
    raw = kv[:, 1, :, 0, :]
    # independent oracle: torch's own fp8 / fp16 dtypes
    oracle = {"fp16": raw, "e4m3": raw.view(torch.float8_e4m3fn), "e5m2": raw.view(torch.float8_e5m2)}[kv_dtype]
    bad = check(oracle.float())
    assert torch.equal(bad, written[:, 1]) and torch.equal(kv[:, 0], case.kv_cache[:, 0])


def test_payload_bits_match_the_formats():
    assert payload_bits("e4m3", "nan") == 0x7F and payload_bits("e5m2", "inf") == 0x7C
    assert payload_bits("fp16", "nan") == 0x7E00 and payload_bits("fp16", "inf") == 0x7C00
    assert fp8.decode(torch.tensor([payload_bits("e4m3", "max")], dtype=torch.uint8), "e4m3").item() == 448
    with pytest.raises(ValueError, match="payload: e4m3 has no inf encoding"):
        payload_bits("e4m3", "inf")


# -- verdicts ---------------------------------------------------------------------------------------

def test_compare_verdicts():
    base = torch.tensor([[1.0, 2.0, float("nan")]], dtype=torch.float16)
    assert compare(base, base.clone())[0] == "clean"
    other_nan = base.clone()
    other_nan.view(torch.int16)[0, 2] = 0x7FFF                # a NaN with other payload bits is still NaN
    assert compare(base, other_nan)[0] == "clean"
    for value, verdict, key in ((float("nan"), "nan-leak", "nan"), (float("inf"), "inf-leak", "inf"),
                                (1.0009765625, "finite-leak", "finite_changed")):
        p = base.clone()
        p[0, 0] = value
        v, counts, changed = compare(base, p)
        assert v == verdict and counts[key] == 1 and sum(counts.values()) == 1
        assert changed.tolist() == [[True, False, False]]


# -- acceptance: the qsa routes ---------------------------------------------------------------------

def test_grouped_leaks_v_nan_from_the_null_block_only_on_grouped_rows():
    rep = run_canary(["qsa:grouped"], regions=["null-block"], payloads=["nan"], backend="emulate")
    v = rep.find("qsa:grouped", "null-block", "v", "nan")
    assert v.verdict == "nan-leak" and v.where()["rows"] == list(range(8))   # rows 8, 9 go to XQA: clean
    assert v.nan == 8 * CASE.geometry.q_heads * CASE.geometry.head_dim
    assert rep.find("qsa:grouped", "null-block", "k", "nan").verdict == "clean"


@pytest.mark.parametrize("kv_dtype", ["fp16", "e5m2", "e4m3"])
def test_kernel_fix_is_clean_for_every_region_plane_and_payload(kv_dtype):
    rep = run_canary(["qsa:grouped+kernel_fix", "qsa:grouped"], payloads=PAYLOADS if kv_dtype != "e4m3"
                     else ("nan", "max", "zero"), backend="emulate", kv_dtype=kv_dtype)
    fixed = [r for r in rep.results if r.kernel == "qsa:grouped+kernel_fix"]
    assert len(fixed) == 5 * 2 * (4 if kv_dtype != "e4m3" else 3)   # unselected is empty here
    assert {r.verdict for r in fixed if r.region not in ("free-pages", "other-requests")} == {"clean"}
    # a group of 8 rows spans requests here: fix A zeroes only tokens no query of the group attends,
    # so a NaN in another request's V reaches the grouped rows (0 * NaN), never through K or a finite value
    cross = {(r.plane, r.payload): r.verdict for r in fixed if r.region == "other-requests"}
    assert cross.pop(("v", "nan")) == "nan-leak" and set(cross.values()) <= {"clean", "nan-leak"}
    assert rep.find("qsa:grouped+kernel_fix", "other-requests", "v", "nan").where()["rows"] == list(range(8))
    assert {r.verdict for r in fixed if r.region == "free-pages"} == {"n/a"}   # no input references them
    # ... on the very bytes that make the unfixed route leak
    assert rep.find("qsa:grouped", "stale-tail", "v", "nan").verdict == "nan-leak"


def test_pad_fix_still_leaks_the_stale_tail():
    rep = run_canary(["qsa:grouped+pad_fix"], regions=["null-block", "stale-tail"], planes=["v"],
                     payloads=["nan"], backend="emulate")
    assert rep.find("qsa:grouped+pad_fix", "null-block", "v", "nan").verdict == "clean"
    assert rep.find("qsa:grouped+pad_fix", "stale-tail", "v", "nan").verdict == "nan-leak"


# -- acceptance: PyTorch kernels on the CPU ---------------------------------------------------------

def test_sdpa_math_with_a_boolean_mask_leaks_masked_k_and_v():
    """One NaN dim: masked K poisons every dim of the rows that read it, masked V only its dim."""
    rep = run_canary(["torch:sdpa-math"], regions=["null-block", "free-pages"], payloads=["nan", "inf"],
                     backend="emulate", dims=[5])
    k = rep.find("torch:sdpa-math", "null-block", "k", "nan")
    v = rep.find("torch:sdpa-math", "null-block", "v", "nan")
    readers = [r for r in range(ROWS) if int(CASE.token_to_req[r]) > 0]      # requests with a padded entry
    assert k.verdict == v.verdict == "nan-leak"
    assert k.where() == {"rows": readers, "heads": [0, 1], "dims": list(range(16))}
    assert v.where() == {"rows": readers, "heads": [0, 1], "dims": [5]}
    assert rep.find("torch:sdpa-math", "null-block", "v", "inf").verdict == "nan-leak"   # 0 * Inf = NaN
    # pages outside every block table are never read, and no input references them: n/a, not "clean"
    assert {r.verdict for r in rep.results if r.region == "free-pages"} == {"n/a"}


def test_sdpa_cut_at_the_attended_length_is_clean():
    rep = run_canary(["torch:sdpa-cut"], payloads=["nan", "inf"], backend="emulate")
    assert len(rep.results) == 20 and {r.verdict for r in rep.results if r.region != "free-pages"} == {"clean"}
    assert rep.checks("torch:sdpa-cut") == 16 and rep.exit_code() == 0


def test_flex_eager_is_clean_for_k_and_leaks_v():
    rep = run_canary(["torch:flex"], regions=["null-block"], payloads=["nan"], backend="emulate")
    assert rep.find("torch:flex", "null-block", "k", "nan").verdict == "clean"
    assert rep.find("torch:flex", "null-block", "v", "nan").verdict == "nan-leak"


def test_gpu_only_kernels_are_skipped_with_a_reason_on_the_cpu():
    rep = run_canary(["torch:sdpa-flash", "torch:sdpa-cudnn"], regions=["null-block"], backend="emulate")
    assert rep.results == []
    assert {s["kernel"] for s in rep.skipped} == {"torch:sdpa-flash", "torch:sdpa-cudnn"}
    assert all("GPU" in s["reason"] for s in rep.skipped)


def test_controls_agree_with_the_reference():
    """The torch adapters compute the same attention as the qsa reference (zero-filled pool)."""
    from qsa_lab.routes.reference import reference_forward
    from qsa_lab.canary.kernels import TORCH_KERNELS

    ref = reference_forward(CASE.to_case())
    for name in ("torch:sdpa-math", "torch:sdpa-cut", "torch:flex"):
        out = TORCH_KERNELS[name](PagedCall.from_case(CASE)).double()
        assert (out - ref).abs().max() < 2e-3, name
    assert (honest_kernel(PagedCall.from_case(CASE)).double() - ref).abs().max() < 2e-3


# -- user kernels and assert_no_leak ----------------------------------------------------------------

def test_user_kernels_get_the_verdicts_they_were_built_for():
    rep = run_canary([masked_pv_kernel, inf_leak_kernel, finite_leak_kernel], regions=["null-block"],
                     planes=["v"], payloads=["nan", "inf", "max"], backend="emulate")
    name = {f: f"{__name__}:{f}" for f in ("masked_pv_kernel", "inf_leak_kernel", "finite_leak_kernel")}
    got = {(r.kernel, r.payload): r.verdict for r in rep.results}
    assert got == {
        (name["masked_pv_kernel"], "nan"): "nan-leak", (name["masked_pv_kernel"], "inf"): "nan-leak",
        (name["masked_pv_kernel"], "max"): "clean",
        (name["inf_leak_kernel"], "nan"): "nan-leak", (name["inf_leak_kernel"], "inf"): "inf-leak",
        (name["inf_leak_kernel"], "max"): "clean",
        (name["finite_leak_kernel"], "nan"): "clean", (name["finite_leak_kernel"], "inf"): "finite-leak",
        (name["finite_leak_kernel"], "max"): "finite-leak"}


def test_assert_no_leak_passes_a_clean_kernel():
    rep = assert_no_leak(honest_kernel, backend="emulate", payloads=["nan", "inf", "max"])
    assert len(rep.results) == 5 * 2 * 3 and not rep.leaks() and rep.checks(rep.kernels[0]) == 4 * 2 * 3


def test_assert_no_leak_lists_the_leaks():
    with pytest.raises(AssertionError) as e:
        assert_no_leak(finite_leak_kernel, regions=["null-block"], planes=["v"], backend="emulate")
    msg = str(e.value)
    assert "finite_leak_kernel: 2 leak(s)" in msg
    assert "null-block/v/inf: finite-leak" in msg and "null-block/v/max: finite-leak" in msg
    assert "null-block/v/nan" not in msg                     # nan_to_num(NaN) = 0 = the control


def test_assert_no_leak_fails_a_kernel_that_cannot_run():
    with pytest.raises(AssertionError, match="error in 30 cell.*control run: raised RuntimeError: no kernel image"):
        assert_no_leak(broken_kernel, backend="emulate")
    rep = assert_no_leak(gpu_only_kernel, backend="emulate", allow_skipped=True)
    assert {"kernel": f"{__name__}:gpu_only_kernel", "reason": "needs a GPU"} in rep.skipped and not rep.results


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="^regions: unknown"):
        run_canary(["qsa:xqa"], regions=["tail"])
    with pytest.raises(ValueError, match="^payloads: unknown"):
        run_canary(["qsa:xqa"], payloads=["nan", "NaN"])
    with pytest.raises(ValueError, match="^kernels: unknown qsa route"):
        run_canary(["qsa:grouped+fix"])
    with pytest.raises(ValueError, match="^kernels: .*cannot import"):
        run_canary(["no_such_module_xyz:fn"])
    with pytest.raises(ValueError, match="^dims must"):
        run_canary(["qsa:xqa"], dims=[16])


def test_wrong_output_shape_is_reported_not_raised():
    rep = run_canary([lambda call: call.q[:1]], regions=["null-block"], backend="emulate")
    assert {r.verdict for r in rep.results} == {"error"} and "returned shape [1, 2, 16]" in rep.results[0].error
    assert rep.exit_code() == 3


def test_e4m3_has_no_inf_payload():
    rep = run_canary(["qsa:xqa"], regions=["null-block"], payloads=["nan", "inf"], backend="emulate",
                     kv_dtype="e4m3")
    assert {r.payload for r in rep.results} == {"nan"}
    assert {"payload": "inf", "reason": "e4m3 has no inf code"} in rep.skipped


# -- the poison sites are this model x a payload ------------------------------------------------------

def _written_slots(before, after):
    """[pages, page_size] bool: slots where any byte of either plane changed."""
    a, b = before.kv_cache.view(torch.uint8), after.kv_cache.view(torch.uint8)
    return (a != b).view(a.shape[0], 2, a.shape[2], -1).any(dim=1).any(dim=-1)


@pytest.mark.parametrize("site,region", [("zeros", "null-block"), ("random", "null-block"),
                                         ("fp16-state", "null-block"), ("stale-tail", "stale-microblock")])
def test_poison_sites_write_their_region(site, region):
    from qsa_lab.model.poison import apply_poison

    base = canary_case("e4m3").to_case()
    base.kv_cache[0] = 7                                      # so that writing zeros shows too
    after = apply_poison(base, site, plane="kv", dims=[0, 3] if site == "stale-tail" else None)
    written = _written_slots(base, after)
    assert written.any() and not (written & ~region_slots(base, region)).any()
    if site != "stale-tail":
        assert torch.equal(written, region_slots(base, region))


def test_site_stale_tail_is_the_microblock_part_of_the_region_stale_tail():
    """Two meanings, two names: site 'stale-tail' writes only the stale slots of the last
    partial microblock (what the grouped route reads); region 'stale-tail' is the rest of the page."""
    from qsa_lab.model.poison import apply_poison

    after = apply_poison(CASE.to_case(), "stale-tail", dims=[2], payload="nan")
    written = _written_slots(CASE, after)
    assert torch.equal(written, region_slots(CASE, "stale-microblock"))
    assert int(written.sum()) == 4 < int(region_slots(CASE, "stale-tail").sum()) == 16
    assert after.poison["nan_bytes"] == 4 and after.poison["poisoned_dims"] == [2]


def test_paged_flex_eager_reads_the_whole_pool():
    rep = run_canary(["torch:flex-paged"], regions=["free-pages"], payloads=["nan"], backend="emulate")
    assert rep.find("torch:flex-paged", "free-pages", "k", "nan").verdict == "n/a"
    assert rep.find("torch:flex-paged", "free-pages", "v", "nan").verdict == "nan-leak"   # unreferenced, yet read


def test_sparse_case_has_unselected_slots_that_masking_kernels_read():
    sparse = canary_case(topk=2, context=65)          # rows select 2 of up to 16 blocks
    rep = run_canary(["torch:sdpa-math", "torch:sdpa-cut", "qsa:grouped+kernel_fix"], regions=["unselected"],
                     payloads=["nan"], backend="emulate", case=sparse)
    assert rep.find("torch:sdpa-math", "unselected", "v", "nan").verdict == "nan-leak"
    assert {r.verdict for r in rep.results if r.kernel == "qsa:grouped+kernel_fix"} == {"clean"}
    assert any(s.get("kernel") == "torch:sdpa-cut" and "prefix" in s["reason"] for s in rep.skipped)


def test_a_malformed_case_is_refused_before_any_kernel_runs():
    import dataclasses

    bad = dataclasses.replace(CASE, positions=CASE.positions.int())
    with pytest.raises(ValueError, match="^positions: expected"):
        run_canary([honest_kernel], case=bad, backend="emulate")
    with pytest.raises(TypeError, match="case must be a qsa_lab Case or CanaryCase"):
        run_canary([honest_kernel], case=42, backend="emulate")
    with pytest.raises(FileNotFoundError, match="^case: no file"):
        run_canary([honest_kernel], case="no-such-case.safetensors", backend="emulate")


def test_a_refusing_sdpa_backend_says_why_in_its_skip_line_and_prints_no_warning(monkeypatch, recwarn):
    """torch explains a forced backend's refusal in warnings (one per backend, 'not used because'); the
    canary folds the reason into the one skip line instead of printing them."""
    import warnings

    def refuse(*a, **k):
        warnings.warn("Flash attention kernel not used because: (Triggered internally at x.cpp:1.)")
        warnings.warn("Flash Attention does not support non-null attn_mask. (Triggered internally at y.h:2.)")
        raise RuntimeError("No available kernel. Aborting execution.")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", refuse)
    rep = run_canary(["torch:sdpa-math"], regions=["null-block"], planes=["v"], payloads=["nan"], backend="emulate")
    assert [s["reason"] for s in rep.skipped if s.get("kernel")] == [
        "SDPA backend 'math' refused the inputs: RuntimeError: No available kernel. Aborting execution. "
        "(Flash Attention does not support non-null attn_mask.)"]
    assert [str(w.message) for w in recwarn if "attention" in str(w.message).lower()] == []

"""No canary verdict is false or vacuous: every spec at a production geometry (GQA 4:1, head dim
128, page 16), and every hostile kernel through the API, assert_no_leak and the CLI."""
import json

import pytest
import torch

import canary_kernels as K
from qsa_lab.canary import AttentionSpec, assert_no_leak, attended_tokens, canary_case, run_canary
from qsa_lab.canary.results import MAX_HINT
from qsa_lab.app.cli import main
from qsa_lab.model.regions import regions_of
from qsa_lab.routes.labels import ROUTES

GQA = dict(q_heads=8, kv_heads=2, head_dim=128, page_size=16, context=65, topk=3)
SPECS = ["dense", "window:8,sink:4", "sparse", "mask"]


def gqa_case(spec):
    case = canary_case(**GQA, attend="dense" if spec == "mask" else spec)
    if spec == "mask":  # a tree-like mask: every third token of the prefix, plus the row itself
        att = attended_tokens(case)
        t = torch.arange(att.shape[1])
        mask = att & ((t % 3 == 0) | (t == case.positions.unsqueeze(1)))
        case = case.with_spec(AttentionSpec("mask", mask=mask))
    return case


@pytest.fixture(scope="module", params=SPECS)
def spec_report(request):
    case = gqa_case(request.param)
    rep = run_canary({"reference": K.reference, "zero_times_v": K.zero_times_v, "extra_token": K.extra_token},
                     payloads=["nan", "max"], backend="emulate", case=case)
    return case, rep


def test_reference_kernel_is_clean_everywhere(spec_report):
    case, rep = spec_report
    cells = [r for r in rep.results if r.kernel == "reference"]
    assert len(cells) == len(regions_of(case.spec)) * 2 * 2
    assert {r.verdict for r in cells if r.region != "free-pages"} == {"clean"}
    assert {r.verdict for r in cells if r.region == "free-pages"} == {"n/a"}
    assert not rep.failures()


def test_zero_times_v_leaks_v_nan_in_exactly_the_unattended_regions(spec_report):
    case, rep = spec_report
    for region in regions_of(case.spec):
        v, k = rep.find("zero_times_v", region, "v", "nan"), rep.find("zero_times_v", region, "k", "nan")
        assert k.verdict == ("n/a" if region == "free-pages" else "clean"), region
        # every region this call reaches leaks; free pages are not reachable through the block table,
        # and it reads only its own request's pages (other-requests)
        want = {"free-pages": "n/a", "other-requests": "clean"}.get(region, "nan-leak")
        assert v.verdict == want, region
    inside = case.spec.in_range_region
    assert (inside is None) == (case.spec.kind == "dense")


def test_one_extra_token_is_a_finite_leak_of_max_with_the_hint(spec_report):
    case, rep = spec_report
    for region in ("stale-tail", "stale-microblock"):
        for plane in ("k", "v"):
            r = rep.find("extra_token", region, plane, "max")
            assert r.verdict == "finite-leak" and r.note == MAX_HINT, (region, plane)
    # request 1 holds 64 tokens, whole pages: its position 64 is a padding entry, the null block
    assert rep.find("extra_token", "null-block", "v", "max").verdict == "finite-leak"
    if case.spec.in_range_region:                          # tokens before seq_len it does not attend
        assert rep.find("extra_token", case.spec.in_range_region, "v", "max").verdict == "clean"
    assert rep.exit_code() == 1


def test_a_dense_kernel_on_a_sparse_case_is_clean_when_told_it_is_dense():
    sparse = run_canary([K.dense], payloads=["nan"], backend="emulate", **GQA)
    false = sparse.find("canary_kernels:dense", "unselected", "v", "nan")
    assert false.verdict == "nan-leak"          # told "sparse", the dense kernel attends unselected tokens
    rep = run_canary([K.dense], payloads=["nan", "inf", "max"], backend="emulate", attend="dense", **GQA)
    assert {r.verdict for r in rep.results} <= {"clean", "n/a"} and rep.exit_code() == 0
    # it reads only the page list: the null block is n/a for it, not "clean"
    assert rep.find("canary_kernels:dense", "null-block", "v", "nan").verdict == "n/a"
    assert rep.checks("canary_kernels:dense") == 3 * 3 * 2   # stale-tail, stale-microblock, other-requests


# -- hostile kernels through the API ------------------------------------------------------------

FAST = dict(regions=["null-block", "stale-tail"], payloads=["nan"], backend="emulate")


def _only(rep, verdict):
    assert rep.results and {r.verdict for r in rep.results} == {verdict}, {r.verdict for r in rep.results}
    f = rep.failures()
    assert len(f) == 1 and f[0]["verdict"] == verdict and rep.exit_code() == 3
    return f[0]


@pytest.mark.parametrize("kernel,text", [(K.raises, "raised RuntimeError: no kernel image"),
                                         (K.exits, "raised SystemExit: 0"),
                                         (K.interrupts, "raised KeyboardInterrupt"),
                                         (K.returns_list, "returned list"),
                                         (K.returns_ints, "returned dtype torch.int32"),
                                         (K.returns_meta, "returned a tensor on meta")])
def test_a_kernel_that_fails_is_an_error_never_a_pass(kernel, text):
    rep = run_canary([kernel], **FAST)
    f = _only(rep, "error")
    assert text in f["message"] and text in rep.results[0].error
    if kernel in (K.raises, K.exits, K.interrupts):
        assert "Traceback" in rep.results[0].traceback and "canary_kernels.py" in rep.results[0].traceback
    with pytest.raises(AssertionError, match="error in"):
        assert_no_leak(kernel, **FAST)


def test_a_hung_kernel_times_out_and_is_not_called_again():
    rep = run_canary([K.hangs], timeout=1, **FAST)
    f = _only(rep, "error")
    assert "timed out after 1 s" in rep.results[0].error and len(rep.results) == 2 * 2
    assert rep.results[-1].error.startswith("not run: the kernel timed out after 1 s at null-block/k")
    assert f["cells"] == 4
    with pytest.raises(AssertionError, match="timed out after 1 s"):
        assert_no_leak(K.hangs, timeout=1, **FAST)


@pytest.mark.parametrize("kernel,text", [(K.nan_everywhere, "control output holds 320 NaN and 0 Inf of 320"),
                                         (K.nan_control, "control output holds 1 NaN"),
                                         (K.noisy, "two control runs differ"),
                                         (K.alternating, "two control runs differ")])
def test_an_untrustworthy_control_gives_no_verdict(kernel, text):
    rep = run_canary([kernel], **FAST)
    _only(rep, "unstable-control")
    assert all(text in r.note for r in rep.results)
    with pytest.raises(AssertionError, match="unstable-control"):
        assert_no_leak(kernel, **FAST)


@pytest.mark.parametrize("name", K.EDITED)
def test_a_kernel_that_edits_an_input_is_caught_and_cannot_touch_the_next(name):
    case = canary_case()
    before = {k: t.clone() for k, t in case.tensors().items()}
    edit = getattr(K, f"edits_{name}")
    rep = run_canary([edit, K.zero_times_v], case=case, **FAST)
    mine = [r for r in rep.results if r.kernel == f"canary_kernels:edits_{name}"]
    assert {r.verdict for r in mine} == {"input-modified"} and all(r.modified == [name] for r in mine)
    # the next kernel got fresh inputs: its verdicts are its own; the user's case is untouched
    assert rep.find("canary_kernels:zero_times_v", "null-block", "v", "nan").verdict == "nan-leak"
    assert all(torch.equal(before[k], t) for k, t in case.tensors().items())
    assert rep.exit_code() == 3
    with pytest.raises(AssertionError, match="input-modified in 4 cell"):
        assert_no_leak(edit, **FAST)


def test_two_callables_of_one_name_stay_apart():
    def a(call):
        return K.reference(call)

    def make():
        def a(call):
            return K.zero_times_v(call)
        return a

    b = make()
    b.__qualname__ = a.__qualname__
    rep = run_canary([a, b], **FAST)
    assert len(rep.kernels) == 2 and rep.kernels[1] == rep.kernels[0] + "#2"
    assert rep.find(rep.kernels[1], "null-block", "v", "nan").verdict == "nan-leak"
    assert rep.find(rep.kernels[0], "null-block", "v", "nan").verdict == "clean"
    with pytest.raises(ValueError, match="^kernels: 'qsa:xqa' given twice"):
        run_canary(["qsa:xqa", "qsa:xqa"], **FAST)


def test_zero_checks_for_a_requested_kernel_is_a_failure():
    rep = run_canary(["torch:sdpa-flash"], **FAST)               # needs a GPU: skipped here
    if not torch.cuda.is_available():
        assert rep.results == [] and rep.failures()[0]["verdict"] == "no-checks" and rep.exit_code() == 3
    with pytest.raises(ValueError, match="^regions: every one asked for is empty"):
        run_canary(["qsa:xqa"], regions=["unselected"], backend="emulate")      # empty in the default case
    with pytest.raises(ValueError, match="^payloads: e4m3 has a code for none"):
        run_canary(["qsa:xqa"], payloads=["inf"], kv_dtype="e4m3", backend="emulate")
    free = run_canary([K.reference], regions=["free-pages"], payloads=["nan"], backend="emulate")
    assert {r.verdict for r in free.results} == {"n/a"} and free.failures()[0]["verdict"] == "no-checks"


def test_the_qsa_routes_skip_a_case_they_cannot_judge():
    rep = run_canary(["qsa:grouped", K.reference], **FAST, kv_heads=2)
    assert rep.failures()[0]["kernel"] == "qsa:grouped" and "one KV head" in rep.failures()[0]["message"]
    assert rep.checks("canary_kernels:reference") == 4
    dense = run_canary(None, attend="dense", topk=3, context=65, payloads=["nan"], regions=["null-block"],
                       backend="emulate")
    qsa = [s for s in dense.skipped if s.get("kernel", "").startswith("qsa:")]
    assert len(qsa) == len(ROUTES) and all("attends dense" in s["reason"] for s in qsa) and not dense.failures()


# -- the CLI ----------------------------------------------------------------------------------------

def cli(capsys, *argv):
    rc = main(["canary", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


CLI_FAST = ["--regions", "null-block", "--payloads", "nan", "--backend", "emulate"]


@pytest.mark.parametrize("kernel,verdict", [("raises", "error"), ("exits", "error"), ("interrupts", "error"),
                                            ("nan_control", "unstable-control"), ("noisy", "unstable-control"),
                                            ("alternating", "unstable-control"), ("edits_kv_cache", "input-modified"),
                                            ("edits_block_table", "input-modified")])
def test_hostile_kernels_exit_3_with_one_line_naming_them(capsys, kernel, verdict):
    rc, out, err = cli(capsys, "--kernel", f"canary_kernels:{kernel}", *CLI_FAST)
    lines = [x for x in err.splitlines() if x.startswith("qsa-lab: ")]
    assert rc == 3 and lines == [f"qsa-lab: canary: canary_kernels:{kernel}: {verdict} in 2 cell(s), first "
                                 + lines[0].split(" first ", 1)[1]]
    assert f"canary_kernels:{kernel}: {verdict} at null-block / k,v / nan" in out


def test_debug_prints_the_kernels_traceback(capsys):
    rc, _, err = cli(capsys, "--kernel", "canary_kernels:raises", *CLI_FAST, "--debug")
    assert rc == 3 and "Traceback" in err and 'raise RuntimeError("no kernel image' in err


def test_a_hung_user_kernel_is_killed_at_the_timeout(capsys):
    rc, out, err = cli(capsys, "--kernel", "canary_kernels:hangs", *CLI_FAST, "--timeout", "2", "--json", "-")
    doc = json.loads(out)
    assert rc == 3 and doc["results"][0]["verdict"] == "error"
    assert "timed out after 2 s (its worker process was killed)" in doc["results"][0]["error"]
    assert doc["failures"][0]["kernel"] == "canary_kernels:hangs" and doc["exit_code"] == 3


def test_what_a_kernel_prints_never_reaches_json_stdout(capfd):
    rc, out, err = cli(capfd, "--kernel", "canary_kernels:prints", "--kernels", "torch:sdpa-math", *CLI_FAST,
                       "--json", "-")
    doc = json.loads(out)                                         # stdout is the document alone
    assert "hello from the kernel" in err and rc == 1
    assert {r["verdict"] for r in doc["results"] if r["kernel"] == "canary_kernels:prints"} == {"clean"}


def test_a_kernel_named_twice_is_refused(capsys):
    rc, _, err = cli(capsys, "--kernel", "canary_kernels:reference", "--kernel", "canary_kernels:reference",
                     *CLI_FAST)
    assert rc == 2 and err.startswith("qsa-lab: error: --kernel: 'canary_kernels:reference' given twice")


def test_errors_about_kernel_name_kernel(capsys):
    rc, _, err = cli(capsys, "--kernel", "no_such_module_xyz:fn", *CLI_FAST)
    assert rc == 2 and err.startswith("qsa-lab: error: --kernel: 'no_such_module_xyz:fn': cannot import")
    rc, _, err = cli(capsys, "--kernels", "no_such_module_xyz:fn", *CLI_FAST)
    assert rc == 2 and err.startswith("qsa-lab: error: --kernels: 'no_such_module_xyz:fn'")


def test_json_may_not_replace_the_kernels_own_file(capsys, tmp_path):
    src = tmp_path / "mine.py"
    src.write_text("import canary_kernels\n\ndef fn(call):\n    return canary_kernels.reference(call)\n")
    rc, _, err = cli(capsys, "--kernel", f"{src}:fn", *CLI_FAST, "--json", str(src), "--force")
    assert rc == 2 and "--json: same file as --kernel" in err and "canary_kernels" in src.read_text()


def test_a_file_kernel_imports_its_neighbours(capsys, tmp_path):
    (tmp_path / "helper_mod_i17.py").write_text("import canary_kernels\nkernel = canary_kernels.zero_times_v\n")
    (tmp_path / "entry.py").write_text("from helper_mod_i17 import kernel\n")
    rc, out, _ = cli(capsys, "--kernel", f"{tmp_path / 'entry.py'}:kernel", *CLI_FAST)
    assert rc == 1 and "nan-leak at null-block / v / nan" in out.replace("\n#   ", " "), out   # folded to 120 columns


def test_dense_kernel_with_attend_dense_exits_0_at_a_production_geometry(capsys):
    geo = ["--q-heads", "8", "--kv-heads", "2", "--head-dim", "128", "--page-size", "16", "--context", "65",
           "--topk", "3", "--backend", "emulate"]
    # told sparse: a false leak, exit 1 (NaN alone shows it; a max payload would add calls, not a check)
    rc, out, _ = cli(capsys, "--kernel", "canary_kernels:dense", *geo, "--payloads", "nan")
    assert rc == 1 and "unselected" in out
    rc, out, err = cli(capsys, "--kernel", "canary_kernels:dense", *geo, "--payloads", "nan,max", "--attend", "dense",
                       "--json", "-")
    doc = json.loads(out)
    assert rc == 0 and doc["attend"] == "dense" and doc["geometry"]["kv_heads"] == 2
    assert {r["verdict"] for r in doc["results"]} == {"clean", "n/a"}


@pytest.mark.parametrize("argv,message", [
    (["--attend", "window"], "--attend: expected dense, sparse, window:W"),
    (["--kv-heads", "3"], "--kv-heads: must divide q_heads"),
    (["--query-len", "4", "--rows", "5"], "--query-len: rows (5) must be requests x query_len"),
    (["--head-dim", "20"], "--head-dim: must be a multiple of 16"),
    (["--regions", "out-of-window"], "--regions: region 'out-of-window' belongs to a window spec"),
    (["--timeout", "0"], "--timeout: expected a number of seconds > 0"),
    (["--case", "/nonexistent-qsa/case.safetensors"], "--case: "),
    (["--case", "x.safetensors", "--rows", "4"], "--case: takes no geometry option (got --rows)"),
    (["--dims", "16"], "--dims: must be a non-empty list of head dims in [0, 16)"),
])
def test_bad_geometry_exits_2_with_one_line(capsys, argv, message):
    rc, _, err = cli(capsys, "--kernels", "qsa:xqa", "--backend", "emulate", *argv)
    assert rc == 2 and err.startswith(f"qsa-lab: error: {message}") and len(err.strip().splitlines()) == 1, err

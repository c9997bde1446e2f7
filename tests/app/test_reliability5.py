"""Reliability V (issue 48): this round's new surfaces as a stranger uses them: bad input is one line
naming the argument (exit 2), nothing checked is exit 3, a received file never chooses code to run."""
import re

import pytest

from qsa_lab.app.cli import main


def _one_line(err: str, flag: str) -> None:
    assert err.startswith(f"qsa-lab: error: {flag}: ") and err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("value", ["0", "99999"])
def test_search_pins_requests_inside_the_canary_range_naming_it(capsys, value):
    """Before: `--requests 0` said `canary --search: max() arg is an empty sequence`, `--requests 99999`
    blamed --rows."""
    assert main(["canary", "--search", "--kernels", "qsa:xqa", "--requests", value, "--budget", "1"]) == 2
    _one_line(capsys.readouterr().err, "--requests")


# -- a received call file whose tensors disagree with each other ----------------------------------

@pytest.fixture
def call_file(tmp_path):
    from qsa_lab.canary.calls import save_call
    from qsa_lab.canary.case import canary_case
    from qsa_lab.model.regions import region_slots

    case = canary_case()
    path = tmp_path / "calls" / "cell.safetensors"
    save_call(path, case, "torch:sdpa-math", "stale-tail", "v", "nan", region_slots(case, "stale-tail"), None,
              "nan-leak", {"nan": 1, "inf": 0, "finite_changed": 0}, {})
    return path


def _rewrite(path, **tensors):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        meta, old = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    save_file({**old, **tensors}, str(path), metadata=meta)


@pytest.mark.parametrize("change", ["empty", "flat", "float32"])
def test_a_poisoned_pool_unlike_the_pool_is_bad_input(call_file, capsys, change):
    """Before: an empty or reshaped kv_cache_poisoned was `qsa-lab: failed: IndexError` (exit 3); a float32
    one replayed a verdict on a pool of another dtype."""
    import torch
    from safetensors import safe_open

    with safe_open(str(call_file), framework="pt") as f:
        kv = f.get_tensor("kv_cache_poisoned")
    _rewrite(call_file, kv_cache_poisoned={"empty": kv.flatten()[:0].clone(), "flat": kv.flatten().clone(),
                                           "float32": kv.float()}[change])
    assert main(["replay", str(call_file), "--backend", "emulate"]) == 2
    err = capsys.readouterr().err
    _one_line(err, "CALL_FILE")
    assert "kv_cache_poisoned" in err and str(torch.float16) in err


@pytest.mark.parametrize("change", ["empty", "flat"])
def test_a_case_file_whose_selections_have_no_rows_is_bad_input(call_file, capsys, change):
    """Before: `canary --case` with an empty or 1-D `selected` was `qsa-lab: failed: IndexError` (exit 3)."""
    from safetensors import safe_open

    with safe_open(str(call_file), framework="pt") as f:
        sel = f.get_tensor("selected")
    _rewrite(call_file, selected={"empty": sel.flatten()[:0].clone(), "flat": sel.flatten().clone()}[change])
    assert main(["canary", "--case", str(call_file), "--kernels", "torch:sdpa-math", "--regions", "stale-tail",
                 "--payloads", "nan", "--planes", "v", "--backend", "emulate"]) == 2
    err = capsys.readouterr().err
    _one_line(err, "--case")
    assert "selected" in err


# -- canary --search: options that leave nothing to search --------------------------------------

@pytest.mark.parametrize("argv, flag", [
    (["--kernels", "qsa:grouped", "--regions", "out-of-window"], "--regions"),    # sparse only: never there
    (["--kernels", "torch:sdpa-math", "--attend", "window:4", "--regions", "unselected"], "--regions"),
    (["--kernels", "torch:sdpa-math", "--kv-dtype", "fp16", "--payloads", "max"], None),   # fp16 has max: runs
    (["--kernels", "torch:sdpa-math", "--kv-dtype", "e4m3", "--payloads", "inf"], "--payloads"),   # E4M3: no Inf
])
def test_search_regions_or_payloads_no_case_holds_are_bad_input(capsys, argv, flag):
    """Before: `qsa-lab: failed: Unsatisfiable: Unable to satisfy assumptions of test. 459 of 459 ...` (exit 3)."""
    code = main(["canary", "--search", *argv, "--budget", "1", "--backend", "emulate"])
    err = capsys.readouterr().err
    if flag is None:
        assert code in (0, 1) and "Unsatisfiable" not in err, err
        return
    assert code == 2, err
    _one_line(err, flag)
    assert ("no case under attend" if flag == "--regions" else "has no code for") in err


def test_search_payload_zero_runs(capsys):
    """Before: `--payloads zero` (a payload the canary accepts) was `canary --search: tuple.index(x): x not in tuple`."""
    code = main(["canary", "--search", "--kernels", "torch:sdpa-math", "--payloads", "zero", "--budget", "1",
                 "--backend", "emulate"])
    out, err = capsys.readouterr()
    assert code in (0, 1, 3) and "tuple.index" not in err and "search torch:sdpa-math" in out + err, err


# -- --json inside the --report folder ------------------------------------------------------------

@pytest.mark.parametrize("command", [
    ["canary", "--kernels", "torch:sdpa-math", "--regions", "stale-tail", "--payloads", "nan", "--backend", "emulate"],
    ["canary", "--search", "--kernels", "torch:sdpa-math", "--budget", "1", "--backend", "emulate"],
    ["scribble", "--regions", "other-requests", "--payloads", "nan"],
])
def test_json_inside_the_report_folder_is_refused_before_any_work(tmp_path, capsys, command):
    """Before: the whole run, then --json written into the (empty) report folder, then `--report: R is not
    empty` (exit 2): the run lost and a stray file left."""
    folder = tmp_path / "R"
    folder.mkdir()
    assert main([*command, "--report", str(folder), "--json", str(folder / "doc.json")]) == 2
    err = capsys.readouterr().err
    _one_line(err, "--report")
    assert "--json" in err and list(folder.iterdir()) == []


@pytest.mark.parametrize("command", [["scribble", "--attn", "user_attention.py:heads_first"],
                                     ["canary", "--kernels", "canary_kernels:reference"]])
def test_a_timeout_beyond_a_week_is_bad_input(capsys, command):
    """Before: `scribble --attn ... --timeout 1e99` ran, then `qsa-lab: failed: OverflowError: timestamp out of
    range for platform time_t` (exit 3)."""
    assert main([*command, "--timeout", "1e99"]) == 2
    _one_line(capsys.readouterr().err, "--timeout")


def test_scribble_attention_refuses_such_a_timeout():
    from qsa_lab.scribble.isolated import scribble_attention

    with pytest.raises(ValueError, match="timeout: must be a number of seconds in"):
        scribble_attention("user_attention.py:heads_first", timeout=1e99)


# -- cross-request: a list option naming one item twice --------------------------------------------

@pytest.mark.parametrize("flag, value", [("--requests", "1,1"), ("--payloads", "nan,nan"), ("--routes", "xqa,xqa")])
def test_cross_request_refuses_an_item_named_twice(capsys, flag, value):
    """Before: `--requests 1,1` and `--payloads nan,nan` ran the request twice and doubled every count
    (exit 0); `--routes xqa,xqa` was blamed on --q-heads."""
    assert main(["cross-request", flag, value, "--q-heads", "2"]) == 2
    err = capsys.readouterr().err
    _one_line(err, flag)
    assert "more than once" in err


@pytest.mark.parametrize("limits, said", [
    ({"max_requests": -1}, "max_requests must be an int in 1..256"),      # was Hypothesis: max_value < min_value
    ({"max_requests": 10 ** 9}, "max_requests must be an int in 1..256"),  # was Hypothesis: min_size too large
    ({"kv_dtypes": ("int8",)}, "kv_dtypes ['int8'] unknown"),             # was Unsatisfiable, exit 3
    ({"page_sizes": (3,)}, "page_sizes must hold ints in 4..1024"),        # was exit 3: no case ran a check
    ({"head_dims": (24,)}, "multiples of 16"),
    ({"gqa": "yes"}, "gqa must be true or false"),                         # was taken as true
    ({"max_extra_context": 10 ** 12}, "max_extra_context must be an int in 0..65536"),   # was searched
])
def test_a_kernels_declared_limits_are_checked_naming_the_field(limits, said):
    from qsa_lab.canary.leak_search import Limits, limits_of

    def attn(call):
        return None

    attn.canary_limits = limits
    with pytest.raises(ValueError, match=re.escape(said)):
        limits_of(attn)
    with pytest.raises(ValueError, match=re.escape(said)):
        Limits(**limits)


def test_two_kernel_files_of_one_name_keep_a_call_file_each(tmp_path, capsys):
    """Before: a/k.py:attn and b/k.py:attn, both leaking, wrote one calls/k.attn__... file: the second
    overwrote the first, and the first kernel's replay line replayed the other kernel's call."""
    import json

    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "k.py").write_text("import canary_kernels\n\ndef attn(call):\n"
                                                "    return canary_kernels.zero_times_v(call)\n")
    report = tmp_path / "R"
    code = main(["canary", "--kernels", f"{tmp_path}/a/k.py:attn,{tmp_path}/b/k.py:attn", "--regions", "stale-tail",
                 "--payloads", "nan", "--planes", "v", "--backend", "emulate", "--report", str(report)])
    assert code == 1, capsys.readouterr().err
    calls = sorted(p.name for p in (report / "calls").iterdir())
    assert len(calls) == 2, calls
    text = (report / "report.md").read_text()
    lines = [x for x in text.splitlines() if x.startswith("qsa-lab replay calls/")]
    assert len(lines) == 2 and len({x.split()[2] for x in lines}) == 2, lines
    from qsa_lab.canary.calls import load_call

    copies = {load_call(report / "calls" / c)[2].get("kernel_copy") for c in calls}
    assert copies == {"kernels/k.py:attn", "kernels/k_2.py:attn"}, copies
    assert json.loads((report / "canary.json").read_text())["schema"] == "qsa_lab.canary/1"


@pytest.mark.parametrize("key", ["sm_scale", "k_scale", "v_scale"])
def test_a_header_scale_that_is_not_a_number_names_the_entry(call_file, capsys, key):
    """Before: `could not convert string to float: 'null'` (Python's words, no entry named)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(call_file), framework="pt") as f:
        meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys() if k != key}
    save_file(tensors, str(call_file), metadata={**meta, key: "null"})
    for argv, flag in ((["replay", str(call_file), "--backend", "emulate"], "CALL_FILE"),
                       (["canary", "--case", str(call_file), "--kernels", "torch:sdpa-math", "--regions", "stale-tail",
                         "--payloads", "nan", "--planes", "v", "--backend", "emulate"], "--case")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        _one_line(err, flag)
        assert f"{key}: expected a number" in err and "convert string" not in err, err

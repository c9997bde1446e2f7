"""Your own attention: `qsa-lab scribble --attn file.py:function` and scribble_attention(), in a worker
process with the canary's rules for user code (stdout to stderr, killed on a timeout, bad input exit 2)."""
import json
from pathlib import Path

import pytest

from qsa_lab.app.cli import main
from qsa_lab.scribble.isolated import AttentionLoadError, is_user_attention, scribble_attention
from qsa_lab.scribble.regions import OTHER

pytest.importorskip("transformers")

USER = Path(__file__).resolve().parent / "user_attention.py"


def test_attn_catches_a_users_leaking_attention_and_names_it(capfd, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = f"{USER}:one_more_key"
    rc = main(["scribble", "--attn", spec, "--regions", f"{OTHER},free-blocks", "--payloads", "nan", "--json", "-"])
    out, err = capfd.readouterr()
    report = json.loads(out)                       # what the function printed went to stderr, not into the JSON
    assert rc == 1 and "one_more_key runs" in err
    assert report["engine"] == f"transformers:{spec} (in the paged|eager slot)"
    verdicts = {(r["check"], r["region"], r["payload"]): r["verdict"] for r in report["results"]}
    assert verdicts == {("write", "free-blocks", "-"): "clean", ("read", OTHER, "nan"): "nan-leak",
                        ("read", "free-blocks", "nan"): "clean"}


def test_the_api_runs_a_module_function_in_a_worker_and_the_example_is_clean():
    report = scribble_attention("qsa_lab.scribble.examples:per_request_attention", regions=(OTHER, "read-trash"),
                                payloads=("nan",), pad=True)
    assert report.engine == ("transformers:qsa_lab.scribble.examples:per_request_attention "
                             "(in the paged|eager slot)+pad")
    assert {c.verdict for c in report.cells} == {"clean"} and report.exit_code() == 0


@pytest.mark.parametrize("spec, problem", [
    ("nofile.py:attention", "--attn: 'nofile.py:attention': no file nofile.py"),
    ("user_attention.py:nothing", "--attn: 'user_attention.py:nothing': user_attention.py has no callable 'nothing'"),
])
def test_an_attention_that_cannot_be_loaded_is_bad_input_in_one_line(capsys, monkeypatch, spec, problem):
    monkeypatch.chdir(USER.parent)
    assert main(["scribble", "--attn", spec]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"qsa-lab: error: {problem}") and err.count("\n") == 1


def test_a_stuck_attention_is_killed_at_the_timeout_and_every_check_is_an_error():
    report = scribble_attention(f"{USER}:stuck", regions=("free-blocks",), payloads=("nan",), timeout=15)
    assert {c.verdict for c in report.cells} == {"error"} and report.exit_code() == 3
    assert all("timed out after 15 s" in c.error for c in report.cells)


def test_only_file_and_module_functions_are_user_attention():
    assert is_user_attention("my_attn.py:attention") and is_user_attention("pkg.mod:fn")
    for name in ("paged|eager", "sdpa", "flash_attention_2", "kernels-community/flash-attn3:flash_attention"):
        assert not is_user_attention(name), name
    with pytest.raises(AttentionLoadError, match="^attn: 'sdpa' is not file.py:function"):
        scribble_attention("sdpa")


@pytest.mark.parametrize("function, problem", [
    ("heads_first", "returned output a float32 tensor of shape [1, 4, 64, 16] on the first step's clean input; "
                    "paged|eager returns a float32 tensor of shape [1, 64, 4, 16] there"),
    ("nan_everywhere", "returned 4096 non-finite values of 4096 on the first step's clean input, where paged|eager's "
                       "output is finite"),
    ("mistaken", "raised KeyError: 'max_seqlen_x' on the first step's clean input; it must return (output, weights "
                 "or None)"),
])
def test_an_attention_that_breaks_its_contract_is_bad_input_in_one_line_before_the_matrix(capfd, function, problem):
    rc = main(["scribble", "--attn", f"{USER}:{function}", "--regions", "free-blocks", "--payloads", "nan"])
    out, err = capfd.readouterr()
    assert rc == 2 and out == ""
    assert err == f"qsa-lab: error: --attn: {USER}:{function} {problem}" + err.split(problem, 1)[1]
    assert err.count("\n") == 1 and "Traceback" not in err


def test_debug_adds_the_traceback_of_an_attention_that_raised(capfd):
    rc = main(["scribble", "--attn", f"{USER}:mistaken", "--regions", "free-blocks", "--payloads", "nan", "--debug"])
    err = capfd.readouterr().err
    assert rc == 2 and err.startswith("Traceback") and 'kwargs["max_seqlen_x"]' in err
    assert err.splitlines()[-1].startswith(f"qsa-lab: error: --attn: {USER}:mistaken raised KeyError")


def test_a_control_that_is_all_nan_is_an_unstable_control_never_clean():
    from qsa_lab.scribble.check import scribble
    from qsa_lab.scribble.isolated import build_engine
    from qsa_lab.support.loading import load_callable

    nan_everywhere = load_callable(f"{USER}:nan_everywhere", "attn")       # in this process: no contract check
    report = scribble(build_engine(attn=nan_everywhere), regions=("free-blocks",), payloads=("nan",))
    read = [c for c in report.cells if c.check == "read"]
    assert [c.verdict for c in read] == ["unstable-control"] and report.exit_code() == 3
    assert "the clean run's logprobs are all NaN or infinite" in read[0].error

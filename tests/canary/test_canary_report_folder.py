"""The report folder's own writing discipline and the standalone repro scripts, on the CPU:
the counts agree everywhere, the folder appears whole or not at all, no write goes through a
link or over an input, and a generated FlashInfer / vLLM script (no qsa_lab in it) exits 1 / 0 / 3."""
import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qsa_lab.canary import run_canary
from qsa_lab.canary.case import canary_case
from qsa_lab.canary.calls import save_call
from qsa_lab.canary.report import write_report
from qsa_lab.canary.standalone import script_text
from qsa_lab.analysis.leaks import summary

DATA = Path(__file__).parents[1] / "data"
LEAKY = f"{DATA / 'canary_kernels.py'}:leaky"
GQA = dict(q_heads=8, kv_heads=2, head_dim=32, requests=3, context=40, query_len=2)
ROOT = Path(__file__).parents[2]


def cli(capsys, *argv):
    from qsa_lab.app.cli import main

    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def canary_args(report):
    return ["canary", "--kernel", LEAKY, "--backend", "emulate", "--attend", "window:8", "--payloads", "nan,max",
            "--q-heads", "8", "--kv-heads", "2", "--head-dim", "32", "--requests", "3", "--context", "40",
            "--query-len", "2", "--report", report]


def test_cli_json_and_report_agree_on_every_count(tmp_path, capsys):
    code, out, _ = cli(capsys, *canary_args(tmp_path / "r"), "--json", tmp_path / "c.json")
    assert code == 1
    doc = json.loads((tmp_path / "c.json").read_text())
    c = doc["counts"]
    assert c["cells"] == len(doc["results"]) > c["checks"] > c["leaking"] > 0   # n/a cells are cells, not checks
    line = summary(c)
    assert f"# {line}" in out
    md = (tmp_path / "r" / "report.md").read_text()
    assert md.splitlines()[2].startswith(line + ";") and json.loads((tmp_path / "r" / "canary.json").read_text())["counts"] == c
    assert re.findall(r"\d+ leaking of \d+ checks \(\d+ cells\)", out) == [line]
    assert "qsa-lab canary --kernel" in md and "--report" in md                # the command line, recorded


def test_a_failed_run_leaves_no_folder_and_the_next_run_is_not_refused(tmp_path, monkeypatch):
    report = run_canary([LEAKY], case=canary_case("fp16", attend="window:8", **GQA), payloads=["nan"])
    from qsa_lab.canary import report as rep

    def boom(*a, **k):
        raise KeyboardInterrupt   # Ctrl-C in the middle of writing
    monkeypatch.setattr(rep, "markdown", boom)
    with pytest.raises(KeyboardInterrupt):
        write_report(report, tmp_path / "r", minimize=False)
    assert os.listdir(tmp_path) == []                  # neither the folder nor a partial one beside it
    monkeypatch.undo()
    write_report(report, tmp_path / "r", minimize=False)
    assert (tmp_path / "r" / "report.md").is_file() and sorted(os.listdir(tmp_path)) == ["r"]


@pytest.fixture(scope="module")
def small_report():
    return run_canary([LEAKY], case=canary_case("fp16", attend="window:8", **GQA), payloads=["nan"])


@pytest.mark.parametrize("link", ["report.md", "calls"])
def test_a_link_inside_the_report_folder_is_refused_naming_it(tmp_path, small_report, link):
    out = tmp_path / "r"
    write_report(small_report, out, minimize=False)
    victim = tmp_path / "victim"
    victim.mkdir() if link == "calls" else victim.write_text("mine\n")
    target = out / link
    if target.is_dir():
        import shutil
        shutil.rmtree(target)
    else:
        target.unlink()
    target.symlink_to(victim)
    with pytest.raises(ValueError, match=f"report: .*{link} is a symlink"):
        write_report(small_report, out, force=True, minimize=False)
    assert (victim.read_text() == "mine\n") if link == "report.md" else os.listdir(victim) == []


def test_force_keeps_a_folder_holding_other_files_or_an_input(tmp_path, small_report, capsys):
    out = tmp_path / "r"
    write_report(small_report, out, minimize=False)
    (out / "notes.txt").write_text("my notes\n")
    with pytest.raises(ValueError, match="holds 'notes.txt'|holds notes.txt"):
        write_report(small_report, out, force=True, minimize=False)
    (out / "notes.txt").unlink()
    call = next((out / "calls").glob("*.safetensors"))
    before = call.read_bytes()
    code, _, err = cli(capsys, "canary", "--kernel", LEAKY, "--backend", "emulate", "--payloads", "nan",
                       "--case", call, "--report", out, "--force")
    assert code == 2 and err.strip().splitlines()[-1].startswith("qsa-lab: error: --report:") and "--case" in err
    assert call.read_bytes() == before


def test_the_pytest_plugin_keeps_an_existing_report(tmp_path):
    from qsa_lab.canary.pytest_plugin import Config, run  # noqa: F401 - the plugin's own writer
    reports = tmp_path / "reports"
    folder = reports / "canary_kernels_leaky"
    folder.mkdir(parents=True)
    (folder / "report.md").write_text("edited by me\n")
    test = tmp_path / "test_k.py"
    test.write_text(f'''
import importlib.util, pytest
spec = importlib.util.spec_from_file_location("canary_kernels", {str(DATA / "canary_kernels.py")!r})
kernels = importlib.util.module_from_spec(spec); spec.loader.exec_module(kernels)

@pytest.mark.qsa_canary(kernels.leaky, attend="window:8", kv_heads=2, q_heads=8, head_dim=32, requests=3,
                        context=40, query_len=2, payloads=["nan"], regions=["out-of-window"], backend="emulate")
def test_leaky(qsa_canary_cell):
    qsa_canary_cell.check()
''')
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "qsa_lab.canary.pytest_plugin", "-p",
                        "no:cacheprovider", str(test), "--qsa-canary-report", str(reports)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "failed" in r.stdout, r.stdout + r.stderr
    assert (folder / "report.md").read_text() == "edited by me\n" and sorted(os.listdir(folder)) == ["report.md"]


# -- standalone repro scripts -------------------------------------------------------------------------

FAKE_FLASHINFER = '''
import os
import torch
__version__ = "0.0-stub"
MODE = os.environ["FAKE_FLASHINFER"]
if MODE == "import":
    raise ImportError("libcudart.so.12: cannot open shared object file")


class _Wrapper:
    def __init__(self, workspace, layout, use_tensor_cores=False, backend="auto"):
        pass

    def plan(self, *args, **kw):
        if MODE == "plan":
            raise RuntimeError("FA3 module failed to compile")

    def run(self, q, kv, k_scale=None, v_scale=None):
        out = q.clone()
        if MODE == "nan":      # reads every byte of the pool into row 0: any NaN there reaches it
            out[0] = out[0] + kv.float().sum() * 0
        return out


BatchDecodeWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper = _Wrapper
'''


@pytest.fixture(scope="module")
def flashinfer_script(tmp_path_factory):
    root = tmp_path_factory.mktemp("standalone")
    case = canary_case("fp16", attend="window:8", requests=3, context=40, query_len=1, q_heads=8, kv_heads=2,
                       head_dim=32)
    slots = torch.zeros(case.kv_cache.shape[0], case.page_size, dtype=torch.bool)
    slots[1, 0] = True
    save_call(root / "calls" / "x.safetensors", case, "flashinfer:decode", "out-of-window", "v", "nan", slots,
              None, "nan-leak", {}, {})
    text = script_text("flashinfer:decode", case, "x.safetensors",
                       {"region": "out-of-window", "plane": "v", "payload": "nan", "slots": 1})
    (root / "repro").mkdir()
    (root / "repro" / "x.py").write_text(text)
    stub = root / "stub" / "flashinfer"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(FAKE_FLASHINFER)
    return root


def test_a_generated_script_imports_nothing_from_qsa_lab(flashinfer_script):
    tree = ast.parse((flashinfer_script / "repro" / "x.py").read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "qsa_lab" not in names and {"torch", "safetensors", "flashinfer"} <= names, names


@pytest.mark.parametrize("mode,code,said", [("nan", 1, "LEAK REPRODUCED"), ("clean", 0, "no leak"),
                                            ("import", 3, "CANNOT RUN: import flashinfer"),
                                            ("plan", 3, "CANNOT RUN: flashinfer decode plan / run"),
                                            ("missing", 3, "CANNOT RUN: import flashinfer")])
def test_a_generated_script_exits_1_on_a_leak_0_clean_3_when_it_cannot_run(flashinfer_script, tmp_path, mode,
                                                                          code, said):
    stub = flashinfer_script / "stub"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(FAKE_FLASHINFER=mode, PYTHONPATH="" if mode == "missing" else str(stub))
    r = subprocess.run([sys.executable, str(flashinfer_script / "repro" / "x.py"), "--device", "cpu"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)   # another cwd
    assert r.returncode == code and said in r.stdout, r.stdout + r.stderr


def test_the_vllm_script_is_generated_without_qsa_lab_and_none_for_other_kernels():
    case = canary_case("fp16", attend="window:8", requests=3, context=40, query_len=1, q_heads=8, kv_heads=2,
                       head_dim=32)
    cell = {"region": "out-of-window", "plane": "v", "payload": "nan", "slots": 1}
    text = script_text("vllm:unified-3d", case, "x.safetensors", cell)
    assert "qsa_lab" not in re.sub(r'""".*?"""', "", text, flags=re.S).replace("qsa_lab's", "")
    assert "'window_size': [7, 0]" in text and "'segments': 16" in text
    compile(text, "x.py", "exec")
    assert script_text("torch:sdpa-math", case, "x.safetensors", cell) is None
    sparse = canary_case("fp16", attend="sparse", requests=3, context=40, query_len=1, q_heads=8, kv_heads=2,
                         head_dim=32, topk=4)
    assert script_text("flashinfer:decode", sparse, "x.safetensors", cell) is None   # the adapter skips it too
    assert "custom_mask" in script_text("flashinfer:prefill-fa2", sparse, "x.safetensors", cell)

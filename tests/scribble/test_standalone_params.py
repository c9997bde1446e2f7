"""The report's standalone scripts run on a stranger's machine with a stranger's --params (issue 48):
a workload that is not one (not JSON, not an object, an unknown key, a wrong type, a number out of
range, no reader request) is bad input, exit 2 in one line before the engine loads (it never checks
nothing and says CLEAN); an error of the engine mid-run is exit 3, never 1 (the leak's exit code)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qsa_lab.scribble.standalone import KINDS, SMALLEST, script_name, script_text


def _script(tmp_path, kind) -> Path:
    path = tmp_path / script_name(kind)
    path.write_text(script_text(kind, SMALLEST[kind]))
    return path


def _run(script, *args, env=None, isolate=True):
    flags = ["-I", "-S"] if isolate else []     # -S: the standard library only, no engine, no torch
    return subprocess.run([sys.executable, *flags, str(script), *args], cwd=script.parent, capture_output=True,
                          text=True, timeout=300, env=env)


BAD = [("x", "not JSON"), ("[1]", "must be a JSON object"), ('"{}"', "must be a JSON object"),
       ('{"nope": 1}', "unknown ['nope']"), ('{"prompt_lengths": [3]}', "prompt_lengths must list 2"),
       ('{"prompt_lengths": []}', "prompt_lengths"), ('{"prompt_lengths": "ab"}', "prompt_lengths"),
       ('{"prompt_lengths": [1, -4]}', "prompt_lengths"), ('{"prompt_lengths": [1, 1e999]}', "prompt_lengths"),
       ('{"vocab": 2}', "vocab must be an integer"), ('{"vocab": 99999999999}', "vocab must be"),
       ('{"new_tokens": 0}', "new_tokens"), ('{"layers": 0}', "layers"), ('{"layers": true}', "layers"),
       ('{"blocks": -1}', "blocks"), ('{"bad": 1e999}', "bad must be"), ('{"bad": "7"}', "bad must be"),
       ('{"bad": 1}', "bad must be"), ('{"seed": -1}', "seed"), ('{"new_tokens": NaN}', "new_tokens")]


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("params, said", BAD)
def test_a_workload_that_is_not_one_is_bad_input_in_one_line(tmp_path, kind, params, said):
    out = _run(_script(tmp_path, kind), "--params", params)
    assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr)
    assert out.stderr.count("\n") == 1 and ": error: --params: " in out.stderr and said in out.stderr, out.stderr


@pytest.mark.parametrize("kind, params", [("transformers-other-requests", '{"attn": "os:system"}'),
                                          ("vllm-cpu-tail", '{"dtype": "int8"}'),
                                          ("vllm-cpu-tail", '{"prefix_caching": "yes"}')])
def test_a_text_or_switch_out_of_its_choices_is_bad_input(tmp_path, kind, params):
    out = _run(_script(tmp_path, kind), "--params", params)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--params" in out.stderr, out.stderr


ENGINE = {   # a transformers or vLLM that imports, then fails the way `fails` says once the script runs it
    "transformers-other-requests": {
        "transformers/__init__.py": "__version__ = '5.25.0'\nAttentionInterface = GenerationConfig = object\n",
        "transformers/generation/__init__.py": "",
        "transformers/generation/configuration_utils.py": "ContinuousBatchingConfig = object\n",
        "transformers/utils/__init__.py": "from . import logging\n",
        "transformers/utils/logging.py": "def set_verbosity_error():\n    {fails}\n"},
    "vllm-cpu-tail": {
        "vllm/__init__.py": "__version__ = '0.32.0'\nLLM = SamplingParams = object\n",
        "vllm/inputs.py": "TokensPrompt = object\n",
        "safetensors/__init__.py": "",
        "safetensors/torch.py": "def save_file(*a, **k):\n    {fails}\n"},
}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("fails, code, said", [("raise RuntimeError('boom\\nsecond line')", 3,
                                                "CANNOT RUN: RuntimeError: boom second line"),
                                               ("raise KeyboardInterrupt", 130, "CANNOT RUN: interrupted")])
def test_an_engine_error_is_no_verdict(tmp_path, kind, fails, code, said):
    fake = tmp_path / "fake"
    for name, text in ENGINE[kind].items():
        (fake / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / name).write_text(text.replace("{fails}", fails))
    env = {**os.environ, "PYTHONPATH": str(fake)}
    out = _run(_script(tmp_path, kind), env=env, isolate=False)
    assert out.returncode == code and out.stdout.strip().splitlines()[-1] == said, (out.stdout, out.stderr[-2000:])
    assert "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_modules_lying_beside_a_script_are_never_imported(tmp_path, kind):
    """A report folder someone sent: `python scripts/<name>.py` puts scripts/ first on the import path.
    Before: a json.py (or torch.py) lying there ran."""
    script = _script(tmp_path, kind)
    marks = tmp_path / "MARKS"
    marks.mkdir()
    for name in ("json", "math", "argparse", "tempfile", "torch", "transformers", "vllm", "safetensors"):
        (tmp_path / f"{name}.py").write_text(f"import pathlib\npathlib.Path({str(marks / name)!r}).write_text('ran')\n")
    out = subprocess.run([sys.executable, "-S", str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert sorted(p.name for p in marks.iterdir()) == [], out.stderr
    assert out.returncode == 3 and out.stdout.startswith("CANNOT RUN: "), (out.stdout, out.stderr)

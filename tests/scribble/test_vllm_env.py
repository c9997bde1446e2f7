"""The scribble's vLLM adapter from the project's environment: its refusals and bad input (no torch,
no vLLM), and its tests, which run in vLLM's own environment (`make vllm-env`; `make test` builds
it): tests/scribble/on_vllm/ there, as one pytest run (each of its modules starts one engine)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qsa_lab.scribble.engines.vllm import env as vllm_env
from qsa_lab.scribble.versions import UnsupportedVersion

REPO = Path(__file__).resolve().parents[2]


def test_a_vllm_version_the_adapter_was_not_written_for_is_one_line():
    for version in ("0.31.0", "0.33.0"):
        line = vllm_env.VLLM.refusal(version)
        assert line is not None and "\n" not in line and version in line and "0.32.0" in line
    assert vllm_env.VLLM.refusal("0.32.0") is None
    with pytest.raises(UnsupportedVersion, match="0.31.0"):
        vllm_env.VLLM.require("0.31.0")


def test_transformers_only_options_with_the_vllm_engine_are_bad_input_without_torch():
    code = ("import sys; from qsa_lab.app.cli import main; "
            "print(main(['scribble', '--engine', 'vllm', '--pad']), main(['scribble', '--no-prefix-caching']), "
            "'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["2", "2", "False"], out.stderr
    lines = out.stderr.splitlines()
    assert lines[0].startswith("qsa-lab: error: --pad: applies to --engine transformers only")
    assert lines[1].startswith("qsa-lab: error: --no-prefix-caching: applies to --engine vllm only")


def test_without_a_vllm_environment_the_command_says_how_to_make_one(tmp_path):
    if vllm_env.vllm_python() == sys.executable:
        pytest.skip("this Python has vLLM itself")
    code = "from qsa_lab.app.cli import main; raise SystemExit(main(['scribble', '--engine', 'vllm']))"
    env = {**os.environ, "VLLM_PYTHON": str(tmp_path / "no-such-python")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 3 and out.stdout == "", out.stderr
    assert out.stderr == ("qsa-lab: failed: vllm: not installed; the scribble's vLLM adapter needs vLLM 0.32.0 "
                          "(make vllm-env)\n")


@pytest.mark.parametrize("python", ["/bin/false", "/bin/true"])
def test_a_vllm_python_that_is_no_python_is_one_line_and_exit_3_never_the_leak_code(python):
    """VLLM_PYTHON=/bin/false once printed nothing and exited 1, the leak code; /bin/true would have exited 0."""
    if vllm_env.vllm_python() == sys.executable:
        pytest.skip("this Python has vLLM itself")
    code = "from qsa_lab.app.cli import main; raise SystemExit(main(['scribble', '--engine', 'vllm']))"
    env = {**os.environ, "VLLM_PYTHON": python}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 3 and out.stdout == "", out.stderr
    assert out.stderr.startswith(f"qsa-lab: failed: scribble: --engine vllm: {python} ") and "make vllm-env" in out.stderr


def _vllm_env():
    python = REPO / ".venv-vllm" / "bin" / "python"
    if not (REPO / ".venv-vllm" / ".qsa_lab-vllm").exists() or not python.exists():
        pytest.skip("no vLLM environment here (make vllm-env builds it; make test tries to)")
    return str(python)


def test_the_vllm_adapter_tests_pass_in_the_vllm_environment():
    python = _vllm_env()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT",
                                                          "PYTEST_CURRENT_TEST", "VIRTUAL_ENV")}
    out = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--tb=short",
                          "--disable-warnings",
                          "tests/scribble/on_vllm"], cwd=REPO, env=env, capture_output=True, text=True, timeout=2400)
    tail = (out.stdout + out.stderr)[-4000:]
    assert out.returncode == 0, tail
    summary = out.stdout.strip().splitlines()[-1]
    assert "passed" in summary and "skipped" not in summary and "failed" not in summary, tail


def test_the_vllm_workloads_are_the_named_workloads_sized_for_blocks_of_32():
    from qsa_lab.scribble.engines.vllm.engine import VLLM_WORKLOADS, vllm_workload
    from qsa_lab.scribble.engines.vllm.env import NOT_ON_VLLM
    from qsa_lab.scribble.models import WORKLOADS
    assert set(VLLM_WORKLOADS) == set(WORKLOADS) - set(NOT_ON_VLLM)
    for name, w in VLLM_WORKLOADS.items():
        assert w.name == name and w.page_size % 32 == 0
        assert sum(w.prompt_lengths) > w.max_batch_tokens          # every workload prefills in chunks
    reuse = vllm_workload("reuse")
    blocks = sum(-(-(n + reuse.new_tokens) // reuse.page_size) for n in reuse.prompt_lengths[:4])
    assert blocks > reuse.num_blocks - 1          # the first four requests cannot all hold their blocks at once
    assert reuse.shared_prefix >= 2 * reuse.page_size                 # two full blocks to hit in the prefix cache
    with pytest.raises(ValueError, match=r"^workload: 'issue32' is now called 'chunked-prefill'$"):
        vllm_workload("issue32")
    for name in ("offload", "fork"):
        with pytest.raises(ValueError, match=rf"^workload: {name}: vLLM 0.32 "):
            vllm_workload(name)


def test_the_models_and_workloads_vllm_does_not_run_are_bad_input_naming_why():
    for flag, name, why in (("--model", "qwen2-hybrid", "vLLM 0.32 refuses"), ("--workload", "offload", "vLLM 0.32 has no"),
                            ("--workload", "fork", "vLLM 0.32 runs parallel samples")):
        code = f"from qsa_lab.app.cli import main; raise SystemExit(main(['scribble', '--engine', 'vllm', '{flag}', '{name}']))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and out.stderr.startswith(f"qsa-lab: error: {flag}: {name}: {why}"), out.stderr


def test_the_vllm_only_model_is_bad_input_for_the_transformers_engine():
    code = "from qsa_lab.app.cli import main; raise SystemExit(main(['scribble', '--model', 'mixtral-moe']))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr == "qsa-lab: error: --model: mixtral-moe: built for --engine vllm only\n", out.stderr

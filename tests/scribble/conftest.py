"""The scribble's tests run transformers' continuous batching on the CPU with tiny models from a config.
They need a transformers version the adapter supports (`make test` installs one and runs this folder again
under the other: scripts/test_other_transformers.sh); without one they are skipped with the reason.
The vLLM adapter's tests do not use the project's transformers: on_vllm/ runs in vLLM's own environment
(test_vllm_env.py starts it there; elsewhere the folder is not collected), test_vllm_*.py need none."""
from importlib import util

import pytest

from qsa_lab.scribble.versions import refusal

HERE = __file__.rsplit("/", 1)[0]
collect_ignore = [] if util.find_spec("vllm") else ["on_vllm"]


def _uses_transformers(path: str) -> bool:
    return not (path.startswith(f"{HERE}/on_vllm/") or path.rsplit("/", 1)[-1].startswith("test_vllm_"))


def pytest_collection_modifyitems(config, items):
    line = refusal()
    if line is None:
        return
    for item in items:
        path = str(item.fspath)
        if path.startswith(HERE) and _uses_transformers(path):
            item.add_marker(pytest.mark.skip(reason=line))

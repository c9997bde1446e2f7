"""What every vLLM test shares: this folder is collected only where vLLM imports (tests/scribble/conftest.py),
its tests are skipped with the one-line refusal where that vLLM is not the one the adapter reads, and
`vllm_engine(model, workload)` builds one engine on a tiny model of its own (closed after the module).
In-process engines are ~20 s each to start: a module builds the ones it needs once."""
import pytest

from qsa_lab.scribble.engines.vllm.engine import VllmEngine, vllm_model, vllm_workload
from qsa_lab.scribble.engines.vllm.env import VLLM

#: regions the chunked-prefill workload fills at some step on vLLM (no sliding window, no write trash)
HELD = ("free-blocks", "unwritten-tail", "step-writes", "read-trash", "prefix-cache")


def pytest_collection_modifyitems(config, items):
    line = VLLM.refusal()
    if line is not None:
        for item in items:
            item.add_marker(pytest.mark.skip(reason=line))


@pytest.fixture(scope="module")
def held():
    return HELD


@pytest.fixture(scope="module")
def vllm_engine(tmp_path_factory):
    """make(model, workload, **VllmEngine's keywords) -> a VllmEngine on a tiny `model` saved in a fresh folder."""
    built = []

    def make(model="llama-gqa", workload="chunked-prefill", **kwargs):
        folder = vllm_model(model, folder=str(tmp_path_factory.mktemp(model)))
        built.append(VllmEngine(folder, vllm_workload(workload), **kwargs))
        return built[-1]
    yield make
    for engine in reversed(built):
        engine.close()

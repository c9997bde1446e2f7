"""The scribble on vLLM's CPU backend with a sliding window (a tiny Mistral, window 48, blocks of 32):
the out-of-window region holds the slots of a request's blocks that its window has left and the
blocks the window gave back. One engine for the module. Runs in the vLLM environment."""
import pytest

pytest.importorskip("vllm")

from qsa_lab.scribble import vllm_env  # noqa: E402
from qsa_lab.scribble.check import scribble  # noqa: E402
from qsa_lab.scribble.vllm_engine import VllmEngine, vllm_model, vllm_workload  # noqa: E402

if vllm_env.refusal() is not None:
    pytest.skip(vllm_env.refusal(), allow_module_level=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = VllmEngine(vllm_model("mistral-swa", folder=str(tmp_path_factory.mktemp("mistral"))), vllm_workload("reuse"))
    yield eng
    eng.close()


def test_out_of_window_slots_are_read_with_weight_zero_and_never_written(engine):
    """The CPU attention's first 32-token tile of a window starts at a tile boundary: the slots before
    the window in that tile are loaded with probability 0 (NaN leaks, the dtype's max does not)."""
    report = scribble(engine, regions=("out-of-window", "free-blocks"), payloads=("nan", "max"),
                      localise_leaks=False)
    read = {(c.region, c.payload): c for c in report.cells if c.check == "read"}
    assert read[("out-of-window", "nan")].verdict == "nan-leak" and read[("out-of-window", "nan")].slots > 0
    assert read[("out-of-window", "max")].verdict == "clean"
    assert read[("free-blocks", "nan")].verdict == read[("free-blocks", "max")].verdict == "clean"
    write = {c.region: c.verdict for c in report.cells if c.check == "write"}
    assert write == {"out-of-window": "clean", "free-blocks": "clean"}

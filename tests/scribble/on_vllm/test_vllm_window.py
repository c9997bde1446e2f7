"""The scribble on vLLM's CPU backend with a sliding window (a tiny Mistral, window 48, blocks of 32):
the out-of-window region holds the slots of a request's blocks that its window has left and the
blocks the window gave back. One engine for the module. Runs in the vLLM environment."""
import pytest

from qsa_lab.scribble.check import scribble


@pytest.fixture(scope="module")
def engine(vllm_engine):
    return vllm_engine("mistral-swa", "reuse")


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

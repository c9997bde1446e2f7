"""The scribble on vLLM's CPU backend with a mixture of experts (a tiny Mixtral: 4 experts, 2 per token,
vLLM's CPUUnquantizedExperts), the chunked-prefill workload, prefix caching on. One engine, one
scribble. Runs in the vLLM environment."""
import pytest

pytest.importorskip("vllm")

from qsa_lab.scribble import vllm_env  # noqa: E402
from qsa_lab.scribble.check import scribble  # noqa: E402
from qsa_lab.scribble.verdicts import OTHER, REGIONS  # noqa: E402
from qsa_lab.scribble.vllm_engine import VllmEngine, vllm_model, vllm_workload  # noqa: E402

if vllm_env.refusal() is not None:
    pytest.skip(vllm_env.refusal(), allow_module_level=True)

#: regions chunked-prefill fills at some step on vLLM (no sliding window, no write trash)
HELD = ("free-blocks", "unwritten-tail", "step-writes", "read-trash", "prefix-cache")


def test_the_moe_model_is_clean_everywhere_but_the_unwritten_tails(tmp_path):
    """The experts change the MLP, not the KV cache: the same pool regions as the Llama's, and the
    same one finding (the last block's slots past a request's length are read with weight 0)."""
    engine = VllmEngine(vllm_model("mixtral-moe", folder=str(tmp_path)), vllm_workload("chunked-prefill"))
    try:
        report = scribble(engine, payloads=("nan",), localise_leaks=False)
    finally:
        engine.close()
    read = {c.region: c for c in report.cells if c.check == "read"}
    assert set(read) == set(REGIONS) | {OTHER}
    for region, c in read.items():
        if region == "unwritten-tail":
            assert c.verdict == "nan-leak" and c.slots > 0, c
        elif region in HELD or region == OTHER:
            assert c.verdict == "clean" and c.slots > 0, (region, c)
        else:
            assert c.verdict == "n/a", (region, c)
    write = {c.region: c.verdict for c in report.cells if c.check == "write"}
    assert {r for r, v in write.items() if v == "clean"} == set(HELD), write
    assert all(v == "n/a" for r, v in write.items() if r not in HELD), write
    assert report.events["chunked_prefill"] >= 1 and report.exit_code() == 1

"""The scribble on vLLM's CPU backend with a mixture of experts (a tiny Mixtral: 4 experts, 2 per token,
vLLM's CPUUnquantizedExperts), the chunked-prefill workload, prefix caching on. One engine, one
scribble. Runs in the vLLM environment."""
from qsa_lab.scribble.check import scribble
from qsa_lab.scribble.regions import OTHER, REGIONS


def test_the_moe_model_is_clean_everywhere_but_the_unwritten_tails(vllm_engine, held):
    """The experts change the MLP, not the KV cache: the same pool regions as the Llama's, and the
    same one finding (the last block's slots past a request's length are read with weight 0)."""
    report = scribble(vllm_engine("mixtral-moe"), payloads=("nan",), localise_leaks=False)
    read = {c.region: c for c in report.cells if c.check == "read"}
    assert set(read) == set(REGIONS) | {OTHER}
    for region, c in read.items():
        if region == "unwritten-tail":
            assert c.verdict == "nan-leak" and c.slots > 0, c
        elif region in held or region == OTHER:
            assert c.verdict == "clean" and c.slots > 0, (region, c)
        else:
            assert c.verdict == "n/a", (region, c)
    write = {c.region: c.verdict for c in report.cells if c.check == "write"}
    assert {r for r, v in write.items() if v == "clean"} == set(held), write
    assert all(v == "n/a" for r, v in write.items() if r not in held), write
    assert report.events["chunked_prefill"] >= 1 and report.exit_code() == 1

"""The scribble on vLLM's CPU backend under pressure: the `reuse` workload on a tiny Llama, a pool of
7 usable blocks, prefix caching on. One engine for the module. Runs in the vLLM environment."""
import pytest

from qsa_lab.scribble.check import scribble


@pytest.fixture(scope="module")
def engine(vllm_engine):
    return vllm_engine("llama-gqa", "reuse")


def test_the_reuse_workload_forces_chunked_prefill_prefix_hits_block_reuse_and_preemption(engine):
    gen = engine.generate()
    assert not gen.error and all(len(t) == engine.workload.new_tokens for t in gen.tokens.values())
    events = gen.events
    assert events["chunked_prefill"] >= 1, events      # prompts longer than a step's 48 tokens
    assert events["prefix_hit_tokens"] >= 64, events   # the last two prompts share two full blocks
    assert events["blocks_reused"] >= 1, events        # a block one request freed, another one took
    assert events["preempted"] >= 1, events            # a decode found no free block


def test_under_pressure_the_only_leaks_are_the_unwritten_tail_and_nothing_writes_where_it_must_not(engine):
    """A prefix-cache hit on a block another request fills in the same step: those slots are that
    step's writes (each layer writes before it reads), not a stray write into owned rows.
    other-requests leaks here through the same unwritten tails: the poisoned request reads its own NaN,
    so the K and V it writes from layer 1 on are NaN (layer 0's come from the embeddings); after it
    finishes, a later request is handed that block and reads the stale slots past its own length with
    weight 0. Every pair is read after the poisoned request left the batch, first at layer 1."""
    report = scribble(engine, payloads=("nan",), localise_leaks=True)
    read = {c.region: c for c in report.cells if c.check == "read"}
    assert {r: c.verdict for r, c in read.items()} == {
        "free-blocks": "clean", "unwritten-tail": "nan-leak", "step-writes": "clean", "read-trash": "clean",
        "write-trash": "n/a", "prefix-cache": "clean", "out-of-window": "n/a", "other-requests": "nan-leak"}
    steps = engine.generate().steps
    last = {r: max(i for i, (batch, _) in enumerate(steps) if r in batch) for batch, _ in steps for r in batch}
    pairs = read["other-requests"].pairs
    assert pairs and all(p["step"] > last[p["poisoned"]] and p["layer"] == 1 for p in pairs), pairs
    write = [c for c in report.cells if c.check == "write"]
    assert all(c.verdict in ("clean", "n/a") for c in write), [(c.region, c.verdict, c.strays[:1]) for c in write]
    assert {c.region for c in write} == set(read) - {"other-requests"}     # no stray write into owned rows

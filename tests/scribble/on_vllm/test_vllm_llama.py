"""The scribble on vLLM's CPU backend: a tiny Llama (GQA 4:2, head_dim 32), the chunked-prefill workload,
prefix caching on. One engine for the module (in-process, ~20 s to start). Runs in the vLLM
environment (make vllm-env); tests/scribble/test_vllm_env.py runs this folder there."""
import json
import subprocess
import sys

import pytest
import torch

from qsa_lab.scribble.check import scribble
from qsa_lab.scribble.compare import same
from qsa_lab.scribble.engines.vllm.engine import VllmEngine, vllm_workload
from qsa_lab.scribble.engines.vllm.env import VLLM
from qsa_lab.scribble.guard import Scribbler
from qsa_lab.scribble.regions import OTHER, REGIONS


@pytest.fixture(scope="module")
def engine(vllm_engine):
    return vllm_engine("llama-gqa", "chunked-prefill")


@pytest.fixture(scope="module")
def folder(engine):
    return engine.model_dir


@pytest.fixture(scope="module")
def stock(engine):
    return scribble(engine, payloads=("nan", "max"))      # inf behaves as nan here (0 * inf = NaN): the matrix has it


def cells(report, check="read"):
    return {(c.region, c.payload): c for c in report.cells if c.check == check}


def test_the_stock_cpu_engine_is_clean_everywhere_but_the_unwritten_tails_it_reads_with_weight_zero(stock, held):
    """vLLM's CPU attention walks a request's KV in tiles of 32 tokens: the slots of the last block past
    the request's length are loaded and multiplied by probability 0. NaN or Inf there (stale bytes of a
    block's earlier owner) turns every logprob NaN; the dtype's max changes nothing (0 * max = 0). This
    workload hands no block to a second request, so no request's NaN reaches another (other-requests
    clean; the reuse workload's test shows the path through a reused block)."""
    read = cells(stock)
    assert len(read) == len(REGIONS) * 2
    for (region, payload), c in read.items():
        if region == "unwritten-tail" and payload == "nan":
            assert c.verdict == "nan-leak" and c.slots > 0, c
            assert c.where["step"] == 0 and c.where["layer"] == 0, c.where
        elif region in held or region == OTHER:
            assert c.verdict == "clean" and c.slots > 0, (region, payload, c)
        else:
            assert c.verdict == "n/a", (region, payload, c)
    write = cells(stock, "write")
    assert {r for (r, _), c in write.items() if c.verdict == "clean"} == set(held)
    assert {r for (r, _), c in write.items() if c.verdict != "clean"} == {"write-trash", "out-of-window"}
    assert all(c.verdict == "n/a" for (r, _), c in write.items() if r not in held)
    assert stock.moved_rows == 0 and stock.events["chunked_prefill"] >= 1 and stock.events["blocks_reused"] == 0
    assert stock.exit_code() == 1


PLAIN = """
import json, sys, torch
from qsa_lab.scribble.engines.vllm.engine import VllmEngine, vllm_workload
gen = VllmEngine(sys.argv[1], vllm_workload("chunked-prefill"), scribble=False).generate()
torch.save({"tokens": gen.tokens, "logprobs": gen.logprobs, "logits": gen.logits}, sys.argv[2])
"""


def test_tokens_and_logprobs_are_bit_identical_with_and_without_the_scribble(engine, folder, tmp_path):
    """The same model in an engine without the connector (another process: one engine a process)
    gives the very same tokens, logprobs and full-vocabulary logprobs as this one, guarded or not."""
    out = tmp_path / "plain.pt"
    run = subprocess.run([sys.executable, "-c", PLAIN, folder, str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    plain = torch.load(out)
    guarded = engine.generate(Scribbler())
    bare = engine.generate()
    for gen in (guarded, bare):
        assert not gen.error and gen.tokens == plain["tokens"] and gen.logprobs == plain["logprobs"]
        assert len(gen.logits) == len(plain["logits"])
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(gen.logits, plain["logits"]))
    assert same(guarded, bare)


def test_an_attention_that_reads_one_free_block_with_weight_zero_is_a_nan_leak_in_free_blocks(engine, stock,
                                                                                               monkeypatch):
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    forward = CPUAttentionBackendImpl.forward
    last = engine.workload.num_blocks - 1        # handed out last: free in some steps of every generation

    def leaky(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        out = forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if attn_metadata is not None:            # one element of a free block, with weight 0
            out[: attn_metadata.num_actual_tokens] += 0.0 * kv_cache[last].reshape(-1)[0]
        return out

    monkeypatch.setattr(CPUAttentionBackendImpl, "forward", leaky)
    report = scribble(engine, payloads=("nan",))
    read, before = cells(report), cells(stock)
    assert read[("free-blocks", "nan")].verdict == "nan-leak"
    assert read[("free-blocks", "nan")].where["layer"] == 0      # the first layer to read the block shows it
    changed = {k for k, c in read.items() if c.verdict != before[k].verdict}
    assert changed == {("free-blocks", "nan")}, {k: read[k].verdict for k in changed}


def test_one_byte_written_into_the_null_block_is_a_stray_write(engine, monkeypatch):
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    update = CPUAttentionBackendImpl.do_kv_cache_update

    def stray(self, layer, key, value, kv_cache, slot_mapping):
        update(self, layer, key, value, kv_cache, slot_mapping)
        kv_cache[0].view(torch.uint8).reshape(-1)[5] += 1      # one byte of block 0: the null block

    monkeypatch.setattr(CPUAttentionBackendImpl, "do_kv_cache_update", stray)
    report = scribble(engine, payloads=())
    write = cells(report, "write")
    assert write[("read-trash", "-")].verdict == "stray-write"
    first = write[("read-trash", "-")].strays[0]
    assert first["step"] == 0 and first["count"] == 1 and first["layer"] == 0
    assert {r for (r, _), c in write.items() if c.verdict == "stray-write"} == {"read-trash"}
    assert report.exit_code() == 1


def test_a_write_into_a_free_block_between_steps_is_a_stray_write_naming_the_step_and_the_call(engine, monkeypatch):
    """vLLM's model runner works on the pool between two forwards (`_update_states`: zeroing new blocks,
    copy-on-write copies). One element of a block free at that moment, written after step 1 and before
    step 2 of every generation."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from qsa_lab.scribble.engines.vllm.connector import ACTIVE
    update = GPUModelRunner._update_states

    def stray(self, scheduler_output):
        out = update(self, scheduler_output)
        if ACTIVE["run"] is not None and ACTIVE["run"].step == 2:
            pool = ACTIVE["scheduler"]._block_pool
            free = next(b.block_id for b in pool.blocks if b.ref_cnt == 0 and not b.is_null and b.block_hash is None)
            worker = ACTIVE["worker"]
            worker.flat[torch.nonzero(worker.map.block == free)[0]] += 1.0
        return out

    monkeypatch.setattr(GPUModelRunner, "_update_states", stray)
    report = scribble(engine, payloads=())
    write = cells(report, "write")
    assert {r for (r, _), c in write.items() if c.verdict == "stray-write"} == {"free-blocks"}
    first = write[("free-blocks", "-")].strays[0]
    assert first["when"] == "after step 1, before step 2" and first["call"] == "CPUModelRunner._update_states"
    assert first["count"] == 1 and first["layer"] in (0, 1)
    assert report.exit_code() == 1


def test_an_attention_that_reads_another_live_requests_kv_with_weight_zero_is_a_nan_leak_at_other_requests(
        engine, stock, monkeypatch):
    """Each request's attention output gets 0 x the first element (K of its first token) of the next
    request's first block in the batch: a cross-request read at weight 0. Filling one request's own rows
    with NaN turns the request before it NaN, named as the reader."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    forward = CPUAttentionBackendImpl.forward

    def across(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        out = forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if attn_metadata is not None:
            starts = attn_metadata.query_start_loc.tolist()
            n = len(starts) - 1
            for i in range(n if n > 1 else 0):
                out[starts[i]: starts[i + 1]] += 0.0 * kv_cache[attn_metadata.block_table[(i + 1) % n, 0]].reshape(-1)[0]
        return out

    monkeypatch.setattr(CPUAttentionBackendImpl, "forward", across)
    report = scribble(engine, regions=(OTHER, "free-blocks"), payloads=("nan",))
    other = cells(report)[(OTHER, "nan")]
    assert other.verdict == "nan-leak" and other.pairs, other
    assert all(p["reader"] != p["poisoned"] and p["layer"] == 0 for p in other.pairs), other.pairs
    assert cells(report)[("free-blocks", "nan")].verdict == "clean"


def test_a_write_into_the_null_block_during_warm_up_is_a_stray_write_at_warm_up(engine):
    """The pool as allocated against the pool when the first generation starts: what warm-up and
    graph capture wrote. Here the record of the allocated pool is made to differ by one element."""
    from qsa_lab.scribble.engines.vllm.connector import ACTIVE
    worker = ACTIVE["worker"]
    saved = worker.at_allocation.clone()
    worker.at_allocation[7] = 1.0          # element 7 lies in block 0 (every layer's block 0 is the null block)
    try:
        report = scribble(engine, payloads=())
    finally:
        worker.at_allocation.copy_(saved)
    stray = cells(report, "write")[("read-trash", "-")]
    assert stray.verdict == "stray-write" and stray.strays[0]["step"] == "warmup" and stray.strays[0]["count"] == 1


def test_an_unsupported_vllm_version_is_refused_in_one_line(engine, monkeypatch, capsys):
    from qsa_lab.app.cli import main
    from qsa_lab.scribble.versions import UnsupportedVersion
    monkeypatch.setattr(VLLM, "installed", lambda: "0.31.0")
    with pytest.raises(UnsupportedVersion, match="0.31.0"):
        VllmEngine(engine.model_dir, vllm_workload("chunked-prefill"))
    assert main(["scribble", "--engine", "vllm", "--regions", "read-trash", "--payloads", "nan"]) == 3
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("qsa-lab: failed: vllm: version 0.31.0")


def test_the_report_names_the_engine_and_its_facts(stock, engine):
    doc = json.loads(json.dumps(stock.to_dict()))
    assert doc["engine"] == "vllm" and doc["reads_pool"] == "block-table" and doc["graphs"] is False
    assert engine.facts["vllm"] == "0.32.0" and engine.facts["isa"] in ("vec", "vec16", "amx", "neon")
    assert engine.facts["threads"] == 1
    assert doc["events"]["chunked_prefill"] >= 1       # the 47-token prompt does not fit one step's 64 tokens
    assert doc["events"]["steps"] == len(engine.generate().steps)

"""The scribble on transformers' continuous batching, CPU, a tiny random Llama (2 layers, GQA 4:2)."""
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qsa_lab.scribble import versions  # noqa: E402
from qsa_lab.scribble.check import scribble  # noqa: E402
from qsa_lab.scribble.engines.transformers import TransformersEngine  # noqa: E402
from qsa_lab.scribble.guard import Scribbler  # noqa: E402
from qsa_lab.scribble.models import tiny_model, workload  # noqa: E402
from qsa_lab.scribble.regions import PAYLOADS, POOL_REGIONS, REGION_TEXT  # noqa: E402

# regions the chunked-prefill workload fills at some step; out-of-window needs a sliding-window model
HELD = ("free-blocks", "unwritten-tail", "step-writes", "read-trash", "write-trash", "prefix-cache")


def engine(pad=False, name="llama-gqa", wl="chunked-prefill"):
    return TransformersEngine(tiny_model(name), workload(wl), pad=pad)


def cells(report, check="read"):
    return {(c.region, c.payload): c for c in report.cells if c.check == check}


def test_unmodified_engine_unpadded_is_clean_in_every_pool_region():
    report = scribble(engine(), regions=POOL_REGIONS)
    read = cells(report)
    assert len(read) == len(POOL_REGIONS) * len(PAYLOADS)
    for (region, payload), c in read.items():
        if region in HELD:
            assert c.verdict == "clean" and c.slots > 0, (region, payload, c)
        else:
            assert c.verdict == "n/a", (region, payload, c)     # a dense model has no window
    assert all(c.verdict in ("clean", "n/a") for c in cells(report, "write").values())
    assert report.exit_code() == 0


def test_padded_read_trash_nan_is_a_nan_leak_there_only():
    """The issue's CPU reproduction: pad_inputs on, read trash NaN -> every generated token is garbage."""
    eng = engine(pad=True)
    hooks = Scribbler("read-trash", "nan")
    gen = eng.generate(hooks)
    assert all(tok == 0 for toks in gen.tokens.values() for tok in toks)          # argmax of NaN logits
    assert all(lp != lp for lps in gen.logprobs.values() for lp in lps)           # every logprob NaN
    report = scribble(eng, regions=POOL_REGIONS, payloads=("nan",))
    read = cells(report)
    assert read[("read-trash", "nan")].verdict == "nan-leak"
    assert read[("read-trash", "nan")].where["step"] == 0        # the first step already reads it
    assert {r for (r, _), c in read.items() if c.verdict != "clean" and c.verdict != "n/a"} == {"read-trash"}
    assert report.exit_code() == 1


def test_unpadded_read_trash_nan_changes_nothing():
    report = scribble(engine(), regions=("read-trash",), payloads=("nan",))
    assert cells(report)[("read-trash", "nan")].verdict == "clean"


def test_attention_that_reads_one_free_slot_with_weight_zero_is_a_nan_leak_in_free_blocks():
    from transformers import AttentionInterface
    from transformers.integrations.eager_paged import eager_paged_attention_forward
    eng = engine()

    def leaky(module, query, key, value, attention_mask, scaling, **kwargs):
        # also read block 2 token 0 (the last block the pool hands out: free in this workload), weight 0
        cache = eng.cache
        a = cache.layer_to_allocator[module.layer_idx]
        i, page = a.layer_indices.index(module.layer_idx), a.tokens_per_page
        rows = cache.cache_tensor.view(cache.dtype).view(-1, a.num_key_value_heads, a.head_dim)
        slot = 2 * a.block_physical_stride
        k, v = rows[slot + 2 * i * page], rows[slot + (2 * i + 1) * page]          # [kv_heads, head_dim]
        key = torch.cat([key, k[None, :, None, :].to(key.dtype)], dim=2)
        value = torch.cat([value, v[None, :, None, :].to(value.dtype)], dim=2)
        pad = torch.full((*attention_mask.shape[:-1], 1), torch.finfo(attention_mask.dtype).min,
                         dtype=attention_mask.dtype)
        return eager_paged_attention_forward(module, query, key, value, torch.cat([attention_mask, pad], -1),
                                             scaling, **kwargs)

    AttentionInterface.register("paged|eager", leaky)
    try:
        report = scribble(eng, regions=POOL_REGIONS, payloads=("nan",))
    finally:
        AttentionInterface.register("paged|eager", eager_paged_attention_forward)
    read = cells(report)
    leaking = {r for (r, _), c in read.items() if c.verdict not in ("clean", "n/a")}
    assert leaking == {"free-blocks"}, {k: c.verdict for k, c in read.items()}
    assert read[("free-blocks", "nan")].verdict == "nan-leak"


def test_a_step_that_writes_one_byte_into_the_read_trash_is_a_stray_write():
    from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator
    orig = FullAttentionCacheAllocator.update

    def update(self, key_states, value_states, layer_idx, read_index, write_index):
        out = orig(self, key_states, value_states, layer_idx, read_index, write_index)
        self._copy_view[0, 5] += 1          # one byte of block 0: the read trash
        return out

    FullAttentionCacheAllocator.update = update
    try:
        report = scribble(engine(), regions=POOL_REGIONS, payloads=())
    finally:
        FullAttentionCacheAllocator.update = orig
    write = cells(report, "write")
    assert write[("read-trash", "-")].verdict == "stray-write"
    stray = write[("read-trash", "-")].strays[0]
    assert stray["step"] == 0 and stray["count"] == 1 and stray["when"] == "during step 0"
    assert stray["rows"] == [0] and stray["where"] == "layer 0"          # byte 5 of block 0: layer 0's K, token 0
    assert {r for (r, _), c in write.items() if c.verdict == "stray-write"} == {"read-trash"}
    assert report.exit_code() == 1


def test_two_clean_runs_that_differ_are_unstable_control():
    eng = engine()
    calls = []

    def drift(module, args, output):     # a nondeterministic head: each forward adds a little more
        calls.append(1)
        return output + 1e-3 * len(calls)

    handle = eng.model.lm_head.register_forward_hook(drift)
    try:
        report = scribble(eng, regions=("free-blocks", "read-trash"), payloads=("nan",))
    finally:
        handle.remove()
    assert {c.verdict for c in report.cells if c.check == "read"} == {"unstable-control"}
    assert report.exit_code() == 3


def test_unsupported_transformers_version_is_one_line_and_no_verdict(monkeypatch, capsys):
    from qsa_lab.app.cli import main
    line = versions.refusal("5.17.0")
    assert line is not None and "\n" not in line and "5.17.0" in line and "5.24.0" in line
    monkeypatch.setattr(versions.TRANSFORMERS, "installed", lambda: "5.17.0")
    with pytest.raises(versions.UnsupportedVersion, match="5.17.0"):
        TransformersEngine(tiny_model(), workload("chunked-prefill"))
    assert main(["scribble", "--regions", "read-trash", "--payloads", "nan"]) == 3
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("qsa-lab: failed: transformers: version 5.17.0")


def test_bad_arguments_are_one_line_without_torch():
    code = ("import sys; from qsa_lab.app.cli import main; rc = main(['scribble', '--payloads', 'zero']); "
            "print(rc, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["2", "False"]
    assert done.stderr.startswith("qsa-lab: error: --payloads: unknown payload 'zero'") and done.stderr.count("\n") == 1


@pytest.mark.parametrize("name", ["mistral-swa", "qwen2-hybrid"])
def test_sliding_window_ring_leaves_no_out_of_window_slot_and_reads_nothing_unowned(name):
    """transformers' sliding layers are a ring (slot = position % window): the slot of the token that
    leaves the window is the one the step overwrites, so out-of-window is empty (n/a), not clean."""
    report = scribble(engine(name=name, wl="reuse"), regions=POOL_REGIONS, payloads=("nan",), localise_leaks=False)
    read = cells(report)
    assert read[("out-of-window", "nan")].verdict == "n/a"
    for region in ("free-blocks", "unwritten-tail", "step-writes", "read-trash", "write-trash"):
        assert read[(region, "nan")].verdict == "clean" and read[(region, "nan")].slots > 0, region
    assert report.exit_code() == 0


def test_verdict_grid_draws_every_region_and_column():
    import matplotlib
    matplotlib.use("Agg")
    from qsa_lab.scribble.report import Cell, ScribbleReport
    from qsa_lab.scribble.figures import verdict_grid
    report = ScribbleReport("e", "gather", False, "m", {}, [
        Cell("read", "read-trash", "nan", "nan-leak"), Cell("read", "free-blocks", "nan", "clean"),
        Cell("write", "read-trash", "-", "stray-write")])
    ax = verdict_grid(report)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["free-blocks", "read-trash"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["nan", "write"]
    # one mark per cell (qsa_lab.plotting.verdicts): free-blocks has no write cell, read-trash every one
    assert sorted(t.get_text() for t in ax.texts) == sorted([".", "-", "N", "W"])
    assert ax.get_xlabel() == report.verdict_line() == ("2 leaking of 3 checks (3 cells): 1 clean, 1 nan-leak, "
                                                   "1 stray-write; leaks or stray writes in read-trash; exit code 1")


def test_the_table_ends_with_a_summary_line_and_a_legend_of_its_regions():
    report = scribble(engine(pad=True), regions=("free-blocks", "read-trash"), payloads=("nan",))
    lines = report.table().splitlines()
    summary = next(line for line in lines if line.startswith("summary: "))
    assert summary == "summary: " + report.verdict_line()
    assert report.verdict_line() == ("1 leaking of 4 checks (4 cells): 3 clean, 1 nan-leak; leaks or stray writes in "
                                "read-trash; exit code 1")
    legend = lines[lines.index(summary) + 1:]
    assert legend[0].startswith("regions (rows filled per read run")
    for line, region in zip(legend[1:], ("free-blocks", "read-trash")):
        name, rows, text = line.split(maxsplit=2)
        rows_filled = next(c.slots for c in report.cells if c.check == "read" and c.region == region)
        assert (name, int(rows), text) == (region, rows_filled, REGION_TEXT[region]) and rows_filled > 0
    assert report.to_dict()["counts"] == {"cells": 4, "checks": 4, "leaking": 1}


def test_an_mla_models_latent_rows_are_the_pool_on_525_and_refused_on_524():
    """transformers 5.25 caches an MLA layer's two latents in one row per token (its MLA allocator); 5.24
    has no MLA allocator and fails in continuous batching, so the adapter refuses the model there."""
    model = tiny_model("deepseek-mla")
    if versions.TRANSFORMERS.installed() == "5.24.0":
        with pytest.raises(ValueError, match="^model: an MLA model"):
            TransformersEngine(model, workload("chunked-prefill"))
        return
    eng = TransformersEngine(model, workload("chunked-prefill"))
    widths = []

    class Rows(Scribbler):
        def before_step(self, view):
            widths.append(view.pool.shape[1])
            super().before_step(view)
    assert not eng.generate(Rows()).error
    assert set(widths) == {32 + 8}                        # kv_lora_rank + qk_rope_head_dim
    report = scribble(eng, regions=POOL_REGIONS, payloads=("nan",))
    assert {c.verdict for c in report.cells} <= {"clean", "n/a"}
    assert cells(report)[("free-blocks", "nan")].slots > 0 and report.exit_code() == 0

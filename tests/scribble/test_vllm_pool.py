"""vLLM's pool sorted into the scribble's regions, without vLLM: a synthetic pool of 4 blocks of 4
tokens, one layer, one head, K and V of a token side by side (4 elements a token), block 0 the null
block. Each element's label is checked against what the regions mean."""
import torch

from qsa_lab.scribble.vllm_pool import PoolMap, RequestMeta, StepMeta

BS, BLOCKS, PER_TOKEN = 4, 4, 4


def pool_map():
    flat = torch.zeros(BLOCKS * BS * PER_TOKEN)
    view = flat.view(BLOCKS, 1, BS, PER_TOKEN)                    # [blocks, heads, tokens, K and V]
    token_of = torch.arange(BS).repeat_interleave(PER_TOKEN)      # block 0's elements, in view order
    return PoolMap(flat, [(0, 0, view, token_of)], BS, BLOCKS, groups=1)


def labels(view):
    out = {}
    for name, rows in view.regions.items():
        for r in rows.tolist():
            out[(r // (BS * PER_TOKEN), r // PER_TOKEN % BS)] = name
    for r in view.owned.tolist():
        out[(r // (BS * PER_TOKEN), r // PER_TOKEN % BS)] = "owned"
    return out


def step(requests, windows=(None,), free=(), cached=()):
    return StepMeta(sum(r.scheduled for r in requests), 0, list(free), list(cached), {}, requests,
                    [(r.name, r.scheduled) for r in requests if r.scheduled], windows)


def test_null_block_written_slots_this_steps_slots_tails_and_free_blocks():
    view = pool_map().view(0, step([RequestMeta("a", ([1, 2],), computed=5, scheduled=2)], free=[3]))
    got = labels(view)
    assert all(got[(0, t)] == "read-trash" for t in range(BS))
    assert [got[(1, t)] for t in range(BS)] == ["owned"] * 4
    assert [got[(2, t)] for t in range(BS)] == ["owned", "step-writes", "step-writes", "unwritten-tail"]
    assert all(got[(3, t)] == "free-blocks" for t in range(BS))
    assert view.may_write.tolist() == view.regions["step-writes"].tolist()
    assert len(got) == BLOCKS * BS and view.owned.numel() == 5 * PER_TOKEN      # every element, once


def test_a_prefix_hit_on_slots_another_request_writes_in_the_same_step_leaves_them_step_writes():
    a = RequestMeta("a", ([1, 2],), computed=5, scheduled=3)                    # fills block 2 now
    b = RequestMeta("b", ([1, 2, 3],), computed=8, scheduled=1)                 # hit both blocks
    got = labels(pool_map().view(0, step([a, b])))
    assert [got[(2, t)] for t in range(BS)] == ["owned", "step-writes", "step-writes", "step-writes"]
    assert [got[(3, t)] for t in range(BS)] == ["step-writes"] + ["unwritten-tail"] * 3


def test_a_sliding_window_leaves_its_older_slots_out_of_window_and_cached_free_blocks_are_prefix_cache():
    c = RequestMeta("c", ([1, 2],), computed=6, scheduled=1)        # window 4: position 6 sees 3..6
    got = labels(pool_map().view(0, step([c], windows=(4,), cached=[3])))
    assert [got[(1, t)] for t in range(BS)] == ["out-of-window"] * 3 + ["owned"]
    assert [got[(2, t)] for t in range(BS)] == ["owned", "owned", "step-writes", "unwritten-tail"]
    assert all(got[(3, t)] == "prefix-cache" for t in range(BS))


def test_warm_up_owns_nothing_and_names_the_null_block():
    pm = pool_map()
    view = pm.warmup_view(pm.pool.clone())
    assert view.owned.numel() == 0 and view.may_write.numel() == 0
    assert view.regions["read-trash"].tolist() == list(range(BS * PER_TOKEN))

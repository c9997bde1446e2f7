"""vLLM's pool sorted into the scribble's regions, without vLLM: a synthetic pool of 4 blocks of 4
tokens, one layer, one head, K and V of a token side by side (4 elements a token), block 0 the null
block. Each element's label is checked against what the regions mean."""
import pytest
import torch

from qsa_lab.scribble.engines.vllm.pool import PoolMap, RequestMeta, StepMeta

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


def rows_of(view, request):
    """request -> {(block, token)} of the rows only it may read."""
    return {(r // (BS * PER_TOKEN), r // PER_TOKEN % BS) for r in view.request_rows.get(request, torch.zeros(0)).tolist()}


def test_each_request_owns_the_written_slots_no_other_request_reads():
    a = RequestMeta("a", ([1],), computed=3, scheduled=1)
    b = RequestMeta("b", ([2, 3],), computed=5, scheduled=1)
    view = pool_map().view(0, step([a, b]))
    assert rows_of(view, "a") == {(1, 0), (1, 1), (1, 2)}
    assert rows_of(view, "b") == {(2, t) for t in range(BS)} | {(3, 0)}
    mine = torch.cat([view.request_rows["a"], view.request_rows["b"]]).sort().values
    assert torch.equal(mine, view.owned)              # every owned row is one request's here


def test_slots_two_requests_read_are_nobodys_alone_unless_they_are_one_family():
    a = RequestMeta("a", ([1, 2],), computed=6, scheduled=1)
    b = RequestMeta("b", ([1, 3],), computed=5, scheduled=1)        # block 1: a prefix both read
    view = pool_map().view(0, step([a, b]))
    assert rows_of(view, "a") == {(2, 0), (2, 1)} and rows_of(view, "b") == {(3, 0)}
    joined = pool_map().view(0, step([a, b]), family=lambda r: "a")
    assert set(joined.request_rows) == {"a"}
    assert rows_of(joined, "a") == {(1, t) for t in range(BS)} | {(2, 0), (2, 1), (3, 0)}


def test_a_prefix_hit_on_a_block_another_request_wrote_joins_its_family_a_fresh_block_does_not():
    from qsa_lab.scribble.engines.vllm.pool import Families
    fam = Families(BS)
    fam.update(step([RequestMeta("a", ([1, 2],), computed=0, scheduled=6)]))    # a writes blocks 1 and 2
    fam.update(step([RequestMeta("c", ([2],), computed=0, scheduled=3)]))       # a gone; c gets block 2 fresh
    assert fam.mapping() == {}
    fam.update(step([RequestMeta("b", ([1, 3],), computed=4, scheduled=1)]))    # b is handed block 1 written
    assert fam.mapping() == {"b": "a"} and fam.of("b") == "a" and fam.of("c") == "c"
    fam.update(step([RequestMeta("b", ([1, 3],), computed=5, scheduled=1)]))    # held since: no new link
    assert fam.mapping() == {"b": "a"}


@pytest.mark.parametrize("few", [1, 10 ** 9])      # every region from its cells' runs | from one pass over the pool
def test_a_guard_alone_gets_the_step_writes_and_region_sizes_without_the_regions_and_still_names_a_stray(monkeypatch, few):
    monkeypatch.setattr(PoolMap, "FEW", few)
    from qsa_lab.scribble.guard import Scribbler
    flat = torch.zeros(BLOCKS * BS * PER_TOKEN)
    cache = flat.view(BLOCKS, 1, PER_TOKEN, BS).transpose(2, 3)     # column-major: a token's elements lie apart
    pm = PoolMap(flat, [(0, 0, cache, torch.arange(BS).repeat_interleave(PER_TOKEN))], BS, BLOCKS, groups=1)
    built, rows_of = [], PoolMap.rows_of
    monkeypatch.setattr(PoolMap, "rows_of", lambda self, *args: built.append(1) or rows_of(self, *args))
    a = RequestMeta("a", ([1, 2],), computed=5, scheduled=3)
    b = RequestMeta("b", ([1, 2, 3],), computed=8, scheduled=1)
    view = pm.view(0, step([a, b]))
    guard = Scribbler()
    guard.before_step(view)
    flat[view.may_write] += 1                                       # the step's own writes
    guard.after_step(view)
    one = {name: view.rows_in(name).tolist() for name in view.region_sizes()}   # what a scribble fills
    assert not built and guard.strays == [] and view.rows_in("no-such-region") is None   # nothing sorted, nothing stray
    assert one == {name: rows.tolist() for name, rows in view.regions.items()}
    slots = {(int(pm.block[r]), int(pm.token[r])) for r in view.may_write}
    assert slots == {(2, 1), (2, 2), (2, 3), (3, 0)}
    assert view.may_write.tolist() == view.regions["step-writes"].tolist() and built == [1]    # ascending
    assert view.region_sizes() == {name: rows.numel() for name, rows in view.regions.items()}
    assert guard.region_rows["unwritten-tail"] == 3 * PER_TOKEN
    tail = int(view.regions["unwritten-tail"][0])
    view2 = pm.view(1, step([a, b]))
    guard.before_step(view2)
    flat[tail] = 7.0                                                # a stray write into block 3's tail
    guard.after_step(view2)
    assert [(s["region"], s["rows"]) for s in guard.strays] == [("unwritten-tail", [tail])]

"""Never write what the engine wrote; the write guard between steps (transformers 5.24 / 5.25, CPU).

An engine moves KV between steps on its own: a preempted request's blocks come back from the CPU swap
pool into blocks that were free (and filled) a moment before, a forked child gets a copy of its
parent's partial block. The scribble must leave those rows alone and call the stock engine clean; a
write between steps that is not such a move is a stray write, named by when and by the engine call."""
import pytest
import torch

from qsa_lab.scribble.check import scribble
from qsa_lab.scribble.engines.base import NoHooks, StepView
from qsa_lab.scribble.guard import Scribbler
from qsa_lab.scribble.regions import POOL_REGIONS

transformers = pytest.importorskip("transformers")

from qsa_lab.scribble.engines.transformers import TransformersEngine  # noqa: E402
from qsa_lab.scribble.models import tiny_model, workload  # noqa: E402


def cells(report, check="read"):
    return {(c.region, c.payload): c for c in report.cells if c.check == check}


def engine(wl="offload", name="llama-gqa", **kw):
    return TransformersEngine(tiny_model(name), workload(wl), **kw)


def bits(gen):
    """Tokens, logprobs and logits of a generation, floats as their bits."""
    return ({r: list(t) for r, t in gen.tokens.items()},
            {r: torch.tensor(v, dtype=torch.float32).view(torch.int32).tolist() for r, v in gen.logprobs.items()},
            [t.view(torch.int32).reshape(-1).tolist() for t in gen.logits])


@pytest.mark.parametrize("wl, event", [("offload", "restored"), ("fork", "forked_blocks")])
def test_restores_and_fork_copies_of_the_stock_engine_are_clean_with_identical_tokens(wl, event):
    eng = engine(wl)
    plain = eng.generate(NoHooks())
    assert plain.events[event] > 0 and not plain.error           # the engine really moved KV between steps
    guarded = Scribbler()
    assert bits(eng.generate(guarded)) == bits(plain)          # nothing poisoned: bit-identical
    assert guarded.moved_rows > 0 and guarded.strays == []
    for region in ("free-blocks", "unwritten-tail", "step-writes", "prefix-cache"):
        hooks = Scribbler(region, "nan")
        assert bits(eng.generate(hooks)) == bits(plain), region     # filled, and still bit-identical
        assert hooks.filled_rows > 0 and hooks.strays == [], region
    report = scribble(eng, regions=POOL_REGIONS, payloads=("nan",))
    assert {c.verdict for c in report.cells} <= {"clean", "n/a"}, report.table()
    assert report.moved_rows > 0 and report.exit_code() == 0


def test_a_write_into_a_free_block_between_steps_is_a_stray_write_with_its_step_and_call():
    """One element of row 128 (a sector no allocator holds, free in this workload) incremented after
    every update_batch: the engine's bytes change between steps, outside any step."""
    from transformers.generation.continuous_batching import continuous_api as api
    orig = api.ContinuousBatchProcessor.update_batch
    eng = engine("chunked-prefill")

    def update_batch(bp):
        orig(bp)
        bp.cache.cache_tensor.view(bp.cache.dtype).view(-1, 32)[128, 3] += 1

    api.ContinuousBatchProcessor.update_batch = update_batch
    try:
        report = scribble(eng, regions=POOL_REGIONS, payloads=())
    finally:
        api.ContinuousBatchProcessor.update_batch = orig
    write = cells(report, "write")
    assert {r for (r, _), c in write.items() if c.verdict == "stray-write"} == {"free-blocks"}
    strays = write[("free-blocks", "-")].strays
    assert strays[0]["when"] == "after step 0, before step 1" and strays[0]["call"] == "update_batch"
    assert strays[0]["rows"] == [128] and strays[0]["where"] == "no layer: unassigned sector"
    steps = len(eng.generate().steps)
    assert len(strays) == steps - 1            # after every step but the last (no step follows to see it)
    assert report.exit_code() == 1
    assert "after step 0, before step 1 in update_batch: free-blocks, no layer: unassigned sector" in report.table()


def test_a_restore_that_also_lands_in_the_write_trash_is_a_stray_write_of_that_call():
    """The engine's own move is legitimate only into rows a request owns next (and no request held before):
    the same copy into the write trash is stray, named by restore_scheduled_requests."""
    from transformers.generation.continuous_batching import offloading_manager as om
    orig = om.OffloadingManager.restore_scheduled_requests
    landed = []

    def restore(manager, requests_in_batch):
        back = [fs.state.request_id for fs in requests_in_batch if fs.state.is_cpu_offloaded]
        orig(manager, requests_in_batch)
        if back and not landed:     # the first real restore: its first block once more, into sector 1's first
            a = next(iter(manager.cache.cache_allocators.values()))
            a._copy_view[a.blocks_per_sector] = a._copy_view[a.block_table[back[0]][0]] + 1
            landed.append(a.blocks_per_sector * a.block_physical_stride)

    eng = engine("offload")
    om.OffloadingManager.restore_scheduled_requests = restore
    try:
        guard = Scribbler()
        eng.generate(guard)
    finally:
        om.OffloadingManager.restore_scheduled_requests = orig
    assert landed, "the workload restored nothing"
    assert {(s["call"], s["region"]) for s in guard.strays} == {("restore_scheduled_requests", "write-trash")}
    stray = guard.strays[0]
    assert stray["rows"][0] == landed[0] and stray["when"].startswith("after step ")
    assert stray["where"] == "layer 0" and guard.moved_rows > 0      # the real restore stayed legitimate


def test_rows_the_engine_wrote_between_steps_are_never_written_back():
    """A filled row that the engine overwrote between two steps keeps the engine's bytes when it leaves the
    region; a move into a row that no request held is the engine's own, a write nobody called or a move
    over a request's own rows is a stray write."""
    pool = torch.arange(16.0).reshape(8, 2)
    none = torch.zeros(0, dtype=torch.int64)

    def view(step, free, mine=()):
        mine = torch.tensor(mine, dtype=torch.int64)
        return StepView(step, pool, {"free-blocks": torch.tensor(free, dtype=torch.int64)}, mine, none,
                        torch.zeros(8, dtype=torch.int64), request_rows={"req_0": mine} if mine.numel() else {})
    s = Scribbler("free-blocks", "nan")
    s.before_step(view(0, [1, 2], mine=[6]))
    s.after_step(view(0, [1, 2], mine=[6]))
    with s.engine_call("restore", pool, moves=True):
        pool[1] = torch.tensor([-7.0, -8.0])        # the engine's own move: row 1 is a request's now
        pool[6] = torch.tensor([-1.0, -1.0])        # the same call over req_0's own row: stray
    pool[4] = torch.tensor([5.0, 5.0])              # and a write nobody called
    s.before_step(view(1, [], mine=[1, 6]))
    assert pool[1].tolist() == [-7.0, -8.0] and pool[2].tolist() == [4.0, 5.0]    # row 2 restored, row 1 not
    assert s.taken_back == 1 and s.moved_rows == 1
    assert sorted((x["rows"], x["call"], x["region"]) for x in s.strays) == [
        ([4], "outside every engine call the adapter wraps", "unlabelled"), ([6], "restore", "owned")]
    assert {x["when"] for x in s.strays} == {"after step 0, before step 1"}


def test_rows_that_leave_the_region_get_their_own_bytes_back():
    pool = torch.arange(12.0).reshape(6, 2)
    none = torch.zeros(0, dtype=torch.int64)

    def view(rows):
        return StepView(0, pool, {"free-blocks": torch.tensor(rows)}, none, none, torch.full((6,), -1))
    s = Scribbler("free-blocks", "nan")
    s.before_step(view([1, 2]))
    assert pool[1:3].isnan().all() and not pool[[0, 3, 4, 5]].isnan().any()
    s.after_step(view([1, 2]))
    s.before_step(view([2, 3]))
    assert pool[1].tolist() == [2.0, 3.0] and pool[2:4].isnan().all()       # row 1 restored, row 3 filled
    assert s.filled_rows == 4 and s.strays == []

"""The write guard's comparison (guard.changed_rows, sync_rows): every changed bit of every row is seen, an unchanged
pool is never flagged, and the guard built on it reports a stray bit where it landed (layer, K or V)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qsa_lab.scribble.engines.base import StepView
from qsa_lab.scribble.guard import Scribbler, changed_rows, pool_words, sync_rows

LAYERS, TOKENS = 3, 8


def kv_pool(dtype, width, seed=0):
    """[layers x (K, V) x tokens, width]: row (layer * 2 + plane) * TOKENS + token, as transformers lays it out."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS * 2 * TOKENS, width, generator=g).to(dtype)


def changed(pool, copy, first=None):
    """The rows changed since `copy` (brought up to date), as the guard sees them after a step: `first`
    (the step's writes) compared on their own, then the rest of the pool."""
    words = pool_words(pool)
    hits = sync_rows(words, copy, first).tolist() if first is not None else []
    rest = changed_rows(words, copy)
    return sorted(hits + ([] if rest is None else torch.nonzero(rest).reshape(-1).tolist()))


def flip(pool, row, element, bit):
    raw = pool.view(torch.uint8)
    size = pool.element_size()
    raw[row, element * size + bit // 8] ^= 1 << (bit % 8)


@pytest.mark.parametrize("dtype, width", [(torch.float32, 32), (torch.bfloat16, 24), (torch.float16, 3),
                                          (torch.float8_e4m3fn, 5), (torch.float32, 1), (torch.bfloat16, 1)])
@pytest.mark.parametrize("first", [False, True])
def test_one_flipped_bit_in_any_layer_k_or_v_is_that_row_and_no_other(dtype, width, first):
    pool = kv_pool(dtype, width)
    copy = pool_words(pool).clone()
    g = torch.Generator().manual_seed(1)
    for layer in range(LAYERS):
        for plane in (0, 1):                       # K, V
            row = (layer * 2 + plane) * TOKENS + int(torch.randint(TOKENS, (1,), generator=g))
            element = int(torch.randint(width, (1,), generator=g))
            bit = int(torch.randint(pool.element_size() * 8, (1,), generator=g))
            flip(pool, row, element, bit)
            hint = torch.tensor([row - 1, row]) if first and row else None
            assert changed(pool, copy, hint) == [row], (layer, plane, bit)
            assert changed_rows(pool_words(pool), copy) is None          # synced: the same pool is unchanged


def test_an_unchanged_pool_is_never_flagged_nan_payloads_and_signed_zeros_included():
    pool = kv_pool(torch.float32, 16)
    pool[3] = float("nan")
    pool[4] = -0.0
    copy = pool_words(pool).clone()
    assert changed_rows(pool_words(pool), copy) is None
    assert changed(pool, copy, torch.arange(pool.shape[0])) == []
    pool[4, 0] = 0.0                               # equal as floats, another bit pattern: a change
    assert torch.nonzero(changed_rows(pool_words(pool), copy)).reshape(-1).tolist() == [4]


def test_without_sync_the_copy_stays_and_with_it_only_the_changed_rows_are_copied():
    pool = kv_pool(torch.bfloat16, 8)
    copy = pool_words(pool).clone()
    kept = copy.clone()
    flip(pool, 5, 2, 3)
    assert torch.nonzero(changed_rows(pool_words(pool), copy, sync=False)).reshape(-1).tolist() == [5]
    assert torch.equal(copy, kept)
    assert torch.nonzero(changed_rows(pool_words(pool), copy)).reshape(-1).tolist() == [5]
    assert torch.equal(copy, pool_words(pool))
    with pytest.raises(ValueError, match="^pool:"):
        changed_rows(pool_words(pool[:-1]), copy)


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float8_e5m2]),
       width=st.integers(1, 9), rows=st.integers(1, 40), data=st.data())
def test_any_set_of_bit_flips_is_seen_on_exactly_the_rows_it_touched(dtype, width, rows, data):
    pool = torch.randn(rows, width).to(dtype)
    copy = pool_words(pool).clone()
    bits = width * pool.element_size() * 8
    spots = data.draw(st.sets(st.tuples(st.integers(0, rows - 1), st.integers(0, bits - 1)), max_size=6))
    for row, bit in spots:
        flip(pool, row, bit // (pool.element_size() * 8), bit % (pool.element_size() * 8))
    first = data.draw(st.none() | st.lists(st.integers(0, rows - 1), unique=True).map(
        lambda r: torch.tensor(r, dtype=torch.int64)))
    assert changed(pool, copy, first) == sorted({row for row, _ in spots})
    assert torch.equal(copy, pool_words(pool))


def test_the_guard_names_a_stray_bit_by_its_layer_and_a_write_of_the_step_is_no_stray():
    """Rows of layer l, K and V: one bit flipped during a step outside its writes is one stray of that row
    and layer; between steps, one stray outside every engine call; the step's own write is none."""
    pool = kv_pool(torch.bfloat16, 16)
    n = pool.shape[0]
    row_layer = torch.arange(n) // (2 * TOKENS)
    none = torch.zeros(0, dtype=torch.int64)
    writes = torch.tensor([TOKENS - 1, 2 * TOKENS - 1])      # layer 0's last token, K and V

    def view(step):
        return StepView(step, pool, {"free-blocks": torch.arange(n)}, none, writes, row_layer)
    for layer in range(LAYERS):
        for plane in (0, 1):
            row = (layer * 2 + plane) * TOKENS + 2
            guard = Scribbler()
            guard.before_step(view(0))
            flip(pool, row, 7, 15)                    # the sign bit of element 7
            flip(pool, int(writes[plane]), 0, 0)      # and the step's own write
            guard.after_step(view(0))
            assert [(s["rows"], s["layer"], s["when"]) for s in guard.strays] == [([row], layer, "during step 0")]
            flip(pool, row, 0, 0)
            guard.before_step(view(1))
            assert [(s["rows"], s["call"]) for s in guard.strays[1:]] == [
                ([row], "outside every engine call the adapter wraps")]

"""The attention spec and the one region model derived from it, at the kernel's own geometry
(GQA, prefill chunks, MLA), and the tables PagedCall gives adapters. Oracles are plain loops."""
import pytest
import torch

from qsa_lab.canary import AttentionSpec, PagedCall, attended_tokens, canary_case
from qsa_lab.model.plan import INT64_MAX, xqa_tokens
from qsa_lab.model.regions import _written, attended_slots, region_parts, region_referenced, region_slots, regions_of

SPECS = ["dense", "window:5", "window:6,sink:3", "sparse"]


@pytest.mark.parametrize("text", SPECS)
def test_spec_parse_round_trips(text):
    spec = AttentionSpec.parse(text)
    assert str(spec) == text and AttentionSpec.parse(str(spec)) == spec


@pytest.mark.parametrize("text", ["window", "window:0", "window:-1", "window:3,sink:x", "causal", "sink:2"])
def test_spec_parse_refuses_bad_text(text):
    with pytest.raises(ValueError, match="^attend: "):
        AttentionSpec.parse(text)


def test_spec_fields_are_checked():
    with pytest.raises(ValueError, match="attend: a mask spec needs"):
        AttentionSpec("mask")
    with pytest.raises(ValueError, match="window and sink belong"):
        AttentionSpec("dense", window=3)
    assert AttentionSpec("window", window=4, sink=1).in_range_region == "out-of-window"
    assert AttentionSpec("dense").in_range_region is None


def _oracle(case, spec):
    """[rows, max_tokens] bool by a loop over rows and positions, straight from the spec's words."""
    ps = case.page_size
    T = case.block_table.shape[1] * ps
    out = torch.zeros(case.rows, T, dtype=torch.bool)
    for i in range(case.rows):
        r, pos = int(case.token_to_req[i]), int(case.positions[i])
        seq = int(case.seq_lens[r])
        vis = min(pos + 1, seq)
        blocks = {int(b) for b in case.selected[i] if b >= 0}
        for p in range(T):
            if p >= seq or p > pos:
                continue
            if spec.kind == "dense":
                out[i, p] = True
            elif spec.kind == "window":
                out[i, p] = p > pos - spec.window or p < spec.sink
            elif spec.kind == "sparse":
                out[i, p] = p // 4 in blocks or p >= vis // 4 * 4
    return out


@pytest.mark.parametrize("text", SPECS)
@pytest.mark.parametrize("geometry", [{}, {"topk": 2, "context": 65}, {"query_len": 4, "requests": 2, "topk": 3}])
def test_attended_tokens_follow_the_spec(text, geometry):
    case = canary_case(attend=text, **geometry)
    assert torch.equal(attended_tokens(case), _oracle(case, case.spec))


def test_sparse_spec_is_the_xqa_token_list():
    case = canary_case(topk=2, context=65, layout="scatter")
    tok, _ = xqa_tokens(case.to_case())
    want = torch.zeros(case.kv_cache.shape[0] * case.page_size, dtype=torch.bool)
    want[tok[tok != INT64_MAX]] = True
    assert torch.equal(attended_slots(case).flatten(), want)


@pytest.mark.parametrize("text", SPECS + ["mask"])
def test_regions_are_reachable_and_never_attended(text):
    case = canary_case(context=65, topk=3, query_len=3, requests=3)
    if text == "mask":  # every other written token of the row's request, up to its position
        att = attended_tokens(case.with_spec("dense"))
        mask = att & (torch.arange(att.shape[1]) % 2 == 0)
        case = case.with_spec(AttentionSpec("mask", mask=mask))
    else:
        case = case.with_spec(text)
    attended = attended_slots(case)
    for region in regions_of(case.spec):
        for s, rows in region_parts(case, region):   # other-requests: not attended by the rows it judges
            assert not (s & attended_slots(case, rows)).any(), region
    inside = case.spec.in_range_region
    if inside is None:
        assert not (_written(case) & ~attended).any()          # dense: every written token is attended
    else:
        assert torch.equal(region_slots(case, inside), _written(case) & ~attended)
        assert region_slots(case, inside).any()
    with pytest.raises(ValueError, match="belongs to a"):
        region_slots(case, "masked" if text != "mask" else "unselected")


def test_a_mask_past_seq_len_is_refused():
    case = canary_case(attend="dense")
    mask = torch.ones(case.rows, case.block_table.shape[1] * case.page_size, dtype=torch.bool)
    with pytest.raises(ValueError, match="attend: mask row 0 attends position"):
        case.with_spec(AttentionSpec("mask", mask=mask))


def test_null_block_is_referenced_only_through_padding_entries():
    case = canary_case()
    assert region_referenced(case, "null-block")               # the shorter requests have a padding entry
    assert not region_referenced(case, "null-block", "page_table")
    assert region_referenced(canary_case(requests=1, rows=4), "null-block", "padded_plan")
    assert not region_referenced(case, "free-pages")
    one = canary_case(requests=1, rows=4)
    assert not region_referenced(one, "null-block")


# -- the kernel's geometry ---------------------------------------------------------------------------

GQA = dict(q_heads=8, kv_heads=2, head_dim=128, page_size=16)


def test_gqa_case_has_a_kv_head_dimension_and_each_head_its_own_values():
    case = canary_case(**GQA)
    pages = case.kv_cache.shape[0]
    assert tuple(case.kv_cache.shape) == (pages, 2, 16, 2, 128) and tuple(case.q.shape) == (10, 8, 128)
    assert not torch.equal(case.kv_cache[1, 0, :, 0], case.kv_cache[1, 0, :, 1])
    # never-written slots and the null block are zero, like the one-head builder leaves them
    assert not case.kv_cache.transpose(1, 2)[~_written(case)].any()
    assert case.qsa_unsupported().startswith("the qsa routes read one KV head")


def test_prefill_chunk_rows_are_each_requests_last_positions():
    case = canary_case(query_len=5, requests=2, context=40)
    assert case.rows == 10 and case.query_lens().tolist() == [5, 5]
    assert case.positions.tolist() == list(range(35, 40)) + list(range(34, 39))
    with pytest.raises(ValueError, match="^query_len: rows"):
        canary_case(query_len=5, requests=2, rows=9)


def test_one_kv_head_keeps_the_qsa_case_byte_for_byte():
    from qsa_lab.model.case import build_case
    from qsa_lab.canary.case import CANARY_GEOMETRY

    case = canary_case(free_pages=0)
    assert torch.equal(case.kv_cache, build_case(CANARY_GEOMETRY).kv_cache) and case.qsa_unsupported() is None
    assert canary_case(attend="dense").qsa_unsupported() is None          # same set: topk covers every block
    assert "attends dense" in canary_case(attend="dense", topk=2, context=65).qsa_unsupported()


def test_mla_case_reads_one_latent_as_k_and_v():
    case = canary_case(mla=True, head_dim=576, v_head_dim=512, q_heads=4)
    call = PagedCall.from_case(case)
    assert call.mla and not case.kv_cache[:, 1].any()
    assert torch.equal(call.pages("v"), call.pages("k")[..., :512])
    with pytest.raises(ValueError, match="kv_heads"):
        canary_case(mla=True, head_dim=576, v_head_dim=512, kv_heads=2, q_heads=4)


# -- PagedCall: the tables adapters rebuild -----------------------------------------------------------

def test_page_table_lists_only_used_pages():
    case = canary_case(**GQA, layout="scatter")
    call = PagedCall.from_case(case)
    indptr, indices, last = call.page_table()
    ps = case.page_size
    want_ind, want_ptr, want_last = [], [0], []
    for r, s in enumerate(case.seq_lens.tolist()):
        n = -(-s // ps)
        want_ind += case.block_table[r, :n].tolist()
        want_ptr.append(want_ptr[-1] + n)
        want_last.append(s - (n - 1) * ps)
    assert indices.tolist() == want_ind and indptr.tolist() == want_ptr and last.tolist() == want_last
    assert 0 not in want_ind and all(t.dtype == torch.int32 for t in (indptr, indices, last))


def test_indptrs_query_lens_and_attend_mask():
    case = canary_case(query_len=3, requests=2, context=30, attend="window:4,sink:2")
    call = PagedCall.from_case(case)
    assert call.query_lens().tolist() == [3, 3] and call.qo_indptr().tolist() == [0, 3, 6]
    assert call.kv_indptr().tolist() == [0, 30, 59]
    assert torch.equal(call.attend_mask(), _oracle(case, case.spec)) and call.attend_mask().device == call.device
    assert call.attend_mask().shape == call.row_slots().shape


def test_pages_by_plane_name_or_index_and_per_query_head():
    case = canary_case(**GQA)
    call = PagedCall.from_case(case)
    k, v = call.pages("k"), call.pages("v")
    assert torch.equal(k, call.pages(0)) and torch.equal(v, call.pages(1))
    S = case.block_table.shape[1] * case.page_size
    assert tuple(k.shape) == (10, S, 2, 128) and k.dtype == torch.float16
    kq = call.pages("k", heads="q")
    assert tuple(kq.shape) == (10, S, 8, 128) and torch.equal(kq[:, :, 5], k[:, :, 1])   # head 5 reads KV head 1
    r, pos = 3, int(case.positions[3])
    req = int(case.token_to_req[r])
    page, slot = int(case.block_table[req, pos // 16]), pos % 16
    assert torch.equal(k[r, pos], case.kv_cache[page, 0, slot])
    with pytest.raises(ValueError, match="plane: must be"):
        call.pages("q")

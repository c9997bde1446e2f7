"""The kernels, emulated in PyTorch tile by tile.

Same signatures as qsa_lab.routes.compiled, so every CUDA result has this slower twin.

grouped_forward follows the grouped page4 CTA of the real route: 32-token tiles of 8
entries, panels decoded to fp16 values without scale, inactive M-tiles skipped, and
its online softmax exactly:

    s        = attended ? (Q K^T) * sm_scale * k_scale : -1e30        (select masking)
    tile_max = max over the tile's 32 scores, NaN ignored (fmaxf)
    new_max  = fmaxf(old_max, tile_max)                               (NaN ignored)
    p        = attended ? exp(fmaxf(s - new_max, -80)) : 0            (fp32)
    tile_sum = sum of the fp32 p
    exp_diff = tile_sum > 0 ? exp(fmaxf(old_max - new_max, -80)) : 1
    sum, max updated only when tile_sum > 0; O = O * exp_diff + fp16(P) @ V (fp32)
    out      = sum > 0 ? O * v_scale / sum : 0

fmaxf ignores NaN, so a NaN score of an ATTENDED token never becomes the max and its
probability is exp(-80), 0 in fp16: the route silently drops that token (finite, wrong)
where XQA and the float64 reference give NaN. The scores, maxima and probabilities of
all tiles are computed at once; O and the sum are then accumulated tile by tile in the
kernel's order, so 0 * NaN in any P@V survives exactly as it does on the GPU.

The variants differ only in V: kernel_fix zeroes (masked_load never loads) the panel rows that
no query of the group attends; finite_pv multiplies P by V's finite values only and then adds,
to each row, the IEEE sum of p * v over the non-finite values that row itself attends:

    O   = O * exp_diff + P @ where(isfinite(V), V, 0)
    hit = the row attends a non-finite v of this tile (in an active M-tile)
    O   = hit ? O + sum over those v of p * v : O         (NaN, +Inf or -Inf; 0 * Inf = NaN)

so a row gets exactly the non-finite result its own values give it, and a row of another
request that shares the M-tile (P = 0 there) gets none. An empty query slot of a padded group
(group_rows EMPTY_ROW) has zero queries and attends nothing: its output is 0.
"""
from __future__ import annotations

import torch

from qsa_lab.model.case import slot_values, token_values
from qsa_lab.model.plan import EMPTY_ROW, GROUP, TILE_ENTRIES, m_tiles, tile_active_m_tiles, unattended_tokens
from qsa_lab.routes.labels import KERNEL_VARIANTS

VARIANTS = KERNEL_VARIANTS
ZEROING = ("kernel_fix", "masked_load")  # the variants whose unattended panel rows hold zeros
MASKED_SCORE = -1e30   # the real route's "negative infinity" for unattended scores
EXP_FLOOR = -80.0      # exp arguments are clamped here (fmaxf), as in the real route
#: XQA partitions as the real route sizes them: fp8 KV 256 tokens with fp32 partials,
#: fp16 KV 1024 tokens with fp16 partials
XQA_PARTITION = {"e4m3": (256, torch.float32), "e5m2": (256, torch.float32), "fp16": (1024, torch.float16)}
_CHUNK_ELEMS = 1 << 24  # panel elements per group chunk: bounds memory on long contexts


def fmax_reduce(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Max over `dim` as a tree of C fmaxf: NaN is ignored unless every element is NaN."""
    nan = torch.isnan(x)
    m = torch.where(nan, -torch.inf, x).amax(dim=dim)
    return torch.where(nan.all(dim=dim), torch.nan, m)


def decode_panel(kv_cache, microblocks, *, plane, kv_dtype):
    """[n] microblock ids -> [n*4, head_dim] fp16: their tokens decoded, no scale."""
    tok = (microblocks.long().unsqueeze(1) * 4 + torch.arange(4, device=kv_cache.device)).flatten()
    return token_values(kv_cache, tok, plane, kv_dtype).to(torch.float16)


def _check_variant(variant):
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def _grouped_chunk(q, kv_cache, k_scale, v_scale, group_rows, panels, masks, seq_len, kv_dtype, sm_scale,
                   units=None, unit_key=None):
    """One chunk of groups through the grouped kernel, for several (microblocks, variant) at once.

    What the variants share is computed once: they differ only in the panel rows that no query
    of the group attends (padding entries repointed by pad_fix; rows zeroed by kernel_fix /
    never loaded by masked_load) and in how P @ V treats non-finite values (finite_pv), and
    unattended scores are select-masked, so S, the maxima, P and the sums are the same for every
    variant (_softmax_state, which reads K only: with `units`, a routes.reuse.CleanUnits, it is
    taken from them when no K byte it reads changed); only V and with it P @ V differ, and panels
    whose P @ V is the same (_equal_panels) share one. -> [(out, lse)] per panel."""
    G, cap = masks.shape
    _, hq, D = q.shape
    nt = cap // TILE_ENTRIES
    R = GROUP * hq
    dev = q.device
    f32 = torch.float32
    # 1. panels [G, nt, 32, D]: token j of a tile is entry j//4, token j%4
    arange4 = torch.arange(4, device=dev)
    toks = [(mb.long().unsqueeze(-1) * 4 + arange4).view(G, nt, 32) for mb, _ in panels]
    state = lambda: _softmax_state(q, kv_cache, k_scale, v_scale, group_rows, toks[0], masks, seq_len,  # noqa: E731
                                   kv_dtype, sm_scale)
    if units is None:
        dead, attended, p16, e, inactive, row_sum, scale, lse, operands = state()
    else:
        dead, attended, p16, e, inactive, row_sum, scale, lse, operands = units(
            (unit_key, "softmax"), toks[0], state, (group_rows, masks, seq_len, panels[0][0]), planes=(0,))
    owner = _equal_panels(panels)
    done = {}
    for i in dict.fromkeys(owner):  # each distinct panel once
        zeroed = panels[i][1] in ZEROING
        V = token_values(kv_cache, toks[0 if zeroed else i], 1, kv_dtype)  # zeroed rows: the token read is moot
        if zeroed:
            V.masked_fill_(dead, 0.0)
        hit = None
        if panels[i][1] == "finite_pv":
            hit = _finite_pv(V, p16, attended, operands)   # V's non-finite values zeroed in place
        # 5. P @ V on fp16 values, fp32 accumulate: 0 * NaN = NaN survives here
        pv = torch.matmul(p16, V)                                              # [G, nt, R, D]
        del V
        pv.masked_fill_(inactive, 0.0)                                         # inactive M-tiles: no P@V
        O = torch.zeros(G, R, D, dtype=f32, device=dev)
        for t in range(nt):  # the kernel's accumulation order: O = O * exp_diff + P@V
            O.mul_(e[:, t]).add_(pv[:, t])
            if hit is not None and t in hit[0]:  # finite_pv: the non-finite values each row attends here
                dims, where, add = hit[0][t], hit[1], hit[2]
                O[..., dims] = torch.where(where[:, t], O[..., dims] + add[:, t], O[..., dims])
        # 6. output: 0 for a row that attended nothing (an empty slot's P@V may hold 0 * NaN)
        out = torch.where(row_sum.unsqueeze(-1) > 0, O * scale.unsqueeze(-1), 0.0)
        done[i] = out.to(torch.float16).view(G, GROUP, hq, D)
    return [(done[i], lse) for i in owner]


def _softmax_state(q, kv_cache, k_scale, v_scale, group_rows, toks, masks, seq_len, kv_dtype, sm_scale):
    """What every variant of a chunk shares and V does not enter (_grouped_chunk, steps 1-4):
    -> (dead, attended, p16, exp_diff, inactive, row_sum, scale, lse, operands), operands a dict
    where _finite_pv keeps what it derives from the state. toks: the first panel's tokens
    [G, nt, 32] (the attended ones are the same in every panel)."""
    G, cap = masks.shape
    _, hq, D = q.shape
    nt = cap // TILE_ENTRIES
    R = GROUP * hq
    dev = q.device
    f32 = torch.float32
    # kernel_fix zeroes unattended rows after the load, masked_load never loads them: same panel
    dead = unattended_tokens(masks).view(G, nt, 32, 1)
    K = token_values(kv_cache, toks, 0, kv_dtype)  # attended rows are the same in every panel
    # 2. active M-tiles of each tile (tiles past seq_len are never walked)
    mt_bits = tile_active_m_tiles(masks, seq_len, hq)
    row_tile = torch.arange(R, device=dev) // 16
    active = ((mt_bits.unsqueeze(-1) >> row_tile) & 1).bool()                  # [G, nt, R]
    # 3. S = Q K^T (fp16 values, fp32 accumulate), then scale; select masking
    rows = group_rows.long()
    Q = q[rows.clamp(min=0)].float().masked_fill_((rows == EMPTY_ROW).view(G, GROUP, 1, 1), 0.0)
    Q = Q.reshape(G, 1, R, D)                                                  # row = query*hq + head
    s = torch.matmul(Q, K.transpose(-1, -2)) * torch.tensor(sm_scale * k_scale, dtype=f32)  # [G, nt, R, 32]
    query = torch.arange(R, device=dev) // hq
    bit = (query.view(R, 1) * 4 + torch.arange(32, device=dev) % 4).view(1, 1, R, 32)
    entry_mask = masks.long().view(G, nt, 1, TILE_ENTRIES).repeat_interleave(4, dim=-1) & 0xFFFFFFFF
    attended = ((entry_mask >> bit) & 1).bool() & active.unsqueeze(-1)         # [G, nt, R, 32]
    s.masked_fill_(~attended, MASKED_SCORE)
    # 4. online softmax. A row without an attended token in a tile leaves max and sum
    # alone (tile_sum 0), so the running max is the NaN-ignoring running max of tile maxima.
    tile_max = fmax_reduce(s, -1)                                              # [G, nt, R]
    run_max = torch.cummax(torch.where(torch.isnan(tile_max), -torch.inf, tile_max), dim=1).values
    run_max = run_max.clamp(min=MASKED_SCORE)                                  # +inf stays +inf
    old_max = torch.cat([torch.full_like(run_max[:, :1], MASKED_SCORE), run_max[:, :-1]], dim=1)
    p = torch.exp(torch.fmax(s - run_max.unsqueeze(-1), torch.tensor(EXP_FLOOR))).masked_fill_(~attended, 0.0)
    tile_sum = p.sum(dim=-1)                                                   # fp32 probabilities
    exp_diff = torch.where(tile_sum > 0, torch.exp(torch.fmax(old_max - run_max, torch.tensor(EXP_FLOOR))), 1.0)
    p16 = p.to(torch.float16).float()
    del s, p
    # the sum and the output scale do not depend on V
    row_sum = torch.zeros(G, R, dtype=f32, device=dev)
    for t in range(nt):
        row_sum = row_sum * exp_diff[:, t] + tile_sum[:, t]
    scale = torch.where(row_sum > 0, torch.tensor(v_scale, dtype=f32) / row_sum, 0.0)
    lse = torch.where(row_sum > 0, run_max[:, -1] + torch.log(row_sum), MASKED_SCORE).view(G, GROUP, hq)
    return dead, attended, p16, exp_diff.unsqueeze(-1), ~active.unsqueeze(-1), row_sum, scale, lse, {}


def _finite_pv(V, p16, attended, operands=None):  # operands: a dict kept with p16 and attended
    """finite_pv's P @ V operands: V's non-finite values replaced by 0 (in place), and for every row
    the IEEE sum of p * v over the non-finite values it attends, at the head dims that hold a
    non-finite value (the others hit nothing) -> None when V holds none, else (tiles, hit, add):
    tiles {tile: those dims} for each tile where some row attends one, hit [G, nt, R, d] bool
    where a row does, add [G, nt, R, d] the sum (NaN, +Inf or -Inf). Counted by 0/1 matrix
    products (exact): NaN when the row attends a NaN, an Inf whose p is 0 in fp16 (0 * Inf) or
    Infs of both signs."""
    nonfinite = ~torch.isfinite(V)                                             # [G, nt, 32, D]
    dims = torch.nonzero(nonfinite.flatten(0, 2).any(dim=0)).flatten()
    if not dims.numel():
        return None
    Vd = V.index_select(-1, dims)                                              # [G, nt, 32, d]
    operands = {} if operands is None else operands
    if "att" not in operands:
        operands["att"] = attended.float()                                     # [G, nt, R, 32]
        operands["weighted"] = (attended & (p16 > 0)).float()
    att, weighted = operands["att"], operands["weighted"]
    pos, neg = (Vd == torch.inf).float(), (Vd == -torch.inf).float()
    nan = (torch.matmul(att, torch.isnan(Vd).float()) > 0) | (torch.matmul(att - weighted, pos + neg) > 0)
    up, down = torch.matmul(weighted, pos) > 0, torch.matmul(weighted, neg) > 0
    nan |= up & down
    hit = nan | up | down
    add = torch.where(nan, torch.nan, torch.where(up, torch.inf, -torch.inf))
    V.masked_fill_(nonfinite, 0.0)
    tiles = torch.nonzero(hit.transpose(0, 1).flatten(1).any(dim=1)).flatten().tolist()
    return {t: dims for t in tiles}, hit, add


def _equal_panels(panels) -> list:
    """For each (microblocks, variant), the index of the first panel with the same P @ V: every
    zeroing variant (kernel_fix, masked_load) reads the same values, as the rows where the plans
    differ are unattended and so zeroed; panels of one other variant (unfixed, finite_pv) read
    the same bytes when their microblocks are equal."""
    def same(a, b):
        if a[1] in ZEROING or b[1] in ZEROING:
            return a[1] in ZEROING and b[1] in ZEROING
        return a[1] == b[1] and (a[0] is b[0] or torch.equal(a[0], b[0]))

    owner = []
    for i, panel in enumerate(panels):
        owner.append(next(j for j in range(i + 1) if j == i or (owner[j] == j and same(panels[j], panel))))
    return owner


def grouped_forward(q, kv_cache, k_scale, v_scale, group_rows, microblocks, masks, seq_len, *,
                    kv_dtype, sm_scale, variant, return_lse=False):
    """q [rows, Hq, D] fp16 -> out [groups, 8, Hq, D] fp16 (and lse [groups, 8, Hq] fp32)."""
    (out, lse), = grouped_forward_many(q, kv_cache, k_scale, v_scale, group_rows, [(microblocks, variant)], masks,
                                       seq_len, kv_dtype=kv_dtype, sm_scale=sm_scale)
    return (out, lse) if return_lse else out


def grouped_forward_many(q, kv_cache, k_scale, v_scale, group_rows, panels, masks, seq_len, *, kv_dtype, sm_scale,
                         units=None, unit_key=None):
    """grouped_forward for several kernel variants and plans of one case at once: `panels` is a
    list of (microblocks, variant), plans that differ only in their padding entries (a plan and
    its pad_fix) -> [(out, lse)], each bit for bit what grouped_forward gives it alone.
    units: a routes.reuse.CleanUnits bound to this case: a chunk of groups that reads none of the
    tokens where the cache differs from its base's is taken from it (unit_key names the pass)."""
    for _, variant in panels:
        _check_variant(variant)
    G, cap = masks.shape
    for mb, _ in panels:
        if tuple(mb.shape) != (G, cap):
            raise ValueError(f"microblocks: expected [{G}, {cap}] like masks, got {list(mb.shape)}")
    if cap % TILE_ENTRIES:
        raise ValueError(f"microblocks: cap must be a multiple of {TILE_ENTRIES}, got {cap}")
    per_group = max(cap * 4 * q.shape[-1] * max(m_tiles(q.shape[1]) * 16, 32), 1)
    step = max(1, _CHUNK_ELEMS // per_group)
    parts = []
    for g0 in range(0, G, step):
        sl = slice(g0, g0 + step)
        chunk = [(mb[sl], v) for mb, v in panels]
        key = ("grouped", unit_key, g0, step, tuple(v for _, v in chunk))
        run = lambda sl=sl, chunk=chunk, key=key: _grouped_chunk(  # noqa: E731
            q, kv_cache, k_scale, v_scale, group_rows[sl], chunk, masks[sl], seq_len[sl], kv_dtype, sm_scale,
            units, key)
        if units is None:
            parts.append(run())
            continue
        blocks = torch.cat([mb.reshape(-1) for mb, _ in chunk]).long()
        tokens = (blocks.unsqueeze(-1) * 4 + torch.arange(4, device=blocks.device)).flatten()
        parts.append(units(key, tokens, run, (group_rows[sl], masks[sl], seq_len[sl], *(mb for mb, _ in chunk))))
    result = []
    for i in range(len(panels)):
        if parts:
            result.append((torch.cat([p[i][0] for p in parts]), torch.cat([p[i][1] for p in parts])))
        else:
            result.append((q.new_zeros((0, GROUP) + tuple(q.shape[1:])),
                           q.new_zeros((0, GROUP, q.shape[1]), dtype=torch.float32)))
    return result


def gather_tokens(kv_cache, token_index, token_count, kv_dtype, width: int | None = None):
    """Decoded K and V [n, T, D] float32 of each row's real tokens; unused slots are 0 and
    never read from the cache (a real XQA never touches them). width: T rounded up to XQA's
    partition (more unused slots at the end), so that one gather serves XQA and the reference."""
    index, valid = token_slots(token_index, token_count, width)
    K, V = (slot_values(kv_cache, index, valid, plane, kv_dtype) for plane in (0, 1))
    return K, V, valid


def token_slots(token_index, token_count, width: int | None = None):
    """-> (index, valid) [n, width]: each row's token list padded to `width` slots (default its
    own), and which slots hold a real token (the first token_count of the row)."""
    n, T = token_index.shape
    width = T if width is None else width
    valid = torch.arange(width, device=token_index.device) < token_count.long().unsqueeze(1)
    return (token_index if width == T else torch.nn.functional.pad(token_index, (0, width - T))), valid


def xqa_width(tokens: int, kv_dtype: str) -> int:
    """Token slots XQA walks: `tokens` rounded up to whole partitions."""
    part = XQA_PARTITION[kv_dtype][0]
    return -(-tokens // part) * part


def xqa_forward(q_rows, kv_cache, k_scale, v_scale, token_index, token_count, *, kv_dtype, sm_scale):
    """Row-wise XQA: partitions (XQA_PARTITION: size and partial dtype per kv format), each
    with its own max m_p (NaN ignored), exp sum l_p and normalised partial O_p * v_scale / l_p
    stored in the partial dtype; the reduce weighs partitions by exp(m_p - M) * l_p.
    -> [n, Hq, D] fp16."""
    if q_rows.shape[0] == 0:
        return q_rows.new_zeros((0,) + tuple(q_rows.shape[1:]))
    return xqa_from_tokens(q_rows, *gather_tokens(kv_cache, token_index, token_count, kv_dtype), k_scale, v_scale,
                           kv_dtype=kv_dtype, sm_scale=sm_scale)


def xqa_from_tokens(q_rows, K, V, valid, k_scale, v_scale, *, kv_dtype, sm_scale):
    """xqa_forward on the rows' tokens as gather_tokens gives them (shared with the reference)."""
    n, hq, D = q_rows.shape
    if n == 0:
        return q_rows.new_zeros((0, hq, D))
    return xqa_values(xqa_weights(q_rows, K, valid, k_scale, kv_dtype=kv_dtype, sm_scale=sm_scale), V, v_scale,
                      kv_dtype=kv_dtype)


def _partitions(x: torch.Tensor, part: int) -> torch.Tensor:
    """x [n, T, ...] with zero slots appended up to whole partitions (gather_tokens(width=...) gives
    them already): slots past the last token, zero and not valid."""
    pad = -x.shape[1] % part
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) if pad else x


def xqa_weights(q_rows, K, valid, k_scale, *, kv_dtype, sm_scale) -> tuple:
    """XQA's K side, which V does not change: per partition the scores' max m_p (NaN ignored), the
    exps p and their sum l_p, and each partition's weight in the reduce, exp(m_p - M) * l_p (0 for
    a partition without tokens) -> (p [n, hq, P, part], l_p, used [n, 1, P], w [n, hq, P])."""
    n, hq, _ = q_rows.shape
    part = XQA_PARTITION[kv_dtype][0]
    K, valid = _partitions(K, part), _partitions(valid, part)
    n_part = K.shape[1] // part
    s = torch.einsum("nhd,ntd->nht", q_rows.float(), K) * torch.tensor(sm_scale * k_scale, dtype=torch.float32)
    s = s.view(n, hq, n_part, part)
    vp = valid.view(n, 1, n_part, part)
    m_p = fmax_reduce(torch.where(vp, s, -torch.inf), -1)                          # [n, hq, P]
    used = vp.any(dim=-1)                                                           # [n, 1, P]
    p = torch.where(vp, torch.exp(s - torch.where(used, m_p, 0.0).unsqueeze(-1)), 0.0)
    l_p = p.sum(dim=-1)
    # reduce: partitions without tokens weigh 0 (and are never read)
    m = fmax_reduce(torch.where(used, m_p, -torch.inf), -1).unsqueeze(-1)          # [n, hq, 1]
    return p, l_p, used, torch.where(used, torch.exp(m_p - m) * l_p, 0.0)


def xqa_values(weights: tuple, V, v_scale, *, kv_dtype) -> torch.Tensor:
    """XQA's V side from xqa_weights: each partition's normalised partial O_p * v_scale / l_p in
    the partial dtype, then the weighted reduce -> [n, hq, D] fp16."""
    p, l_p, used, w = weights
    n, _, n_part, part = p.shape
    V = _partitions(V, part)
    O_p = torch.einsum("nhpt,nptd->nhpd", p, V.view(n, n_part, part, V.shape[-1]))
    partial = (O_p * (torch.tensor(v_scale, dtype=torch.float32) / l_p).unsqueeze(-1)).to(XQA_PARTITION[kv_dtype][1])
    O = (w.unsqueeze(-1) * torch.where(used.unsqueeze(-1), partial.float(), 0.0)).sum(dim=2)
    return (O / w.sum(dim=-1, keepdim=True)).to(torch.float16)

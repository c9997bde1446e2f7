"""The kernels, emulated in PyTorch tile by tile (SPEC §2-§3).

Same signatures as qsa_lab.kernels, so every CUDA result has this slower twin.

grouped_forward follows the grouped page4 CTA: 32-token tiles of 8 entries, panels
decoded to fp16 values without scale, inactive M-tiles skipped, select masking to
-1e30, online softmax in fp32 with P rounded to fp16, fp32 P@V. The online softmax
is evaluated for all tiles at once: with m_t the running max after tile t (a cummax),
the sequential updates O = O*alpha + P_t@V_t telescope to O = sum_t exp(m_t - m_T) P_t@V_t,
where P_t is taken relative to m_t exactly as the kernel does. NaN in any P_t@V_t
therefore survives exactly as in the loop (NaN * anything = NaN).
"""
from __future__ import annotations

import torch

from ..case import token_values
from ..plan import GROUP, TILE_ENTRIES, m_tiles, tile_active_m_tiles, unattended_tokens

VARIANTS = ("unfixed", "kernel_fix", "masked_load")
MASKED_SCORE = -1e30
EXP_FLOOR = -80.0
XQA_PARTITION = 256
_CHUNK_ELEMS = 1 << 24  # panel elements per group chunk: bounds memory on long contexts


def decode_panel(kv_cache, microblocks, *, plane, kv_format):
    """[n] microblock ids -> [n*4, head_dim] fp16: their tokens decoded, no scale."""
    tok = (microblocks.long().unsqueeze(1) * 4 + torch.arange(4, device=kv_cache.device)).flatten()
    return token_values(kv_cache, tok, plane, kv_format).to(torch.float16)


def _check_variant(variant):
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def _grouped_chunk(q, kv_cache, k_scale, v_scale, group_rows, microblocks, masks, seq_len,
                   kv_format, sm_scale, variant):
    G, cap = microblocks.shape
    _, hq, D = q.shape
    nt = cap // TILE_ENTRIES
    R = GROUP * hq
    dev = q.device
    # 1. panels [G, nt, 32, D]: token j of a tile is entry j//4, token j%4
    tok = (microblocks.long().unsqueeze(-1) * 4 + torch.arange(4, device=dev)).view(G, nt, 32)
    K = token_values(kv_cache, tok, 0, kv_format)
    V = token_values(kv_cache, tok, 1, kv_format)
    if variant != "unfixed":
        # fix A zeroes unattended rows after the load, fix C never loads them: same panel
        dead = unattended_tokens(masks).view(G, nt, 32, 1)
        K = torch.where(dead, 0.0, K)
        V = torch.where(dead, 0.0, V)
    # 2. active M-tiles of each tile (tiles past seq_len are never walked)
    mt_bits = tile_active_m_tiles(masks, seq_len, hq)
    row_tile = torch.arange(R, device=dev) // 16
    active = ((mt_bits.unsqueeze(-1) >> row_tile) & 1).bool()                  # [G, nt, R]
    # 3. S = Q K^T (fp16 values, fp32 accumulate), then scale; select masking
    Q = q[group_rows.long()].float().reshape(G, 1, R, D)                      # row = query*hq + head
    S = torch.matmul(Q, K.transpose(-1, -2))                                   # [G, nt, R, 32]
    s = S * torch.tensor(sm_scale * k_scale, dtype=torch.float32)
    query = torch.arange(R, device=dev) // hq
    bit = (query.view(R, 1) * 4 + torch.arange(32, device=dev) % 4).view(1, 1, R, 32)
    entry_mask = masks.long().view(G, nt, 1, TILE_ENTRIES).repeat_interleave(4, dim=-1) & 0xFFFFFFFF
    attended = ((entry_mask >> bit) & 1).bool()                                # [G, nt, R, 32]
    s = torch.where(attended, s, MASKED_SCORE)
    # 4. online softmax: running max over the tiles a row walks
    tile_max = torch.where(active, s.amax(dim=-1), MASKED_SCORE)
    m = torch.cummax(tile_max, dim=1).values                                   # [G, nt, R]
    p = torch.where(attended, torch.exp(torch.clamp(s - m.unsqueeze(-1), min=EXP_FLOOR)), 0.0)
    p = p.to(torch.float16).float()
    # 5. P @ V on fp16 values, fp32 accumulate: 0 * NaN = NaN survives here
    pv = torch.matmul(p, V)                                                    # [G, nt, R, D]
    m_last = m[:, -1:, :]
    w = torch.exp(m - m_last)                                                  # prod of later alphas
    O = torch.where(active.unsqueeze(-1), w.unsqueeze(-1) * pv, 0.0).sum(dim=1)
    l = torch.where(active, w * p.sum(dim=-1), 0.0).sum(dim=1)                 # [G, R]
    # 6. output
    out = (O * v_scale / l.unsqueeze(-1)).to(torch.float16).view(G, GROUP, hq, D)
    lse = (m_last.squeeze(1) + torch.log(l)).view(G, GROUP, hq)
    return out, lse


def grouped_forward(q, kv_cache, k_scale, v_scale, group_rows, microblocks, masks, seq_len, *,
                    kv_format, sm_scale, variant, return_lse=False):
    """q [rows, Hq, D] fp16 -> out [groups, 8, Hq, D] fp16 (and lse [groups, 8, Hq] fp32)."""
    _check_variant(variant)
    G, cap = microblocks.shape
    if cap % TILE_ENTRIES:
        raise ValueError(f"microblocks: cap must be a multiple of {TILE_ENTRIES}, got {cap}")
    per_group = max(cap * 4 * q.shape[-1] * max(m_tiles(q.shape[1]) * 16, 32), 1)
    step = max(1, _CHUNK_ELEMS // per_group)
    outs, lses = [], []
    for g0 in range(0, G, step):
        sl = slice(g0, g0 + step)
        o, s = _grouped_chunk(q, kv_cache, k_scale, v_scale, group_rows[sl], microblocks[sl], masks[sl],
                              seq_len[sl], kv_format, sm_scale, variant)
        outs.append(o)
        lses.append(s)
    out = torch.cat(outs) if outs else q.new_zeros((0, GROUP) + tuple(q.shape[1:]))
    lse = torch.cat(lses) if lses else q.new_zeros((0, GROUP, q.shape[1]), dtype=torch.float32)
    return (out, lse) if return_lse else out


def gather_tokens(kv_cache, token_index, token_count, kv_format):
    """Decoded K and V [n, T, D] float32 of each row's real tokens; unused slots are 0 and
    never read from the cache (a real XQA never touches them)."""
    valid = torch.arange(token_index.shape[1], device=token_index.device) < token_count.long().unsqueeze(1)
    tok = torch.where(valid, token_index, 0)
    K = token_values(kv_cache, tok, 0, kv_format)
    V = token_values(kv_cache, tok, 1, kv_format)
    keep = valid.unsqueeze(-1)
    return torch.where(keep, K, 0.0), torch.where(keep, V, 0.0), valid


def xqa_forward(q_rows, kv_cache, k_scale, v_scale, token_index, token_count, *, kv_format, sm_scale):
    """Row-wise XQA: 256-token partitions with fp32 partials, then a reduce. -> [n, Hq, D] fp16."""
    n, hq, D = q_rows.shape
    if n == 0:
        return q_rows.new_zeros((0, hq, D))
    K, V, valid = gather_tokens(kv_cache, token_index, token_count, kv_format)
    T = K.shape[1]
    n_part = -(-T // XQA_PARTITION)
    pad = n_part * XQA_PARTITION - T
    K, V = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (K, V))
    valid = torch.nn.functional.pad(valid, (0, pad))
    s = torch.einsum("nhd,ntd->nht", q_rows.float(), K) * (sm_scale * k_scale)
    s = s.view(n, hq, n_part, XQA_PARTITION)
    vp = valid.view(n, 1, n_part, XQA_PARTITION)
    m_p = torch.where(vp, s, -torch.inf).amax(dim=-1)                               # [n, hq, P]
    p = torch.where(vp, torch.exp(s - torch.where(torch.isinf(m_p), 0.0, m_p).unsqueeze(-1)), 0.0)
    l_p = p.sum(dim=-1)
    O_p = torch.einsum("nhpt,nptd->nhpd", p, V.view(n, n_part, XQA_PARTITION, D))
    # reduce: partitions without tokens have m_p = -inf and weigh 0
    m = m_p.amax(dim=-1, keepdim=True)
    w = torch.where(torch.isinf(m_p), 0.0, torch.exp(m_p - m))
    O = (w.unsqueeze(-1) * O_p).sum(dim=2)
    l = (w * l_p).sum(dim=-1, keepdim=True)
    return (O * v_scale / l).to(torch.float16)

"""Comparing two generations by the canary's rule (qsa_lab.analysis.leaks: bit for bit, two NaNs
equal): what changed, which requests changed, and where attention outputs first differ."""
from __future__ import annotations

import torch

from qsa_lab.analysis.leaks import compare as compare_outputs
from qsa_lab.analysis.leaks import compare_generation

from .engines.base import Generation


def _flat(gen: Generation, requests=None) -> tuple[list, torch.Tensor]:
    """Tokens and values to compare: every request's logprobs and the logits, or only the logprobs of
    `requests` (logits rows mix requests)."""
    ids = sorted(gen.tokens) if requests is None else [r for r in sorted(gen.tokens) if r in requests]
    values = [torch.tensor(gen.logprobs[r], dtype=torch.float32) for r in ids]
    if gen.logits and requests is None:
        values += [t.reshape(-1) for t in gen.logits]
    return [gen.tokens[r] for r in ids], torch.cat(values) if values else torch.zeros(0)


def same(a: Generation, b: Generation) -> bool:
    """Nothing changed between two generations (compare)."""
    return not any(compare(a, b).values())


def compare(clean: Generation, other: Generation, requests=None) -> dict:
    """Counts of what changed (qsa_lab.analysis.leaks.compare_generation): nan / inf (values that became
    NaN / Inf), finite_changed, tokens_changed; over every request and the logits, or over the tokens and
    logprobs of `requests` only."""
    tc, vc = _flat(clean, requests)
    to, vo = _flat(other, requests)
    return compare_generation(tc, to, vc, vo).counts


def changed_requests(clean: Generation, other: Generation, requests) -> dict:
    """request -> the index of its first generated token or logprob that changed (compare's rule), for the
    requests whose output changed."""
    out = {}
    for r in requests:
        a, b = clean.tokens.get(r, []), other.tokens.get(r, [])
        la = torch.tensor(clean.logprobs.get(r, []), dtype=torch.float32)
        lb = torch.tensor(other.logprobs.get(r, []), dtype=torch.float32)
        firsts = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        if la.shape == lb.shape:
            firsts += torch.nonzero(compare_outputs(la, lb).changed).reshape(-1).tolist()
        if firsts or len(a) != len(b) or la.shape != lb.shape:
            out[r] = min(firsts, default=min(len(a), len(b)))
    return out


def localise(clean: Generation, other: Generation, requests=None) -> dict:
    """Where two generations' attention outputs first differ: step, request, layer, heads, head dims
    (only in the query rows of `requests` when given). Needs both recorded with record_attention (no
    graphs); {} when they do not differ there."""
    if not clean.attention or not other.attention:
        return {}
    for step, (a, b) in enumerate(zip(clean.attention, other.attention)):
        batch, query_rows = clean.steps[step] if step < len(clean.steps) else ([], [])
        starts = [sum(query_rows[:i]) for i in range(len(query_rows))]
        for layer in sorted(a):
            if layer not in b or a[layer].shape != b[layer].shape:
                continue
            diff = compare_outputs(a[layer], b[layer]).changed          # [q_rows, heads, head_dim]
            if requests is not None:
                keep = torch.zeros(diff.shape[0], dtype=torch.bool)
                for r, s, n in zip(batch, starts, query_rows):
                    if r in requests:
                        keep[s: s + n] = True
                diff &= keep[:, None, None]
            if not diff.any():
                continue
            rows = torch.nonzero(diff.any(dim=(1, 2))).reshape(-1).tolist()
            owner = [next((r for r, s, n in zip(batch, starts, query_rows) if s <= q < s + n), None) for q in rows]
            return {"step": step, "layer": layer, "requests": sorted({o for o in owner if o is not None}),
                    "query_rows": rows, "heads": torch.nonzero(diff.any(dim=(0, 2))).reshape(-1).tolist(),
                    "dims": torch.nonzero(diff.any(dim=(0, 1))).reshape(-1).tolist(),
                    "nan": bool(b[layer].isnan().any())}
    return {}

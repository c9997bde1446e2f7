"""The scribble's vocabulary: regions, payloads, verdicts. Torch-free, so `--help` stays fast.

The canary's names are borrowed here and only here: payload names from the geometry module,
verdict names from the canary's verdicts (both plain Python).
"""
from __future__ import annotations

from qsa_lab.canary.verdicts import LEAKS, VERDICTS as _CANARY_VERDICTS  # noqa: F401 - LEAKS: the scribble names it too
from qsa_lab.model.geometry import PAYLOADS as _CANARY_PAYLOADS

SCHEMA = "qsa_lab.scribble/1"

OTHER = "other-requests"
#: what each region holds, one line each: the report's legend and the docs' table say the same
REGION_TEXT = {
    "free-blocks": "blocks no request owns (and sectors no allocator holds)",
    "unwritten-tail": "slots of owned blocks past what their request has written",
    "step-writes": "the slots a step is about to write, filled just before it writes them",
    "read-trash": "the null block padded rows read on purpose, with weight 0",
    "write-trash": "where padded rows write; never to be read",
    "prefix-cache": "complete blocks kept for prefix reuse that no live request owns",
    "out-of-window": "slots of a sliding-window request outside its window",
    OTHER: "one live request's own rows at a time; every other request's tokens and logprobs must not change",
}
#: the slots of the KV pool that no live request may read in a step (the read check fills them one region
#: at a time; the write guard watches them), then the other-requests check
POOL_REGIONS = tuple(r for r in REGION_TEXT if r != OTHER)
REGIONS = POOL_REGIONS + (OTHER,)
#: payloads the read check writes (a whole element of the pool's dtype); zero is the canary's negative
#: control and changes nothing in a pool that starts zeroed, so it is not a read check here
PAYLOADS = tuple(p for p in _CANARY_PAYLOADS if p != "zero")
STRAY = "stray-write"
CHECKS = ("read", "write")

VERDICTS = _CANARY_VERDICTS + (STRAY,)

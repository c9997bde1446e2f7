"""The scribble's own names: its regions, its payloads, its schema. Torch-free, so `--help` stays fast.

The verdicts, what "changed" means and the report base are the one leak check's, shared with the
canary (qsa_lab.analysis.leaks); the payload names come from the geometry module.
"""
from __future__ import annotations

from qsa_lab.analysis.leaks import STRAY_WRITE as STRAY  # noqa: F401 - the write guard's verdict, by its old name here
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

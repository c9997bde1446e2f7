"""The scribble's vocabulary: regions, payloads, verdicts. Torch-free, so `--help` stays fast.

The canary's names are borrowed here and only here: payload names from the geometry module,
verdict names from the canary's verdicts (both plain Python).
"""
from __future__ import annotations

from qsa_lab.canary.verdicts import LEAKS, VERDICTS as _CANARY_VERDICTS  # noqa: F401 - LEAKS: the scribble names it too
from qsa_lab.model.geometry import PAYLOADS as _CANARY_PAYLOADS

SCHEMA = "qsa_lab.scribble/1"

#: slots of the KV pool that no live request may read in a step, one region at a time.
#:   free-blocks     blocks no request owns (also never-assigned sectors)
#:   unwritten-tail  slots of owned blocks past what the request has written (and not written this step)
#:   step-writes     slots this step is about to write, filled before it writes them
#:   read-trash      the engine's null / read-trash block: padded rows read it on purpose, with weight 0
#:   write-trash     where padded rows write; never to be read
#:   prefix-cache    complete blocks kept for reuse that no live request owns
#:   out-of-window   slots of a sliding-window request that hold tokens outside its window
REGIONS = ("free-blocks", "unwritten-tail", "step-writes", "read-trash", "write-trash", "prefix-cache",
           "out-of-window")
#: payloads the read check writes (a whole element of the pool's dtype); zero is the canary's negative
#: control and changes nothing in a pool that starts zeroed, so it is not a read check here
PAYLOADS = tuple(p for p in _CANARY_PAYLOADS if p != "zero")
STRAY = "stray-write"
CHECKS = ("read", "write")

VERDICTS = _CANARY_VERDICTS + (STRAY,)

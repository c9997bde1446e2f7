"""The scribble's own names: its regions, its payloads, its schema. Torch-free, so `--help` stays fast.

The verdicts, what "changed" means and the report base are the one leak check's, shared with the
canary (qsa_lab.analysis.leaks); the payload names come from the geometry module.
"""
from __future__ import annotations

from qsa_lab.analysis.leaks import STRAY_WRITE as STRAY  # noqa: F401 - the write guard's verdict, by its old name here
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

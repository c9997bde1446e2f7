"""The scribble's regions, once: their names, what each holds, and which one a row takes when an
engine's bookkeeping puts it in two. Torch-free (no import of torch), so `--help` stays fast; the
payloads the read check writes are listed here too.

Every row of an engine's KV pool is, at one step, in exactly one of these:

    owned           rows a live request has written and attention may read: never filled
    the regions     REGION_TEXT below (the read check fills one at a time; the write guard watches them)

An adapter sorts its rows with `RowLabels`: mark each row with every label the engine's own
bookkeeping gives it, in any order; the row keeps the most protected one (`precedence`). The order
is the same for every engine but for one question the engine answers: in one step, does attention
read a row before the step's own write lands on it (transformers' sliding layers read the ring's
old slot first: the row is owned) or after (vLLM writes each layer's new KV first: the row is a step
write, filled in vain)?

The verdicts, what "changed" means and the report base are the one leak check's, shared with the
canary (qsa_lab.analysis.leaks); the payload names come from the geometry module.
"""
from __future__ import annotations

from qsa_lab.model.geometry import PAYLOADS as _CANARY_PAYLOADS

OTHER = "other-requests"
#: not a region: the rows live requests have written (attention may read them; never filled)
OWNED = "owned"
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
#: the engine's deliberate slots: padded rows read the one (with weight 0) and write the other
TRASH = ("read-trash", "write-trash")
#: regions whose rows lie in no live request's block (a row the engine moves there is never its own move)
UNOWNED = ("free-blocks", "prefix-cache") + TRASH
#: payloads the read check writes (a whole element of the pool's dtype); zero is the canary's negative
#: control and changes nothing in a pool that starts zeroed, so it is not a read check here
PAYLOADS = tuple(p for p in _CANARY_PAYLOADS if p != "zero")


def precedence(reads_before_write: bool) -> tuple:
    """Every label a row can take, the least protected first: a row that two labels claim keeps the later.

    A free or prefix-cache block is nobody's; an owned block's slots past what its request wrote are its
    unwritten tail, unless a sliding window left them behind (out of window); what attention may read and
    what the step writes come next, in the order the engine does them (`reads_before_write`: a row read
    and then overwritten in one step stays owned); the trash slots are the engine's own, never relabelled.
    """
    top = ("step-writes", OWNED) if reads_before_write else (OWNED, "step-writes")
    return ("free-blocks", "prefix-cache", "unwritten-tail", "out-of-window") + top + TRASH


class RowLabels:
    """One label per row (or per cell of an engine's own table), marked in any order, kept by precedence.

        labels = RowLabels(torch.zeros(n_rows, dtype=torch.int8), precedence(reads_before_write=True))
        labels.mark(rows, "unwritten-tail"); labels.mark(rows_read, OWNED)
        view_regions, owned = labels.regions(), labels.rows(OWNED)

    `codes`: an int8 tensor of zeros (every row starts as the least protected label, a free block) of any
    shape; `mark` takes any index of it (a tensor of rows, a list of blocks, (block, slice))."""

    def __init__(self, codes, order: tuple):
        self.codes, self.order = codes, order
        self.code = {name: i for i, name in enumerate(order)}

    def mark(self, index, label: str) -> None:
        self.codes[index] = self.codes[index].clamp(min=self.code[label])

    def is_(self, label: str):
        """Bool tensor: the rows whose label is `label`."""
        return self.codes == self.code[label]

    def rows(self, label: str):
        return self.is_(label).nonzero().reshape(-1)

    def regions(self) -> dict:
        """{region: int64 rows} for every region in the order (a StepView's regions); rows flat."""
        return {name: self.rows(name) for name in self.order if name != OWNED}

"""vLLM's KV pool sorted into the scribble's regions. Torch and numpy only: vLLM itself is not imported here.

vLLM (0.32) keeps every layer's KV in ONE backing buffer; each attention layer sees a strided view
of it whose first dimension is the block id. Inside a block, where token t's K and V bytes lie is
the attention backend's own business (the CPU backend keeps K column-major, `[head_dim, block]`,
and V row-major), so no layout is assumed here: the connector writes one block through the
backend's own cache-write call into a scratch copy of the pool, with token codes, and hands this
module the result (`token_of`: the token of each element of block 0, -1 for none).

The scribble's rows are therefore single ELEMENTS of the pool (`pool` is the flat buffer viewed
as `[elements, 1]` in the KV dtype): every element belongs to one block and one token slot (or
none), so every region is exact at any layout.

Per step the scheduler side of the connector sends a `StepMeta` (plain Python, picklable): the
null block, the free blocks with and without a prefix-cache hash, the blocks a sliding window gave
back, and every live request's block ids per KV-cache group with its tokens computed before the
step and scheduled in it. `PoolMap.view(step, meta, family)` turns it into the contract's
`StepView` (a `LazyStepView`: the step's writes and the region sizes at once, from the label table;
every element sorted into its region only when a hook first reads the regions, which a guard alone
never does), each request's own rows (other-requests) under its family's name (`Families`: a
prefix-cache hit on a block another request wrote makes the two one family, as a fork makes a child
its parent's).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy
import torch

from ...regions import OWNED, RowLabels, precedence
from ..base import LazyStepView, StepView

#: each layer writes the step's KV before its attention reads it: a slot both written and read in one step
#: (a prefix-cache hit on a block another request is still filling) is a step write, filled in vain
READS_BEFORE_WRITE = False
ORDER = precedence(READS_BEFORE_WRITE)


@dataclass
class RequestMeta:
    """One live request: its block ids per KV-cache group (the null block where a sliding window
    gave one back), tokens computed before this step and scheduled in it."""
    name: str
    blocks: tuple
    computed: int
    scheduled: int = 0


@dataclass
class StepMeta:
    """What the scheduler knows about the pool when a step is scheduled (built by the connector)."""
    scheduled_tokens: int
    null_block: int
    free: list
    cached_free: list
    window_freed: dict                 # group -> blocks a live request's window gave back, now free
    requests: list                     # RequestMeta of every request holding blocks
    batch: list                        # (name, scheduled tokens) in the scheduler's order
    windows: tuple                     # per group: the sliding window in tokens, or None
    facts: dict = field(default_factory=dict)


def layer_number(name: str, fallback: int) -> int:
    """'model.layers.3.self_attn.attn' -> 3 (the model's layer index), else `fallback`."""
    m = re.search(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else fallback


class PoolMap:
    """Each element of the pool: its block (-1: no layer's block), its token slot in the block (-1:
    none) and, per KV-cache group, its model layer (-1: none).

    flat:     [elements] the pool in the KV dtype (a view of the engine's buffer: writes reach it)
    layers:   per attention layer (group, layer index, view, token_of): `view` the layer's cache as
              the kernel gets it (dim 0: kernel blocks) over `flat`'s storage, `token_of` the token
              of each element of manager block 0, in `view[0:ratio]` order
    """

    #: a region of fewer than 1/FEW of the elements is gathered from its cells' runs and sorted; a larger
    #: one found by one pass over every element's label (sorting many rows costs more than that pass)
    FEW = 8

    def __init__(self, flat: torch.Tensor, layers: list, block_size: int, num_blocks: int, groups: int):
        n = flat.numel()
        self.flat, self.block_size, self.num_blocks = flat, block_size, num_blocks
        self.block = torch.full((n,), -1, dtype=torch.int32)
        self.token = torch.full((n,), -1, dtype=torch.int32)
        self.layer = torch.full((groups, n), -1, dtype=torch.int64)
        index = torch.arange(n, dtype=torch.int64)
        for group, layer, view, token_of in layers:
            if view.shape[0] % num_blocks:
                raise RuntimeError(f"scribble: the attention backend's cache view does not keep blocks in its first "
                                   f"dimension ({tuple(view.shape)} for {num_blocks} blocks)")
            ids = index.as_strided(view.size(), view.stride(), view.storage_offset() - flat.storage_offset())
            ratio = view.shape[0] // num_blocks          # kernel blocks per manager block
            ids = ids.reshape(num_blocks, -1)            # manager block b: kernel blocks b*ratio .. b*ratio+ratio-1
            blocks = torch.arange(num_blocks, dtype=torch.int32).repeat_interleave(ids.shape[1])
            self.block[ids.reshape(-1)] = blocks
            self.token[ids.reshape(-1)] = token_of.to(torch.int32).repeat(num_blocks)
            self.layer[group, ids.reshape(-1)] = layer
        self.pool = flat.view(-1, 1)
        # each element's cell of the per-step [blocks, block_size + 1] label table (column block_size:
        # an element of no token slot; the extra last cell: an element of no block, always free)
        cell = self.block.long() * (block_size + 1) + torch.where(self.token >= 0, self.token, block_size).long()
        self._cell = torch.where(self.block >= 0, cell, num_blocks * (block_size + 1))
        self._block_of = self.block.clamp(min=0).long()
        self._cell_size = torch.bincount(self._cell, minlength=num_blocks * (block_size + 1) + 1)
        self._warmup = None
        self._by_cell = self._cell_start = None     # cell_rows

    def labels(self, meta: StepMeta, family: list | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's labels per cell of the [blocks, block_size + 1] table (column block_size: elements of no
        token slot; one extra last cell: elements of no block, always free), flat: (label code of each cell
        (an index of ORDER), group of each block, owner of each cell: the number in `family` (one per
        request of meta.requests; default its place there) of the family whose own readable slot it is,
        -1 none, -2 a slot two families read)."""
        nb, bs = self.num_blocks, self.block_size
        table = RowLabels(torch.zeros((nb, bs + 1), dtype=torch.int8), ORDER)
        group = [0] * nb
        table.mark(meta.cached_free, "prefix-cache")
        for g, blocks in meta.window_freed.items():
            table.mark(blocks, "out-of-window")
            for b in blocks:
                group[b] = g
        spans = []      # (block, visible from, written up to, written this step up to (token slots), family)
        for k, r in enumerate(meta.requests):
            for g, blocks in enumerate(r.blocks):
                window = meta.windows[g]
                first_visible = 0 if window is None else max(0, r.computed - window + 1)
                for i, b in enumerate(blocks):
                    if b == meta.null_block:
                        continue
                    lo = i * bs
                    spans.append((b, *(min(max(p - lo, 0), bs) for p in
                                       (first_visible, r.computed, r.computed + r.scheduled)),
                                  k if family is None else family[k]))
                    group[b] = g
        codes = table.codes.reshape(-1)
        owner = torch.full((nb * (bs + 1) + 1,), -1, dtype=torch.int64)
        if spans:
            # every span at once: its block is an unwritten tail, then by token slot out-of-window, owned
            # (what it may read) and step writes (a block another request is still filling can be a
            # prefix-cache hit in the same step: those slots are step writes for both)
            span = torch.tensor(spans, dtype=torch.int64)
            vis, done, step, fam = (span[:, i:i + 1] for i in range(1, 5))
            t = torch.arange(bs + 1)
            code = {name: torch.tensor(i, dtype=torch.int8) for i, name in enumerate(ORDER)}
            mine = (vis <= t) & (t < done)
            label = torch.where(t < torch.minimum(vis, done), code["out-of-window"], code["unwritten-tail"])
            label = torch.where(mine, torch.maximum(label, code[OWNED]), label)
            label = torch.where((done <= t) & (t < step), torch.maximum(label, code["step-writes"]), label)
            cell = span[:, :1] * (bs + 1) + t
            codes.scatter_reduce_(0, cell.reshape(-1), label.reshape(-1), "amax")
            # a slot two families may read is nobody's alone
            cell, fam = cell[mine], fam.expand_as(mine)[mine]
            low = torch.full_like(owner, len(spans) + 2).scatter_reduce_(0, cell, fam, "amin")
            owner = owner.scatter_reduce_(0, cell, fam, "amax")
            owner = torch.where((owner >= 0) & (low != owner), -2, owner)
        table.mark(meta.null_block, "read-trash")
        return torch.cat([codes, torch.zeros(1, dtype=torch.int8)]), torch.tensor(group, dtype=torch.int64), owner

    def view(self, step, meta: StepMeta, family=None) -> StepView:
        """The StepView of a step; `family(request name) -> family name` keys each request's own rows
        (default: every request is its own family). The step's writes and the region sizes now (from the
        label table, without touching every element); one region's rows when asked (`rows_in`), every
        region's only when first read (`rows_of`)."""
        names = [family(r.name) if family else r.name for r in meta.requests]
        order = list(dict.fromkeys(names))
        codes, group, owner = self.labels(meta, [order.index(n) for n in names])
        counts = torch.zeros(len(ORDER), dtype=torch.int64).index_add_(0, codes.long(), self._cell_size)

        def one_region(name):
            code = ORDER.index(name)
            if counts[code] * self.FEW < self._cell.numel():     # few rows: the runs of their cells
                return self.cell_rows(torch.nonzero(codes == code).reshape(-1))
            return torch.nonzero(codes.index_select(0, self._cell) == code).reshape(-1)    # many: one pass
        sizes = {name: n for name, n in zip(ORDER, counts.tolist()) if name != OWNED}
        return LazyStepView(step, self.pool, one_region("step-writes"), sizes,
                            lambda: self.rows_of(codes, group, owner, counts, order),
                            [n for n, _ in meta.batch], [q for _, q in meta.batch], one_region=one_region)

    def cell_rows(self, cells: torch.Tensor) -> torch.Tensor:
        """int64, ascending: the elements of those cells of the label table (cells of `labels`)."""
        if self._by_cell is None:        # elements grouped by cell, ascending within each: once per pool
            self._by_cell = torch.from_numpy(numpy.argsort(self._cell.numpy(), kind="stable"))
            self._cell_start = torch.cumsum(self._cell_size, 0) - self._cell_size
        size = self._cell_size.index_select(0, cells)
        total = int(size.sum())
        if not total:
            return torch.zeros(0, dtype=torch.int64)
        # position k of cell c's run: its start plus k
        first = torch.cumsum(size, 0) - size
        at = torch.arange(total) + (self._cell_start.index_select(0, cells) - first).repeat_interleave(size)
        return self._by_cell.index_select(0, at).sort().values

    def rows_of(self, codes, group, owner, counts, order) -> dict:
        """Every region's rows, owned rows, each family's own rows and each row's layer (LazyStepView's
        labels). Every region in one pass: the elements sorted by label (a stable sort keeps each region's
        rows ascending)."""
        # numpy's stable sort of 8-bit keys is a radix sort: faster than torch's here
        rows = torch.from_numpy(numpy.argsort(codes.index_select(0, self._cell).numpy(), kind="stable"))
        label = dict(zip(ORDER, rows.split(counts.tolist())))
        regions = {name: rows for name, rows in label.items() if name != OWNED}
        row_layer = self.layer[0] if self.layer.shape[0] == 1 else \
            self.layer.gather(0, group[self._block_of].reshape(1, -1)).reshape(-1)
        owned = label[OWNED]
        # each family's own rows, ascending: owned rows sorted by family (-2: shared, first), stably
        owned_by = owner.index_select(0, self._cell.index_select(0, owned)) + 2
        key = owned_by.to(torch.int16) if len(order) < 32000 else owned_by      # 16-bit keys: a radix sort
        mine = owned[torch.from_numpy(numpy.argsort(key.numpy(), kind="stable"))]
        per_family = torch.bincount(owned_by, minlength=len(order) + 2).tolist()
        request_rows = dict(zip(order, mine.split(per_family)[2:]))
        return {"regions": regions, "owned": owned, "request_rows": request_rows, "row_layer": row_layer}

    def warmup_view(self, pool: torch.Tensor) -> StepView:
        """Warm-up (and graph capture): no request owns anything and no row may change; the null
        block is the read trash, every other row a free block. `pool`: the rows to show ([elements, 1])."""
        if self._warmup is None:        # the same every generation
            label = RowLabels(torch.zeros(self.block.shape, dtype=torch.int8), ORDER)
            label.mark(self.block == 0, "read-trash")
            self._warmup = {name: label.rows(name) for name in ("free-blocks", "read-trash")}
        none = torch.zeros(0, dtype=torch.int64)
        return StepView("warmup", pool, dict(self._warmup), none, none, self.layer[0].clone())


class Families:
    """Which requests' KV started from another's. A request that is handed a block already computed (a
    prefix-cache hit) which another request wrote reads that request's KV by design: the two become one
    family (named by the earlier request), as a forked child is its parent's, and the other-requests
    check judges neither by the other's rows. A block handed out fresh and written again links nobody:
    what its new owner then reads of the old owner's bytes is a cross-request read."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.parent = {}          # request -> a request of the family it joined
        self._writer = {}         # block -> the request that last wrote a slot of it
        self._held = {}           # request -> the blocks it held at its last step

    def of(self, name: str) -> str:
        while name in self.parent:
            name = self.parent[name]
        return name

    def mapping(self) -> dict:
        """request -> its family, for the requests that joined another's (Generation.families)."""
        return {r: self.of(r) for r in self.parent}

    def update(self, meta: StepMeta) -> None:
        """One step: who writes which blocks now, and which requests were handed blocks already written."""
        bs, held = self.block_size, {}
        for r in meta.requests:
            for blocks in r.blocks:
                for i, b in enumerate(blocks):
                    if b != meta.null_block and r.computed < (i + 1) * bs and r.computed + r.scheduled > i * bs:
                        self._writer[b] = r.name
        for r in meta.requests:
            mine = held.setdefault(r.name, set())
            for blocks in r.blocks:
                for i, b in enumerate(blocks):
                    if b == meta.null_block:
                        continue
                    mine.add(b)
                    writer = self._writer.get(b)
                    hit = b not in self._held.get(r.name, ()) and (i + 1) * bs <= r.computed
                    if hit and writer is not None and self.of(writer) != self.of(r.name):
                        self.parent[self.of(r.name)] = self.of(writer)
        self._held = held

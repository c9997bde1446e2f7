"""The engine adapter contract, the one protocol every engine adapter implements (engines/ holds one
module or folder per engine): what an inference engine shows the scribble before each forward step.

A kernel shows the canary one `PagedCall`; an engine shows the scribble a stream of steps. Before
each forward step the adapter hands over a `StepView`: the KV pool as rows (transformers: one row =
one token of one layer's K or V, or of an MLA layer's latents; vLLM: one element; in the pool's
dtype), which rows the live requests have written (attention may read those), and every other row
sorted into the regions of `regions.REGIONS` (sorted by `regions.RowLabels`, which settles a row two
regions claim), the engine's deliberate slots (read trash / null
block, write trash) among them.
After the step it hands the same view back, so the write guard can check what changed.
`generate(hooks)` runs a whole, seeded, greedy generation and returns tokens, logprobs and, where no
graph hides them, logits and attention outputs.

Between two steps the engine still works on the pool: it restores preempted requests, copies the
blocks of forked requests, evicts cached blocks. The adapter wraps each such entry point it knows in
`hooks.engine_call(name, pool, moves)`, so the write guard can name the call that wrote a row, and
tell an engine's own move (`moves=True`: a restore or a fork copy into rows a request owns at the
next step) from a stray write.

The regions are disjoint. A row belongs to `owned` (never poisoned) or to at most one region;
`may_write` lists the rows the step is allowed to change (its own writes and the write trash).
`request_rows` gives each live request (forked children under their parent's name) the owned rows
that it alone may read: the other-requests check poisons them one request at a time.
`region_sizes()` counts each region's rows and `rows_in(region)` gives one region's: a guard alone reads
only the sizes and `may_write`, a scribble one region more, so an adapter whose sorting is costly hands a
`LazyStepView` (vLLM), which sorts every row only when `regions` (or another label) is first read.

How the built-in adapter reads the pool (`reads_pool`):
  "gather"        the engine gathers each request's rows by index before attention (transformers'
                  paged|eager and sdpa without padding)
  "padded-gather" the same, padded to a static size with the read-trash index (CUDA graphs, compile)
  "block-table"   the kernel walks a block table itself (flash decode fast path)

Adapters: transformers' continuous batching (engines/transformers.py) and vLLM through its KV
connector API (engines/vllm/). How to add one: engines/__init__.py.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import ContextManager, Protocol

import torch


@dataclass
class StepView:
    """One forward step of the engine, as it is about to run (and, handed back, as it ran).

    pool:         [rows, row_elems] the KV pool in its dtype, a view: writes reach the engine
    regions:      region name -> int64 rows (disjoint, only regions that exist for this engine)
    owned:        int64 rows live requests have written (what attention may read)
    may_write:    int64 rows the step may change (its own writes, the write trash)
    row_layer:    [rows] int64, the model layer of each row (-1: a sector no allocator holds, or a trash
                  sector that several allocators share)
    requests:     the requests of this step's batch, in query-row order; query_rows: their query lengths
    request_rows: request -> int64 owned rows that only it (and its forked children) may read
    """
    step: int | str               # 0, 1, ... or "warmup"
    pool: torch.Tensor
    regions: dict
    owned: torch.Tensor
    may_write: torch.Tensor
    row_layer: torch.Tensor
    requests: list = field(default_factory=list)
    query_rows: list = field(default_factory=list)
    padded: bool = False
    request_rows: dict = field(default_factory=dict)

    def region_sizes(self) -> dict:
        """region name -> how many rows it holds (what a guard alone reads of the regions)."""
        return {name: int(rows.numel()) for name, rows in self.regions.items()}

    def rows_in(self, region: str) -> torch.Tensor | None:
        """int64 rows of one region (what a scribble fills), None where this engine has no such region."""
        return self.regions.get(region)


class LazyStepView(StepView):
    """A StepView whose row labels (regions, owned, request_rows, row_layer) are computed on first access,
    by `labels()` -> that dict, once: a guard alone reads only `may_write` and `region_sizes()`, which are
    given. What the labels are does not depend on when they are read (`labels` sees only the step's plan)."""

    def __init__(self, step, pool, may_write, sizes: dict, labels, requests=(), query_rows=(), padded=False,
                 one_region=None):
        self.step, self.pool, self.may_write, self.padded = step, pool, may_write, padded
        self.requests, self.query_rows = list(requests), list(query_rows)
        self._sizes, self._labels, self._done = dict(sizes), labels, None
        self._one_region = one_region       # region -> its rows, ascending, without sorting the others

    def _label(self, name):
        if self._done is None:
            self._done, self._labels = self._labels(), None
        return self._done[name]

    def region_sizes(self) -> dict:
        return dict(self._sizes)

    def rows_in(self, region: str) -> torch.Tensor | None:
        if self._done is not None or self._one_region is None:
            return self.regions.get(region)
        return self._one_region(region) if region in self._sizes else None

    regions = property(lambda self: self._label("regions"))
    owned = property(lambda self: self._label("owned"))
    request_rows = property(lambda self: self._label("request_rows"))
    row_layer = property(lambda self: self._label("row_layer"))


@dataclass
class Generation:
    """A whole generation. tokens / logprobs: request -> list; logits: per step [n, vocab] float32
    (None under CUDA graphs); attention: per step {layer: [q_rows, heads, head_dim]} when recorded;
    steps: per step (requests, query_rows); families: request -> the request whose KV it started from
    (a forked child -> its parent; absent: itself); events: what the engine did that the workload is
    meant to exercise (counts: chunked prefills, preemptions, restores, fork copies, prefix hits);
    error: the text of an exception, '' if none."""
    tokens: dict
    logprobs: dict
    logits: list | None = None
    attention: list | None = None
    steps: list = field(default_factory=list)
    families: dict = field(default_factory=dict)
    events: dict = field(default_factory=dict)
    error: str = ""

    def family(self, request: str) -> str:
        return self.families.get(request, request)


class StepHooks(Protocol):
    def before_step(self, view: StepView) -> None: ...
    def after_step(self, view: StepView) -> None: ...
    def engine_call(self, name: str, pool: torch.Tensor, moves: bool) -> ContextManager: ...


class EngineAdapter(Protocol):
    name: str          # e.g. "transformers:paged|eager"
    reads_pool: str    # "gather" | "padded-gather" | "block-table"
    graphs: bool       # outputs come from captured graphs (logits and attention outputs unseen)
    model: object      # what the report names the model by (its `name_or_path`, or its config's)
    workload: object   # the workload it generates (models.Workload: `to_dict()` for the report)

    def generate(self, hooks: StepHooks | None = None, record_attention: bool = False) -> Generation: ...


class NoHooks:
    """Hooks that do nothing: a plain run through the same code path."""
    def before_step(self, view: StepView) -> None:
        pass

    def after_step(self, view: StepView) -> None:
        pass

    def engine_call(self, name: str, pool: torch.Tensor, moves: bool) -> ContextManager:
        return contextlib.nullcontext()

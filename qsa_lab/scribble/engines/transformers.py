"""transformers' continuous batching (`generate_batch`) as a scribble engine.

What this adapter relies on, read in transformers 5.24.0 and 5.25.0 (`generation/continuous_batching/`):
- The pool is ONE flat uint8 tensor, `PagedAttentionCache.cache_tensor`, cut into sectors of
  `bytes_per_sector`. Sectors 0 and 1 are never allocated: sector 0 is the read trash (padded rows
  read physical index `read_trash_index = 0`; sliding layers also read the sentinel index 1 and
  overwrite it before use), sector 1 the write trash (`write_trash_index`, where padded rows write).
  The tensor starts zeroed, so the read trash holds zeros and a padded read has weight exactly 0.
- Each attention type has one allocator; it views the pool in the model dtype as rows of one token:
  `rows_per_token` rows per token and layer (K and V for full and sliding attention; one row holding
  both latents for 5.25's MLA allocator, `row_numel` wide), in blocks of
  `block_physical_stride = rows_per_token * page * layers` rows: [L0 K page | L0 V page | L1 K page |
  ...]. Physical index p of the group's i-th layer reads row p + (rows_per_token*i + plane)*page.
  Block ids are global: block b of an allocator lives in sector b // blocks_per_sector.
- `allocator.block_table[request]` lists a live request's blocks; `allocator.ledger.cached_blocks`
  the complete blocks kept for prefix reuse that no request owns; `CachePool` hands out sectors
  from the end of its free list and blocks from the end of a sector.
- Full-attention layers write the step's K/V first, then gather every row the request has; sliding
  layers gather the last window-1 rows first (a ring buffer, slot = position % window), then write.
- `ContinuousBatchProcessor._generation_step(model)` runs after `prepare_next_batch` has filled the
  batch (read/write indexes, masks, `requests_in_batch`, each state's `position_offset` already
  advanced by the query length) and before the forward: the step hook. In synchronous batching it
  returns after the outputs reached the host, so the hook sees the finished step (async batching
  would overlap the next batch's preparation with this forward: refused).
- Between two steps, `update_batch` forks requests (`PagedAttentionCache.perform_cache_copy`: whole
  blocks into the children's fresh blocks) and `prepare_next_batch` preempts (`offload_requests`) and
  brings CPU-offloaded requests back (`restore_scheduled_requests`: whole blocks into blocks that
  were free a moment before). The adapter wraps these five entry points for the write guard; the
  copies of the last two are the engine's own moves.
- `ModelRunner.pad_inputs` (on when CUDA graphs or compile are) pads the query rows with the write
  trash index and the KV rows with the read-trash index, masked with dtype-min: weight 0, and
  0 * NaN = NaN. It is settable after the processor is built, which lets the CPU show the padded path.
- paged|eager and sdpa both gather by index here; flash's decode fast path walks a block table.
- Continuous batching runs only paged|eager, sdpa and flash: a user's attention function is put in
  the paged|eager slot of transformers' AttentionInterface for the run (and the slot given back).
"""
from __future__ import annotations

import contextlib
import gc
import threading
import traceback

import torch

from .. import patching
from ..regions import OWNED, RowLabels, precedence
from ..versions import TRANSFORMERS
from .base import Generation, NoHooks, StepView

_PATCH_LOCK = threading.Lock()   # the hooks patch classes: one scribbled generation at a time
USER_SLOT = "paged|eager"        # the attention slot a user's function takes for the run
#: full-attention layers write the step's rows before they read, sliding layers read the ring's old slot
#: first: a slot both read and written in one step is read before it is written, so it stays owned
READS_BEFORE_WRITE = True


class AttentionNameError(ValueError):
    """An attention implementation name transformers cannot use here: 'attn: <problem>' (bad input)."""


def _decoder_layers(model):
    inner = getattr(model, "model", None)
    return list(getattr(inner, "layers", []) or [])


def family(request_id: str) -> str:
    """transformers names a forked child `<parent>__child#<i>`: its KV starts as its parent's."""
    return request_id.split("__child#")[0]


class TransformersEngine:
    """One model + workload + attention settings; `generate(hooks)` runs a whole greedy generation.

    attn: "paged|eager" | "sdpa" | a flash implementation | a user's attention function, which takes
    paged|eager's place (it receives what paged|eager receives); attn_name: how the report names a
    user's function (default: its qualified name); pad: force the model runner's padded inputs (what
    CUDA graphs and compile switch on) even without them; cuda_graph: ask transformers for CUDA graphs
    (a CUDA device only)."""

    def __init__(self, model, workload, attn="paged|eager", pad: bool = False, cuda_graph: bool = False,
                 check_version: bool = True, attn_name: str | None = None):
        if not callable(getattr(model, "generate_batch", None)) or not hasattr(model, "config"):
            raise TypeError(f"model: expected a transformers model (scribble.models.tiny_model or local_model), got "
                            f"{type(model).__name__}")
        if not callable(getattr(workload, "prompts", None)):
            raise TypeError(f"workload: expected a workload (scribble.models.workload(name)), got "
                            f"{type(workload).__name__}")
        if check_version:
            TRANSFORMERS.require()
        if cuda_graph and model.device.type != "cuda":
            raise ValueError("cuda_graph: CUDA graphs need a model on a CUDA device")
        if getattr(model.config.get_text_config(), "kv_lora_rank", None) and TRANSFORMERS.installed() == "5.24.0":
            raise ValueError("model: an MLA model (kv_lora_rank) needs transformers 5.25: the continuous batching "
                             "of 5.24 caches expanded heads in slots sized for the latents and fails")
        self.model, self.workload = model, workload
        if callable(attn):
            self.user_attention = attn
            label = attn_name or f"{getattr(attn, '__module__', '?')}:{getattr(attn, '__qualname__', attn)}"
            self.attn, label = USER_SLOT, f"{label} (in the {USER_SLOT} slot)"
        elif isinstance(attn, str) and attn:
            self.user_attention, self.attn, label = None, attn, attn
        else:
            raise TypeError(f"attn: expected an implementation name or an attention function, got {attn!r}")
        self.pad, self.cuda_graph = pad or cuda_graph, cuda_graph
        self.graphs = cuda_graph
        self.reads_pool = "padded-gather" if self.pad else "gather"
        if "flash" in self.attn:
            self.reads_pool += "+block-table"
        self.name = f"transformers:{label}" + ("+graphs" if cuda_graph else "+pad" if pad else "")
        self.prompts = workload.prompts(model.config.get_text_config().vocab_size)
        self.cache = None        # the live PagedAttentionCache while a generation runs
        try:
            model.set_attn_implementation(self.attn)
        except (ValueError, ImportError, KeyError) as e:      # an unknown name, or a flash kernel not installed
            if self.user_attention is not None:
                raise
            raise AttentionNameError(
                f"attn: transformers {TRANSFORMERS.installed()} cannot use {self.attn!r} ({type(e).__name__}); give "
                "paged|eager, eager, sdpa, a flash implementation installed here, or your own function as "
                "file.py:function or module:function") from None

    # ------------------------------------------------------------------ run
    def generate(self, hooks=None, record_attention: bool = False) -> Generation:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        hooks = hooks or NoHooks()
        wl = self.workload
        # several samples per prompt fork each request after its prefill; transformers allows them only when
        # sampling, so the config asks for sampling and the model runner is set back to argmax (_Run.patched)
        sampling = {"do_sample": True, "num_return_sequences": wl.samples, "top_k": None, "top_p": None,
                    "temperature": None} if wl.samples > 1 else {"do_sample": False}
        gen_config = GenerationConfig(max_new_tokens=wl.new_tokens, eos_token_id=-1, pad_token_id=0, **sampling)
        cb_config = ContinuousBatchingConfig(
            page_size=wl.page_size, num_blocks=wl.num_blocks, max_batch_tokens=wl.max_batch_tokens,
            return_logprobs=True, use_cuda_graph=self.cuda_graph, use_async_batching=False,
            auto_switch_to_flash=False, seed=wl.seed, cpu_offload_space=wl.cpu_offload_gib,
            # padding granularity: set only when padding, as a non-default value switches graphs on
            **({"q_padding_interval_size": wl.page_size, "kv_padding_interval_size": wl.page_size} if self.pad else {}))
        run = _Run(self, hooks, record_attention)
        # transformers calls gc.collect() twice per generation (stop, processor __del__): ~0.4 s each in a
        # process holding torch and transformers. Freezing the objects that exist already keeps it cheap.
        gc.freeze()
        try:
            with _PATCH_LOCK, run.patched():
                out = self.model.generate_batch(self.prompts, generation_config=gen_config,
                                                continuous_batching_config=cb_config, warmup=True)
        finally:
            gc.unfreeze()
        ids = [f"req_{i}" for i in range(len(self.prompts))]
        ids = [c for r in ids for c in [r] + [f"{r}__child#{k}" for k in range(wl.samples - 1)]]
        errors = [f"{r}: {out[r].error}" for r in ids if r in out and out[r].error]
        errors += [f"{r}: no result" for r in ids if r not in out]
        error = run.hook_error or "; ".join(errors)
        return Generation(
            tokens={r: list(out[r].generated_tokens) for r in ids if r in out},
            logprobs={r: list(out[r].logprobs or []) for r in ids if r in out},
            logits=None if self.graphs else run.logits,
            attention=run.attention if record_attention and not self.graphs else None,
            steps=run.steps, families={r: family(r) for r in ids if family(r) != r}, events=run.events,
            error=error)


class _TorchWithoutPinning:
    """torch, but `empty(..., pin_memory=True)` allocates ordinary memory. A CPU-only torch has no pinned
    allocator, and transformers' CPU swap pool asks for one; with the model on the CPU the swap copies are
    plain CPU copies either way, so the run computes the same."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, pin_memory=False, **kwargs):
        return torch.empty(*args, **kwargs)


class _Run:
    """The patches and the records of one generation."""

    def __init__(self, engine: TransformersEngine, hooks, record_attention: bool):
        self.engine, self.hooks, self.record_attention = engine, hooks, record_attention
        self.logits, self.attention, self.steps = [], [], []
        self.events = {"chunked_prefill": 0, "preempted": 0, "restored": 0, "forked_blocks": 0, "prefix_hits": 0}
        self.hook_error = ""
        self._step = 0
        self._n_logits = 0
        self._q_real = 0

    def pool(self):
        cache = self.engine.cache
        return None if cache is None else _pool_rows(cache)

    @contextlib.contextmanager
    def patched(self):
        from transformers import AttentionInterface
        from transformers.generation.continuous_batching import cache as cache_mod
        from transformers.generation.continuous_batching import continuous_api as api
        from transformers.generation.continuous_batching import offloading_manager as offload_mod
        proc_cls, mgr_cls = api.ContinuousBatchProcessor, api.ContinuousBatchingManager
        run = self

        def with_settings(orig_create):
            def create(manager):
                bp = orig_create(manager)
                if run.engine.pad:
                    bp.model_runner.pad_inputs = True
                if run.engine.workload.samples > 1:
                    bp.model_runner.do_sample = False      # forks, greedy: every sample comparable bit for bit
                run.engine.cache = bp.cache
                return bp
            return create

        def counting_hits(orig_prefix):
            def search(cache, *args, **kwargs):
                matched = orig_prefix(cache, *args, **kwargs)
                run.events["prefix_hits"] += bool(matched)
                return matched
            return search

        with patching.patched() as patch:
            patch.wrap(mgr_cls, "_create_batch_processor", with_settings)
            patch.wrap(proc_cls, "_generation_step",
                       lambda orig: lambda bp, model: run._guarded(bp, lambda: orig(bp, model), False))
            patch.wrap(proc_cls, "warmup", lambda orig: lambda bp, model: run._guarded(bp, lambda: orig(bp, model), True))
            # the engine's entry points between steps: the guard names them; the last two are its own KV moves
            for owner, attr, moves, count in (
                    (proc_cls, "update_batch", False, None), (proc_cls, "prepare_next_batch", False, None),
                    (offload_mod.OffloadingManager, "offload_requests", False, self._count_preempted),
                    (offload_mod.OffloadingManager, "restore_scheduled_requests", True, self._count_restored),
                    (cache_mod.PagedAttentionCache, "perform_cache_copy", True, self._count_forked)):
                patch.wrap(owner, attr, lambda orig, attr=attr, moves=moves, count=count:
                           self._engine_call(orig, attr, moves, count))
            patch.wrap(cache_mod.PagedAttentionCache, "search_prefix_match", counting_hits)
            if self.engine.model.device.type == "cpu" and not torch.cuda.is_available():
                patch.set(offload_mod, "torch", _TorchWithoutPinning())
            if self.engine.user_attention is not None:
                patch.set(AttentionInterface, "_global_mapping",
                          {**AttentionInterface._global_mapping, USER_SLOT: self.engine.user_attention})
            handles = self._register_model_hooks()
            try:
                yield
            finally:
                for h in handles:
                    h.remove()
                self.engine.cache = None

    def _engine_call(self, orig, name: str, moves: bool, count):
        run = self

        def call(obj, *args, **kwargs):
            pool = run.pool()
            before = count(obj, *args) if count and pool is not None else None
            if pool is None or (moves and before == 0):     # no engine yet, or a move with nothing to move
                return orig(obj, *args, **kwargs)
            with run.hooks.engine_call(name, pool, moves):
                out = orig(obj, *args, **kwargs)
                if pool.is_cuda:       # the copies run on transformers' compute stream
                    torch.cuda.synchronize(pool.device)
            if count:
                count(obj, *args, before=before, out=out)
            return out
        return call

    def _count_preempted(self, manager, *args, before=None, out=None):
        active = len(manager.scheduler.active_requests)
        if before is None:
            return active
        self.events["preempted"] += max(0, before - active)

    def _count_restored(self, manager, requests_in_batch=(), before=None, out=None):
        if before is None:
            return sum(bool(fs.state.is_cpu_offloaded) for fs in requests_in_batch)
        if manager._cpu_pool is not None:
            self.events["restored"] += before

    def _count_forked(self, cache, copies=None, before=None, out=None):
        if before is None:
            return sum(len(src) for src, _ in (copies or {}).values())
        self.events["forked_blocks"] += before

    def _guarded(self, bp, call, warmup: bool):
        try:
            view = pool_view(bp, "warmup" if warmup else self._step)
            if not warmup:
                io = bp.inputs_and_outputs
                self._n_logits = sum(bool(fs.has_new_token) for fs in io.requests_in_batch)
                self._q_real = int(io.total_seqlen_q)
                # a prefill chunk that does not finish its prompt
                self.events["chunked_prefill"] += sum(not fs.has_new_token for fs in io.requests_in_batch)
                self.steps.append((view.requests, view.query_rows))
                if self.record_attention:
                    self.attention.append({})
            self.hooks.before_step(view)
            if view.pool.is_cuda:
                # the fills ran on this thread's stream; the forward runs on transformers' compute stream,
                # which does not wait for it: finish them first
                torch.cuda.current_stream(view.pool.device).synchronize()
        except Exception:
            self.hook_error = self.hook_error or traceback.format_exc(limit=4)
            raise
        result = call()
        try:
            stream = bp.inputs_and_outputs.compute_stream
            if stream is not None:      # synchronous batching has synchronised already; be explicit
                stream.synchronize()
            self.hooks.after_step(view)
        except Exception:
            self.hook_error = self.hook_error or traceback.format_exc(limit=4)
            raise
        if not warmup:
            self._step += 1
        return result

    def _register_model_hooks(self) -> list:
        model, handles = self.engine.model, []
        if self.engine.graphs:
            return handles   # a replayed graph runs no Python hooks

        def keep_logits(module, args, kwargs, output):
            if self._n_logits == 0 or not torch.is_tensor(getattr(output, "logits", None)):
                return
            logits = output.logits[0]
            if "logits_to_keep" not in kwargs:   # else the model already kept the logits rows only
                logits = logits[kwargs["logits_indices"]]
            self.logits.append(logits[: self._n_logits].detach().float().cpu())
        handles.append(model.register_forward_hook(keep_logits, with_kwargs=True))

        if self.record_attention:
            for layer, block in enumerate(_decoder_layers(model)):
                attn = getattr(block, "self_attn", None)
                o_proj = getattr(attn, "o_proj", None)
                if o_proj is None:
                    continue
                heads = getattr(attn, "config", model.config).num_attention_heads

                def keep_attention(module, args, layer=layer, heads=heads):
                    if self.attention:
                        x = args[0][0, : self._q_real]          # [q_rows, heads * head_dim], before o_proj
                        self.attention[-1][layer] = x.detach().float().cpu().view(x.shape[0], heads, -1)
                handles.append(o_proj.register_forward_pre_hook(keep_attention))
        return handles


# ---------------------------------------------------------------------- the pool, sorted into regions
def _row_elems(allocator) -> int:
    """Elements of one row: a token's K (or V) of one layer, or an MLA layer's two latents."""
    numel = getattr(allocator, "row_numel", None)
    return numel if numel is not None else allocator.num_key_value_heads * allocator.head_dim


def _pool_rows(cache) -> torch.Tensor:
    """The pool as [rows, row_elems] in the cache dtype. Every allocator must cut the same rows."""
    widths = {_row_elems(a) for a in cache.cache_allocators.values()}
    if len(widths) != 1:
        raise ValueError(f"model: its attention types cache rows of different widths {sorted(widths)}; the scribble "
                         "reads the pool as rows of one width")
    return cache.cache_tensor.view(cache.dtype).view(-1, widths.pop())


def pool_view(bp, step) -> StepView:
    """The StepView of a ContinuousBatchProcessor whose next batch is prepared (or of its warm-up)."""
    cache = bp.cache
    allocators = list(cache.cache_allocators.values())
    pool = _pool_rows(cache)
    n_rows = pool.shape[0]
    rows_per_sector = cache.bytes_per_sector // (pool.shape[1] * cache.dtype.itemsize)
    label = RowLabels(torch.zeros(n_rows, dtype=torch.int8), precedence(READS_BEFORE_WRITE))   # free blocks
    label.mark(slice(0, rows_per_sector), "read-trash")
    label.mark(slice(rows_per_sector, 2 * rows_per_sector), "write-trash")
    row_layer = torch.full((n_rows,), -1, dtype=torch.int64)
    io = bp.inputs_and_outputs
    padded = bool(bp.model_runner.pad_inputs)

    def layout(a):
        page, planes = a.tokens_per_page, a.rows_per_token * len(a.layer_indices)
        offsets = torch.arange(planes) * page                   # every plane (K, V or latents) of every layer
        layers = torch.tensor(a.layer_indices).repeat_interleave(a.rows_per_token * page)
        return offsets, layers

    if len(allocators) == 1:
        # one allocator: the two trash sectors are laid out as its blocks too, so their rows have layers
        a = allocators[0]
        _, layers = layout(a)
        row_layer[: 2 * rows_per_sector] = layers.repeat(2 * rows_per_sector // a.block_physical_stride)

    if step == "warmup":
        # warm-up requests may write anywhere outside the read trash; nothing is poisoned
        rows = torch.arange(n_rows)
        return StepView(step, pool, {}, rows[:0], rows[rows_per_sector:], row_layer, padded=padded)

    batch = {fs.state.request_id: fs for fs in io.requests_in_batch}
    active = bp.scheduler.active_requests
    may_write = [torch.arange(rows_per_sector, 2 * rows_per_sector)]
    readable = {}             # family -> the rows it may read (a list of tensors)
    for a in allocators:
        page, stride = a.tokens_per_page, a.block_physical_stride
        plane_offsets, layer_of_offset = layout(a)

        def rows_of_slots(phys):      # physical indexes -> every plane of every layer of the group
            phys = torch.as_tensor(phys, dtype=torch.int64).reshape(-1, 1)
            return (phys + plane_offsets).reshape(-1)

        def rows_of_blocks(blocks):
            start = torch.as_tensor(sorted(blocks), dtype=torch.int64).reshape(-1, 1) * stride
            return (start + torch.arange(stride)).reshape(-1)

        known = set(a.ledger.cached_blocks)
        for tree in cache.pool._free_blocks[a.index].trees.values():
            known.update(tree)
        owned_blocks = {b for blocks in a.block_table.values() for b in blocks}
        known |= owned_blocks
        if known:
            rows = rows_of_blocks(known)
            row_layer[rows] = layer_of_offset.repeat(len(known))
        if a.ledger.cached_blocks:
            label.mark(rows_of_blocks(set(a.ledger.cached_blocks) - owned_blocks), "prefix-cache")
        if owned_blocks:
            label.mark(rows_of_blocks(owned_blocks), "unwritten-tail")

        window = getattr(a, "sliding_window", None)
        visible, held, writes = [], [], []
        for rid, blocks in a.block_table.items():
            fs, state = batch.get(rid), active.get(rid)
            if state is None:     # blocks of a request the scheduler does not list: never poison them
                mine = [b * stride + t for b in blocks for t in range(page)]
            else:
                past = state.position_offset - (fs.query_length if fs is not None else 0)
                first_visible = 0 if window is None else max(0, past - window + 1)
                first_held = 0 if window is None else max(0, past - window)
                slot = _slot_fn(blocks, page, stride, window)
                mine = [slot(p) for p in range(first_visible, past)]
                held.extend(slot(p) for p in range(first_held, first_visible))
                if fs is not None:
                    writes.extend(i for i in a.get_write_indices(rid, past, fs.query_length)
                                  if i != a.write_trash_index)
            visible.extend(mine)
            readable.setdefault(family(rid), []).append(rows_of_slots(mine))
        if held:
            label.mark(rows_of_slots(held), "out-of-window")
        if writes:
            w = rows_of_slots(writes)
            label.mark(w, "step-writes")
            may_write.append(w)
        if visible:
            label.mark(rows_of_slots(visible), OWNED)
    regions = label.regions()
    readable = {f: torch.cat(rows).unique() for f, rows in sorted(readable.items())}
    every = torch.cat(list(readable.values())) if readable else torch.zeros(0, dtype=torch.int64)
    rows, count = every.unique(return_counts=True)
    shared = rows[count > 1]                # rows two requests read (a common prefix) are nobody's alone
    request_rows = {f: r[~torch.isin(r, shared)] for f, r in readable.items()}
    requests = [fs.state.request_id for fs in io.requests_in_batch]
    return StepView(step, pool, regions, label.rows(OWNED), torch.cat(may_write).unique(),
                    row_layer, requests, [fs.query_length for fs in io.requests_in_batch], padded, request_rows)


def _slot_fn(blocks, page, stride, window):
    """Position -> physical index: blocks in order, or a ring of `window` slots for sliding layers."""
    if window is None:
        return lambda p: blocks[p // page] * stride + p % page
    return lambda p: blocks[(p % window) // page] * stride + (p % window) % page

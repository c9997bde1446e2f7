"""transformers' continuous batching (`generate_batch`) as a scribble engine.

What this adapter relies on, read in transformers 5.24.0 (`generation/continuous_batching/`):
- The pool is ONE flat uint8 tensor, `PagedAttentionCache.cache_tensor`, cut into sectors of
  `bytes_per_sector`. Sectors 0 and 1 are never allocated: sector 0 is the read trash (padded rows
  read physical index `read_trash_index = 0`; sliding layers also read the sentinel index 1 and
  overwrite it before use), sector 1 the write trash (`write_trash_index`, where padded rows write).
  The tensor starts zeroed, so the read trash holds zeros and a padded read has weight exactly 0.
- Each attention type has one allocator; it views the pool in the model dtype as
  [tokens, 2, kv_heads, head_dim] with blocks of `block_physical_stride = 2 * page * layers` token
  rows: [L0 K page | L0 V page | L1 K page | ...]. Physical index p of layer i reads row
  p + 2*i*page (K) and p + (2*i + 1)*page (V) of that view. Block ids are global: block b of an
  allocator lives in sector b // blocks_per_sector.
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
- `ModelRunner.pad_inputs` (on when CUDA graphs or compile are) pads the query rows with the write
  trash index and the KV rows with the read-trash index, masked with dtype-min: weight 0, and
  0 * NaN = NaN. It is settable after the processor is built, which lets the CPU show the padded path.
- paged|eager and sdpa both gather by index here; flash's decode fast path walks a block table.
"""
from __future__ import annotations

import contextlib
import gc
import threading
import traceback

import torch

from .contract import Generation, NoHooks, StepView
from .versions import require_supported

_PATCH_LOCK = threading.Lock()   # the hooks patch classes: one scribbled generation at a time


def _decoder_layers(model):
    inner = getattr(model, "model", None)
    return list(getattr(inner, "layers", []) or [])


class TransformersEngine:
    """One model + workload + attention settings; `generate(hooks)` runs a whole greedy generation.

    attn: "paged|eager" | "sdpa" | a flash implementation; pad: force the model runner's padded
    inputs (what CUDA graphs and compile switch on) even without them; cuda_graph: ask transformers
    for CUDA graphs (a CUDA device only)."""

    def __init__(self, model, workload, attn: str = "paged|eager", pad: bool = False, cuda_graph: bool = False,
                 check_version: bool = True):
        if check_version:
            require_supported()
        if cuda_graph and model.device.type != "cuda":
            raise ValueError("cuda_graph: CUDA graphs need a model on a CUDA device")
        self.model, self.workload, self.attn = model, workload, attn
        self.pad, self.cuda_graph = pad or cuda_graph, cuda_graph
        self.graphs = cuda_graph
        self.reads_pool = "padded-gather" if self.pad else "gather"
        if "flash" in attn:
            self.reads_pool += "+block-table"
        self.name = f"transformers:{attn}" + ("+graphs" if cuda_graph else "+pad" if pad else "")
        self.prompts = workload.prompts(model.config.get_text_config().vocab_size)
        self.cache = None        # the live PagedAttentionCache while a generation runs
        model.set_attn_implementation(attn)

    # ------------------------------------------------------------------ run
    def generate(self, hooks=None, record_attention: bool = False) -> Generation:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        hooks = hooks or NoHooks()
        wl = self.workload
        gen_config = GenerationConfig(max_new_tokens=wl.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
        cb_config = ContinuousBatchingConfig(
            page_size=wl.page_size, num_blocks=wl.num_blocks, max_batch_tokens=wl.max_batch_tokens,
            return_logprobs=True, use_cuda_graph=self.cuda_graph, use_async_batching=False,
            auto_switch_to_flash=False, seed=wl.seed,
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
        errors = [f"{r}: {out[r].error}" for r in ids if r in out and out[r].error]
        errors += [f"{r}: no result" for r in ids if r not in out]
        error = run.hook_error or "; ".join(errors)
        return Generation(
            tokens={r: list(out[r].generated_tokens) for r in ids if r in out},
            logprobs={r: list(out[r].logprobs or []) for r in ids if r in out},
            logits=None if self.graphs else run.logits,
            attention=run.attention if record_attention and not self.graphs else None,
            steps=run.steps, error=error)


class _Run:
    """The patches and the records of one generation."""

    def __init__(self, engine: TransformersEngine, hooks, record_attention: bool):
        self.engine, self.hooks, self.record_attention = engine, hooks, record_attention
        self.logits, self.attention, self.steps = [], [], []
        self.hook_error = ""
        self._step = 0
        self._n_logits = 0
        self._q_real = 0

    @contextlib.contextmanager
    def patched(self):
        from transformers.generation.continuous_batching import continuous_api as api
        proc_cls, mgr_cls = api.ContinuousBatchProcessor, api.ContinuousBatchingManager
        orig_step, orig_warmup, orig_create = proc_cls._generation_step, proc_cls.warmup, mgr_cls._create_batch_processor
        run = self

        def create(manager):
            bp = orig_create(manager)
            if run.engine.pad:
                bp.model_runner.pad_inputs = True
            run.engine.cache = bp.cache
            return bp

        def step(bp, model):
            return run._guarded(bp, lambda: orig_step(bp, model), warmup=False)

        def warmup(bp, model):
            return run._guarded(bp, lambda: orig_warmup(bp, model), warmup=True)

        handles = self._register_model_hooks()
        proc_cls._generation_step, proc_cls.warmup, mgr_cls._create_batch_processor = step, warmup, create
        try:
            yield
        finally:
            proc_cls._generation_step, proc_cls.warmup, mgr_cls._create_batch_processor = (
                orig_step, orig_warmup, orig_create)
            for h in handles:
                h.remove()
            self.engine.cache = None

    def _guarded(self, bp, call, warmup: bool):
        try:
            view = pool_view(bp, "warmup" if warmup else self._step)
            if not warmup:
                self._n_logits = sum(bool(fs.has_new_token) for fs in bp.inputs_and_outputs.requests_in_batch)
                self._q_real = int(bp.inputs_and_outputs.total_seqlen_q)
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
_OWNED, _TAIL, _OOW, _STEP, _FREE, _READ_TRASH, _WRITE_TRASH, _PREFIX = range(8)
_LABELS = {_TAIL: "unwritten-tail", _OOW: "out-of-window", _STEP: "step-writes", _FREE: "free-blocks",
           _READ_TRASH: "read-trash", _WRITE_TRASH: "write-trash", _PREFIX: "prefix-cache"}


def pool_view(bp, step) -> StepView:
    """The StepView of a ContinuousBatchProcessor whose next batch is prepared (or of its warm-up)."""
    cache = bp.cache
    allocators = list(cache.cache_allocators.values())
    heads, head_dim = allocators[0].num_key_value_heads, allocators[0].head_dim
    pool = cache.cache_tensor.view(cache.dtype).view(-1, heads * head_dim)
    n_rows = pool.shape[0]
    rows_per_sector = cache.bytes_per_sector // (heads * head_dim * cache.dtype.itemsize)
    label = torch.full((n_rows,), _FREE, dtype=torch.int8)
    label[:rows_per_sector] = _READ_TRASH
    label[rows_per_sector: 2 * rows_per_sector] = _WRITE_TRASH
    row_layer = torch.full((n_rows,), -1, dtype=torch.int64)
    io = bp.inputs_and_outputs
    padded = bool(bp.model_runner.pad_inputs)

    if step == "warmup":
        # warm-up requests may write anywhere outside the read trash; nothing is poisoned
        rows = torch.arange(n_rows)
        return StepView(step, pool, {}, rows[:0], rows[rows_per_sector:], row_layer, padded=padded)

    batch = {fs.state.request_id: fs for fs in io.requests_in_batch}
    active = bp.scheduler.active_requests
    may_write = [torch.arange(rows_per_sector, 2 * rows_per_sector)]
    for a in allocators:
        page, n_layers, stride = a.tokens_per_page, len(a.layer_indices), a.block_physical_stride
        plane_offsets = torch.arange(2 * n_layers) * page                    # K, V of every layer of the group
        layer_of_offset = torch.tensor(a.layer_indices).repeat_interleave(2 * page)

        def rows_of_slots(phys):      # physical indexes -> the K and V rows of every layer of the group
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
            label[rows_of_blocks(set(a.ledger.cached_blocks) - owned_blocks)] = _PREFIX
        if owned_blocks:
            label[rows_of_blocks(owned_blocks)] = _TAIL

        window = getattr(a, "sliding_window", None)
        visible, held, writes = [], [], []
        for rid, blocks in a.block_table.items():
            fs, state = batch.get(rid), active.get(rid)
            if state is None:     # blocks of a request the scheduler does not list: never poison them
                visible.extend(b * stride + t for b in blocks for t in range(page))
                continue
            past = state.position_offset - (fs.query_length if fs is not None else 0)
            first_visible = 0 if window is None else max(0, past - window + 1)
            first_held = 0 if window is None else max(0, past - window)
            slot = _slot_fn(blocks, page, stride, window)
            visible.extend(slot(p) for p in range(first_visible, past))
            held.extend(slot(p) for p in range(first_held, first_visible))
            if fs is not None:
                writes.extend(i for i in a.get_write_indices(rid, past, fs.query_length) if i != a.write_trash_index)
        # precedence: an owned block's other rows < out of window < this step's writes < what may be read
        # (a sliding ring's chunked prefill reads a slot before it overwrites it: that slot stays owned)
        if held:
            label[rows_of_slots(held)] = _OOW
        if writes:
            w = rows_of_slots(writes)
            label[w] = _STEP
            may_write.append(w)
        if visible:
            label[rows_of_slots(visible)] = _OWNED
    regions = {name: torch.nonzero(label == code).reshape(-1) for code, name in _LABELS.items()}
    requests = [fs.state.request_id for fs in io.requests_in_batch]
    return StepView(step, pool, regions, torch.nonzero(label == _OWNED).reshape(-1), torch.cat(may_write).unique(),
                    row_layer, requests, [fs.query_length for fs in io.requests_in_batch], padded)


def _slot_fn(blocks, page, stride, window):
    """Position -> physical index: blocks in order, or a ring of `window` slots for sliding layers."""
    if window is None:
        return lambda p: blocks[p // page] * stride + p % page
    return lambda p: blocks[(p % window) // page] * stride + (p % window) % page

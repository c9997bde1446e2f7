"""The scribble's KV connector for vLLM: the engine's own extension point for code that reads and
writes the KV pool around every forward step. vLLM loads this module by path
(`kv_connector_module_path`: engine.CONNECTOR_MODULE), so it imports vLLM at the top; nothing else in
qsa_lab imports it.

Scheduler side (`build_connector_meta`, once a step, after scheduling): the block pool handed over
by `bind_gpu_block_pool` (block 0 the null block; free blocks with and without a prefix-cache
hash), every live request's block ids (`KVCacheManager.get_block_ids`) with its tokens computed
before the step (requests are seen in `on_new_request`) and scheduled in it. It marks the step as
having a synchronous load (`has_sync_kv_loads`, as vLLM's own HiSparse connector does), so the
worker's `start_load_kv` runs before the forward, not after it.

Worker side: `register_kv_caches` hands over every layer's view of the one KV buffer (a copy is
kept: the pool as it was allocated, for the warm-up guard); `start_load_kv` (before the forward)
builds the step's view and calls the hooks' `before_step`, `wait_for_save` (after the forward)
their `after_step`. The connector never loads, saves or delays anything: no matched tokens, no
async loads, blocks freed at once.

In-process only (VLLM_ENABLE_V1_MULTIPROCESSING=0, one worker): both sides and the generation that
owns the hooks live in this process and meet in `ACTIVE`.
"""
from __future__ import annotations

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                              KVConnectorRole, SupportsHMA)

from .pool import PoolMap, RequestMeta, StepMeta, layer_number

#: the connectors of the running engine and the generation being scribbled (None between them)
ACTIVE = {"scheduler": None, "worker": None, "run": None}


class StepMetadata(KVConnectorMetadata):
    def __init__(self, step: StepMeta):
        self.step = step


class ScribbleConnector(KVConnectorBase_V1, SupportsHMA):
    """Reads the pool's state each step; writes nothing itself (the hooks do, between the calls)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._block_pool = None
        self._live = {}            # request id -> vLLM Request (scheduler side)
        self._held = {}            # request id -> per group, blocks it held (to see what a window gave back)
        self.names = {}            # request id -> "req_<i>", in the order requests arrive
        self.kv_caches = None      # worker side: layer name -> view of the one buffer
        self.flat = None           # worker side: the whole buffer in the KV dtype
        self.at_allocation = None  # the buffer as allocated, before warm-up and capture
        self.map = None
        self.attention = {}        # the attention implementation the layers use (a fact for the report)
        ACTIVE["scheduler" if role == KVConnectorRole.SCHEDULER else "worker"] = self

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # ------------------------------------------------------------------ scheduler side
    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        self._block_pool = gpu_block_pool

    def fresh_free_queue(self) -> None:
        """With no request live: the free block queue in block order, as a new engine's (vLLM hands out
        free blocks from its front; finished requests put theirs back at the end)."""
        from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue
        pool = self._block_pool
        free = [b for b in pool.blocks if not b.is_null]
        if any(b.ref_cnt for b in free):
            raise RuntimeError("the free block queue is reset only when no request holds a block")
        pool.free_block_queue = FreeKVCacheBlockQueue(free)

    def on_new_request(self, request) -> None:
        self._live[request.request_id] = request
        self.names[request.request_id] = f"req_{len(self.names)}"

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def request_finished(self, request, block_ids):
        self._forget(request.request_id)
        return False, None

    def request_finished_all_groups(self, request, block_ids):
        self._forget(request.request_id)
        return False, None

    def _forget(self, request_id):
        self._live.pop(request_id, None)
        self._held.pop(request_id, None)

    def build_connector_meta(self, scheduler_output) -> StepMetadata:
        scheduler_output.has_sync_kv_loads = True      # start_load_kv before the forward
        pool, groups = self._block_pool, self._kv_cache_config.kv_cache_groups
        free = [b.block_id for b in pool.blocks if b.ref_cnt == 0 and not b.is_null]
        cached = [b for b in free if pool.blocks[b].block_hash is not None]
        cached_set = set(cached)
        windows = tuple(getattr(g.kv_cache_spec, "sliding_window", None) for g in groups)
        scheduled = scheduler_output.num_scheduled_tokens
        requests, window_freed = [], {}
        for rid, req in self._live.items():
            blocks = tuple(list(b) for b in self._kv_cache_manager.get_block_ids(rid))
            if not any(blocks):                     # waiting, or preempted: holds nothing
                self._held.pop(rid, None)
                continue
            requests.append(RequestMeta(self.names.get(rid, rid), blocks, req.num_computed_tokens, scheduled.get(rid, 0)))
            held = self._held.setdefault(rid, [set() for _ in groups])
            for g, ids in enumerate(blocks):
                if windows[g] is None:
                    continue
                held[g] = {b for b in held[g] | set(ids) if b != pool.null_block.block_id}
                gone = {b for b in held[g] - set(ids) if pool.blocks[b].ref_cnt == 0}
                held[g] -= {b for b in held[g] - set(ids) if b not in gone}    # taken by another request
                window_freed.setdefault(g, []).extend(sorted(gone))
        new = scheduler_output.scheduled_new_reqs
        chunked = sum(1 for rid, n in scheduled.items() if rid in self._live and
                      self._live[rid].num_computed_tokens + n < self._live[rid].num_prompt_tokens)
        facts = {"chunked_prefill": chunked, "preempted": len(scheduler_output.preempted_req_ids or ()),
                 "prefix_hits": sum(r.num_computed_tokens > 0 for r in new),
                 "prefix_hit_tokens": sum(r.num_computed_tokens for r in new),
                 "zeroed_blocks": len(scheduler_output.new_block_ids_to_zero or ()),
                 "copied_blocks": len(scheduler_output.kv_cache_block_copies or ())}
        step = StepMeta(scheduler_output.total_num_scheduled_tokens, pool.null_block.block_id,
                        [b for b in free if b not in cached_set], cached, window_freed, requests,
                        [(self.names.get(r, r), n) for r, n in scheduled.items()], windows, facts)
        return StepMetadata(step)

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict) -> None:
        self.kv_caches = kv_caches
        storages = {t.untyped_storage().data_ptr() for t in kv_caches.values()}
        if len(storages) != 1:
            raise RuntimeError(f"scribble: expected one KV buffer for all layers, found {len(storages)}")
        first = next(iter(kv_caches.values()))
        storage = first.untyped_storage()
        dtype = first.dtype
        self.flat = torch.empty(0, dtype=dtype, device=first.device).set_(
            storage, 0, (storage.nbytes() // dtype.itemsize,))
        self.at_allocation = self.flat.clone()

    def start_load_kv(self, forward_context, **kwargs) -> None:
        run = ACTIVE["run"]
        if run is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata().step
        if meta.scheduled_tokens == 0:
            return
        if self.map is None:
            self.map = self._build_map(forward_context)
        run.before_step(self, meta, forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        pass

    def wait_for_save(self) -> None:
        run = ACTIVE["run"]
        if run is None or not self.has_connector_metadata():
            return
        if self._get_connector_metadata().step.scheduled_tokens:
            run.after_step(self)

    # ------------------------------------------------------------------ the pool's geometry
    def _build_map(self, forward_context) -> PoolMap:
        """Where each token's bytes lie: one block per layer written by the attention backend's own
        cache-write call (`do_kv_cache_update`) into a scratch copy of the pool, K as token + 1 and V
        as -(token + 1); the engine's pool is not touched."""
        config = self._kv_cache_config
        group_of = {name: g for g, grp in enumerate(config.kv_cache_groups) for name in grp.layer_names}
        block_size = config.kv_cache_groups[0].kv_cache_spec.block_size
        layers = []
        for i, (name, module) in enumerate(forward_context.no_compile_layers.items()):
            kv, impl = getattr(module, "kv_cache", None), getattr(module, "impl", None)
            if name not in group_of or not torch.is_tensor(kv) or not hasattr(impl, "do_kv_cache_update"):
                continue
            spec = config.kv_cache_groups[group_of[name]].kv_cache_spec
            if spec.block_size != block_size:
                raise RuntimeError("scribble: KV-cache groups with different block sizes are not supported")
            scratch = torch.zeros_like(self.flat).as_strided(kv.size(), kv.stride(), kv.storage_offset())
            code = torch.arange(1, block_size + 1, dtype=kv.dtype, device=kv.device)
            key = code.reshape(-1, 1, 1).expand(block_size, spec.num_kv_heads, spec.head_size).contiguous()
            value = -code.reshape(-1, 1, 1).expand(block_size, spec.num_kv_heads, spec.head_size_v).contiguous()
            slots = torch.arange(block_size, dtype=torch.int64, device=kv.device)
            impl.do_kv_cache_update(module, key, value, scratch, slots)
            ratio = kv.shape[0] // config.num_blocks
            codes = scratch[:ratio].reshape(-1).float().cpu()
            token_of = torch.where(codes != 0, codes.abs() - 1, -1).long()
            layers.append((group_of[name], layer_number(name, i), kv, token_of))
            self.attention = {"attention": type(impl).__name__, "isa": getattr(module, "isa", None)}
        if not layers:
            raise RuntimeError("scribble: no attention layer with a paged KV cache found")
        return PoolMap(self.flat, layers, block_size, config.num_blocks, len(config.kv_cache_groups))

"""vLLM's engine (`vllm.LLM`, in-process) as a scribble engine, through a KV connector.

    engine = VllmEngine(vllm_model("llama-gqa"), vllm_workload("reuse"))
    report = scribble(engine)

What it relies on, read in vLLM 0.32.0 (the versions in `env.SUPPORTED_VLLM`; another is
refused with one line: env.VLLM):
- The KV connector API (`KVConnectorBase_V1`, loaded from `kv_connector_module_path`): the
  scheduler side sees the block pool (`bind_gpu_block_pool`), new requests (`on_new_request`) and
  builds one metadata object per step after scheduling; the worker side gets the KV views
  (`register_kv_caches`) and runs `start_load_kv` before the forward when the step has a
  synchronous load, `wait_for_save` after it. That is where the hooks run (connector.py).
- Attributes the API hands over without documenting them: `BlockPool.blocks[i].ref_cnt`,
  `.block_hash`, `.is_null`, `BlockPool.null_block`, `Request.num_computed_tokens` and
  `.num_prompt_tokens`, the attention layers' `kv_cache` and `impl.do_kv_cache_update` (the cache
  write used to find where each token's bytes lie), the KV-cache config's groups and specs, and
  `BlockPool.free_block_queue` (put back in block order, `FreeKVCacheBlockQueue`, before each
  scribbled generation).
- One backing buffer holds every layer's KV (`allocate_kv_cache`): the pool is that buffer.
- Between two steps (after one forward's `wait_for_save`, before the next one's `start_load_kv`) the
  model runner's `_update_states` zeroes newly allocated blocks where the cache needs it
  (`_zero_block_ids`: Mamba and mixed-precision caches) and runs the block copies of copy-on-write
  prefix hits (`copy_kv_cache_blocks_inplace` of `vllm.v1.worker.gpu_model_runner`). The adapter wraps
  all three in `hooks.engine_call` for the write guard; the last two are the engine's own KV moves.
  It reaches the model runner through `LLM.collective_rpc`.
The engine is built once (about 20 s on a small CPU) and then generates many times: every
generation starts from the same pool bytes (those after warm-up, put back) with an empty prefix
cache and the free block queue in block order (as a new engine hands blocks out), so a clean run, a
scribbled one and a confirming re-run see the same engine. Greedy decoding, full-vocabulary
logprobs for small vocabularies (the adapter's "logits"), synchronous scheduling (async scheduling
would overlap the next step's preparation with this forward: a fill could race with it). On the
CPU, one thread (`threads`, set before the engine starts; vLLM's worker then locks the number): the
tiny models gain nothing from more, and where other processes keep the cores busy every
multi-threaded operation waits for a core to come free (a guarded `reuse` generation took 20 to 30 s
on two threads and 0.5 s on one, at load 11 on 2 cores).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import traceback
from dataclasses import replace

import torch

from ...models import RENAMED_WORKLOADS, Workload
from ... import patching
from ..base import Generation
from .env import NOT_ON_VLLM, VLLM
from .pool import Families, layer_number

#: where vLLM imports the KV connector from (kv_connector_module_path): this package's connector.py
CONNECTOR_MODULE = "qsa_lab.scribble.engines.vllm.connector"

#: the tiny models vLLM's CPU backend runs: its attention needs head_dim 32, 64, 80, ... (not 16)
VLLM_TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
VLLM_MODELS = {
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral-swa": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 48}),
    # a mixture of experts: 4 experts, 2 per token (vLLM's CPUUnquantizedExperts); its KV cache is a Llama's
    "mixtral-moe": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}
#: the named workloads sized for vLLM's CPU backend (blocks of 32 tokens: it refuses smaller ones);
#: num_blocks counts the null block
VLLM_WORKLOADS = {
    # 4 requests on 16 usable blocks: the 47-token prompt is prefilled in chunks (64 tokens a step)
    "chunked-prefill": Workload("chunked-prefill", (5, 13, 30, 47), 6, 32, 17, 64),
    # 6 requests, at most 4 at a time, on 7 usable blocks: requests wait for blocks that finished ones
    # free, running ones are preempted when a decode needs a block, prompts are prefilled in chunks of
    # 48 tokens, and the last two share their first 64 tokens (two full blocks: prefix-cache hits)
    "reuse": Workload("reuse", (5, 40, 70, 47, 80, 80), 24, 32, 8, 48, shared_prefix=64),
}


def vllm_workload(name: str) -> Workload:
    if name in RENAMED_WORKLOADS:
        raise ValueError(f"workload: {name!r} is now called {RENAMED_WORKLOADS[name]!r}")
    if name in NOT_ON_VLLM:
        raise ValueError(f"workload: {name}: {NOT_ON_VLLM[name]}")
    if name not in VLLM_WORKLOADS:
        raise ValueError(f"workload must be one of {sorted(VLLM_WORKLOADS)}, got {name!r}")
    return VLLM_WORKLOADS[name]


def vllm_model(name: str = "llama-gqa", seed: int = 0, folder: str | None = None) -> str:
    """A tiny random model built from a config (torch.manual_seed(seed)) and saved as a local
    checkpoint in `folder` (default: a new temporary folder); returns the folder."""
    if name in NOT_ON_VLLM:
        raise ValueError(f"model: {name}: {NOT_ON_VLLM[name]}")
    if name not in VLLM_MODELS:
        raise ValueError(f"model must be one of {sorted(VLLM_MODELS)} or a local checkpoint folder, got {name!r}")
    import transformers
    config_cls, model_cls, extra = VLLM_MODELS[name]
    config = getattr(transformers, config_cls)(**VLLM_TINY, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    folder = folder or tempfile.mkdtemp(prefix=f"qsa_lab-{name}-")
    model.save_pretrained(folder)
    return folder


class VllmEngine:
    """One engine (model folder + workload + prefix caching on/off), built once; `generate(hooks)`
    runs a whole greedy generation of the workload's prompts.

    scribble=False builds the same engine without the connector: the unscribbled reference."""

    reads_pool = "block-table"
    graphs = False

    def __init__(self, model_dir: str, workload: Workload, prefix_caching: bool = True, dtype: str = "float32",
                 scribble: bool = True, check_version: bool = True, remove_model_dir: bool = False,
                 label: str | None = None, threads: int | None = 1):
        if check_version:
            VLLM.require()
        if workload.page_size % 32:
            raise ValueError(f"workload: vLLM's CPU attention needs blocks of a multiple of 32 tokens, "
                             f"got {workload.page_size}")
        # the hooks run inside the engine's worker: it must be this process
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu" and threads and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)     # before vLLM's CPU worker replaces set_num_threads with a no-op
        from vllm import LLM
        self.model_dir, self.workload, self.prefix_caching = model_dir, workload, prefix_caching
        self._remove_model_dir = remove_model_dir
        self.model = _ModelName(label or model_dir)
        connector = {"kv_connector": "ScribbleConnector", "kv_connector_module_path": CONNECTOR_MODULE,
                     "kv_role": "kv_producer"}
        self.llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype=dtype, seed=workload.seed,
                       block_size=workload.page_size, num_gpu_blocks_override=workload.num_blocks,
                       kv_cache_memory_bytes=64 << 20, max_model_len=_max_len(workload),
                       max_num_seqs=4, max_num_batched_tokens=workload.max_batch_tokens,
                       enable_chunked_prefill=True, enable_prefix_caching=prefix_caching,
                       async_scheduling=False, enforce_eager=device == "cpu", max_logprobs=-1,
                       disable_log_stats=True, **({"kv_transfer_config": connector} if scribble else {}))
        config = self.llm.llm_engine.model_config.hf_config
        self.vocab = config.get_text_config().vocab_size
        self.prompts = workload.prompts(self.vocab)
        self.name = "vllm" + ("" if prefix_caching else "+no-prefix-caching") + ("" if device == "cpu" else f"+{device}")
        self.scribbled = scribble
        from .connector import ACTIVE
        # this engine's connectors (the last engine built in this process owns ACTIVE's)
        self._worker, self._scheduler = (ACTIVE["worker"], ACTIVE["scheduler"]) if scribble else (None, None)
        # the model runner, for the calls between steps (in-process: the object itself comes back)
        self._runner = self.llm.collective_rpc(lambda worker: worker.model_runner)[0] if scribble else None
        self._initial = None          # the pool after warm-up: every generation starts from these bytes
        self.facts = {}

    def close(self) -> None:
        """Free the engine (and the model folder it was given to remove)."""
        from .connector import ACTIVE
        self.llm = None
        ACTIVE.update(scheduler=None, worker=None, run=None)
        if self._remove_model_dir:
            shutil.rmtree(self.model_dir, ignore_errors=True)

    # ------------------------------------------------------------------ run
    def generate(self, hooks=None, record_attention: bool = False) -> Generation:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from .connector import ACTIVE
        top = self.vocab if self.vocab <= 1024 else 20
        params = SamplingParams(max_tokens=self.workload.new_tokens, temperature=0.0, ignore_eos=True,
                                logprobs=top, detokenize=False)
        self.llm.reset_prefix_cache()
        worker = self._worker
        if worker is not None:
            self._scheduler.fresh_free_queue()
            if self._initial is None:
                self._initial = worker.flat.clone()
            else:
                worker.flat.copy_(self._initial)
            self._scheduler.names.clear()
        run = _Run(self, hooks, record_attention)
        ACTIVE["run"] = run if self.scribbled else None
        try:
            with run.between_steps(self._runner):
                outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in self.prompts], params,
                                         use_tqdm=False)
        except Exception:
            return Generation({}, {}, error=run.error or traceback.format_exc(limit=4))
        finally:
            ACTIVE["run"] = None
            run.remove_hooks()
        tokens, logprobs, logits = {}, {}, []
        for i, out in enumerate(outs):
            completion = out.outputs[0]
            tokens[f"req_{i}"] = list(completion.token_ids)
            logprobs[f"req_{i}"] = [float(lp[t].logprob) for t, lp in zip(completion.token_ids, completion.logprobs)]
            logits.append(torch.tensor([[float(lp[k].logprob) for k in sorted(lp)] for lp in completion.logprobs]))
        self.facts = {"vllm": VLLM.installed(), "prefix_caching": self.prefix_caching, "threads": torch.get_num_threads()}
        if worker is not None:
            self.facts |= worker.attention
        return Generation(tokens, logprobs, logits=logits, attention=run.attention if record_attention else None,
                          steps=run.steps, families=run.families.mapping(), events=run.events, error=run.error)


def _max_len(wl: Workload) -> int:
    need = max(wl.prompt_lengths) + wl.new_tokens
    return -(-need // wl.page_size) * wl.page_size


class _ModelName:
    """What the report names the model by (the checkpoint folder)."""

    def __init__(self, path: str):
        self.name_or_path = path


#: the model runner's calls between steps the write guard names: (where, attribute, the engine's own KV move)
BETWEEN_STEPS = (("runner", "_update_states", False), ("runner", "_zero_block_ids", True),
                 ("module", "copy_kv_cache_blocks_inplace", True))


class _Run:
    """The hooks and records of one generation, called by the connector around every forward
    (hooks None: a plain run, which only counts what the engine did)."""

    def __init__(self, engine: VllmEngine, hooks, record_attention: bool):
        self.engine, self.hooks, self.record_attention = engine, hooks, record_attention
        self.step, self.view, self.error = 0, None, ""
        self.steps, self.attention, self.handles = [], [], []
        self.events = {"steps": 0, "chunked_prefill": 0, "preempted": 0, "prefix_hits": 0, "prefix_hit_tokens": 0,
                       "blocks_reused": 0, "zeroed_blocks": 0, "copied_blocks": 0}
        self.families = Families(engine.workload.page_size)
        self._owner = {}       # block -> first request seen holding it

    @contextlib.contextmanager
    def between_steps(self, runner):
        """Each of the model runner's calls between steps (BETWEEN_STEPS) inside hooks.engine_call, for
        this generation."""
        if runner is None or self.hooks is None:
            yield
            return
        from vllm.v1.worker import gpu_model_runner as module
        with patching.patched() as patch:
            for where, attr, moves in BETWEEN_STEPS:
                owner = runner if where == "runner" else module
                name = f"{type(runner).__name__}.{attr}" if where == "runner" else f"{module.__name__}.{attr}"
                patch.wrap(owner, attr, lambda orig, name=name, moves=moves: self._engine_call(orig, name, moves))
            yield

    def _engine_call(self, orig, name: str, moves: bool):
        def call(*args, **kwargs):
            with self.hooks.engine_call(name, self.engine._worker.flat.view(-1, 1), moves):
                return orig(*args, **kwargs)
        return call

    def before_step(self, worker, meta, forward_context) -> None:
        self.families.update(meta)
        if self.hooks is None:                    # a plain run: what the engine did and the steps only
            self._count(meta)
            self.steps.append(([n for n, _ in meta.batch], [q for _, q in meta.batch]))
            return
        try:
            if self.step == 0:
                self._warmup(worker)
                if self.record_attention:
                    self._hook_attention(forward_context)
            self._count(meta)
            order = _runner_order(meta, forward_context)
            self.steps.append(([n for n, _ in order], [q for _, q in order]))
            if self.record_attention:
                self.attention.append({})
            self.view = worker.map.view(self.step, replace(meta, batch=order), self.families.of)
            self.hooks.before_step(self.view)
        except Exception:
            self.error = self.error or traceback.format_exc(limit=4)
            raise

    def after_step(self, worker) -> None:
        if self.hooks is None:
            return
        try:
            self.hooks.after_step(self.view)
        except Exception:
            self.error = self.error or traceback.format_exc(limit=4)
            raise
        self.step += 1

    def _warmup(self, worker) -> None:
        """The guard around warm-up and graph capture: the pool as allocated against the pool now."""
        pool_map = worker.map
        self.hooks.before_step(pool_map.warmup_view(worker.at_allocation.view(-1, 1).clone()))
        self.hooks.after_step(pool_map.warmup_view(self.engine._initial.view(-1, 1).clone()))

    def _count(self, meta) -> None:
        self.events["steps"] += 1
        for k, n in meta.facts.items():
            self.events[k] += n
        for r in meta.requests:
            for blocks in r.blocks:
                for b in blocks:
                    if b == meta.null_block:
                        continue
                    first = self._owner.setdefault(b, r.name)
                    if first != r.name and first != "*":
                        self.events["blocks_reused"] += 1
                        self._owner[b] = "*"

    def _hook_attention(self, forward_context) -> None:
        for i, (name, module) in enumerate(forward_context.no_compile_layers.items()):
            if not hasattr(getattr(module, "impl", None), "do_kv_cache_update"):
                continue
            layer, heads = layer_number(name, i), module.num_heads

            def keep(mod, args, output, layer=layer, heads=heads):
                if self.attention and torch.is_tensor(output):
                    rows = sum(self.steps[-1][1])
                    x = output[:rows].detach().float().cpu()
                    self.attention[-1][layer] = x.reshape(rows, heads, -1)
            self.handles.append(module.register_forward_hook(keep))

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def _runner_order(meta, forward_context) -> list:
    """The step's requests in the model runner's row order (it puts decodes first), matched by
    (query length, sequence length) against the attention metadata; the scheduler's order when
    the metadata does not say."""
    metadata = forward_context.attn_metadata
    one = next(iter(metadata.values()), None) if isinstance(metadata, dict) else None
    starts, seq_lens = getattr(one, "query_start_loc", None), getattr(one, "seq_lens", None)
    if starts is None or seq_lens is None:
        return list(meta.batch)
    computed = {r.name: r.computed for r in meta.requests}
    left = list(meta.batch)
    order = []
    q = (starts[1:] - starts[:-1]).tolist()
    for q_len, s_len in zip(q, seq_lens.tolist()):
        match = next((x for x in left if x[1] == q_len and computed.get(x[0], 0) + q_len == s_len), None)
        if match is None:
            return list(meta.batch)
        left.remove(match)
        order.append(match)
    return order if not left else list(meta.batch)

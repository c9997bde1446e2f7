"""The scribble's engine adapters, one module or folder per engine, each on the one protocol of
`engines.base` (StepView, Generation, EngineAdapter):

    base.py            the protocol the checker drives (qsa_lab.scribble.check.scribble)
    transformers.py    transformers' continuous batching (`generate_batch`), in this process
    vllm/              vLLM through its KV connector API: engine.py (the adapter), connector.py (what
                       vLLM loads by module path), pool.py (the pool sorted into regions), env.py
                       (the supported vLLM and the environment it lives in; torch-free)

How to add an engine (one new module or folder here, and a test; nothing else touched):
1. A class with `name`, `reads_pool`, `graphs`, `model`, `workload` and `generate(hooks=None,
   record_attention=False) -> Generation` (engines.base.EngineAdapter). Import the engine itself
   lazily (inside the methods), so this package imports without it.
2. Before each forward step hand `hooks.before_step` a StepView (the pool as rows, each row's
   region), after it `hooks.after_step` the same view; sort the rows with `regions.RowLabels` and
   `regions.precedence(reads_before_write)`: the regions and which wins a row two claim are defined
   there once, the adapter only marks what its engine's bookkeeping says. Where sorting every row
   costs more than the step, hand a `LazyStepView`: `may_write` and the region sizes now, the rows
   of each region only when a hook first reads them (a guard alone never does).
3. Wrap each of the engine's calls between steps that writes the pool in `hooks.engine_call(name,
   pool, moves)` (moves=True: the engine's own restore or copy into rows a request owns next), with
   `patching.patched()`: every attribute it replaces is given back after the generation.
4. Refuse an engine version it was not written for with `versions.VersionGate` (one line, no verdict).
5. A test in tests/scribble/ that runs `scribble(YourEngine(...))` on a tiny model;
   tests/scribble/test_floor_plan.py checks the adapter class against the protocol.

The next one, SGLang: an `sglang.srt.plugins` entry point with an AROUND hook on
`ModelRunner.forward`; the `ForwardBatch` carries `req_to_token_pool` / `token_to_kv_pool`,
`out_cache_loc` (this step's writes) and the allocator's free list; padding for CUDA graphs reads
slot 0.
"""

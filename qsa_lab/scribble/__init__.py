"""The scribble: the canary for a running inference engine.

Before every forward step of a whole generation, fill one region of the KV pool that no live
request owns (free blocks, unwritten tails, the step's own write slots, the read and write trash,
prefix-cache blocks, out-of-window slots), or one live request's own rows (other-requests), with
NaN, Inf or the dtype's max, and compare the tokens, logprobs and logits with a clean run, every
leak confirmed by a re-run; and guard every row a step, or the engine between steps, must not write.

    from qsa_lab.scribble import TransformersEngine, scribble, tiny_model, workload
    engine = TransformersEngine(tiny_model("llama-gqa"), workload("reuse"), attn="paged|eager")
    report = scribble(engine)
    print(report.table())

    report = scribble_attention("my_attn.py:attention", workload="reuse")   # yours, in a worker process

vLLM (in its own environment, `make vllm-env`): VllmEngine(vllm_model("llama-gqa"), vllm_workload("reuse")).

The floor plan (the canary's pattern):

    check.py        the run loop: scribble(), every region x payload, each leak confirmed
    guard.py        the hooks that fill a region and guard every row (Scribbler, changed_rows)
    compare.py      what changed between two generations, and where it first shows
    report.py       ScribbleReport: cells, table, legend, JSON (on analysis.leaks' report base)
    regions.py      the regions, what each holds and which wins a row two claim, once; the payloads
    engines/        one adapter per engine on one protocol (engines/base.py: StepView, Generation,
                    EngineAdapter): transformers.py, vllm/; how to add one: engines/__init__.py
    patching.py     the one patch-and-restore helper the adapters use
    versions.py     the one version gate (VersionGate; transformers' own)
    models.py       the tiny models and named workloads; isolated.py + worker.py: a user's --attn
                    function in a process of its own; figures.py: the verdict grid

Names load on first use, so `qsa-lab scribble --help` needs neither torch nor transformers.
"""
from qsa_lab.support.lazy import lazy

_NAMES = {
    "REGIONS": ".regions", "POOL_REGIONS": ".regions", "OTHER": ".regions", "REGION_TEXT": ".regions",
    "PAYLOADS": ".regions", "SCHEMA": ".report", "STRAY": ".report",
    "SUPPORTED_TRANSFORMERS": ".versions", "refusal": ".versions", "VersionGate": ".versions",
    "StepView": ".engines.base", "Generation": ".engines.base", "EngineAdapter": ".engines.base",
    "TransformersEngine": ".engines.transformers", "VllmEngine": ".engines.vllm.engine",
    "vllm_model": ".engines.vllm.engine", "vllm_workload": ".engines.vllm.engine",
    "SUPPORTED_VLLM": ".engines.vllm.env",
    "tiny_model": ".models", "local_model": ".models", "workload": ".models", "WORKLOADS": ".models",
    "MODELS": ".models",
    "scribble": ".check", "Scribbler": ".guard", "ScribbleReport": ".report", "compare": ".compare",
    "localise": ".compare", "verdict_grid": ".figures", "scribble_attention": ".isolated",
    "per_request_attention": ".examples",
}
__all__ = list(_NAMES)

__getattr__, __dir__ = lazy(__name__, _NAMES)

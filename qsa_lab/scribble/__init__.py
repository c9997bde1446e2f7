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

The contract an engine adapter implements: qsa_lab.scribble.contract (StepView, EngineAdapter).
Names load on first use, so `qsa-lab scribble --help` needs neither torch nor transformers.
"""
from qsa_lab.support.lazy import lazy

_NAMES = {
    "REGIONS": ".verdicts", "POOL_REGIONS": ".verdicts", "OTHER": ".verdicts", "REGION_TEXT": ".verdicts",
    "PAYLOADS": ".verdicts", "SCHEMA": ".verdicts", "STRAY": ".verdicts",
    "SUPPORTED_TRANSFORMERS": ".versions", "refusal": ".versions",
    "StepView": ".contract", "Generation": ".contract", "EngineAdapter": ".contract",
    "TransformersEngine": ".hf_engine", "VllmEngine": ".vllm_engine", "vllm_model": ".vllm_engine",
    "vllm_workload": ".vllm_engine", "SUPPORTED_VLLM": ".vllm_env",
    "tiny_model": ".models", "local_model": ".models", "workload": ".models", "WORKLOADS": ".models",
    "MODELS": ".models",
    "scribble": ".check", "Scribbler": ".check", "ScribbleReport": ".check", "compare": ".check",
    "localise": ".check", "verdict_grid": ".figures", "scribble_attention": ".isolated",
    "per_request_attention": ".examples",
}
__all__ = list(_NAMES)

__getattr__, __dir__ = lazy(__name__, _NAMES)

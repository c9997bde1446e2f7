"""vLLM as a scribble engine: engine.py (VllmEngine, the adapter; vllm_model, vllm_workload),
connector.py (the KV connector vLLM loads by its module path: imports vLLM, nothing else in qsa_lab
imports it), pool.py (vLLM's pool sorted into the scribble's regions; torch only) and env.py (the
supported vLLM, the models and workloads it does not run, and the environment it lives in;
torch-free, so the command line reads it first)."""

"""The canary: poison every byte a paged-attention call does not attend, and show which outputs leak.

    from qsa_lab.canary import run_canary, assert_no_leak
    report = run_canary(backend="auto")            # every built-in kernel x region x plane x payload
    report.frame()                                 # one row per result: verdict, NaN / Inf / changed counts
    assert_no_leak(my_kernel, attend="dense", q_heads=8, kv_heads=2, head_dim=128)   # in your own tests

What a row attends and where the unattended bytes are: qsa_lab.model.regions (AttentionSpec).
The call and its geometry: qsa_lab.canary.case (CanaryCase, canary_case, load_case).
Verdicts and what "changed" means: qsa_lab.analysis.leaks (the scribble's too).
Payloads: qsa_lab.model.poison.PAYLOAD_BITS. Your own kernel: qsa_lab.canary.kernels (PagedCall, KernelSkipped).
Search a kernel's whole space and shrink each leak: qsa_lab.canary.leak_search (search).
Names load on first use, so `qsa-lab canary --help` needs no torch.
"""
from qsa_lab.support.lazy import lazy

_NAMES = {
    "AttentionSpec": "qsa_lab.model.regions", "attended_tokens": "qsa_lab.model.regions",
    "CanaryCase": ".case", "canary_case": ".case", "load_case": ".case",
    "KernelSkipped": ".call", "PagedCall": ".call", "builtin_kernels": ".kernels", "register_kernel": ".kernels",
    "LEAKS": "qsa_lab.analysis.leaks", "VERDICTS": "qsa_lab.analysis.leaks", "compare": "qsa_lab.analysis.leaks",
    "DEFAULT_PAYLOADS": ".runner", "SCHEMA": ".results",
    "CanaryReport": ".results", "LeakResult": ".results", "assert_no_leak": ".runner",
    "load_canary": ".results", "run_canary": ".runner",
    "search": ".leak_search", "SearchReport": ".leak_search", "Limits": ".leak_search",
}
__all__ = list(_NAMES)

__getattr__, __dir__ = lazy(__name__, _NAMES)

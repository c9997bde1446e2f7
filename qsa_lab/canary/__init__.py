"""The canary: poison every byte a paged-attention call does not attend, and show which outputs leak.

    from qsa_lab.canary import run_canary, assert_no_leak
    report = run_canary(backend="auto")            # every built-in kernel x region x plane x payload
    report.frame()                                 # one row per result: verdict, NaN / Inf / changed counts
    assert_no_leak(my_kernel)                      # in your own test suite: AssertionError lists the leaks

Where the unattended bytes are: qsa_lab.regions. Payloads: qsa_lab.poison.PAYLOAD_BITS.
Your own kernel: qsa_lab.canary.kernels (PagedCall, KernelSkipped).
"""
from ..regions import AttentionSpec, attended_tokens
from .case import CanaryCase, canary_case, load_case
from .kernels import KernelSkipped, PagedCall, builtin_kernels
from .runner import (DEFAULT_PAYLOADS, LEAKS, SCHEMA, VERDICTS, CanaryReport, LeakResult, assert_no_leak, compare,
                     load_canary, run_canary)

__all__ = ["AttentionSpec", "attended_tokens", "CanaryCase", "canary_case", "load_case", "KernelSkipped", "PagedCall",
           "builtin_kernels", "DEFAULT_PAYLOADS", "LEAKS", "SCHEMA", "VERDICTS", "CanaryReport", "LeakResult",
           "assert_no_leak", "compare", "load_canary", "run_canary"]

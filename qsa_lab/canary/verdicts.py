"""The canary's verdicts, plain Python (no torch): the command line, the scribble and reports
name them from here.

    clean             the check ran and no output changed
    nan-leak          an output became NaN          (a leak: the kernel read a byte it does not attend)
    inf-leak          an output became +-Inf
    finite-leak       an output changed, finite
    error             the kernel raised, exited or hung: no verdict
    unstable-control  two clean runs differ: no verdict can be trusted
    input-modified    the kernel wrote into its inputs
    n/a               nothing to poison (the region is empty or never reachable): no check ran
"""
LEAKS = ("nan-leak", "inf-leak", "finite-leak")
FAILURES = ("error", "unstable-control", "input-modified")
VERDICTS = ("clean",) + LEAKS + FAILURES + ("n/a",)
CHECKED = ("clean",) + LEAKS        # verdicts that are a leak check that ran
DEFAULT_PAYLOADS = ("nan", "inf", "max")

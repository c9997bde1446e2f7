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


def counts(verdicts) -> dict:
    """The run's counts, defined once for the command line, the JSON and the report:
    cells    every kernel x region x plane x payload with a verdict (n/a and failures included)
    checks   the cells whose leak check ran (clean or a leak)
    leaking  the checks that leaked"""
    verdicts = list(verdicts)
    return {"cells": len(verdicts), "checks": sum(v in CHECKED for v in verdicts),
            "leaking": sum(v in LEAKS for v in verdicts)}


def summary(c: dict) -> str:
    """counts() as one line: '36 leaking of 200 checks (264 cells)'."""
    return f"{c['leaking']} leaking of {c['checks']} checks ({c['cells']} cells)"

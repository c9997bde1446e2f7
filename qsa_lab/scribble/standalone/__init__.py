"""Scribble findings that travel: standalone scripts, their shrunk workloads, the report folder.

    from qsa_lab.scribble.standalone import write_report, script_text, shrink
    write_report(report, "rep")        # report.md, scribble.json, verdict_grid.png, scripts/

- scripts: per confirmed leak kind a script that imports only the engine (vLLM or transformers)
  and torch; exit 1 leak, 0 clean, 3 cannot run; `--workaround` applies an engine-side fix.
- shrink: the smallest workload that still leaks, found by running the script, then re-checked.
- report: `write_report`, the folder `qsa-lab scribble --report DIR` writes.
"""
from .report import NAMES, SMALLEST, check_report_dir, what_to_change, write_report
from .scripts import DEFAULTS, EXIT_CANNOT_RUN, EXIT_CLEAN, EXIT_LEAK, KINDS, script_name, script_text, write_script
from .shrink import ShrinkError, Shrunk, shrink

__all__ = ["NAMES", "SMALLEST", "check_report_dir", "what_to_change", "write_report", "DEFAULTS", "EXIT_CANNOT_RUN",
           "EXIT_CLEAN", "EXIT_LEAK", "KINDS", "script_name", "script_text", "write_script", "ShrinkError", "Shrunk",
           "shrink"]

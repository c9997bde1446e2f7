"""Shrink one standalone scribble script's workload and write the evidence: the shrunk parameters,
every run, the re-check, the machine (docs/upstream_vllm_cpu_tail.md, docs/upstream_transformers_cb.md).

    python scripts/shrink_scribble_scripts.py KIND --python ENGINE_PYTHON --out evidence/scribble_standalone

Writes OUT/<kind>_shrink.json and SCRIPTS/<script name> (the shrunk script, default examples/scribble);
prints every run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qsa_lab.scribble.standalone.scripts import KINDS, script_name, write_script  # noqa: E402
from qsa_lab.scribble.standalone.shrink import shrink  # noqa: E402


def machine(python: str) -> dict:
    engine = subprocess.run([python, "-I", "-c", "import importlib.metadata as m, torch\n"
                             "for d in ('vllm-cpu', 'vllm', 'transformers'):\n"
                             "    try: print(d, m.version(d))\n"
                             "    except m.PackageNotFoundError: pass\n"
                             "print('torch', torch.__version__)"], capture_output=True, text=True).stdout
    return {"host": platform.node(), "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "python": platform.python_version(), "load": os.getloadavg()[0],
            "engine": dict(line.split(" ", 1) for line in engine.split("\n") if line),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=sorted(KINDS))
    ap.add_argument("--python", required=True, help="a Python with the engine installed")
    ap.add_argument("--out", required=True, help="the evidence folder")
    ap.add_argument("--scripts", default="examples/scribble", help="where the shrunk script goes")
    opts = ap.parse_args()
    out = Path(opts.out)
    t0 = time.perf_counter()
    shrunk = shrink(opts.kind, opts.python, progress=lambda m: print(m, flush=True))
    doc = {**shrunk.to_dict(), "smaller": shrunk.smaller(), "seconds": round(time.perf_counter() - t0, 1),
           "machine": machine(opts.python)}
    (out / f"{opts.kind}_shrink.json").write_text(json.dumps(doc, indent=1) + "\n")
    write_script(Path(opts.scripts) / script_name(opts.kind), opts.kind, shrunk.params)
    print(shrunk.smaller())
    return 0


if __name__ == "__main__":
    sys.exit(main())

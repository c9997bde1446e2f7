"""Run a notebook's code cells as one script (IPython magics dropped) and print its `key_results`.

For machines without Jupyter (the GPU node used to check the notebooks on the compiled
kernels): `QSA_LAB_BACKEND=cuda python scripts/run_notebook_code.py notebooks/02_*.ipynb`.
Figures are drawn with the Agg backend and not shown. Notebooks that build widgets need
ipywidgets (the playground's pure data function, qsa_lab.analysis.playground.playground_data, does not).
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")


def code_of(path: str) -> str:
    cells = json.load(open(path))["cells"]
    lines = [ln for c in cells if c["cell_type"] == "code" for ln in "".join(c["source"]).splitlines()]
    return "\n".join(ln for ln in lines if not ln.lstrip().startswith(("%", "!")))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("notebooks", nargs="+")
    args = ap.parse_args()
    for path in args.notebooks:
        ns: dict = {"__name__": "__notebook__"}
        exec(compile(code_of(path), path, "exec"), ns)
        print(f"{os.path.basename(path)}: {json.dumps(ns.get('key_results'), default=str)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

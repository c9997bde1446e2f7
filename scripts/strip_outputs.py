"""Strip outputs, execution counts and saved widget state from the project's notebooks.

    python scripts/strip_outputs.py notebooks/0*.ipynb     # what `make strip` runs

`make lab` strips the same way on every save (scripts/jupyter_lab_config.py), so the
committed notebooks stay output-free however they are used.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

#: the committed notebooks: NN_name.ipynb (a notebook of your own keeps its outputs)
PROJECT_NOTEBOOK = re.compile(r"\d\d_[^/]*\.ipynb")


def strip(nb: dict) -> bool:
    """Strip `nb` (nbformat JSON as dicts) in place -> whether anything changed."""
    changed = False
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            if cell.get("outputs") or cell.get("execution_count") is not None:
                changed = True
            cell["outputs"], cell["execution_count"] = [], None
    if "widgets" in nb.get("metadata", {}):
        del nb["metadata"]["widgets"]
        changed = True
    return changed


def pre_save(model, path, **kwargs):
    """Jupyter ContentsManager pre-save hook: strip the project's notebooks before they are written."""
    if model.get("type") == "notebook" and PROJECT_NOTEBOOK.fullmatch(Path(path).name):
        strip(model["content"])


def main(paths) -> int:
    for p in map(Path, paths):
        nb = json.loads(p.read_text())
        if strip(nb):
            p.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
            print(f"stripped {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Strip outputs, execution counts and saved widget state from the project's notebooks, and
normalise the metadata that opening and saving in Jupyter rewrites (kernelspec, language_info,
cell UI state), so that using a notebook never shows it modified in git.

    python scripts/strip_outputs.py            # what `make strip` runs: the project's notebooks
    python scripts/strip_outputs.py PATH ...   # those of PATHs that are the project's notebooks

`make lab` does the same on every save (scripts/jupyter_lab_config.py). Only the project's own
notebooks (PROJECT_NOTEBOOKS, in notebooks/) are touched: a notebook of your own, including a
copy such as `02_reproduce_the_grouped_nan-Copy1.ipynb`, keeps its outputs and metadata.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
#: the committed notebooks (tests/app/test_notebooks.py checks this list against notebooks/)
PROJECT_NOTEBOOKS = ("01_e4m3_and_the_null_block.ipynb", "02_reproduce_the_grouped_nan.ipynb",
                     "03_poison_playground.ipynb", "04_confirm_the_fix.ipynb", "05_fix_overhead.ipynb",
                     "06_canary_any_kernel.ipynb", "07_scribble_an_engine.ipynb")
#: the notebook metadata as committed: what JupyterLab writes on opening with ipykernel's python3
#: kernel, but for language_info's version (the running Python's, which differs between machines:
#: `make lab` fills it in when it serves the notebook, see as_opened, and a save drops it again)
METADATA = {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
            "language_info": {"codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py",
                              "mimetype": "text/x-python", "name": "python", "nbconvert_exporter": "python",
                              "pygments_lexer": "ipython3"}}
#: cell metadata the JupyterLab UI writes (scroll, collapse and timing state)
UI_CELL_KEYS = ("collapsed", "scrolled", "execution", "jupyter", "trusted")


def is_project_notebook(path) -> bool:
    return Path(path).name in PROJECT_NOTEBOOKS


def strip(nb: dict) -> bool:
    """Strip `nb` (nbformat JSON as dicts) in place -> whether anything changed."""
    before = json.dumps(nb, sort_keys=True)
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"], cell["execution_count"] = [], None
        for key in UI_CELL_KEYS:
            cell.get("metadata", {}).pop(key, None)
    nb["metadata"] = json.loads(json.dumps(METADATA))   # widget state and kernel details go too
    return json.dumps(nb, sort_keys=True) != before


def as_opened(nb: dict) -> None:
    """Fill in, in place, the metadata JupyterLab would write on opening `nb` with a kernel of this
    Python, so that opening it changes nothing (an unchanged notebook shows no unsaved change)."""
    import platform

    info = nb.get("metadata", {}).get("language_info")
    if isinstance(info, dict) and info.get("name") == "python":
        info.setdefault("version", platform.python_version())


def pre_save(model, path, **kwargs):
    """Jupyter ContentsManager pre-save hook: strip the project's notebooks before they are written."""
    if model.get("type") == "notebook" and is_project_notebook(path):
        strip(model["content"])


def as_saved(nb: dict) -> str:
    """`nb` as Jupyter writes it (nbformat.write): sorted keys, indent 1, a final newline. The
    committed notebooks are in this form, so a save in JupyterLab leaves them unchanged in git."""
    return json.dumps(nb, sort_keys=True, indent=1, ensure_ascii=False) + "\n"


def main(paths) -> int:
    paths = [Path(p) for p in paths] or [NOTEBOOKS / n for n in PROJECT_NOTEBOOKS]
    for p in paths:
        if not is_project_notebook(p):
            print(f"kept {p} (not one of the project's notebooks)")
            continue
        text = p.read_text()
        nb = json.loads(text)
        changed = strip(nb)
        if changed or text != as_saved(nb):   # keys in another order: Jupyter's save would reorder them
            p.write_text(as_saved(nb))
            print(f"stripped {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

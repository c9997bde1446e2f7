# Jupyter config that `make lab` passes with --config: the project's notebooks (NN_*.ipynb) are
# saved without outputs, execution counts or widget state, so using them never breaks
# `make test` (tests/test_notebooks.py checks the committed files are clean).
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from strip_outputs import pre_save  # noqa: E402

c = get_config()  # noqa: F821 - provided by the Jupyter config loader
c.FileContentsManager.pre_save_hook = pre_save

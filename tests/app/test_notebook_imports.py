"""What a notebook's first cells import on a machine without a GPU: notebook 05 (fix overhead)
reads the committed H200 timings and draws them without torch (its seconds-long import)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_notebook_05_on_the_emulation_never_imports_torch(tmp_path):
    nb = json.loads((REPO / "notebooks" / "05_fix_overhead.ipynb").read_text())
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    code = [c.replace("%matplotlib inline", "") for c in code]    # a plain interpreter, headless
    script = "\n".join(["import matplotlib", "matplotlib.use('Agg')", *code,
                        "import sys", "print('TORCH' if 'torch' in sys.modules else 'NO TORCH', key_results['records'])"])
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "QSA_LAB_BACKEND": "emulate"})
    assert run.returncode == 0, run.stderr
    words = run.stdout.split()
    assert words[-3:-1] == ["NO", "TORCH"] and int(words[-1]) > 0, run.stdout


def test_notebook_backend_accepts_auto_and_emulate_without_torch():
    run = subprocess.run([sys.executable, "-c", "import sys; from qsa_lab.analysis.notebook import notebook_backend; "
                          "print(notebook_backend('auto'), notebook_backend('emulate'), 'torch' in sys.modules)"],
                         capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin",
                                                                            "PYTHONPATH": str(REPO)})
    assert run.stdout.split() == ["auto", "emulate", "False"], run.stderr

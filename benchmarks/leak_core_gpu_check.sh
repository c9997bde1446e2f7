#!/usr/bin/env bash
# The one leak check (qsa_lab.analysis.leaks) on a GPU, in one call: the canary on the compiled kernels
# and the GPU's SDPA / FlexAttention against the committed H200 matrix (data/canary_h200.json, by
# tools/compare_verdicts.py), the canary's GPU tests and the leak-check tests, and, where transformers
# 5.24.0 is importable, the scribble's four GPU configurations against the committed ones
# (evidence/scribble_h200/). About 5 minutes on an H200, most of it the first kernel build.
#
#   bash benchmarks/leak_core_gpu_check.sh OUT
#
# OUT gets canary_cuda.json / .log, pytest.log and, with the scribble, scribble/ (benchmarks/scribble_gpu.py).
set -u
OUT=${1:?OUT folder}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"

timeout 420 python3 -m qsa_lab canary --backend cuda --json "$OUT/canary_cuda.json" > "$OUT/canary_cuda.log" 2>&1
echo "canary exit $? (1: it found the committed leaks)"
tail -3 "$OUT/canary_cuda.log"
python3 tools/compare_verdicts.py data/canary_h200.json "$OUT/canary_cuda.json" | tail -20

timeout 240 python3 -m pytest -p no:cacheprovider -q tests/canary/test_canary_gpu.py tests/analysis/test_leaks.py \
  tests/plotting/test_verdict_colours.py tests/scribble > "$OUT/pytest.log" 2>&1
echo "pytest exit $?"
tail -4 "$OUT/pytest.log"

if python3 -c "import sys, transformers; sys.exit(transformers.__version__ != '5.24.0')" 2>/dev/null; then
  timeout 300 python3 benchmarks/scribble_gpu.py "$OUT/scribble" > /dev/null 2>&1
  echo "scribble_gpu exit $?"
  for c in eager eager_graphs sdpa sdpa_graphs; do
    echo "== scribble $c"
    python3 tools/compare_verdicts.py "evidence/scribble_h200/scribble_$c.json" "$OUT/scribble/scribble_$c.json" | tail -5
  done
else
  echo "scribble: not run (transformers 5.24.0 is not importable here)"
fi

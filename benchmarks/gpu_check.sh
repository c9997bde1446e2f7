#!/usr/bin/env bash
# Everything the compiled kernels need checked on a GPU node, in one go:
#   build -> tests/gpu -> benchmark -> compute-sanitizer.   bash benchmarks/gpu_check.sh OUTDIR [full]
# OUTDIR gets run.log (the summary), logs.tgz (every log) and bench.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/gpu_check}; MODE=${2:-quick}
mkdir -p "$OUT/logs"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
exec > >(tee "$OUT/run.log") 2>&1
stage() { echo; echo "######## $1 ($(date +%T))"; }

stage "machine"
nvidia-smi -L; $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
stage "build"
/usr/bin/time -f "build wall %e s" $PY -c "
from qsa_lab import kernels; kernels.load(); import json; print(json.dumps(kernels.status(), indent=1))" \
  || { echo BUILD FAILED; exit 1; }
stage "tests/gpu"
# the binding-level bad-input tests run in their own process: a crash there cannot hide the rest
timeout ${TEST_TIMEOUT:-300} $PY -m pytest -q -p no:cacheprovider -rfE tests/gpu tests/test_nvrtc_sm70.py \
  -k "not binding" >"$OUT/logs/pytest.log" 2>&1
timeout 120 $PY -m pytest -q -p no:cacheprovider -rfE tests/gpu -k binding >"$OUT/logs/pytest_binding.log" 2>&1
for f in "$OUT/logs/pytest.log" "$OUT/logs/pytest_binding.log"; do
  echo "-- $f"; tail -1 "$f"
  grep -E "^(FAILED|ERROR)|^E  |Fatal|tests/gpu/test_kernels_cuda.py\", line" "$f" | head -30
done
stage "bench ($MODE)"
if [ "$MODE" = full ]; then B=""; else B="--quick"; fi
timeout ${BENCH_TIMEOUT:-240} $PY benchmarks/bench.py $B --json "$OUT/bench.json"
stage "sanitize"
timeout ${SAN_TIMEOUT:-300} bash benchmarks/sanitize.sh "$OUT/logs/sanitize"
stage "done"
tar -C "$OUT" -czf "$OUT/logs.tgz" logs && rm -rf "$OUT/logs"

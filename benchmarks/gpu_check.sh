#!/usr/bin/env bash
# Everything the compiled kernels need checked on a GPU node, in one run (about 8-10 minutes
# on an H200): build -> tests/gpu and the canary's GPU tests -> compute-sanitizer (memcheck on
# every variant, racecheck) -> ncu counters of the grouped variants -> benchmark -> the canary
# over every GPU kernel -> the compute_70 PTX run check (when PTX_DIR holds PTX made by
# `python tools/ptx70_check.py generate --out PTX_DIR` from this csrc/).
#   bash benchmarks/gpu_check.sh OUTDIR [full|quick]        (default: full; PTX_DIR default build/ptx70)
# OUTDIR gets gpu_check_h200.log (this summary), bench_h200.json, ncu_variants_h200.txt,
# canary_h200.json, ptx70_h200.log and logs.tgz (every log); bench_h200.json and canary_h200.json
# go to data/ (the package reads them), the other files but logs.tgz to evidence/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/gpu_check}; MODE=${2:-full}
mkdir -p "$OUT/logs"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
exec > >(tee "$OUT/gpu_check_h200.log") 2>&1
T0=$(date +%s)
stage() { echo; echo "######## $1 ($(date -u +%T), +$(( $(date +%s) - T0 )) s)"; }

stage "machine"
nvidia-smi -L; $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
echo "csrc/ sha256: $(cd csrc && sha256sum * | cut -c1-12 | paste -sd" ")"
stage "build"
/usr/bin/time -f "build wall %e s" $PY -c "
from qsa_lab.routes import compiled; compiled.load(); import json; print(json.dumps(compiled.status(), indent=1))" \
  || { echo BUILD FAILED; exit 1; }
stage "tests/gpu"
# the binding-level bad-input tests run in their own process: a crash there cannot hide the rest
timeout ${TEST_TIMEOUT:-300} $PY -m pytest -q -p no:cacheprovider -rfE tests/gpu tests/tools/test_nvrtc_sm70.py \
  -k "not binding" >"$OUT/logs/pytest.log" 2>&1
timeout 120 $PY -m pytest -q -p no:cacheprovider -rfE tests/gpu -k binding >"$OUT/logs/pytest_binding.log" 2>&1
for f in "$OUT/logs/pytest.log" "$OUT/logs/pytest_binding.log"; do
  echo "-- $(basename "$f")"; tail -1 "$f"
  grep -E "^(FAILED|ERROR)|^E  |Fatal|tests/gpu/test_kernels_cuda.py\", line" "$f" | head -30
done
stage "sanitize"
timeout ${SAN_TIMEOUT:-240} bash benchmarks/sanitize.sh "$OUT/logs/sanitize"
stage "ncu"
timeout ${NCU_TIMEOUT:-180} bash benchmarks/ncu_variants.sh "$OUT/ncu_variants_h200.txt"
stage "bench ($MODE)"
if [ "$MODE" = full ]; then B=""; else B="--quick"; fi
timeout ${BENCH_TIMEOUT:-240} $PY benchmarks/bench.py $B --json "$OUT/bench_h200.json"
stage "canary (every GPU kernel)"
timeout ${CANARY_TIMEOUT:-200} $PY -m qsa_lab canary --backend cuda --json "$OUT/canary_h200.json" --force \
  >"$OUT/logs/canary.log" 2>&1; echo "canary exit $?"; tail -40 "$OUT/logs/canary.log"
stage "compute_70 PTX run check"
PTX_DIR=${PTX_DIR:-build/ptx70}
if [ -f "$PTX_DIR/manifest.json" ]; then
  timeout ${PTX_TIMEOUT:-200} $PY tools/ptx70_check.py check --ptx "$PTX_DIR" --log "$OUT/ptx70_h200.log" \
    >"$OUT/logs/ptx70.log" 2>&1; echo "ptx70 exit $?"; tail -25 "$OUT/logs/ptx70.log"
else
  echo "no PTX in $PTX_DIR (make it on a machine with the NVRTC wheels: tools/ptx70_check.py generate)"
fi
stage "done"
tar -C "$OUT" -czf "$OUT/logs.tgz" logs && rm -rf "$OUT/logs"

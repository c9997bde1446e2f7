#!/usr/bin/env bash
# compute-sanitizer memcheck + racecheck on every kernel variant (small case), and the
# demonstration that kernel_fix (A) without its leading barrier is a race.
#   bash benchmarks/sanitize.sh [LOGDIR]
# The extension must build first (a plain run of sanitize_case.py does that).
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-results/sanitize}
mkdir -p "$LOG"
CS=${COMPUTE_SANITIZER:-compute-sanitizer}
PY=${PYTHON:-python3}
OK="unfixed,kernel_fix,masked_load,early_v"
summary() { grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^variant|^xqa|Error|error" "$1" | grep -v "^=========     " | head -20; }

$PY benchmarks/sanitize_case.py --variants "$OK" >"$LOG/plain.log" 2>&1 || { cat "$LOG/plain.log"; exit 1; }
for kv in e4m3 e5m2 fp16; do
  echo "== memcheck, $kv, all variants + xqa + decode_panel"
  $CS --tool memcheck --leak-check no $PY benchmarks/sanitize_case.py --kv $kv \
      --variants "$OK,kernel_fix_no_leading_barrier" >"$LOG/memcheck_$kv.log" 2>&1
  summary "$LOG/memcheck_$kv.log"
done
echo "== racecheck, e4m3, $OK + xqa + decode_panel (expect 0 hazards)"
$CS --tool racecheck $PY benchmarks/sanitize_case.py --variants "$OK" >"$LOG/racecheck_ok.log" 2>&1
summary "$LOG/racecheck_ok.log"
echo "== racecheck, e4m3, kernel_fix_no_leading_barrier (expect hazards)"
$CS --tool racecheck --print-limit 5 $PY benchmarks/sanitize_case.py --variants kernel_fix_no_leading_barrier \
    >"$LOG/racecheck_no_barrier.log" 2>&1
summary "$LOG/racecheck_no_barrier.log"
grep -m3 -E "Race reported|hazard" "$LOG/racecheck_no_barrier.log"
echo "== leak test without sanitizer: random K+V poison of page 0, 300 runs each"
$PY benchmarks/sanitize_case.py --variants kernel_fix,kernel_fix_no_leading_barrier \
    --trials 300 2>&1 | tee "$LOG/leak.log"

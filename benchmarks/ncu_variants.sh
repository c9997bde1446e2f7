#!/usr/bin/env bash
# Hardware counters of the grouped variants on the report's geometry: cycles and instructions
# per tile, stall reasons, barrier stalls. Clocks are left alone (--clock-control none).
#   bash benchmarks/ncu_variants.sh [OUT_TXT]        (default evidence/ncu_variants_h200.txt)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
OUT_TXT=${1:-evidence/ncu_variants_h200.txt}
TMP=$(mktemp -d)
$PY -c "from qsa_lab.routes import compiled; compiled.load()" || exit 1   # build outside the profiler
BASE=gpu__time_duration.sum,sm__cycles_elapsed.max,launch__registers_per_thread,smsp__inst_executed.sum
BASE=$BASE,l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum
STALL=""
for s in barrier long_scoreboard short_scoreboard wait math_pipe_throttle mio_throttle not_selected selected; do
  STALL=$STALL,smsp__warp_issue_stalled_${s}_per_warp_active.pct
done
run() { ncu --clock-control none --csv -k regex:grouped_page4_forward --metrics "$1" \
            $PY benchmarks/ncu_variants.py >"$TMP/raw.csv" 2>"$TMP/err.log"; }
if ! run "$BASE$STALL"; then   # a metric this ncu does not know: fall back to the base set
  echo "ncu with stall metrics failed ($(tail -1 "$TMP/err.log")); retrying with the base metrics"
  run "$BASE" || { cat "$TMP/err.log"; exit 1; }
fi
{
  echo "# ncu $(ncu --version | tail -1), $(nvidia-smi -L | head -1), $(date -u +%FT%TZ)"
  echo "# bash benchmarks/ncu_variants.sh (csrc/ at $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- csrc 2>/dev/null || echo ' + uncommitted changes'))"
  $PY benchmarks/ncu_variants.py --summarize "$TMP/raw.csv" --case-log "$TMP/raw.csv"
  echo
  # Per-phase breakdown from per-instruction (SASS) samples, for the unfixed kernel and kernel_fix (A)
  # (launches 0 and 1 of ncu_variants.py); best effort: an ncu without the source page skips it.
  for pair in "0 unfixed" "1 kernel_fix"; do
    set -- $pair
    if ncu --clock-control none -k regex:grouped_page4_forward --launch-skip "$1" --launch-count 1 \
           --section SourceCounters --section WarpStateStats -f -o "$TMP/src$1" \
           $PY benchmarks/ncu_variants.py >"$TMP/src$1.log" 2>&1 &&
       ncu -i "$TMP/src$1.ncu-rep" --page source --csv --print-source sass >"$TMP/src$1.csv" 2>>"$TMP/src$1.log"; then
      $PY benchmarks/ncu_phases.py "$TMP/src$1.csv" "$2" || echo "($2: phase table failed)"
    else
      echo "($2: source-level profile unavailable: $(tail -1 "$TMP/src$1.log"))"
    fi
    echo
  done
  echo "# raw ncu rows (Kernel Name, Metric Name, Metric Unit, Metric Value)"
  $PY - "$TMP/raw.csv" <<'PYEOF'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if r]
h = next(i for i, r in enumerate(rows) if "Metric Name" in r)
c = rows[h]
for r in rows[h + 1:]:
    if len(r) == len(c):
        print(" | ".join(r[c.index(k)] for k in ("Kernel Name", "Metric Name", "Metric Unit", "Metric Value")))
PYEOF
} >"$OUT_TXT"
cat "$OUT_TXT" | head -20
rm -rf "$TMP"

#!/usr/bin/env bash
# Hardware counters of the grouped variants on the report's geometry: why fix A and fix C cost
# what they cost. Clocks are left alone (--clock-control none).   bash benchmarks/ncu_variants.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -c "from qsa_lab import kernels; kernels.load()"   # build outside the profiler
M=gpu__time_duration.sum,sm__cycles_elapsed.max,launch__registers_per_thread,smsp__inst_executed.sum
M=$M,l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum,smsp__warp_issue_stalled_barrier_per_warp_active.pct
M=$M,smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_short_scoreboard_per_warp_active.pct
M=$M,smsp__warp_issue_stalled_math_pipe_throttle_per_warp_active.pct,smsp__warp_issue_stalled_wait_per_warp_active.pct
ncu --clock-control none -k regex:grouped_page4_forward --metrics "$M" python3 benchmarks/ncu_variants.py

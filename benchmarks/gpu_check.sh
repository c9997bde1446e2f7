#!/usr/bin/env bash
# The GPU check: everything this checkout needs run on a GPU node, in named stages.
#
#   bash benchmarks/gpu_check.sh [--out DIR] [--log FILE] [--append] [--quick] [STAGE ...]
#   bash benchmarks/gpu_check.sh --list          # the stages, one line each
#
# No STAGE: every stage, in the order of --list. Each stage logs under a '######## stage' line and
# ends PASS, FAIL or SKIPPED (with why); the summary lists each stage and every UNEXPECTED check, and
# the exit code is 1 when a stage failed or a stage named on the command line was skipped.
# A stage that needs something optional (FlashInfer, carried transformers wheels, vLLM's environment,
# ncu, PTX from tools/ptx70_check.py generate) skips saying why.
#
#   --out DIR   what the stages write (default $OUT, else results/gpu_check): the JSON to commit
#               (bench_<gpu>.json and canary_<gpu>.json to data/, the rest to evidence/) and logs.tgz
#   --log FILE  this run's log (default evidence/gpu_check_<gpu>.log, <gpu> e.g. h200); --append adds to it
#   --quick     the short benchmarks (bench.py --quick, complete_fix_cost.py --quick)
#   BUDGET_S=N  every step's timeout is cut to what is left of N seconds from the start, so a run ends with
#               its summary inside a machine's time limit (a step cut short exits 124); unset: no budget
#   FLASHINFER_WHEELS and TRANSFORMERS_WHEELS (folders of carried wheels, default .whl), VLLM_SRC (a vLLM
#   checkout for vllm:*), VLLM_PYTHON (vLLM's environment, default .venv-vllm), PTX_DIR (default build/ptx70),
#   WHEEL (a built qsa_lab wheel; default: built here), PYTHON (default python3); a step's timeout: the
#   *_TIMEOUT variable on its line in the code below, where it has one
#
# On a machine that gives one command 10 minutes, run it in parts, e.g.
#   build tests sanitize | bench canary ptx | docs | complete-fix | thirdparty | search | reports | scribble standalone | wheel
# each part with its own --log (or the same one with --append).
set -uo pipefail
HERE=$PWD                      # relative --out and --log are the caller's
cd "$(dirname "$0")/.."
ROOT=$PWD

STAGES=(build tests docs sanitize bench canary thirdparty search reports complete-fix scribble standalone ptx wheel)
declare -A ABOUT=(
  [build]="build the compiled kernels (csrc/) for this GPU and print routes.compiled's status"
  [tests]="tests/gpu (the binding's bad-input tests in their own process), every test marked gpu, the tests that run on this machine's torch"
  [docs]="every qsa-lab command the README and docs/ show for a GPU, run as written (tests/docs/test_docs_run.py, gpu mark)"
  [sanitize]="compute-sanitizer memcheck and racecheck on every variant routes.compiled lists, the race kept for it, the mixed batch"
  [bench]="benchmarks/bench.py on every route and fix, and Nsight Compute counters of the grouped variants (when ncu is here)"
  [canary]="qsa-lab canary --backend cuda against data/canary_h200.json, real-model geometries (SDPA, Flex, MLA), the per-row rule"
  [thirdparty]="the canary on FlashInfer (and vLLM's Triton kernels with VLLM_SRC): the matrix, the per-row rule, the pytest plugin, --report"
  [search]="qsa-lab canary --search from a blank start on each FlashInfer leak (benchmarks/canary_search.py): time to find, shrunk case"
  [reports]="the three FlashInfer leak reports travel: zipped, unpacked elsewhere, every replay and generated script exits as it should"
  [complete-fix]="the complete fixes: their cost, the upstream script through the shim, qsa-lab cross-request --backend cuda"
  [scribble]="the scribble under each supported transformers (CUDA graphs included) against evidence/scribble_h200/; vLLM's matrix (CPU) with its env"
  [standalone]="the transformers standalone script (examples/scribble/) on CUDA, without and with CUDA graphs, with the carried transformers"
  [ptx]="the compute_70 PTX run check (PTX made by python tools/ptx70_check.py generate --out PTX_DIR)"
  [wheel]="a pip user's install: the wheel beside this torch, qsa-lab doctor, a fresh kernel build from its csrc/, tests/gpu on it"
)

usage() { echo "usage: bash benchmarks/gpu_check.sh [--out DIR] [--log FILE] [--append] [--quick] [STAGE ...] | --list"; }
OUTDIR=${OUT:-results/gpu_check}; LOG=""; APPEND=0; QUICK=0; ASKED=()
while (( $# )); do
  case "$1" in
    --list) for s in "${STAGES[@]}"; do printf '%-13s %s\n' "$s" "${ABOUT[$s]}"; done; exit 0;;
    --out) OUTDIR=${2:?--out needs a folder}; shift;;
    --log) LOG=${2:?--log needs a file}; shift;;
    --append) APPEND=1;;
    --quick) QUICK=1;;
    -h|--help) usage; awk 'NR > 1 && !/^#/ {exit} NR > 1 {print substr($0, 3)}' "$0"; exit 0;;
    -*) echo "gpu_check.sh: error: unknown option $1" >&2; usage >&2; exit 2;;
    *) [ -n "${ABOUT[$1]+x}" ] || { echo "gpu_check.sh: error: unknown stage '$1' (stages: ${STAGES[*]})" >&2; exit 2; }
       ASKED+=("$1");;
  esac
  shift
done
RUN=("${STAGES[@]}"); (( ${#ASKED[@]} )) && RUN=("${ASKED[@]}")
case "$OUTDIR" in /*) ;; *) OUTDIR=$HERE/$OUTDIR;; esac
case "$LOG" in /*|"") ;; *) LOG=$HERE/$LOG;; esac

PY=${PYTHON:-python3}
case "$PY" in /*) ;; */*) PY=$PWD/$PY;; esac
CS=${COMPUTE_SANITIZER:-compute-sanitizer}
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
# "NVIDIA H200" -> h200, "NVIDIA H100 80GB HBM3" -> h100; no GPU: cpu
GPU=$(echo "${GPU_NAME:-cpu}" | sed 's/^NVIDIA //' | cut -d' ' -f1 | tr 'A-Z' 'a-z' | tr -cd 'a-z0-9')
HAVE_GPU=0; $PY -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null && HAVE_GPU=1
mkdir -p "$OUTDIR/logs"; OUTDIR=$(cd "$OUTDIR" && pwd); L=$OUTDIR/logs
LOG=${LOG:-evidence/gpu_check_$GPU.log}
mkdir -p "$(dirname "$LOG")"
if (( APPEND )); then exec > >(tee -a "$LOG") 2>&1; else exec > >(tee "$LOG") 2>&1; fi

T0=$(date +%s)
left() { if [ -n "${BUDGET_S:-}" ]; then echo $(( T0 + BUDGET_S - $(date +%s) )); else echo 999999; fi; }
tmo() { local l; l=$(left); (( l < 1 )) && l=1; echo $(( $1 < l ? $1 : l )); }   # tmo S: S, or what is left
CHECKS=(); BAD=0
check() {  # check NAME EXPECTED GOT: one line EXPECTED / UNEXPECTED, counted in the stage's result
  if [ "$2" = "$3" ]; then echo "EXPECTED   $1 ($3)"; CHECKS+=("EXPECTED   [$STAGE] $1 ($3)")
  else echo "UNEXPECTED $1 (expected $2, got $3)"; CHECKS+=("UNEXPECTED [$STAGE] $1 (expected $2, got $3)"); BAD=$((BAD + 1)); fi
}
step() { echo; echo "-- $1 ($(date -u +%T), +$(( $(date +%s) - T0 )) s)"; }
SKIP_WHY=""
skip() { SKIP_WHY=$1; echo "skipped: $1"; return 2; }
need_gpu() { (( HAVE_GPU )) || skip "no CUDA GPU visible to torch here"; }
built() {  # the kernels, built once (stages run alone build them first, outside any profiler or sanitizer)
  $PY -c "from qsa_lab.routes import compiled; compiled.load()" >"$L/build_quiet.log" 2>&1 \
    || { tail -20 "$L/build_quiet.log"; check "kernel build" 0 1; return 1; }
}
sanitizer() {  # sanitizer LOG "SANITIZER OPTIONS" CASE ARGS...: compute-sanitizer on sanitize_case.py; its
  local log=$1 opts=$2; shift 2     # variant lines, then its summary line last
  # shellcheck disable=SC2086
  timeout "$(tmo ${SAN_TIMEOUT:-150})" $CS $opts $PY benchmarks/sanitize_case.py "$@" >"$log" 2>&1
  grep -h "^variant\|^xqa" "$log"
  grep -m1 -E "(ERROR|RACECHECK) SUMMARY" "$log" | sed 's/^========= //'
}

ncu_counters() {  # ncu_counters OUT_TXT: Nsight Compute counters of the grouped variants on the report's geometry
  local txt=$1 tmp base stall s pair rc=0     # (cycles and instructions per tile, stall reasons; clocks left alone)
  tmp=$(mktemp -d)
  base=gpu__time_duration.sum,sm__cycles_elapsed.max,launch__registers_per_thread,smsp__inst_executed.sum
  base=$base,l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum
  stall=""
  for s in barrier long_scoreboard short_scoreboard wait math_pipe_throttle mio_throttle not_selected selected; do
    stall=$stall,smsp__warp_issue_stalled_${s}_per_warp_active.pct
  done
  counters() { timeout "$(tmo ${NCU_TIMEOUT:-180})" ncu --clock-control none --csv -k regex:grouped_page4_forward --metrics "$1" \
    $PY benchmarks/ncu_variants.py >"$tmp/raw.csv" 2>"$tmp/err.log"; }
  if ! counters "$base$stall"; then   # a metric this ncu does not know: the base set
    echo "ncu with stall metrics failed ($(tail -1 "$tmp/err.log")); again with the base metrics"
    counters "$base" || { cat "$tmp/err.log"; rm -rf "$tmp"; return 1; }
  fi
  {
    echo "# ncu $(ncu --version | tail -1), $(nvidia-smi -L | head -1), $(date -u +%FT%TZ)"
    echo "# bash benchmarks/gpu_check.sh bench (csrc/ at $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- csrc 2>/dev/null || echo ' + uncommitted changes'))"
    $PY benchmarks/ncu_variants.py --summarize "$tmp/raw.csv" --case-log "$tmp/raw.csv" || rc=1
    echo
    # the per-phase breakdown from per-instruction (SASS) samples, for the unfixed kernel and kernel_fix (A)
    # (launches 0 and 1 of ncu_variants.py); best effort: an ncu without the source page skips it
    for pair in "0 unfixed" "1 kernel_fix"; do
      set -- $pair
      if timeout "$(tmo 120)" ncu --clock-control none -k regex:grouped_page4_forward --launch-skip "$1" --launch-count 1 \
             --section SourceCounters --section WarpStateStats -f -o "$tmp/src$1" $PY benchmarks/ncu_variants.py >"$tmp/src$1.log" 2>&1 &&
         ncu -i "$tmp/src$1.ncu-rep" --page source --csv --print-source sass >"$tmp/src$1.csv" 2>>"$tmp/src$1.log"; then
        $PY benchmarks/ncu_phases.py "$tmp/src$1.csv" "$2" || echo "($2: phase table failed)"
      else
        echo "($2: source-level profile unavailable: $(tail -1 "$tmp/src$1.log"))"
      fi
      echo
    done
    echo "# raw ncu rows (Kernel Name, Metric Name, Metric Unit, Metric Value)"
    $PY - "$tmp/raw.csv" <<'EOF'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if r]
h = next(i for i, r in enumerate(rows) if "Metric Name" in r)
c = rows[h]
for r in rows[h + 1:]:
    if len(r) == len(c):
        print(" | ".join(r[c.index(k)] for k in ("Kernel Name", "Metric Name", "Metric Unit", "Metric Value")))
EOF
  } >"$txt"
  rm -rf "$tmp"
  return $rc
}

report_travel() {  # report_travel DIR: the three FlashInfer leaks of docs/findings.md (the cells of
  # evidence/canary_thirdparty_h200.json) each written by `qsa-lab canary --report`, zipped, unpacked in another
  # folder and run from there: every replay line and generated standalone script exits 1 (leak reproduced); the
  # same script on a fixed configuration (FA2 instead of FA3 for window_left, tensor-core decode instead of
  # CUDA-core) 0, with flashinfer hidden 3; a replay whose kernel does not load 3. The zips and runs.log go to DIR.
  local out=$1 w leak name opts dir s call got line
  mkdir -p "$out"; w=$(mktemp -d)
  local geo="--q-heads 8 --kv-heads 2 --head-dim 128 --page-size 16 --requests 3 --context 40 --kv-dtype fp16 --payloads nan --planes v"
  local leaks=("fa2_custom_mask|--kernels flashinfer:prefill-fa2 --attend sparse --topk 4 --query-len 4 --regions unselected"
               "decode_window|--kernels flashinfer:decode --attend window:8 --query-len 1 --regions out-of-window"
               "fa3_window|--kernels flashinfer:prefill --attend window:8 --query-len 4 --regions out-of-window")
  for leak in "${leaks[@]}"; do   # the three at once: FlashInfer compiles one module per configuration on first use
    name=${leak%%|*}; opts=${leak#*|}
    # shellcheck disable=SC2086
    ( cd "$w" && timeout "$(tmo 300)" $PY -m qsa_lab canary $opts $geo --report "$w/$name" >"$out/$name.canary.log" 2>&1
      echo "canary exit $?" >>"$out/$name.canary.log" ) &
  done
  wait
  runs() {   # runs WANT LABEL CMD...: CMD in the current folder, its exit code against WANT
    local want=$1 label=$2; shift 2
    timeout "$(tmo 240)" "$@" >"$w/last.log" 2>&1; got=$?
    { echo "== [$label] $*"; cat "$w/last.log"; echo "exit $got (want $want)"; } >>"$out/runs.log"
    check "$label: $(echo "$*" | sed "s#$w/##g" | cut -c1-90)" "$want" "$got"
  }
  # the replay lines say `qsa-lab replay` (never python -m inside a received folder); without an installed
  # qsa-lab, a shim runs this checkout's CLI without the current folder on its path
  mkdir -p "$w/bin"
  if ! command -v qsa-lab >/dev/null; then
    printf '#!/bin/sh\nexec %s -c "import sys; sys.path[:] = [p for p in sys.path if p]; from qsa_lab.app.cli import main; main()" "$@"\n' \
      "$PY" >"$w/bin/qsa-lab"
    chmod +x "$w/bin/qsa-lab"
  fi
  mkdir -p "$w/hidden/flashinfer"
  echo 'raise ImportError("flashinfer hidden by the reports stage of gpu_check.sh")' >"$w/hidden/flashinfer/__init__.py"
  for leak in "${leaks[@]}"; do
    name=${leak%%|*}
    echo "$name: $(tail -1 "$out/$name.canary.log")"
    [ -f "$w/$name/report.md" ] || { check "$name: a report written" yes no; continue; }
    $PY -m zipfile -c "$w/$name.zip" "$w/$name"
    mkdir -p "$w/elsewhere/$name" && $PY -m zipfile -e "$w/$name.zip" "$w/elsewhere/$name"
    cp "$w/$name.zip" "$out/"
    dir=$w/elsewhere/$name/$name
    pushd "$dir" >/dev/null || continue
    # shellcheck disable=SC2086
    while read -r line; do PATH=$w/bin:$PATH runs 1 "$name replay" $line; done < <(grep -E '^qsa-lab replay ' report.md)
    for s in repro/*.py; do
      runs 1 "$name script" $PY "$s"
      case $name in   # the fixed configuration of the same call
        fa3_window) runs 0 "$name on fa2" $PY "$s" --backend fa2;;
        decode_window) runs 0 "$name tensor cores" $PY "$s" --tensor-cores;;
      esac
      runs 3 "$name no flashinfer" env PYTHONPATH="$w/hidden" $PY "$s"
    done
    call=$(ls calls/*.safetensors | head -1)
    PATH=$w/bin:$PATH runs 3 "$name kernel absent" qsa-lab replay "$call" --kernel "$w/absent.py:fn"
    popd >/dev/null || true
  done
  rm -rf "$w"
}

# ------------------------------------------------------------------------------------------ stages

stage_build() {
  need_gpu || return
  /usr/bin/time -f "build wall %e s" $PY -c "
from qsa_lab.routes import compiled; compiled.load(); import json; print(json.dumps(compiled.status(), indent=1))"
  check "kernel build" 0 $?
}

stage_tests() {
  need_gpu || return
  built || return 1
  step "tests/gpu, the canary's GPU tests, the sm_70 NVRTC check"
  timeout "$(tmo ${TEST_TIMEOUT:-300})" $PY -m pytest -q -p no:cacheprovider -rfE tests/gpu tests/canary/test_canary_gpu.py \
    tests/tools/test_nvrtc_sm70.py -k "not binding" >"$L/pytest_gpu.log" 2>&1
  local rc=$?; tail -1 "$L/pytest_gpu.log"; grep -E "^(FAILED|ERROR)|^E  |Fatal" "$L/pytest_gpu.log" | head -30
  check "tests/gpu" 0 $rc
  step "the binding's bad-input tests (own process: a crash there cannot hide the rest)"
  timeout "$(tmo 120)" $PY -m pytest -q -p no:cacheprovider -rfE tests/gpu -k binding >"$L/pytest_binding.log" 2>&1
  rc=$?; tail -1 "$L/pytest_binding.log"; check "tests/gpu -k binding" 0 $rc
  step "tests that run on this machine's torch and GPU (leak core, geometries, other requests, scribble)"
  timeout "$(tmo ${TEST_TIMEOUT:-300})" $PY -m pytest -q -p no:cacheprovider -rfE tests/analysis/test_leaks.py \
    tests/plotting/test_verdict_colours.py tests/canary/test_canary_geometries.py tests/canary/test_other_requests.py \
    tests/app/test_reliability4.py tests/scribble >"$L/pytest_torch.log" 2>&1
  rc=$?; tail -1 "$L/pytest_torch.log"; grep -E "^(FAILED|ERROR)|^E  " "$L/pytest_torch.log" | head -30
  check "tests on this torch" 0 $rc
  step "every other test marked gpu (the docs' GPU commands have their own stage)"
  timeout "$(tmo ${TEST_TIMEOUT:-300})" $PY -m pytest -q -p no:cacheprovider -rfE -m gpu tests --ignore=tests/gpu \
    --ignore=tests/docs/test_docs_run.py >"$L/pytest_marked.log" 2>&1
  rc=$?; tail -1 "$L/pytest_marked.log"; grep -E "^(FAILED|ERROR)|^E  " "$L/pytest_marked.log" | head -30
  (( rc == 5 )) && rc=0   # 5: no other test carries the mark
  check "tests marked gpu" 0 $rc
}

stage_docs() {
  need_gpu || return
  built || return 1
  # those naming FlashInfer or vLLM skip where that library is missing
  timeout "$(tmo ${DOCS_TIMEOUT:-540})" $PY -m pytest -p no:cacheprovider -q -rA -m gpu tests/docs/test_docs_run.py \
    -k gpu_commands >"$L/pytest_docs.log" 2>&1
  local rc=$?; grep -E "^(PASSED|FAILED|SKIPPED|ERROR)" "$L/pytest_docs.log"; tail -1 "$L/pytest_docs.log"
  check "the docs' GPU commands run as shown" 0 $rc
}

stage_sanitize() {
  need_gpu || return
  command -v "$CS" >/dev/null || skip "no $CS here" || return
  built || return 1
  local all race=kernel_fix_no_leading_barrier ok e S=$L/sanitize MEMCHECK="--tool memcheck --leak-check no"
  mkdir -p "$S"
  # every variant routes.compiled builds (a new one is covered without editing this script); the race
  # kept for the sanitizer runs apart, where hazards are expected
  all=$($PY benchmarks/sanitize_case.py --list-variants) || { check "variant list from routes.compiled" 0 1; return 1; }
  ok=$(echo "$all" | tr , '\n' | grep -vx "$race" | paste -sd,)
  echo "variants (routes.compiled): $all"
  for kv in e4m3 e5m2 fp16; do
    step "memcheck $kv, every variant + xqa + decode_panel"
    e=$(sanitizer "$S/memcheck_$kv.log" "$MEMCHECK" --kv $kv --variants "$all" | tee /dev/stderr | tail -1)
    check "memcheck $kv" "ERROR SUMMARY: 0 errors" "$e"
  done
  for kv in e4m3 fp16; do
    step "memcheck $kv on the mixed batch (finite_pv's slow path: NaN in V; padded request groups)"
    e=$(sanitizer "$S/memcheck_mixed_$kv.log" "$MEMCHECK" --mixed --kv $kv --context 300 --variants "$ok" | tee /dev/stderr | tail -1)
    check "memcheck mixed $kv" "ERROR SUMMARY: 0 errors" "$e"
  done
  step "racecheck e4m3, every race-free variant (expect 0 hazards)"
  e=$(sanitizer "$S/racecheck.log" "--tool racecheck" --variants "$ok" | tee /dev/stderr | tail -1)
  check "racecheck" "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)" "$e"
  step "racecheck on the mixed batch"
  e=$(sanitizer "$S/racecheck_mixed.log" "--tool racecheck" --mixed --context 300 --variants "$ok" | tee /dev/stderr | tail -1)
  check "racecheck mixed" "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)" "$e"
  step "racecheck $race (expect hazards: the barrier it lacks is what kernel_fix needs)"
  e=$(sanitizer "$S/racecheck_no_barrier.log" "--tool racecheck --print-limit 5" --variants "$race" | tail -1)
  echo "$e"; grep -m3 -E "Race reported" "$S/racecheck_no_barrier.log"
  check "racecheck finds the race in $race" yes "$(echo "$e" | grep -qE '[1-9][0-9]* hazards' && echo yes || echo "no ($e)")"
  step "leak test without the sanitizer: random K+V poison of page 0, 300 runs each"
  timeout "$(tmo 120)" $PY benchmarks/sanitize_case.py --variants "kernel_fix,$race" --trials 300 | tee "$S/leak.log"
  check "kernel_fix: no run with NaN" "0/300" "$(grep "^variant kernel_fix " "$S/leak.log" | grep -o '[0-9]*/300')"
}

stage_bench() {
  need_gpu || return
  built || return 1
  step "benchmarks/bench.py$( (( QUICK )) && echo ' --quick')"
  timeout "$(tmo ${BENCH_TIMEOUT:-240})" $PY benchmarks/bench.py $( (( QUICK )) && echo --quick) --json "$OUTDIR/bench_$GPU.json"
  check "bench" 0 $?
  step "Nsight Compute counters of the grouped variants"
  if ! command -v ncu >/dev/null; then echo "skipped: no ncu here"; return 0; fi
  ncu_counters "$OUTDIR/ncu_variants_$GPU.txt"
  local rc=$?; head -20 "$OUTDIR/ncu_variants_$GPU.txt" 2>/dev/null; check "ncu counters" 0 $rc
}

stage_canary() {
  need_gpu || return
  built || return 1
  step "qsa-lab canary --backend cuda (every GPU kernel), against data/canary_h200.json"
  timeout "$(tmo ${CANARY_TIMEOUT:-300})" $PY -m qsa_lab canary --backend cuda --json "$OUTDIR/canary_$GPU.json" --force \
    >"$L/canary.log" 2>&1
  local rc=$?; tail -4 "$L/canary.log"; check "canary exit (1: it finds the committed leaks)" 1 $rc
  $PY tools/compare_verdicts.py data/canary_h200.json "$OUTDIR/canary_$GPU.json" | tail -20
  check "canary verdicts and counts as in data/canary_h200.json" 0 "${PIPESTATUS[0]}"

  step "the README's own-kernel command on this GPU, from a folder holding only the user's file"
  local w; w=$(mktemp -d); cp examples/mykernels.py "$w/"
  (cd "$w" && timeout "$(tmo 120)" $PY -m qsa_lab canary --kernel mykernels.py:paged_decode --attend dense --q-heads 32 \
    --kv-heads 8 --head-dim 128 >"$L/canary_readme.log" 2>&1)
  rc=$?; tail -2 "$L/canary_readme.log"; rm -rf "$w"
  check "README's kernel at 32 / 8 / 128 (exit 1: it leaks from the null block and the stale tail)" 1 $rc

  step "real models' geometries: SDPA (math, efficient, cuDNN, flash) and FlexAttention; qsa:grouped skipped past its limits"
  local sdpa="qsa:grouped,torch:sdpa-math,torch:sdpa-efficient,torch:sdpa-cudnn,torch:sdpa-flash" g name opts
  for g in "llama3-8b|--q-heads 32 --kv-heads 8 --head-dim 128 --kernels $sdpa,torch:flex" \
           "llama3-405b-gqa16|--q-heads 128 --kv-heads 8 --head-dim 128 --kernels $sdpa" \
           "mqa-256|--q-heads 16 --kv-heads 1 --head-dim 256 --kernels $sdpa"; do
    name=${g%%|*}; opts=${g#*|}
    # shellcheck disable=SC2086
    timeout "$(tmo 120)" $PY -m qsa_lab canary --attend dense $opts --context 97 --query-len 4 --regions null-block,stale-tail \
      --planes v --json "$OUTDIR/canary_geometry_$name.json" --force >"$L/canary_$name.log" 2>&1
    rc=$?; grep -E "^# |summary|skipped" "$L/canary_$name.log" | tail -4
    echo "leaking cells: $($PY -c "import json, sys; print(json.load(open(sys.argv[1]))['counts']['leaking'])" \
      "$OUTDIR/canary_geometry_$name.json" 2>&1 | tail -1)"
    # a qsa: kernel named past its limits (16 query heads, one KV head) fails the run saying why: exit 3
    check "canary $name (exit 3: qsa:grouped refused with its reason)" 3 $rc
  done
  step "MLA 576/512 at 128 heads, from Python"
  timeout "$(tmo 90)" $PY - <<'EOF' 2>&1 | tail -4
from qsa_lab.canary import canary_case, run_canary
case = canary_case(mla=True, head_dim=576, v_head_dim=512, q_heads=128, attend="dense", free_pages=0)
r = run_canary(["torch:sdpa-math", "torch:sdpa-efficient", "torch:sdpa-flash"], case=case,
               regions=["stale-tail", "null-block"], payloads=["nan"], planes=["v"], backend="cuda")
for x in r.results:
    print(x.describe())
print("skipped", r.skipped, "exit", r.exit_code())
raise SystemExit(r.exit_code())
EOF
  rc=${PIPESTATUS[0]}; check "MLA 576/512 ran (exit 0, 1 or 3, not a crash)" ran "$(case $rc in 0|1|3) echo ran;; *) echo "exit $rc";; esac)"

  step "the per-row rule (other-rows, other-requests) on the qsa routes"
  local qsa=qsa:reference,qsa:xqa,qsa:grouped,qsa:grouped+kernel_fix,qsa:grouped+both_fixes,qsa:grouped+request_groups,qsa:grouped+finite_pv
  timeout "$(tmo 150)" $PY -m qsa_lab canary --backend cuda --kernels "$qsa" --regions other-rows,other-requests --requests 2 \
    --rows 16 --context 40 --json "$OUTDIR/canary_other_rows_$GPU.json" --force >"$L/canary_other_rows.log" 2>&1
  rc=$?; grep "^# .*leak\|leaking of" "$L/canary_other_rows.log"
  check "canary other-rows (the grouped routes leak: exit 1)" 1 $rc
  $PY - "$OUTDIR/canary_other_rows_$GPU.json" <<'EOF'
import json, sys
try:
    doc = json.load(open(sys.argv[1]))
except OSError:
    sys.exit(print("no canary JSON") or 9)
bad = {(r["kernel"], r["region"]) for r in doc["results"] if r["verdict"] not in ("clean", "n/a")}
# the emulation's verdicts on this case (2 requests of 8 rows: the groups are request-aligned, so only the
# spread within a request leaks, on the routes whose panel multiplies a V that only another row attends)
want = {"qsa:reference": [], "qsa:xqa": [], "qsa:grouped+finite_pv": [], "qsa:grouped+request_groups": ["other-rows"],
        "qsa:grouped+kernel_fix": ["other-rows"]}
wrong, ran = 0, {r["kernel"] for r in doc["results"]}
for k, w in want.items():
    got = sorted(b[1] for b in bad if b[0] == k) if k in ran else ["(not run)"]
    wrong += got != w
    print(f"{k}: leaks in {got or 'no region'} ({'as' if got == w else 'NOT as'} on the emulation: {w or 'no region'})")
sys.exit(wrong)
EOF
  check "canary other-rows: each route's regions as on the emulation" 0 $?
}

# FlashInfer: one import decides, shown whole when it fails; carried wheels (FLASHINFER_WHEELS, default .whl:
# flashinfer_python and apache_tvm_ffi) are installed only when it does, without pip's dependency resolution
# (FlashInfer names packages only its other kernels use; nothing can be downloaded there)
flashinfer() {
  local wheels=${FLASHINFER_WHEELS:-.whl}
  fi_import() { timeout "$(tmo 240)" $PY -X faulthandler -c "import flashinfer; print('flashinfer', flashinfer.__version__)" \
    >"$L/flashinfer_import.log" 2>&1; }
  fi_import && { cat "$L/flashinfer_import.log"; return 0; }
  if ls "$wheels"/flashinfer_python-*.whl >/dev/null 2>&1; then
    $PY -m pip install --no-index --no-deps --no-compile "$wheels"/*.whl >"$L/flashinfer_install.log" 2>&1 \
      && echo "installed from $wheels: $(cd "$wheels" && ls *.whl | cut -d- -f1-2 | paste -sd' ')" \
      || { echo "flashinfer install failed:"; tail -3 "$L/flashinfer_install.log"; }
    fi_import && { cat "$L/flashinfer_import.log"; return 0; }
  fi
  tail -25 "$L/flashinfer_import.log"
  skip "flashinfer does not import (put flashinfer_python-*.whl and apache_tvm_ffi-*.whl in $wheels, or set FLASHINFER_WHEELS, and carry it)"
}

stage_thirdparty() {
  need_gpu || return
  flashinfer || return
  local fi=flashinfer:decode,flashinfer:decode-tc,flashinfer:prefill,flashinfer:prefill-fa2 vllm=() rc ran
  [ -n "${VLLM_SRC:-}" ] && vllm=(--vllm-src "$VLLM_SRC" --vllm-rev "${VLLM_REV:-unknown}") && fi=$fi,vllm:unified,vllm:unified-3d
  [ -z "${VLLM_SRC:-}" ] && echo "vllm:*: skipped: no VLLM_SRC (a vLLM checkout) given"
  step "the third-party matrix ($fi), a leak report and a replay of every saved leaking call"
  timeout "$(tmo ${FI_TIMEOUT:-420})" $PY benchmarks/canary_thirdparty.py --kernels "$fi" "${vllm[@]}" \
    --json "$OUTDIR/canary_thirdparty_$GPU.json" --report "$L/thirdparty_reports" >"$L/canary_thirdparty.log" 2>&1
  rc=$?; grep -v "^|" "$L/canary_thirdparty.log" | grep -v "^  replay" | tail -25
  check "third-party matrix ran to its end (its leaks are findings, not failures)" no "$( ((rc == 124)) && echo yes || echo no)"
  ran=$($PY -c "import json, sys; print(sum(not r['summary'].startswith('not run') for r in json.load(open(sys.argv[1]))['runs']))" \
    "$OUTDIR/canary_thirdparty_$GPU.json" 2>/dev/null || echo 0)
  check "third-party matrix: some cell ran (a matrix of 'not run' tells nothing)" yes "$( ((ran > 0)) && echo yes || echo "no ($ran)")"
  step "the per-row rule (other-rows, other-requests) over the FlashInfer kernels"
  fi=flashinfer:decode,flashinfer:decode-tc,flashinfer:prefill,flashinfer:prefill-fa2
  timeout "$(tmo ${FI_TIMEOUT:-420})" $PY benchmarks/canary_thirdparty.py --kernels "$fi" --regions other-rows,other-requests \
    --json "$OUTDIR/canary_other_rows_flashinfer_$GPU.json" >"$L/canary_other_rows_flashinfer.log" 2>&1
  rc=$?; tail -12 "$L/canary_other_rows_flashinfer.log"
  check "per-row FlashInfer matrix ran to its end" no "$( ((rc == 124)) && echo yes || echo no)"
  step "the pytest plugin on real kernels (examples/ci_flashinfer_example.py)"
  timeout "$(tmo 180)" $PY -m pytest -p qsa_lab.canary.pytest_plugin -p no:cacheprovider examples/ci_flashinfer_example.py \
    -q -rf >"$L/pytest_plugin.log" 2>&1
  tail -3 "$L/pytest_plugin.log"
  # the CUDA-core decode leaks under window_left (docs/findings.md), the tensor-core decode does not
  check "pytest plugin: the CUDA-core decode's tests fail, the tensor-core decode's pass" "yes 0" \
    "$(grep -qE '^FAILED .*::test_flashinfer_decode([[ ]|$)' "$L/pytest_plugin.log" && echo yes || echo no) $(grep -c '^FAILED .*::test_flashinfer_decode_tc' "$L/pytest_plugin.log")"
  step "qsa-lab canary --report through the CLI, and the replay of each saved call"
  rm -rf "$L/cli_report"
  timeout "$(tmo 180)" $PY -m qsa_lab canary --kernels flashinfer:prefill-fa2 --attend sparse --q-heads 8 --kv-heads 2 \
    --head-dim 128 --page-size 16 --requests 3 --context 40 --query-len 4 --topk 4 --payloads nan \
    --report "$L/cli_report" >"$L/cli_report.log" 2>&1
  rc=$?; grep -v "^#" "$L/cli_report.log" | tail -4; check "canary --report (FA2 custom mask leaks: exit 1)" 1 $rc
  local f
  for f in "$L"/cli_report/calls/*.safetensors; do
    [ -f "$f" ] || { check "a leaking call saved" yes no; break; }
    timeout "$(tmo 120)" $PY -m qsa_lab.canary.replay "$f" >>"$L/cli_report.log" 2>&1
    check "replay $(basename "$f") (leak reproduced)" 1 $?
  done
}

# each FlashInfer leak searched from a blank start, one process per target (its own budget, SEARCH_BUDGET, and
# shrink); the JIT cache's size before each says what earlier searches of this run had already built
stage_search() {
  need_gpu || return
  flashinfer || return
  local t slug rc jit=${FLASHINFER_WORKSPACE_BASE:-$HOME}/.cache/flashinfer targets
  IFS=, read -ra targets <<<"${SEARCH_TARGETS:-FA2 prefill,CUDA-core decode,FA3 prefill}"   # names of canary_search.py's targets
  for t in "${targets[@]}"; do
    slug=$(echo "$t" | tr 'A-Z ' 'a-z_' | tr -cd 'a-z0-9_')
    step "search: FlashInfer $t (budget ${SEARCH_BUDGET:-180s}; JIT cache before: $(du -sm "$jit" 2>/dev/null | cut -f1 || echo 0) MB)"
    timeout "$(tmo ${SEARCH_TIMEOUT:-540})" $PY benchmarks/canary_search.py --only "$t" --backend cuda \
      --leak-budget "${SEARCH_BUDGET:-180s}" --out "$L/search_$slug.json" >"$L/search_$slug.log" 2>&1
    rc=$?; grep -v '^#' "$L/search_$slug.log" | head -1 | cut -c1-600
    check "search $t ran to its end" 0 $rc
    check "search $t: the leak found" found "$($PY -c "import json, sys; print(json.load(open(sys.argv[1]))['targets'][0]['status'])" \
      "$L/search_$slug.json" 2>/dev/null || echo 'no JSON')"
  done
  $PY - "$OUTDIR/canary_search_flashinfer_$GPU.json" "$L"/search_*.json <<'EOF'
import json, sys
docs = [json.load(open(p)) for p in sys.argv[2:]]
if docs:
    rows = [t for d in docs for t in d["targets"] if t.get("status") != "not run"]
    doc = {**docs[0], "targets": rows, "runs": len(docs)}
    open(sys.argv[1], "w").write(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {sys.argv[1]}: {len(rows)} targets")
EOF
}

# the transformers standalone script on CUDA: the carried transformers (TRANSFORMERS_WHEELS, with the wheels it
# needs) installed into a folder of its own, first on the script's path; the script imports only it and torch
stage_standalone() {
  need_gpu || return
  local wheels=${TRANSFORMERS_WHEELS:-.whl} target=${TMPDIR:-/tmp}/qsa_lab-standalone-transformers got
  ls "$wheels"/transformers-*.whl >/dev/null 2>&1 || { skip "no transformers wheel in $wheels (carry transformers 5.24 or 5.25 and the wheels it needs)"; return; }
  step "install $(cd "$wheels" && ls transformers-*.whl | head -1) and the wheels beside it into $target"
  $PY -m pip install -q --no-index --no-deps --upgrade --target "$target" "$wheels"/*.whl >"$L/standalone_install.log" 2>&1 \
    || { tail -3 "$L/standalone_install.log"; check "the carried transformers installs" 0 1; return 1; }
  step "examples/scribble/transformers_other_requests.py on CUDA (scripts/scribble_script_runs.sh transformers PY cuda)"
  ENGINE_PATH=$target timeout "$(tmo ${STANDALONE_TIMEOUT:-480})" bash scripts/scribble_script_runs.sh transformers "$PY" cuda \
    >"$OUTDIR/runs_transformers_$GPU.log" 2>&1
  grep -E '^# /|^\$|^exit|^LEAK|^CLEAN|^CANNOT' "$OUTDIR/runs_transformers_$GPU.log"
  got=$(grep -E '^exit [0-9]+' "$OUTDIR/runs_transformers_$GPU.log" | cut -d' ' -f2 | tr -d ',' | paste -sd' ')
  # without / with graphs x paged|eager, sdpa x as written (1), --workaround (0); then without the engine (3)
  check "standalone script on CUDA: exit codes" "1 0 1 0 1 0 1 0 3" "$got"
}

stage_reports() {
  need_gpu || return
  flashinfer || return
  report_travel "$OUTDIR/reports"
}

stage_complete_fix() {
  need_gpu || return
  built || return 1
  step "cost (benchmarks/complete_fix_cost.py$( (( QUICK )) && echo ' --quick'))"
  timeout "$(tmo ${COST_TIMEOUT:-180})" $PY benchmarks/complete_fix_cost.py $( (( QUICK )) && echo --quick) \
    --json "$OUTDIR/complete_fix_$GPU.json" >"$L/cost.log" 2>&1
  local rc=$? op name want kv; tail -45 "$L/cost.log"; check "cost bench" 0 $rc
  step "the standalone upstream script on the compiled route (scripts/upstream, through the shim)"
  for op in kernel_fix:1 both_fixes:1 request_groups:0 finite_pv:0; do
    name=${op%%:*}; want=${op##*:}
    timeout "$(tmo 120)" $PY scripts/upstream/cross_request_nan.py --op "scripts/upstream/qsa_lab_shim.py:$name" \
      >"$L/upstream_$name.log" 2>&1
    rc=$?; tail -2 "$L/upstream_$name.log"; check "upstream script on $name" "$want" $rc
  done
  timeout "$(tmo 60)" $PY scripts/upstream/cross_request_nan.py >"$L/upstream_own.log" 2>&1
  rc=$?; tail -2 "$L/upstream_own.log"
  if $PY -c "import vllm" 2>/dev/null; then echo "(vLLM is installed here: upstream's own op ran, exit $rc)"
  else check "upstream script on upstream's op (not installed: 3)" 3 $rc; fi
  step "qsa-lab cross-request --backend cuda (e4m3 and fp16, merged into one document)"
  for kv in e4m3 fp16; do
    timeout "$(tmo 150)" $PY -m qsa_lab cross-request --backend cuda --kv-dtype $kv --json "$L/cross_request_$kv.json" \
      --force >"$L/cross_request_$kv.log" 2>&1
    rc=$?; grep "^# routes\|^# must" "$L/cross_request_$kv.log"
    check "cross-request $kv (complete fixes, xqa, reference clean)" 0 $rc
  done
  $PY - "$L" "$OUTDIR/cross_request_$GPU.json" <<'EOF'
import json, sys
from pathlib import Path
docs = [json.loads(p.read_text()) for kv in ("e4m3", "fp16") if (p := Path(sys.argv[1]) / f"cross_request_{kv}.json").is_file()]
if docs:
    merged = {**docs[0], "kv_dtypes": [d["runs"][0]["geometry"]["kv_dtype"] for d in docs],
              "runs": [r for d in docs for r in d["runs"]], "records": [r for d in docs for r in d["records"]],
              "must_be_clean_leaks": sum(d["must_be_clean_leaks"] for d in docs)}
    Path(sys.argv[2]).write_text(json.dumps(merged, indent=1) + "\n")
    print(f"wrote {sys.argv[2]}: {len(merged['records'])} records")
EOF
}

stage_scribble() {
  local ran=0 rc c v ref
  step "the scribble on the GPU under each supported transformers (benchmarks/scribble_gpu.py)"
  if (( HAVE_GPU )); then
    ran=1
    timeout "$(tmo ${SCRIBBLE_TIMEOUT:-420})" $PY benchmarks/scribble_gpu.py "$OUTDIR/scribble_$GPU" \
      --wheels "${TRANSFORMERS_WHEELS:-.whl}" --budget "$(tmo ${SCRIBBLE_BUDGET:-380})" >/dev/null 2>&1
    rc=$?; grep -E "^-- |^== scribble_gpu" "$OUTDIR/scribble_$GPU/scribble_gpu.log" 2>/dev/null
    check "scribble_gpu (every version it reached ran)" 0 $rc
    check "scribble_gpu: no UNEXPECTED config" 0 "$(grep -c '^-- .*UNEXPECTED' "$OUTDIR/scribble_$GPU/scribble_gpu.log" 2>/dev/null)"
    for c in "$OUTDIR/scribble_$GPU"/*/scribble_*.json; do
      [ -f "$c" ] || continue
      v=$(basename "$(dirname "$c")"); ref=evidence/scribble_h200/$v/$(basename "$c")
      [ -f "$ref" ] || { echo "$v/$(basename "$c"): no committed run to compare with"; continue; }
      $PY tools/compare_verdicts.py "$ref" "$c" | tail -3
      check "scribble $v/$(basename "$c" .json) as in evidence/scribble_h200" 0 "${PIPESTATUS[0]}"
    done
  else
    echo "skipped: no CUDA GPU visible to torch here"
  fi
  step "the scribble on vLLM's CPU backend: every region x nan/inf/max on five configurations"
  # vLLM's environment as `qsa-lab scribble --engine vllm` finds it: VLLM_PYTHON, else .venv-vllm, else this Python
  if [ -x "${VLLM_PYTHON:-$ROOT/.venv-vllm/bin/python}" ] || $PY -c "import vllm" 2>/dev/null; then
    ran=1
    local dir="$OUTDIR/scribble_vllm_cpu" run flag json t
    mkdir -p "$dir"
    for run in "llama-gqa chunked-prefill on" "llama-gqa chunked-prefill off" "llama-gqa reuse on" \
               "llama-gqa reuse off" "mistral-swa reuse on" "mixtral-moe chunked-prefill on"; do
      set -- $run
      flag=$([ "$3" = off ] && echo "--no-prefix-caching" || true)
      json="$dir/$1_$2_prefix-$3.json"; t=$(date +%s)
      echo "== qsa-lab scribble --engine vllm --model $1 --workload $2 $flag (load $(cut -d' ' -f1-3 /proc/loadavg))" | tee -a "$dir/matrix.log"
      # shellcheck disable=SC2086
      timeout "$(tmo 300)" $PY -m qsa_lab scribble --engine vllm --model "$1" --workload "$2" $flag --json "$json" --force \
        >>"$dir/matrix.log" 2>/dev/null
      rc=$?; echo "# exit $rc after $(( $(date +%s) - t )) s" | tee -a "$dir/matrix.log"
      check "vLLM scribble $1 $2 prefix $3 (exit 1: its leaks)" 1 $rc
      ref=evidence/scribble_vllm_cpu/$(basename "$json")
      if [ -f "$ref" ] && [ -f "$json" ]; then
        $PY tools/compare_verdicts.py "$ref" "$json" | tail -3
        check "vLLM scribble $1 $2 prefix $3 as in evidence/scribble_vllm_cpu" 0 "${PIPESTATUS[0]}"
      fi
    done
  else
    echo "skipped: no vLLM environment (make vllm-env builds .venv-vllm; or set VLLM_PYTHON)"
  fi
  (( ran )) || skip "neither a CUDA GPU nor vLLM's environment here"
}

stage_ptx() {
  need_gpu || return
  local dir=${PTX_DIR:-build/ptx70}
  [ -f "$dir/manifest.json" ] || skip "no PTX in $dir (make it where the NVRTC wheels are: python tools/ptx70_check.py generate --out $dir, and carry it)" || return
  built || return 1
  timeout "$(tmo ${PTX_TIMEOUT:-200})" $PY tools/ptx70_check.py check --ptx "$dir" --log "$OUTDIR/ptx70_$GPU.log" --force \
    >"$L/ptx70.log" 2>&1
  local rc=$?; tail -25 "$L/ptx70.log"; check "compute_70 PTX run check" 0 $rc
}

stage_wheel() {
  need_gpu || return
  local work wheel=${WHEEL:-} site from rc
  work=$(mktemp -d /tmp/qsa_lab-wheel-check.XXXXXX)   # outside the checkout
  case "$wheel" in ""|/*) ;; *) wheel=$ROOT/$wheel;; esac
  step "the wheel"
  if [ -z "$wheel" ]; then   # the same PEP 517 hooks pip would call; needs setuptools >= 77 (PEP 639 licence field)
    $PY -c "import sys; from setuptools import build_meta as b; print(b.build_wheel(sys.argv[1]))" "$work/dist" >"$L/wheel_build.log" 2>&1 \
      || { tail -5 "$L/wheel_build.log"; check "wheel built here (else pass WHEEL=, made by make wheel)" 0 1; return 1; }
    wheel=$(ls "$work"/dist/qsa_lab-*.whl)
  fi
  [ -f "$wheel" ] || { check "wheel at $wheel" yes no; return 1; }
  echo "wheel: $wheel ($(wc -c <"$wheel") bytes)"
  site=$work/site
  # --target: the wheel alone, beside this machine's own torch (never a second torch)
  $PY -m pip install -q --no-deps --no-index --target "$site" "$wheel" 2>/dev/null || $PY -m zipfile -e "$wheel" "$site"
  (  # the installed copy only: its own folder first, a fresh build folder, run from outside the checkout
    export PYTHONPATH=$site QSA_LAB_BUILD_DIR=$work/build
    cd "$work" || exit 9
    from=$($PY -c "import qsa_lab; print(qsa_lab.__file__)")
    echo "qsa_lab imported from $from"
    case "$from" in "$site"/*) ;; *) echo "qsa_lab came from $from, not the installed copy"; exit 9;; esac
    $PY -m qsa_lab doctor | tail -3
    $PY -c "from qsa_lab.routes import compiled; from qsa_lab.support import package_data
print('sources:', compiled.CSRC, '(' + package_data.origin() + ')'); compiled.load(); print('built in', compiled.build_dir())" || exit 8
    $PY -m qsa_lab doctor | tail -1 | grep -q "built and loaded" || { echo "doctor does not report the kernels as built"; exit 7; }
    # a plugin that stops the run unless pytest imported the installed qsa_lab
    printf 'import pytest\ndef pytest_configure(config):\n    import qsa_lab\n    if not qsa_lab.__file__.startswith("%s/"):\n        pytest.exit(f"pytest imported qsa_lab from {qsa_lab.__file__}", returncode=3)\n' \
      "$site" >"$work/_installed_qsa_lab.py"
    PYTHONPATH=$site:$work timeout "$(tmo ${TEST_TIMEOUT:-300})" $PY -m pytest -p no:cacheprovider -p _installed_qsa_lab \
      -c "$ROOT/pyproject.toml" --rootdir "$ROOT" -q -rfE "$ROOT/tests/gpu" | tail -3
    exit "${PIPESTATUS[0]}"
  )
  rc=$?; rm -rf "$work"
  check "the installed copy: doctor, a fresh build, tests/gpu" 0 $rc
}

# ------------------------------------------------------------------------------------------ the run

echo "# bash benchmarks/gpu_check.sh ${RUN[*]}   ($(date -u +%FT%TZ))"
echo "# git: $(git rev-parse --short HEAD 2>/dev/null || echo 'not a git checkout') ($(git status --porcelain 2>/dev/null | wc -l) changed files)"
echo "# csrc/ sha256: $(cd csrc && sha256sum * | cut -c1-12 | paste -sd' ')"
echo "# ${GPU_NAME:-no GPU}; $($PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" 2>&1 | tail -1)"
declare -A RESULT
for STAGE in "${RUN[@]}"; do
  echo; echo "######## $STAGE ($(date -u +%T), +$(( $(date +%s) - T0 )) s): ${ABOUT[$STAGE]}"
  BAD=0; SKIP_WHY=""; S0=$(date +%s)
  if (( $(left) < 10 )); then skip "the ${BUDGET_S} s budget is spent"; rc=2
  else "stage_${STAGE//-/_}"; rc=$?; fi
  if (( rc == 2 )); then RESULT[$STAGE]="SKIPPED ($SKIP_WHY)"
  elif (( rc != 0 || BAD > 0 )); then RESULT[$STAGE]="FAIL ($BAD unexpected)"
  else RESULT[$STAGE]="PASS"; fi
  RESULT[$STAGE]+=" in $(( $(date +%s) - S0 )) s"
  echo "== $STAGE: ${RESULT[$STAGE]}"
done

echo; echo "######## summary (+$(( $(date +%s) - T0 )) s)"
FAILED=0
for STAGE in "${RUN[@]}"; do
  printf '%-13s %s\n' "$STAGE" "${RESULT[$STAGE]}"
  case "${RESULT[$STAGE]}" in FAIL*) FAILED=1;; SKIPPED*) (( ${#ASKED[@]} )) && FAILED=1;; esac
done
printf '%s\n' "${CHECKS[@]}" | grep "^UNEXPECTED" || true
echo "$(printf '%s\n' "${CHECKS[@]}" | grep -c "^EXPECTED") expected, $(printf '%s\n' "${CHECKS[@]}" | grep -c "^UNEXPECTED") unexpected checks"
(( ${#ASKED[@]} )) && echo "(a stage named on the command line that skipped counts as failed)"
echo "log: $LOG; files: $OUTDIR (to data/: bench_$GPU.json, canary_$GPU.json, complete_fix_$GPU.json; the rest to evidence/)"
tar -C "$OUTDIR" -czf "$OUTDIR/logs.tgz" logs 2>/dev/null && rm -rf "$OUTDIR/logs"
exit "$FAILED"

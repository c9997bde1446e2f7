#!/usr/bin/env bash
# Issue 40 on a GPU, in one call of at most about 4 minutes on an H200: the canary at real models'
# geometries with the GPU's SDPA (math, efficient, cuDNN, flash) and FlexAttention kernels, the qsa:
# kernels skipped saying why past their limits; the README's own-kernel command at 32 / 8 / 128; MLA
# 576/512 at 128 heads from Python; then the issue's tests on this machine's torch, in what is left.
# Every step runs under a deadline (BUDGET seconds in all, default 225): a step the budget cannot
# hold is cut or not started, and its log says so.
#
#   bash benchmarks/rel4_gpu_check.sh OUT            # BUDGET=225 by default
#
# OUT gets versions.txt, geometries.log (one block per geometry: the terminal matrix and the exit
# code), canary_<geometry>.json, readme.log, mla.log, pytest.log, steps.txt (each step's exit and seconds).
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:?OUT folder}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
W=$(mktemp -d)
export PYTHONPATH="$ROOT:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$ROOT"
DEADLINE=$((SECONDS + ${BUDGET:-225}))
# cap S: S seconds, or what is left of the budget when that is less (0 when nothing is left)
cap() { local left=$((DEADLINE - SECONDS)); (( left < 0 )) && left=0; echo $(( $1 < left ? $1 : left )); }
# step NAME S CMD...: run CMD under `timeout` at most S seconds (cut by the budget); log exit and seconds
step() {
  local name=$1 s; s=$(cap "$2"); shift 2
  if (( s < 5 )); then echo "$name: not run (the ${BUDGET:-225} s budget is spent)" | tee -a "$OUT/steps.txt"; return 0; fi
  local t0=$SECONDS; timeout "$s" "$@"; local rc=$?
  echo "$name: exit $rc in $((SECONDS - t0)) s (limit $s s$( ((rc == 124)) && echo ', cut by the limit'))" \
    | tee -a "$OUT/steps.txt"
}
: > "$OUT/steps.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" \
  | tee "$OUT/versions.txt"

# the README's own-kernel command, from a folder holding only the user's file
cat > "$W/mykernels.py" << 'PY'
import canary_kernels


def paged_decode(call):        # masked before any arithmetic: clean everywhere
    return canary_kernels.reference(call)
PY
(cd "$W" && step "readme command (want exit 0)" 60 python3 -m qsa_lab canary --kernel mykernels.py:paged_decode \
   --attend dense --q-heads 32 --kv-heads 8 --head-dim 128 > "$OUT/readme.log" 2>&1)
tail -1 "$OUT/steps.txt"

# name | geometry options (dense: what SDPA and Flex attend). FlexAttention compiles once per shape on
# a GPU: only the first geometry runs it; qsa:grouped is there to be skipped with its reason past 16
# query heads or at one KV head, so no extension is built (exit 3 then says a named kernel was skipped)
SDPA="qsa:grouped,torch:sdpa-math,torch:sdpa-efficient,torch:sdpa-cudnn,torch:sdpa-flash"
GEOS=("llama3-8b|75|--q-heads 32 --kv-heads 8 --head-dim 128 --kernels $SDPA,torch:flex"
      "llama3-405b-gqa16|35|--q-heads 128 --kv-heads 8 --head-dim 128 --kernels $SDPA"
      "mqa-256|30|--q-heads 16 --kv-heads 1 --head-dim 256 --kernels $SDPA")
for g in "${GEOS[@]}"; do
  IFS='|' read -r name limit opts <<< "$g"
  echo "== $name: $opts" >> "$OUT/geometries.log"
  # shellcheck disable=SC2086
  step "canary $name" "$limit" python3 -m qsa_lab canary --attend dense $opts --context 97 --query-len 4 \
    --regions null-block,stale-tail --planes v --json "$OUT/canary_$name.json" >> "$OUT/geometries.log" 2>&1
  tail -1 "$OUT/steps.txt"
done

cat > "$W/mla.py" << 'PY'
from qsa_lab.canary import run_canary
from qsa_lab.canary.case import canary_case
case = canary_case(mla=True, head_dim=576, v_head_dim=512, q_heads=128, attend="dense", free_pages=0)
r = run_canary(["torch:sdpa-math", "torch:sdpa-efficient", "torch:sdpa-flash"], case=case,
               regions=["stale-tail", "null-block"], payloads=["nan"], planes=["v"], backend="cuda")
for x in r.results:
    print(x.describe())
print("skipped", r.skipped, "exit", r.exit_code())
PY
step "mla 576/512 at 128 heads" 40 python3 "$W/mla.py" > "$OUT/mla.log" 2>&1
tail -1 "$OUT/steps.txt"; tail -2 "$OUT/mla.log"

# the issue's tests on this machine's torch, in what is left of the budget (not the received-folder
# replay tests: they run an installed qsa-lab with nothing of this checkout on the path, CPU-only anyway)
step "pytest" 200 python3 -m pytest -p no:cacheprovider -q tests/canary/test_canary_geometries.py \
  tests/canary/test_other_requests.py tests/app/test_reliability4.py \
  > "$OUT/pytest.log" 2>&1
tail -1 "$OUT/steps.txt"; tail -3 "$OUT/pytest.log"
rm -rf "$W"

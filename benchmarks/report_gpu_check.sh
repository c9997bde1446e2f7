#!/usr/bin/env bash
# The leak report travels, on a GPU (an H200 with flashinfer-python installed, e.g. 0.6.18 from
# a carried wheel): `qsa-lab canary --report` for each of the three FlashInfer leaks of
# docs/findings.md (the cells of evidence/canary_thirdparty_h200.json: 3 requests of 40/39/38
# tokens, 16-token pages, Hq 8, Hkv 2, D 128, fp16), each report zipped, unpacked in another
# folder and run from there (another cwd): every replay line and every generated standalone
# script must exit 1 (leak reproduced). Then the same scripts on a fixed configuration (FA2
# instead of FA3 for window_left, tensor-core decode instead of CUDA-core) must exit 0, and with
# flashinfer hidden 3; a replay whose kernel does not load exits 3. Prints one line per check and
# a summary; exit 0 only when every check gave its expected code. Under 6 minutes.
#
#   bash benchmarks/report_gpu_check.sh OUT
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:?OUT folder}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
W=$(mktemp -d)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import flashinfer, torch; print('flashinfer', flashinfer.__version__, 'torch', torch.__version__,
'cuda', torch.version.cuda, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"

GEO="--q-heads 8 --kv-heads 2 --head-dim 128 --page-size 16 --requests 3 --context 40 --kv-dtype fp16 --payloads nan --planes v"
# name | canary options (each one leak of docs/findings.md)
LEAKS=("fa2_custom_mask|--kernels flashinfer:prefill-fa2 --attend sparse --topk 4 --query-len 4 --regions unselected"
       "decode_window|--kernels flashinfer:decode --attend window:8 --query-len 1 --regions out-of-window"
       "fa3_window|--kernels flashinfer:prefill --attend window:8 --query-len 4 --regions out-of-window")

# the three reports at once: FlashInfer compiles one module per configuration on first use
for leak in "${LEAKS[@]}"; do
  name=${leak%%|*}; opts=${leak#*|}
  ( cd "$W" && timeout 300 python3 -m qsa_lab canary $opts $GEO --report "$W/$name" > "$OUT/$name.canary.log" 2>&1
    echo "canary exit $?" >> "$OUT/$name.canary.log" ) &
done
wait

PASS=0; FAIL=0
check() {   # check WANT LABEL CMD...: run CMD (in the current folder), compare its exit code with WANT
  local want=$1 label=$2; shift 2
  timeout 240 "$@" > "$W/last.log" 2>&1
  local got=$?
  { echo "== [$label] $*"; cat "$W/last.log"; echo "exit $got (want $want)"; } >> "$OUT/runs.log"
  if [ "$got" = "$want" ]; then PASS=$((PASS + 1)); r=ok; else FAIL=$((FAIL + 1)); r=FAIL; fi
  printf '%-4s %-16s exit %s (want %s)  %s\n' "$r" "$label" "$got" "$want" \
    "$(grep -E 'LEAK REPRODUCED|no leak|CANNOT RUN|^verdict|cannot' "$W/last.log" | head -1 | cut -c1-90)"
}

# the replay lines say `qsa-lab replay` (never python -m inside a received folder); without an installed
# qsa-lab, a shim runs this checkout's CLI without the current folder on its path
if ! command -v qsa-lab > /dev/null; then
  mkdir -p "$W/bin"
  printf '#!/bin/sh\nexec python3 -c "import sys; sys.path[:] = [p for p in sys.path if p]; from qsa_lab.app.cli import main; main()" "$@"\n' > "$W/bin/qsa-lab"
  chmod +x "$W/bin/qsa-lab"
  export PATH="$W/bin:$PATH"
fi
mkdir -p "$W/hidden/flashinfer"
echo 'raise ImportError("flashinfer hidden by report_gpu_check.sh")' > "$W/hidden/flashinfer/__init__.py"
for leak in "${LEAKS[@]}"; do
  name=${leak%%|*}
  tail -1 "$OUT/$name.canary.log" | sed "s/^/$name: /"
  [ -f "$W/$name/report.md" ] || { echo "FAIL $name: no report written"; FAIL=$((FAIL + 1)); continue; }
  python3 -m zipfile -c "$W/$name.zip" "$W/$name"
  mkdir -p "$W/elsewhere/$name" && python3 -m zipfile -e "$W/$name.zip" "$W/elsewhere/$name"
  cp "$W/$name.zip" "$OUT/"
  dir="$W/elsewhere/$name/$name"
  pushd "$dir" > /dev/null
  while read -r line; do check 1 "$name replay" $line; done < <(grep -E '^qsa-lab replay ' report.md)
  for s in repro/*.py; do
    check 1 "$name script" python3 "$s"
    case $name in   # the fixed configuration of the same call
      fa3_window) check 0 "$name fa2" python3 "$s" --backend fa2 ;;
      decode_window) check 0 "$name tc" python3 "$s" --tensor-cores ;;
    esac
    check 3 "$name no-lib" env PYTHONPATH="$W/hidden" python3 "$s"
  done
  call=$(ls calls/*.safetensors | head -1)
  check 3 "$name bad-kernel" qsa-lab replay "$call" --kernel "$W/absent.py:fn"
  popd > /dev/null
done
echo "report_gpu_check: $PASS ok, $FAIL failed (logs in $OUT: runs.log, *.canary.log, the zipped reports)"
rm -rf "$W"
[ "$FAIL" = 0 ]

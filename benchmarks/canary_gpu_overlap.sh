#!/usr/bin/env bash
# The canary on a GPU with and without its second process (FlexAttention's two kernels compiled
# there beside the other kernels here), on this checkout:
#   OUT=DIR bash benchmarks/canary_gpu_overlap.sh     (default /tmp/out; a CUDA GPU; ~6 min on an H100)
# 1. builds the kernels (gpu_check.sh build), runs tests/canary/test_canary_gpu.py and test_canary_overlap.py;
# 2. times `qsa-lab canary --backend cuda --json` as a user runs it (two processes where a core is idle)
#    and with the second process held off (one process), first as the machine has Python set up
#    (PYTHONDONTWRITEBYTECODE=1 on the device machine: every process compiles torch's modules from
#    source), then twice each with bytecode cached after a warm-up run;
# 3. compares the verdicts of both runs with each other and with data/canary_h200.json
#    (tools/compare_verdicts.py) and runs benchmarks/track.py --rows canary_gpu --reps 3.
# Everything it prints goes to DIR/run.log; track_gpu.json and the two reports to DIR.
set -u
O=${OUT:-/tmp/out}; J=/tmp/j; mkdir -p $O $J
export PYTHONPATH=$PWD
exec > >(tee $O/run.log) 2>&1
date -u; nvidia-smi --query-gpu=name --format=csv,noheader; nproc; uptime
T0=$(date +%s)
timeout 200 bash benchmarks/gpu_check.sh --out $O/gc --log $O/gc_build.log build; echo "build rc=$? at $(( $(date +%s)-T0 )) s"
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/canary/test_canary_gpu.py tests/canary/test_canary_overlap.py 2>&1 | tail -15; echo "pytest rc=${PIPESTATUS[0]} at $(( $(date +%s)-T0 )) s"
cat > /tmp/one.py <<'PY'
import sys, qsa_lab.canary.overlap as o
o.idle_core = lambda: False
from qsa_lab.app.cli import main
sys.exit(main(sys.argv[1:]))
PY
tm() { local lab=$1; shift; local s=$(date +%s%N); "$@" > /tmp/last.txt 2>&1; local rc=$?; echo "$lab: $(( ($(date +%s%N)-s)/1000000 )) ms rc=$rc | $(grep -E 'cells|leak|checks' /tmp/last.txt | tail -1)"; }
for tag in a; do
  tm "two-process $tag" python3 -m qsa_lab canary --backend cuda --json $J/two_$tag.json
  tm "one-process $tag" python3 /tmp/one.py canary --backend cuda --json $J/one_$tag.json
done
echo "at $(( $(date +%s)-T0 )) s"
python3 tools/compare_verdicts.py $J/one_a.json $J/two_a.json | tail -3
python3 tools/compare_verdicts.py data/canary_h200.json $J/two_a.json | tail -3
python3 tools/compare_verdicts.py data/canary_h200.json $J/one_a.json | tail -3
( unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
  python3 -m qsa_lab canary --backend cuda --json /tmp/warm.json >/dev/null 2>&1
  python3 /tmp/one.py canary --backend cuda --json /tmp/warm1.json >/dev/null 2>&1
  for tag in c d; do
    tm "cached two-process $tag" python3 -m qsa_lab canary --backend cuda --json $J/two_$tag.json
    tm "cached one-process $tag" python3 /tmp/one.py canary --backend cuda --json $J/one_$tag.json
  done
  echo "at $(( $(date +%s)-T0 )) s"
  timeout 150 python3 benchmarks/track.py --rows canary_gpu --reps 3 --json $J/track_gpu.json 2>&1 | tail -12 )
echo "end at $(( $(date +%s)-T0 )) s"; uptime
cp $J/two_a.json $J/one_a.json $J/track_gpu.json $O/; (cd /tmp && tar czf $O/logs.tgz j -C $O gc); ls -la $O

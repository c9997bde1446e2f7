#!/usr/bin/env bash
# A pip user's qsa_lab on a GPU node: install the wheel (built here, or the one given) so that it
# uses this machine's torch, then from a folder outside the checkout run `qsa-lab doctor`, build
# the kernels from the installed copy's csrc/ into a fresh folder, and run tests/gpu against the
# installed copy (pytest is made to refuse any other qsa_lab). No network or package index needed.
#   bash benchmarks/wheel_gpu_check.sh LOG [WHEEL]          (PYTHON=python3 by default)
# Without a CUDA GPU the GPU part is reported as skipped (exit 0); any failure exits non-zero.
set -uo pipefail
LOG=${1:?usage: bash benchmarks/wheel_gpu_check.sh LOG [WHEEL]}
WHEEL=${2:-}
PY=${PYTHON:-python3}
case "$PY" in /*) ;; */*) PY=$PWD/$PY;; *) PY=$(command -v "$PY") || { echo "no $PY"; exit 1; };; esac
case "$WHEEL" in ""|/*) ;; *) WHEEL=$PWD/$WHEEL;; esac
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$(dirname "$LOG")"
LOG=$(cd "$(dirname "$LOG")" && pwd)/$(basename "$LOG")
WORK=$(mktemp -d /tmp/qsa_lab-wheel-check.XXXXXX)   # outside the checkout
exec > >(tee "$LOG") 2>&1
T0=$(date +%s)
stage() { echo; echo "######## $1 ($(date -u +%T), +$(( $(date +%s) - T0 )) s)"; }
fail() { echo "WHEEL CHECK FAILED: $*"; exit 1; }

stage "machine"
echo "checkout $REPO; work folder $WORK"
nvidia-smi -L 2>/dev/null || echo "nvidia-smi: none"
$PY -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda)" \
  || fail "$PY has no torch"

stage "wheel"
if [ -z "$WHEEL" ]; then
  # the same PEP 517 hooks pip would call; needs setuptools >= 77 (PEP 639 licence field)
  (cd "$REPO" && $PY -c "import sys; from setuptools import build_meta as b; print(b.build_wheel(sys.argv[1]))" \
     "$WORK/dist" > "$WORK/build.log" 2>&1) \
    || { tail -5 "$WORK/build.log"; fail "could not build the wheel here: pass one built elsewhere (make wheel)"; }
  WHEEL=$(ls "$WORK"/dist/qsa_lab-*.whl)
fi
[ -f "$WHEEL" ] || fail "no wheel at $WHEEL"
echo "wheel: $WHEEL ($(wc -c < "$WHEEL") bytes)"
SITE="$WORK/site"
# --target: the wheel alone, beside this machine's own torch (never a second torch)
if $PY -m pip --version >/dev/null 2>&1; then
  $PY -m pip install -q --no-deps --no-index --target "$SITE" "$WHEEL" || fail "pip install --target"
else
  echo "no pip here: unpacking the (pure-Python) wheel"; $PY -m zipfile -e "$WHEEL" "$SITE" || fail "unzip"
fi
export PYTHONPATH="$SITE" PYTHONUNBUFFERED=1 QSA_LAB_BUILD_DIR="$WORK/build"   # a fresh build, from the wheel
cd "$WORK" || fail "cd $WORK"
FROM=$($PY -c "import qsa_lab; print(qsa_lab.__file__)") || fail "import qsa_lab"
echo "qsa_lab imported from $FROM"
case "$FROM" in "$SITE"/*) ;; *) fail "qsa_lab came from $FROM, not the installed copy in $SITE";; esac
QSA=("$PY" -m qsa_lab)

stage "qsa-lab doctor (before the build)"
"${QSA[@]}" doctor || fail "qsa-lab doctor exited $?"

GPU=1
$PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || GPU=0
if [ $GPU = 0 ]; then
  stage "kernel build"
  echo "SKIPPED: no CUDA GPU visible to torch here (the build and tests/gpu need one; tests/gpu still runs, skipping)"
else
stage "build the kernels from the installed csrc/"
B0=$(date +%s)
$PY -c "
from qsa_lab.routes import compiled as kernels
from qsa_lab.support import package_data
print('sources:', kernels.CSRC, '(' + package_data.origin() + ')')
kernels.load()
print('built in', kernels.build_dir())" || fail "kernel build"
echo "build wall $(( $(date +%s) - B0 )) s"

stage "qsa-lab doctor (after the build)"
"${QSA[@]}" doctor | tail -3
"${QSA[@]}" doctor | tail -1 | grep -q "built and loaded" || fail "doctor does not report the kernels as built"
fi

stage "tests/gpu on the installed copy"
# a plugin that stops the run unless pytest imported the installed qsa_lab, and names it
cat > "$WORK/_installed_qsa_lab.py" <<EOF
import pytest
def pytest_configure(config):
    import qsa_lab
    if not qsa_lab.__file__.startswith("$SITE/"):
        pytest.exit(f"pytest imported qsa_lab from {qsa_lab.__file__}, not the installed copy", returncode=3)
    print(f"pytest uses qsa_lab from {qsa_lab.__file__}")
EOF
timeout "${TEST_TIMEOUT:-600}" $PY -m pytest -p no:cacheprovider -p _installed_qsa_lab -c "$REPO/pyproject.toml" \
  --rootdir "$REPO" -q -rfEs "$REPO/tests/gpu"
RC=$?
[ $GPU = 1 ] || { stage "done: GPU part SKIPPED (no CUDA GPU), tests/gpu exit $RC"; exit $RC; }
stage "done (tests/gpu exit $RC)"
exit $RC

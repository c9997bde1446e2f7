#!/usr/bin/env bash
# Test-only extras that `make test` needs beyond the package: CUDA 12 NVRTC wheels (the sm_70
# compile check of csrc/) and the browser end-to-end set-up. Idempotent.
set -euo pipefail
PY="${1:-python}"
"$PY" -m pip install -q -r requirements-nvrtc.txt
if [ -f scripts/setup_e2e.sh ]; then PY="$PY" bash scripts/setup_e2e.sh; fi

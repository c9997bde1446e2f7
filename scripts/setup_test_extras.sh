#!/usr/bin/env bash
# Test-only sets that `make test` needs beyond `make setup`'s: the `nvrtc` dependency group of
# pyproject.toml (CUDA 12 NVRTC wheels: the sm_70 compile check of csrc/, tests/tools/), its `docs`
# group (the site's strict build, tests/docs/) and the browser end-to-end set-up (its `e2e` group
# and Debian's Chromium). Idempotent.
set -euo pipefail
PY="${1:-python}"
cd "$(dirname "$0")/.."
"$PY" -m pip install -q --group nvrtc --group docs
if [ -f scripts/setup_e2e.sh ]; then PY="$PY" bash scripts/setup_e2e.sh; fi
# the vLLM adapter's tests run in .venv-vllm: make test builds it, and stops if it cannot (a skipped
# engine is not a tested one)
make --no-print-directory vllm-env

#!/usr/bin/env bash
# Test-only sets that `make test` needs beyond `make setup`'s: the `nvrtc` dependency group of
# pyproject.toml (CUDA 12 NVRTC wheels: the sm_70 compile check of csrc/, tests/tools/), its `docs`
# group (the site's strict build, tests/docs/) and the browser end-to-end set-up (its `e2e` group
# and Debian's Chromium). Idempotent.
# The three groups are one pip call (one resolution; the torch installed is pinned, as
# scripts/setup_e2e.sh pins it, whose own pip step then finds them there), and vLLM's environment,
# which shares nothing with this one, is built at the same time: a fresh clone waits for the longer
# of the two instead of their sum.
set -euo pipefail
PY="${1:-python}"
cd "$(dirname "$0")/.."
LOGS="$(mktemp -d)"
trap 'rm -rf "$LOGS"' EXIT
# the vLLM adapter's tests run in .venv-vllm: make test builds it, and stops if it cannot (a skipped
# engine is not a tested one)
make --no-print-directory vllm-env >"$LOGS/vllm" 2>&1 &
VLLM=$!
status=0
"$PY" - >"$LOGS/constraints" <<'PYEOF' || status=$?
try:
    import torch
    print(f"torch=={torch.__version__}")
except ImportError:
    pass
PYEOF
[ "$status" -eq 0 ] && { "$PY" -m pip install -q -c "$LOGS/constraints" --group nvrtc --group docs --group e2e || status=$?; }
if [ "$status" -eq 0 ] && [ -f scripts/setup_e2e.sh ]; then PY="$PY" bash scripts/setup_e2e.sh || status=$?; fi
vllm_status=0
wait "$VLLM" || vllm_status=$?
cat "$LOGS/vllm"
if [ "$vllm_status" -ne 0 ]; then echo "setup_test_extras: make vllm-env failed (exit $vllm_status)" >&2; exit "$vllm_status"; fi
exit "$status"

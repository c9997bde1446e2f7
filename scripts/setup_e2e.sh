#!/usr/bin/env bash
# Set-up for the browser end-to-end test (tests/e2e/): Debian's Chromium and the
# Python packages that drive it. Idempotent: each step is skipped when its result
# is already there. Never downloads a browser build (`playwright install` is not
# used: Playwright drives /usr/bin/chromium through executable_path).
#
#   PY=.venv/bin/python bash scripts/setup_e2e.sh     # PY defaults to `python`
#
# Without root, or without apt-get, a missing Chromium is reported and left
# missing: the e2e test then skips (or fails under CI=true, where it must run).
set -euo pipefail
PY="${PY:-python}"
CHROMIUM="${QSA_LAB_CHROMIUM:-/usr/bin/chromium}"

if [ -x "$CHROMIUM" ]; then
  echo "setup_e2e: chromium present: $("$CHROMIUM" --version 2>/dev/null || echo "$CHROMIUM")"
elif [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
  echo "setup_e2e: installing Debian's chromium with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends chromium fonts-liberation fonts-dejavu-core >/dev/null
  "$CHROMIUM" --version 2>/dev/null || true
else
  echo "setup_e2e: no chromium at $CHROMIUM and cannot apt-get it (not root or no apt-get); the e2e test will skip, or fail under CI=true" >&2
fi

if "$PY" -c "import playwright.sync_api, jupyterlab" 2>/dev/null; then
  echo "setup_e2e: playwright and jupyterlab already importable"
else
  # Pin whatever torch is installed, so that pip can never replace it (a V100
  # node's CUDA 12 torch must stay); no torch at all means nothing to pin.
  constraints="$(mktemp)"
  trap 'rm -f "$constraints"' EXIT
  "$PY" - >"$constraints" <<'EOF'
try:
    import torch
    print(f"torch=={torch.__version__}")
except ImportError:
    pass
EOF
  echo "setup_e2e: pip install --group e2e (constraints: $(tr '\n' ' ' <"$constraints"))"
  "$PY" -m pip install -q -c "$constraints" --group "$(dirname "$0")/../pyproject.toml:e2e"
fi

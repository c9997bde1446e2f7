#!/usr/bin/env bash
# The scribble's tests again under every other transformers version its adapter is checked against
# (qsa_lab.scribble.versions.SUPPORTED_TRANSFORMERS): `make setup` installed one of them; each other one
# is installed once, without its dependencies (the installed version's serve it: the adapter's tests
# import nothing else they would change), into ENV_DIR/qsa_lab-transformers/VERSION, and put first on
# PYTHONPATH for one run of tests/scribble (the vLLM adapter's tests left out: they use vLLM's own
# environment and transformers, tests/scribble/conftest.py; so is the generated vLLM script's run, which
# runs in that environment: with this version first on its path it would run a transformers vLLM's
# environment does not pin). Idempotent.
#   bash scripts/test_other_transformers.sh PYTHON ENV_DIR [WORKERS]
set -euo pipefail
PY="${1:-python}"
ENV_DIR="${2:-.venv}"
WORKERS="${3:-auto}"
cd "$(dirname "$0")/.."
OTHERS=$("$PY" -c "from qsa_lab.scribble.versions import TRANSFORMERS as T
print(' '.join(x for x in T.supported if x != T.installed()))")
for V in $OTHERS; do
  TARGET="$ENV_DIR/qsa_lab-transformers/$V"
  if [ ! -f "$TARGET/.installed" ]; then
    rm -rf "$TARGET"
    "$PY" -m pip install -q --no-deps --target "$TARGET" "transformers==$V"
    touch "$TARGET/.installed"
  fi
  echo "tests/scribble under transformers $V"
  PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest -q -p no:cacheprovider -n "$WORKERS" tests/scribble \
    --ignore=tests/scribble/on_vllm --ignore-glob='tests/scribble/test_vllm_*.py' \
    --deselect tests/scribble/test_standalone.py::test_the_vllm_script_leaks_as_generated_and_not_with_the_workaround
done

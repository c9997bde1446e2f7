#!/usr/bin/env bash
# The pages' GPU-only commands on a GPU, in one call: every `qsa-lab` command the README and docs/
# show with `--backend cuda` or mark GPU-only runs as written in a fresh folder
# (tests/docs/test_docs_run.py::test_gpu_commands_run_as_shown; those naming FlashInfer or vLLM skip
# where that library is missing). The checkout's qsa_lab is used as it is (no install).
#
#   bash benchmarks/docs_gpu_check.sh OUT
#
# OUT gets pytest.log (one line per command: passed, failed with its output, or skipped with why).
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:?OUT folder}
mkdir -p "$OUT"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
timeout 540 python3 -m pytest -p no:cacheprovider -q -rA -m gpu tests/docs/test_docs_run.py -k gpu_commands \
  > "$OUT/pytest.log" 2>&1
echo "pytest exit $? (0: every GPU command ran as shown)"
grep -E "^(PASSED|FAILED|SKIPPED|ERROR)" "$OUT/pytest.log"
tail -2 "$OUT/pytest.log"

#!/usr/bin/env bash
# The third-party kernels on a GPU, in one go: the canary matrix (benchmarks/canary_thirdparty.py,
# with a leak report and a replay of every saved leaking call), the reports' generated standalone
# FlashInfer scripts (benchmarks/report_gpu_check.sh), the pytest plugin on real FlashInfer kernels, and `qsa-lab canary --report` through
# the CLI. Needs flashinfer-python (and apache-tvm-ffi) installed and a vLLM checkout for vllm:*.
#
#   bash benchmarks/thirdparty_gpu_check.sh OUT VLLM_SRC "what VLLM_SRC holds" [LABEL]
#
# OUT gets canary_thirdparty_h200.json / .md, canary.log, repro.log, pytest.log, cli.log and
# reports.tgz (every leak report written).
set -u
OUT=${1:?OUT folder}; VLLM_SRC=${2:?vLLM checkout}; VLLM_REV=${3:-unknown}; LABEL=${4:-}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -c "import flashinfer, torch, triton; print('flashinfer', flashinfer.__version__, 'torch', torch.__version__,
'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

# the leak reports of the three FlashInfer leaks, zipped and replayed elsewhere, with their generated
# standalone scripts (benchmarks/report_gpu_check.sh), beside the matrix (they share FlashInfer's JIT cache)
bash benchmarks/report_gpu_check.sh "$OUT/report_check" > "$OUT/repro.log" 2>&1 &

timeout 420 python3 benchmarks/canary_thirdparty.py --json "$OUT/canary_thirdparty_h200.json" --vllm-src "$VLLM_SRC" \
  --vllm-rev "$VLLM_REV" --label "$LABEL" --report /tmp/thirdparty_reports > "$OUT/canary.log" 2>&1
echo "matrix exit $?"
wait

# the pytest plugin on real kernels; the CLI's --report and the replay line it prints
timeout 120 python3 -m pytest -p qsa_lab.canary.pytest_plugin -p no:cacheprovider benchmarks/ci_flashinfer_example.py \
  -q -rf > "$OUT/pytest.log" 2>&1; echo "pytest exit $?" >> "$OUT/pytest.log"
{
  timeout 120 python3 -m qsa_lab canary --kernels flashinfer:prefill-fa2 --attend sparse --q-heads 8 --kv-heads 2 \
    --head-dim 128 --page-size 16 --requests 3 --context 40 --query-len 4 --topk 4 --payloads nan \
    --report /tmp/cli_report
  echo "canary exit $?"
  for f in /tmp/cli_report/calls/*.safetensors; do
    echo "\$ python -m qsa_lab.canary.replay $f"; python3 -m qsa_lab.canary.replay "$f"; echo "replay exit $?"
  done
} > "$OUT/cli.log" 2>&1
tar -czf "$OUT/reports.tgz" -C /tmp thirdparty_reports cli_report 2>/dev/null
grep -v "^|" "$OUT/canary.log" | grep -v "^  replay" | tail -40
tail -25 "$OUT/repro.log"; tail -25 "$OUT/pytest.log"; grep -v "^#" "$OUT/cli.log" | tail -12

#!/usr/bin/env bash
# The scribble's full matrix on vLLM's CPU backend (every region x nan/inf/max, other-requests
# included, every leak confirmed): the tiny Llama on chunked-prefill and reuse with prefix caching
# on and off, the tiny Mistral (sliding window) on reuse, the tiny Mixtral (mixture of experts) on
# chunked-prefill. One JSON per configuration and matrix.log
# (commands, verdict tables, exit codes, seconds, load averages) in DIR (default
# evidence/scribble_vllm_cpu; its files are replaced). Needs `make setup` and `make vllm-env`.
#   bash benchmarks/scribble_vllm_matrix.sh [DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-evidence/scribble_vllm_cpu}"
mkdir -p "$DIR"
LOG="$DIR/matrix.log"
load() { cut -d' ' -f1-3 /proc/loadavg; }
cpu=$(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
echo "# $(date -u +%FT%TZ) $(uname -m) $(nproc) cores, $cpu, load $(load)" > "$LOG"
for run in "llama-gqa chunked-prefill on" "llama-gqa chunked-prefill off" "llama-gqa reuse on" \
           "llama-gqa reuse off" "mistral-swa reuse on" "mixtral-moe chunked-prefill on"; do
  set -- $run
  flag=$([ "$3" = off ] && echo "--no-prefix-caching" || true)
  json="$DIR/$1_$2_prefix-$3.json"
  cmd="qsa-lab scribble --engine vllm --model $1 --workload $2 $flag --json $json --force"
  echo "== $cmd" >> "$LOG"
  start=$(date +%s)
  .venv/bin/$cmd >> "$LOG" 2>/dev/null
  rc=$?
  echo "# exit $rc after $(( $(date +%s) - start )) s, load $(load)" >> "$LOG"
done
echo "# done $(date -u +%FT%TZ)" >> "$LOG"

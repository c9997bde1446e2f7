#!/usr/bin/env bash
# Run the committed standalone scribble scripts (examples/scribble/) as a maintainer would, from an
# empty folder where qsa_lab cannot be imported (a package named qsa_lab that fails on import comes
# first on the path), and log each command, its output, exit code and wall time with the machine's
# facts: evidence/scribble_standalone/runs_cpu.log.
#   bash scripts/scribble_script_runs.sh TRANSFORMERS_PYTHON VLLM_PYTHON > evidence/scribble_standalone/runs_cpu.log
set -u
repo=$(cd "$(dirname "$0")/.." && pwd)
tf_python=$1 vllm_python=$2
work=$(mktemp -d) && trap 'rm -rf "$work"' EXIT
mkdir -p "$work/poison/qsa_lab" && echo "raise ImportError('the script imported qsa_lab')" > "$work/poison/qsa_lab/__init__.py"
cp "$repo"/examples/scribble/*.py "$work/"
cd "$work"
echo "# $(date -u '+%Y-%m-%d %H:%M UTC') on $(uname -srm); $(nproc) cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); load $(cut -d' ' -f1 /proc/loadavg)"
echo "# transformers python: $tf_python ($("$tf_python" -c 'import transformers, torch; print("transformers", transformers.__version__, "torch", torch.__version__)'))"
echo "# vLLM python: $vllm_python ($("$vllm_python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>/dev/null))"
run() {
    local python=$1; shift
    echo; echo "\$ python $*"
    local t0=$(date +%s.%N)
    PYTHONPATH="$work/poison" "$python" "$@" 2>/dev/null | grep -v '^$'
    local rc=${PIPESTATUS[0]}
    echo "exit $rc, $(printf '%.1f' "$(echo "$(date +%s.%N) - $t0" | bc)") s"
}
run "$tf_python" transformers_other_requests.py
run "$tf_python" transformers_other_requests.py --workaround
run "$tf_python" transformers_other_requests.py --attn sdpa
run "$tf_python" transformers_other_requests.py --attn sdpa --workaround
run "$vllm_python" vllm_cpu_tail.py
run "$vllm_python" vllm_cpu_tail.py --workaround
echo; echo "# the default workloads the shrinker started from (the scribble's reuse workload, 2 layers)"
run "$tf_python" transformers_other_requests.py --params '{"prompt_lengths": [5, 13, 30, 47, 21, 21], "new_tokens": 8, "layers": 2, "blocks": 12, "batch_tokens": 32, "bad_at": 4}'
run "$vllm_python" vllm_cpu_tail.py --params '{"prompt_lengths": [80, 5, 40, 70, 47, 80], "new_tokens": 24, "layers": 2, "blocks": 8, "batch_tokens": 48, "bad_at": 4}'
echo; echo "# without the engine: python3 -I -S (the standard library only)"
run python3 -I -S transformers_other_requests.py
run python3 -I -S vllm_cpu_tail.py

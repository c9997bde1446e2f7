#!/usr/bin/env bash
# Run a committed standalone scribble script (examples/scribble/) as a maintainer would, from an empty
# folder where qsa_lab cannot be imported (a package named qsa_lab that fails on import comes first on
# the path), and log each command, its output, exit code and wall time with the machine's facts:
#   bash scripts/scribble_script_runs.sh transformers .venv/bin/python > evidence/scribble_standalone/runs_transformers_cpu.log
#   bash scripts/scribble_script_runs.sh vllm .venv-vllm/bin/python > evidence/scribble_standalone/runs_vllm_cpu.log
set -u
repo=$(cd "$(dirname "$0")/.." && pwd)
engine=$1 python=$2
work=$(mktemp -d) && trap 'rm -rf "$work"' EXIT
mkdir -p "$work/poison/qsa_lab" && echo "raise ImportError('the script imported qsa_lab')" > "$work/poison/qsa_lab/__init__.py"
cp "$repo"/examples/scribble/*.py "$work/"
cd "$work"
echo "# $(date -u '+%Y-%m-%d %H:%M UTC') on $(uname -srm); $(nproc) cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); load $(cut -d' ' -f1 /proc/loadavg) (a machine shared with other jobs)"
echo "# $python: $("$python" -c "import $engine, torch; print('$engine', $engine.__version__, 'torch', torch.__version__)" 2>/dev/null)"
echo "# every run from an empty folder, a package named qsa_lab that fails on import first on PYTHONPATH"
run() {
    local py=$1; shift
    echo; echo "\$ python $*"
    local t0=$(date +%s.%N)
    PYTHONPATH="$work/poison" "$py" "$@" 2>/dev/null | grep -v '^$'
    local rc=${PIPESTATUS[0]}
    echo "exit $rc, $(printf '%.1f' "$(echo "$(date +%s.%N) - $t0" | bc)") s"
}
if [ "$engine" = transformers ]; then
    run "$python" transformers_other_requests.py
    run "$python" transformers_other_requests.py --workaround
    run "$python" transformers_other_requests.py --attn sdpa
    run "$python" transformers_other_requests.py --attn sdpa --workaround
    echo; echo "# the default workload the shrinker started from (the scribble's reuse workload, 2 layers)"
    run "$python" transformers_other_requests.py --params '{"prompt_lengths": [5, 13, 30, 47, 21, 21], "new_tokens": 8, "layers": 2, "blocks": 12, "batch_tokens": 32, "bad_at": 4}'
    script=transformers_other_requests.py
else
    run "$python" vllm_cpu_tail.py
    run "$python" vllm_cpu_tail.py --workaround
    echo; echo "# the default workload the shrinker started from (the scribble's reuse workload, 2 layers)"
    run "$python" vllm_cpu_tail.py --params '{"prompt_lengths": [80, 5, 40, 70, 47, 80], "new_tokens": 24, "layers": 2, "blocks": 8, "batch_tokens": 48, "bad_at": 4}'
    script=vllm_cpu_tail.py
fi
echo; echo "# without the engine: python3 -I -S (the standard library only)"
run python3 -I -S "$script"

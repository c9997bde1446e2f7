#!/usr/bin/env bash
# Run a committed standalone scribble script (examples/scribble/) as a maintainer would, from an empty
# folder where qsa_lab cannot be imported (a package named qsa_lab that fails on import comes first on
# the path), and log each command, its output, exit code and wall time with the machine's facts:
#   bash scripts/scribble_script_runs.sh transformers .venv/bin/python > evidence/scribble_standalone/runs_transformers_cpu.log
#   bash scripts/scribble_script_runs.sh vllm .venv-vllm/bin/python > evidence/scribble_standalone/runs_vllm_cpu.log
# On a GPU, the transformers script on CUDA, without and with CUDA graphs (a third argument `cuda`);
# ENGINE_PATH, when set, comes first on the path (a folder holding another transformers):
#   ENGINE_PATH=/tmp/tf525 bash scripts/scribble_script_runs.sh transformers python3 cuda
set -u
repo=$(cd "$(dirname "$0")/.." && pwd)
engine=$1 python=$2 device=${3:-cpu}
case "$python" in */*) python=$(cd "$(dirname "$python")" && pwd)/$(basename "$python");; esac
[ "$device" = cpu ] || [ "$device" = cuda ] || { echo "scribble_script_runs.sh: error: device: cpu or cuda, got '$device'" >&2; exit 2; }
[ "$device" = cpu ] || [ "$engine" = transformers ] || { echo "scribble_script_runs.sh: error: cuda runs only the transformers script" >&2; exit 2; }
work=$(mktemp -d) && trap 'rm -rf "$work"' EXIT
mkdir -p "$work/poison/qsa_lab" && echo "raise ImportError('the script imported qsa_lab')" > "$work/poison/qsa_lab/__init__.py"
cp "$repo"/examples/scribble/*.py "$work/"
cd "$work"
echo "# $(date -u '+%Y-%m-%d %H:%M UTC') on $(uname -srm); $(nproc) cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); load $(cut -d' ' -f1 /proc/loadavg) (a machine shared with other jobs)"
path="$work/poison${ENGINE_PATH:+:$ENGINE_PATH}"
echo "# $python: $(PYTHONPATH=$path "$python" -c "import $engine, torch; print('$engine', $engine.__version__, 'torch', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')" 2>/dev/null)"
echo "# every run from an empty folder, a package named qsa_lab that fails on import first on PYTHONPATH"
run() {
    local py=$1; shift
    echo; echo "\$ python $*"
    local t0=$(date +%s.%N)
    PYTHONPATH="$path" "$py" "$@" 2>/dev/null | grep -v '^$'
    local rc=${PIPESTATUS[0]}
    echo "exit $rc, $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}') s"
}
if [ "$device" = cuda ]; then
    for graph in "" --cuda-graph; do
        for attn in "paged|eager" sdpa; do
            run "$python" transformers_other_requests.py --device cuda $graph --attn "$attn"
            run "$python" transformers_other_requests.py --device cuda $graph --attn "$attn" --workaround
        done
    done
    script=transformers_other_requests.py
elif [ "$engine" = transformers ]; then
    run "$python" transformers_other_requests.py
    run "$python" transformers_other_requests.py --workaround
    run "$python" transformers_other_requests.py --attn sdpa
    run "$python" transformers_other_requests.py --attn sdpa --workaround
    echo; echo "# the default workload the shrinker started from (the scribble's reuse workload, 2 layers)"
    run "$python" transformers_other_requests.py --params '{"prompt_lengths": [5, 13, 30, 47, 21, 21], "new_tokens": 8, "layers": 2, "blocks": 12, "batch_tokens": 32, "bad_at": 4}'
    run "$python" transformers_other_requests.py --params '{"prompt_lengths": [5, 13, 30, 47, 21, 21], "new_tokens": 8, "layers": 2, "blocks": 12, "batch_tokens": 32, "bad_at": 4}' --workaround
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

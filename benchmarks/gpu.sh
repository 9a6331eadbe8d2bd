#!/usr/bin/env bash
# The GPU fast path's checks and benchmarks in one go, for a machine with one CUDA GPU and no
# network (torch, triton and transformers already installed): installs pagoda without deps,
# runs tests/gpu and the kernel tests compiled, then W1 / B1 with random weights from the
# config-only folders, writing JSON lines to ${OUT:-benchmarks/results/gpu}.
#   bash benchmarks/gpu.sh [tests|bench|quant|all]   (default all: tests and bench)
# quant (issue 5): W1 and B1 of Qwen3-0.6B and Llama-3.2-1B with fp8 and int4 weights, to set
# beside bench's bf16 runs of the same models.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results/gpu}"
mkdir -p "$out"
what="${1:-all}"
pip install -q --no-deps -e . >/dev/null 2>&1 || pip install --no-deps -e .
if ls wheels/*.whl >/dev/null 2>&1; then pip install -q --no-deps wheels/*.whl; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"

if [[ "$what" == tests || "$what" == all ]]; then
  python -m pytest -q -p no:cacheprovider tests/unit/test_triton_attention.py \
    tests/unit/test_triton_quant_matmul.py \
    tests/unit/test_triton_kernels.py tests/gpu -m 'not slow' 2>&1 | tail -30 | tee "$out/tests.txt"
fi

if [[ "$what" == bench || "$what" == all ]]; then
  for m in SmolLM2-135M-Instruct Qwen3-0.6B Llama-3.2-1B; do
    pagoda bench throughput --model "benchmarks/models/$m" --load-format dummy \
      --max-model-len 2048 --output-json "$out/w1_$m.json" 2>"$out/w1_$m.log" | tail -1
  done
  for m in SmolLM2-135M-Instruct Qwen3-0.6B Llama-3.2-1B; do
    pagoda bench latency --model "benchmarks/models/$m" --load-format dummy --max-model-len 2048 \
      --input-len 128 --output-len 512 --profile-steps 50 --output-json "$out/b1_$m.json" \
      2>"$out/b1_$m.log" | tail -1
  done
  pagoda bench latency --model benchmarks/models/SmolLM2-135M-Instruct --load-format dummy \
    --max-model-len 2048 --input-len 128 --output-len 512 --enforce-eager --profile-steps 50 \
    --output-json "$out/b1_SmolLM2-135M-Instruct_eager.json" 2>/dev/null | tail -1
  # The host's ceiling with the model math stubbed out: near the measured W1 / B1, host-bound.
  for a in --async-scheduling --no-async-scheduling; do
    python benchmarks/host_overhead.py --device cuda "$a" 2>/dev/null | tail -1 \
      | tee "$out/host_overhead${a#--}.json"
  done
  # What async scheduling buys: the same B1 with each step's update before the next launch.
  pagoda bench latency --model benchmarks/models/SmolLM2-135M-Instruct --load-format dummy \
    --max-model-len 2048 --input-len 128 --output-len 512 --no-async-scheduling \
    --profile-steps 50 --output-json "$out/b1_SmolLM2-135M-Instruct_sync.json" 2>/dev/null | tail -1
fi

if [[ "$what" == quant ]]; then
  for m in Qwen3-0.6B Llama-3.2-1B; do
    for q in fp8 int4; do
      pagoda bench throughput --model "benchmarks/models/$m" --load-format dummy \
        --max-model-len 2048 --quantization "$q" --output-json "$out/w1_${m}_$q.json" \
        2>"$out/w1_${m}_$q.log" | tail -1
      pagoda bench latency --model "benchmarks/models/$m" --load-format dummy \
        --max-model-len 2048 --input-len 128 --output-len 512 --quantization "$q" \
        --output-json "$out/b1_${m}_$q.json" 2>"$out/b1_${m}_$q.log" | tail -1
    done
  done
fi

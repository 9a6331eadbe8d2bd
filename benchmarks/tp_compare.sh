#!/usr/bin/env bash
# Tensor parallelism on this machine: B1 (128-token prompt, 256 greedy tokens) and W-CPU (64
# requests, in/out U[16,256], T = 0.6) at --tensor-parallel-size 1 and 2, back to back, same
# weights (SmolLM2, float32 from the GGUF: TP=2 output equals TP=1's token for token), -O0.
# Usage:
#     benchmarks/tp_compare.sh [OUT_DIR]
# Writes one JSON per run into OUT_DIR (default benchmarks/results/issue19) and prints, then
# writes to OUT_DIR/summary.json, each figure, TP=2 / TP=1, and each rank's step and all-reduce
# time per step.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/issue19}
python=${PYTHON:-$PWD/.venv/bin/python}
mkdir -p "$out"
common=(-q none --max-model-len 2048)
for tp in 1 2; do
    "$python" -m pagoda.cli bench latency "${common[@]}" -tp "$tp" --input-len 128 \
        --output-len 256 --output-json "$out/b1_tp${tp}.json" >/dev/null
    "$python" -m pagoda.cli bench throughput "${common[@]}" -tp "$tp" --num-prompts 64 \
        --input-len-range 16,256 --output-len-range 16,256 \
        --output-json "$out/w_cpu_tp${tp}.json" >/dev/null
done
"$python" - "$out" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
load = lambda name: json.loads((out / name).read_text())
b1 = {tp: load(f"b1_tp{tp}.json") for tp in (1, 2)}
w = {tp: load(f"w_cpu_tp{tp}.json") for tp in (1, 2)}
summary = {
    "bench": "tensor_parallel",
    "note": "same weights (SmolLM2-135M float32 from the GGUF), same workloads, -O0, TP=1 then "
    "TP=2 (2 worker processes of 1 thread each, gloo) on this machine",
    "b1_decode_tok_s": {tp: b1[tp]["pagoda"]["decode_tok_s"] for tp in (1, 2)},
    "b1_ttft_ms": {tp: b1[tp]["pagoda"]["ttft_ms"] for tp in (1, 2)},
    "w_cpu_output_tok_s": {tp: w[tp]["pagoda"]["output_tok_s"] for tp in (1, 2)},
    "b1_tp2_ranks": b1[2].get("tensor_parallel"),
    "w_cpu_tp2_ranks": w[2]["pagoda"].get("tensor_parallel"),
}
for key in ("b1_decode_tok_s", "w_cpu_output_tok_s"):
    summary[key]["ratio_tp2_over_tp1"] = round(summary[key][2] / summary[key][1], 3)
(out / "summary.json").write_text(json.dumps(summary) + "\n")
print(json.dumps(summary))
PY

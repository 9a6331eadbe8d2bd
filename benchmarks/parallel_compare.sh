#!/usr/bin/env bash
# Tensor or pipeline parallelism on this machine: B1 (128-token prompt, 256 greedy tokens) and
# W-CPU (64 requests, in/out U[16,256], T = 0.6) at size 1 and 2, back to back, same weights
# (SmolLM2, float32 from the GGUF: size-2 output equals size-1 output token for token), -O0.
# Size 2 is 2 worker processes of 1 thread each (gloo); size 1 is the engine's process, 2 threads.
# Usage:
#     benchmarks/parallel_compare.sh tp|pp [OUT_DIR]
# Writes one JSON per run into OUT_DIR (default benchmarks/results/issue19 for tp,
# benchmarks/results/issue19/pipeline for pp) and prints, then writes to OUT_DIR/summary.json,
# each figure, size 2 / size 1, and each rank's step time and communication per step.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: parallel_compare.sh tp|pp [OUT_DIR]}
case "$mode" in
    tp) flag=-tp; default_out=benchmarks/results/issue19 ;;
    pp) flag=-pp; default_out=benchmarks/results/issue19/pipeline ;;
    *) echo "mode must be tp or pp" >&2; exit 2 ;;
esac
out=${2:-$default_out}
python=${PYTHON:-$PWD/.venv/bin/python}
mkdir -p "$out"
common=(-q none --max-model-len 2048)
for n in 1 2; do
    "$python" -m pagoda.cli bench latency "${common[@]}" "$flag" "$n" --input-len 128 \
        --output-len 256 --output-json "$out/b1_${mode}${n}.json" >/dev/null
    "$python" -m pagoda.cli bench throughput "${common[@]}" "$flag" "$n" --num-prompts 64 \
        --input-len-range 16,256 --output-len-range 16,256 \
        --output-json "$out/w_cpu_${mode}${n}.json" >/dev/null
done
"$python" - "$out" "$mode" <<'PY'
import json, sys
from pathlib import Path

out, mode = Path(sys.argv[1]), sys.argv[2]
load = lambda name: json.loads((out / name).read_text())
b1 = {n: load(f"b1_{mode}{n}.json") for n in (1, 2)}
w = {n: load(f"w_cpu_{mode}{n}.json") for n in (1, 2)}
what = {"tp": "tensor_parallel", "pp": "pipeline_parallel"}[mode]
summary = {
    "bench": what,
    "note": f"same weights (SmolLM2-135M float32 from the GGUF), same workloads, -O0, "
    f"{mode.upper()}=1 (the engine's process, 2 threads) then {mode.upper()}=2 (2 worker "
    "processes of 1 thread each, gloo) on this machine",
    "b1_decode_tok_s": {n: b1[n]["pagoda"]["decode_tok_s"] for n in (1, 2)},
    "b1_ttft_ms": {n: b1[n]["pagoda"]["ttft_ms"] for n in (1, 2)},
    "w_cpu_output_tok_s": {n: w[n]["pagoda"]["output_tok_s"] for n in (1, 2)},
    "b1_size2_ranks": b1[2].get("parallel"),
    "w_cpu_size2_ranks": w[2]["pagoda"].get("parallel"),
}
for key in ("b1_decode_tok_s", "w_cpu_output_tok_s"):
    summary[key]["ratio_size2_over_size1"] = round(summary[key][2] / summary[key][1], 3)
(out / "summary.json").write_text(json.dumps(summary) + "\n")
print(json.dumps(summary))
PY

#!/usr/bin/env bash
# Tensor, pipeline or prefill context parallelism on this machine, at size 1 and 2, back to back,
# same weights (SmolLM2, float32 from the GGUF: size-2 output equals size-1 output token for
# token), -O0. Size 2 is 2 worker processes of 1 thread each (gloo); size 1 is the engine's
# process, 2 threads.
#   tp, pp: B1 (128-token prompt, 256 greedy tokens) and W-CPU (64 requests, in/out U[16,256],
#           T = 0.6).
#   pcp:    B1 and LONG: a 4096-token prompt (two 2048-token chunks), 64 greedy tokens, 3 times
#           after a warm-up, whose outputs (hashed) must equal size 1's.
# Usage:
#     benchmarks/parallel_compare.sh tp|pp|pcp [OUT_DIR]
# Writes one JSON per run into OUT_DIR (default benchmarks/results/issue19 for tp,
# benchmarks/results/issue19/pipeline for pp, .../context for pcp) and prints, then writes to
# OUT_DIR/summary.json, each figure, size 2 / size 1, and each rank's step time and
# communication per step.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: parallel_compare.sh tp|pp|pcp [OUT_DIR]}
case "$mode" in
    tp) flag=-tp; default_out=benchmarks/results/issue19 ;;
    pp) flag=-pp; default_out=benchmarks/results/issue19/pipeline ;;
    pcp) flag=-pcp; default_out=benchmarks/results/issue19/context ;;
    *) echo "mode must be tp, pp or pcp" >&2; exit 2 ;;
esac
out=${2:-$default_out}
python=${PYTHON:-$PWD/.venv/bin/python}
mkdir -p "$out"
common=(-q none --max-model-len 2048)
for n in 1 2; do
    "$python" -m pagoda.cli bench latency "${common[@]}" "$flag" "$n" --input-len 128 \
        --output-len 256 --output-json "$out/b1_${mode}${n}.json" >/dev/null
    if [ "$mode" = pcp ]; then
        "$python" -m pagoda.cli bench latency -q none --max-model-len 4352 "$flag" "$n" \
            --input-len 4096 --output-len 64 --num-iters 3 --num-iters-warmup 1 \
            --output-json "$out/long_${mode}${n}.json" >/dev/null
    else
        "$python" -m pagoda.cli bench throughput "${common[@]}" "$flag" "$n" --num-prompts 64 \
            --input-len-range 16,256 --output-len-range 16,256 \
            --output-json "$out/w_cpu_${mode}${n}.json" >/dev/null
    fi
done
"$python" - "$out" "$mode" <<'PY'
import json, sys
from pathlib import Path

out, mode = Path(sys.argv[1]), sys.argv[2]
load = lambda name: json.loads((out / name).read_text())
b1 = {n: load(f"b1_{mode}{n}.json") for n in (1, 2)}
what = {"tp": "tensor_parallel", "pp": "pipeline_parallel", "pcp": "prefill_context_parallel"}
what = what[mode]
if mode == "pcp":
    long = {n: load(f"long_{mode}{n}.json") for n in (1, 2)}
    summary = {
        "bench": what,
        "note": "same weights (SmolLM2-135M float32 from the GGUF), same prompts, -O0, PCP=1 "
        "(the engine's process, 2 threads) then PCP=2 (2 worker processes of 1 thread each, "
        "gloo) on this machine; LONG: a 4096-token prompt prefilled in two 2048-token chunks, "
        "64 greedy tokens, median of 3",
        "long_outputs_identical": long[1]["pagoda"]["outputs_sha256"]
        == long[2]["pagoda"]["outputs_sha256"],
        "b1_outputs_identical": b1[1]["pagoda"]["outputs_sha256"]
        == b1[2]["pagoda"]["outputs_sha256"],
        "long_ttft_ms": {n: long[n]["pagoda"]["ttft_ms"] for n in (1, 2)},
        "long_decode_tok_s": {n: long[n]["pagoda"]["decode_tok_s"] for n in (1, 2)},
        "b1_decode_tok_s": {n: b1[n]["pagoda"]["decode_tok_s"] for n in (1, 2)},
        "b1_ttft_ms": {n: b1[n]["pagoda"]["ttft_ms"] for n in (1, 2)},
        "kv_bytes_per_token_per_rank": {
            n: long[n]["pagoda"]["kv_bytes_per_token_per_rank"] for n in (1, 2)
        },
        "kv_bytes_of_the_long_request_per_rank": {
            n: long[n]["pagoda"]["kv_bytes_per_token_per_rank"] * (4096 + 64) for n in (1, 2)
        },
        "long_size2_ranks": long[2].get("parallel"),
    }
    for key in ("long_ttft_ms", "long_decode_tok_s", "b1_decode_tok_s", "b1_ttft_ms"):
        summary[key]["ratio_size2_over_size1"] = round(summary[key][2] / summary[key][1], 3)
    (out / "summary.json").write_text(json.dumps(summary) + "\n")
    print(json.dumps(summary))
    sys.exit(0)
w = {n: load(f"w_cpu_{mode}{n}.json") for n in (1, 2)}
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

#!/usr/bin/env bash
# The cost of speculation where proposals fail: W-CPU (64 requests of random token ids, T = 0.6,
# SmolLM2 Q4_1 GGUF kept quantized, -O2), run without and with n-gram speculation alternately,
# ROUNDS times each, on this machine. Usage:
#     [SPEC='{...}'] [MODEL=FILE] benchmarks/spec_overhead.sh [OUT_DIR] [ROUNDS]
# MODEL: another model than the embedded SmolLM2 (e.g. the 1.5B with its 0.5B draft in SPEC).
# Writes one JSON per run into OUT_DIR (default benchmarks/results/issue18/w_cpu_overhead) and
# prints, then writes to OUT_DIR/summary.json, every run's output tok/s, each side's median and
# best, and speculation / none for both.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/issue18/w_cpu_overhead}
rounds=${2:-3}
python=${PYTHON:-$PWD/.venv/bin/python}
# the copy workload's config by default (benchmarks/README.md); SPEC='{...}' for another
spec=${SPEC:-'{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 3}'}
mkdir -p "$out"

run() {  # run SIDE ROUND [ARGS...]
    local side=$1 round=$2
    shift 2
    "$python" -m pagoda.cli bench throughput -O2 --num-prompts 64 --input-len-range 16,256 \
        --output-len-range 16,256 ${MODEL:+--model "$MODEL"} "$@" --output-json "$out/${side}_${round}.json" >/dev/null
}

for round in $(seq 1 "$rounds"); do
    run none "$round"
    run ngram "$round" --speculative-config "$spec"
done
"$python" - "$out" "$spec" <<'PY'
import json, os, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
sides = {}
for side in ("none", "ngram"):
    records = [json.loads(p.read_text()) for p in sorted(out.glob(f"{side}_*.json"))]
    sides[side] = [r["pagoda"]["output_tok_s"] for r in records]
spec = [json.loads(p.read_text())["pagoda"].get("spec_decode") for p in sorted(out.glob("ngram_*.json"))]
summary = {
    "bench": "spec_overhead_w_cpu",
    "note": "same weights (MODEL, default SmolLM2's Q4_1 GGUF, kept quantized), same workload and -O2, alternately; side 'ngram' runs speculative_config, whatever its method",
    "speculative_config": json.loads(sys.argv[2]),
    "model": os.environ.get("MODEL") or "SmolLM2-135M-Instruct (embedded Q4_1 GGUF)",
    "output_tok_s": sides,
    "median": {s: statistics.median(v) for s, v in sides.items()},
    "best": {s: max(v) for s, v in sides.items()},
    "spec_decode": spec,
}
summary["ratio_median"] = round(summary["median"]["ngram"] / summary["median"]["none"], 3)
summary["ratio_best"] = round(summary["best"]["ngram"] / summary["best"]["none"], 3)
rounds = [round(s / n, 3) for n, s in zip(sides["none"], sides["ngram"])]
summary["ratio_per_round"] = rounds
summary["ratio_per_round_median"] = statistics.median(rounds)
(out / "summary.json").write_text(json.dumps(summary) + "\n")
print(json.dumps(summary))
PY

#!/usr/bin/env bash
# Prefill/decode interference on this machine (issue 19): a decode-heavy stream (4 closed-loop
# clients, 64-token prompts, 128 greedy tokens) plus a 2048-token prompt (8 tokens out) every
# 30 s, for 120 s (DURATION_S, LONG_INTERVAL_S), against
#   colocated:      one `pagoda serve` on both cores (2 threads)
#   disaggregated:  a prefill instance (kv_producer) on core 0 and a decode instance
#                   (kv_consumer) on core 1, one thread each, behind `pagoda proxy`
#   disaggregated_selective: the same, with prompts under 512 tokens sent by the proxy straight
#                   to the decode instance (--min-prefill-tokens 512)
# Same weights (SmolLM2, the GGUF kept quantized), same workload, same SLO. Writes
# OUT_DIR/{colocated,disaggregated,disaggregated_selective}.json and OUT_DIR/summary.json (P50/P99 TPOT and TTFT per
# class, goodput, disaggregated / colocated).
# Usage:
#     benchmarks/disagg_interference.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/issue19/disaggregation}
python=${PYTHON:-$PWD/.venv/bin/python}
mkdir -p "$out"
serve=(-m pagoda.cli serve --max-model-len 4096 --max-num-batched-tokens 512 --uvicorn-log-level warning --disable-log-requests)
bench=(-m pagoda.cli bench interference --duration-s "${DURATION_S:-120}"
       --long-interval-s "${LONG_INTERVAL_S:-30}" --slo-ttft-ms 4000 --slo-tpot-ms 150)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
wait_up() {
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0
        sleep 0.5
    done
    echo "port $1 did not come up" >&2; return 1
}

# colocated
OMP_NUM_THREADS=2 taskset -c 0,1 "$python" "${serve[@]}" --port 8200 > "$out/colocated.log" 2>&1 &
pids+=($!)
wait_up 8200
"$python" "${bench[@]}" --base-url http://127.0.0.1:8200 --label colocated \
    --output-json "$out/colocated.json" >/dev/null
cleanup; pids=()

# disaggregated: LABEL, then pagoda proxy's extra flags
kv() { printf '{"kv_connector": "PagodaConnector", "kv_role": "%s", "kv_port": %d}' "$1" "$2"; }
run_disaggregated() {
    local label=$1; shift
    OMP_NUM_THREADS=1 taskset -c 0 "$python" "${serve[@]}" --port 8201 \
        --kv-transfer-config "$(kv kv_producer 14601)" > "$out/$label.prefill.log" 2>&1 &
    pids+=($!)
    OMP_NUM_THREADS=1 taskset -c 1 "$python" "${serve[@]}" --port 8202 \
        --kv-transfer-config "$(kv kv_consumer 14602)" > "$out/$label.decode.log" 2>&1 &
    pids+=($!)
    wait_up 8201
    wait_up 8202
    "$python" -m pagoda.cli proxy --prefill http://127.0.0.1:8201 --decode http://127.0.0.1:8202 \
        --port 8203 "$@" > "$out/$label.proxy.log" 2>&1 &
    pids+=($!)
    wait_up 8203
    "$python" "${bench[@]}" --base-url http://127.0.0.1:8203 --label "$label" \
        --output-json "$out/$label.json" >/dev/null
    curl -s http://127.0.0.1:8202/metrics | grep '^pagoda:kv_transfer' > "$out/$label.decode_kv_metrics.txt" || true
    curl -s http://127.0.0.1:8203/proxy/stats > "$out/$label.proxy_stats.json" || true
    cleanup; pids=()
}
# every prompt through the prefill instance (vLLM's proxy)
run_disaggregated disaggregated
# prompts under 512 tokens straight to the decode instance
run_disaggregated disaggregated_selective --min-prefill-tokens 512

"$python" - "$out" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
names = ("colocated", "disaggregated", "disaggregated_selective")
runs = {k: json.loads((out / f"{k}.json").read_text()) for k in names}
keys = ("median_tpot_ms", "p99_tpot_ms", "p99_itl_ms", "median_ttft_ms", "p99_ttft_ms",
        "request_goodput", "output_throughput", "completed")
summary = {
    "bench": "disaggregation_interference",
    "note": "same weights (SmolLM2-135M GGUF Q4_1 kept quantized), same workload and SLO "
    "(TTFT <= 4000 ms, TPOT <= 150 ms); colocated: one instance on 2 cores (2 threads); "
    "disaggregated: prefill instance on core 0 + decode instance on core 1 (1 thread each) "
    "behind pagoda proxy, every prompt through the prefill instance (vLLM's proxy); "
    "disaggregated_selective: the same with --min-prefill-tokens 512 (short prompts go to the "
    "decode instance); the proxy and the load generator share the cores",
    "config": runs["colocated"]["config"],
}
for cls in ("decode", "long"):
    summary[cls] = {k: {name: runs[name][cls][k] for name in names} for k in keys}
    for k, v in summary[cls].items():
        a = v["colocated"]
        for name in names[1:]:
            b = v[name]
            if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a:
                v[f"ratio_{name}_over_colocated"] = round(b / a, 3)
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary))
PY

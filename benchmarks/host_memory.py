"""What keeping freed host memory does to a CPU engine (runner/device.py,
keep_freed_host_memory): --runs prefills of one --input-len prompt of random tokens in one
process (the token budget is the prompt, so each is one step), with the memory kept and with
glibc's defaults (PAGODA_CPU_MALLOC=system), each in its own interpreter, alternating --rounds
times; per prefill its seconds, the minor page faults it took and the process's resident MB
after it, as JSON.

    python benchmarks/host_memory.py --model qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --output-json benchmarks/results/issue42/part11/host_memory_prefill2048.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from typing import Any

import psutil

from pagoda.bench.common import write_json
from pagoda.bench.machine import machine_record, pagoda_version

MODES = ("keep", "system")


def _child(model: str | None, input_len: int, runs: int) -> list[dict[str, Any]]:
    from profile_prefill import _prefill_s  # this folder's: one random prompt, prefilled

    from pagoda import LLM

    llm = LLM(
        model,
        max_model_len=input_len + 16,
        max_num_batched_tokens=input_len,
        enable_prefix_caching=False,
    )
    out = []
    for i in range(runs):
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        seconds = _prefill_s(llm, input_len, i)
        out.append(
            {
                "s": round(seconds, 3),
                "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
                "resident_mb": psutil.Process().memory_info().rss >> 20,
            }
        )
    return out


def _run(mode: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    cmd = [sys.executable, __file__, "--child", "--input-len", str(args.input_len)]
    cmd += ["--runs", str(args.runs)] + (["--model", args.model] if args.model else [])
    env = {**os.environ, "PAGODA_CPU_MALLOC": mode}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    runs: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    print(mode, runs, flush=True)
    return runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: SmolLM2)")
    p.add_argument("--input-len", type=int, default=2048)
    p.add_argument("--runs", type=int, default=5, help="prefills per process")
    p.add_argument("--rounds", type=int, default=2, help="processes per mode, alternating")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    if args.child:
        print(json.dumps(_child(args.model, args.input_len, args.runs)))
        return 0
    rounds: list[dict[str, Any]] = []
    for _ in range(args.rounds):
        rounds.append({mode: _run(mode, args) for mode in MODES})
    # the first prefill of a process faults its heap in either way: the steady ones follow
    steady = {m: [r["s"] for rnd in rounds for r in rnd[m][1:]] for m in MODES}
    result = {
        "bench": "host_memory",
        "model": args.model,
        "input_len": args.input_len,
        "method": "each mode in its own process, alternating; steady = every prefill after a "
        "process's first",
        "rounds": rounds,
        "steady_s_median": {m: statistics.median(v) for m, v in steady.items()},
        "steady_s_range": {m: [min(v), max(v)] for m, v in steady.items()},
        "machine": machine_record(),
        "pagoda": pagoda_version(),
    }
    print(json.dumps({k: result[k] for k in ("steady_s_median", "steady_s_range")}))
    if args.output_json:
        write_json(result, args.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

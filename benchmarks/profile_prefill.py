"""Where a prefill goes: one prompt of --input-len random tokens prefilled in one step (the token
budget is the prompt), once to warm up, then once under torch.profiler; the ops by self CPU
time, their share and call counts, as JSON.

    python benchmarks/profile_prefill.py --model qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --input-len 2048 --output-json benchmarks/results/issue42/part3/prefill2048_profile.json
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any

from torch.profiler import ProfilerActivity, profile

from pagoda import LLM, SamplingParams
from pagoda.bench.common import write_json
from pagoda.bench.machine import machine_record, pagoda_version


def _prefill_s(llm: LLM, input_len: int, seed: int) -> float:
    rng = random.Random(seed)
    prompt = [rng.randrange(100, 20000) for _ in range(input_len)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: SmolLM2)")
    p.add_argument("--input-len", type=int, default=2048)
    p.add_argument("--top", type=int, default=12, help="ops kept in the JSON")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    llm = LLM(
        args.model,
        max_model_len=args.input_len + 16,
        max_num_batched_tokens=args.input_len,
        enable_prefix_caching=False,
    )
    warm_s = _prefill_s(llm, args.input_len, 1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled_s = _prefill_s(llm, args.input_len, 2)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total_us = sum(e.self_cpu_time_total for e in events)
    ops: list[dict[str, Any]] = [
        {
            "op": e.key,
            "self_s": round(e.self_cpu_time_total / 1e6, 3),
            "share": round(e.self_cpu_time_total / total_us, 4),
            "calls": e.count,
        }
        for e in events[: args.top]
    ]
    for op in ops:
        print(f"{op['op']:40s} {op['self_s']:9.3f} s {100 * op['share']:6.2f}% {op['calls']:5d}")
    record = {
        "bench": "profile_prefill",
        "model": args.model or "SmolLM2-135M-Instruct (embedded Q4_1 GGUF)",
        "input_len": args.input_len,
        "warm_prefill_s": round(warm_s, 2),
        "warm_prefill_tok_s": round(args.input_len / warm_s, 1),
        "profiled_prefill_s": round(profiled_s, 2),
        "profiled_self_cpu_s": round(total_us / 1e6, 2),
        "ops_by_self_cpu": ops,
        "machine": machine_record(),
        "pagoda": pagoda_version(),
    }
    if args.output_json:
        write_json(record, args.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

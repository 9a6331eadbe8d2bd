"""How far pagoda's outputs move with the scheduling, on a model and path of your choice
(docs/determinism.md): greedy chat answers of each prompt alone (no prefix caching, a roomy pool)
against the same prompts all in one call, under chunked prefill, with prefix caching, async
scheduling, preemption, n-gram speculation and tensor parallelism. For each variation: how many
answers differ in any token, and the largest |logprob difference| of a chosen token before the
first difference (0 where the runs agree bit for bit).

    python benchmarks/determinism.py --output-json benchmarks/results/issue39/determinism.json
    python benchmarks/determinism.py -q none          # the float path
    python benchmarks/determinism.py -q none --dtype bfloat16
    PAGODA_CPU_KERNELS=0 python benchmarks/determinism.py   # torch's quantized ops
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from pagoda.bench.common import write_json

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis briefly.",
    "List three prime numbers.",
    "Who wrote Hamlet?",
    "Give me a tip for learning Python.",
    "What is 17 times 3?",
    "Describe a cat in two sentences.",
]

# name -> (engine arguments over the base ones, whether the prompts go in one call)
VARIATIONS: dict[str, tuple[dict[str, Any], bool]] = {
    "batch": ({}, True),
    "chunked_prefill_32": ({"max_num_batched_tokens": 32}, False),
    "chunked_prefill_32_batch": ({"max_num_batched_tokens": 32}, True),
    "prefix_caching": ({"enable_prefix_caching": True}, True),
    "async_scheduling": ({"async_scheduling": True}, True),
    "preemption": ({"num_gpu_blocks_override": 24}, True),
    "ngram_speculation": (
        {
            "speculative_config": {
                "method": "ngram",
                "num_speculative_tokens": 5,
                "prompt_lookup_min": 2,
                "prompt_lookup_max": 3,
            }
        },
        False,
    ),
    "tensor_parallel_2": ({"tensor_parallel_size": 2}, True),
}


def compare(alone: list[Any], other: list[Any]) -> dict[str, Any]:
    """Answers differing in any token, and the largest |logprob difference| of a chosen token
    on the prefix both runs share."""
    differ, worst = 0, 0.0
    for a, b in zip(alone, other, strict=True):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        same = 0
        while same < min(len(ta), len(tb)) and ta[same] == tb[same]:
            same += 1
        differ += ta != tb
        for i in range(same):
            la = a.outputs[0].logprobs[i][ta[i]].logprob
            lb = b.outputs[0].logprobs[i][tb[i]].logprob
            worst = max(worst, abs(la - lb))
    return {"answers_differing": differ, "max_abs_logprob_diff": worst}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    parser.add_argument("-q", "--quantization", default=None)
    parser.add_argument("--dtype", default="auto", help="with -q none: bfloat16, float16")
    parser.add_argument("-O", "--optimization-level", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--only", default=None, help="comma-separated variations")
    parser.add_argument("--output-json")
    args = parser.parse_args()

    from pagoda import LLM, SamplingParams

    base: dict[str, Any] = {
        "quantization": args.quantization,
        "dtype": args.dtype,
        "optimization_level": args.optimization_level,
        "enable_prefix_caching": False,
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=1)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]

    def run(llm: Any, together: bool) -> list[Any]:
        if together:
            return list(llm.chat(chats, params, use_tqdm=False))
        return [llm.chat([c], params, use_tqdm=False)[0] for c in chats]

    def engine(extra: dict[str, Any]) -> Any:
        return LLM(args.model, **(base | extra))

    alone = run(engine({}), together=False)
    names = args.only.split(",") if args.only else list(VARIATIONS)
    results: dict[str, Any] = {}
    for name in names:
        extra, together = VARIATIONS[name]
        t0 = time.perf_counter()
        llm = engine(extra)
        results[name] = compare(alone, run(llm, together)) | {"engine_args": extra}
        del llm
        r = results[name]
        print(
            f"{name:26s} {r['answers_differing']}/{len(PROMPTS)} answers differ, "
            f"max |dlogprob| {r['max_abs_logprob_diff']:.3g} ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    out = {
        "bench": "determinism",
        "model": args.model or "SmolLM2-135M-Instruct (embedded Q4_1 GGUF)",
        "quantization": args.quantization,
        "dtype": args.dtype,
        "optimization_level": args.optimization_level,
        "cpu_kernels": os.environ.get("PAGODA_CPU_KERNELS", "1") != "0",
        "reference": "each prompt alone, prefix caching off, a roomy KV pool",
        "prompts": len(PROMPTS),
        "max_tokens": args.max_tokens,
        "variations": results,
    }
    if args.output_json:
        write_json(out, args.output_json)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The cost of structured outputs per engine step: W-CPU (64 requests, in/out U[16,256], seed 0,
T = 0.6, ignore_eos) run twice on the same engine arguments, once as is and once with a JSON
schema on every request, on SmolLM2 (the embedded Q4_1 GGUF).

The schema is an array of integers of any length. A sample whose array closes ends there, so
the structured run goes first and the plain run then asks each request for exactly as many
tokens as its structured run produced: both runs produce the same tokens' count per request in
the same number of steps, and the difference in time is the grammar's (masks computed by
llguidance, applied to the logits, matchers advanced). Every structured output is checked: a
fresh matcher of the schema accepts all its tokens.

    python benchmarks/structured_overhead.py --output-json \
        benchmarks/results/issue21/structured_overhead.json
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from typing import Any

from pagoda.bench.common import random_workload, write_json

SCHEMA = {"type": "array", "items": {"type": "integer"}}


def run(
    structured: bool, requests: list[Any], lengths: list[int], temperature: float
) -> tuple[dict[str, Any], list[int]]:
    from pagoda.client.llm import LLM
    from pagoda.sampling_params import SamplingParams

    so = {"json": SCHEMA} if structured else None
    llm = LLM()

    def params(n: int) -> SamplingParams:
        return SamplingParams(
            temperature=temperature, max_tokens=n, ignore_eos=True, structured_outputs=so
        )

    # Warm-up (the tokenizer's llguidance form and the grammar are built here).
    llm.generate([{"prompt_token_ids": [7] * 32}] * 4, params(8), use_tqdm=False)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    steps_before = llm.engine.scheduler.step_id
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, [params(n) for n in lengths], use_tqdm=False)
    elapsed = time.perf_counter() - t0
    steps = llm.engine.scheduler.step_id - steps_before
    tokens = [o.outputs[0].token_ids for o in outputs]
    result: dict[str, Any] = {
        "structured_outputs": so,
        "elapsed_s": round(elapsed, 2),
        "steps": steps,
        "output_tokens": sum(len(t) for t in tokens),
        "output_tok_s": round(sum(len(t) for t in tokens) / elapsed, 2),
        "ms_per_step": round(elapsed / steps * 1000, 2),
    }
    if structured:
        result["outputs_inside_the_grammar"] = outputs_follow_the_schema(llm, tokens)
    del llm
    gc.collect()
    return result, [len(t) for t in tokens]


def outputs_follow_the_schema(llm: Any, tokens: list[list[int]]) -> bool:
    from pagoda.engine.grammar import GrammarCompiler
    from pagoda.structured_outputs import StructuredOutputsParams

    compiler = GrammarCompiler(
        lambda: llm.tokenizer, llm.engine.model_config.vocab_size, llm.engine.eos_token_ids
    )
    template = compiler.compile(StructuredOutputsParams(json=SCHEMA)).result()
    ok = all(template.deep_copy().consume_tokens(t) for t in tokens)
    compiler.shutdown()
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    requests = random_workload(args.num_prompts, (16, 256), (16, 256), seed=0)
    schema, lengths = run(True, requests, [r.output_len for r in requests], args.temperature)
    plain, plain_lengths = run(False, requests, lengths, args.temperature)
    record = {
        "bench": "structured_overhead",
        "model": "SmolLM2-135M-Instruct Q4_1 (embedded), -O0, 2-core CPU",
        "workload": f"W-CPU: {args.num_prompts} requests, in/out U[16,256], seed 0, "
        f"T={args.temperature}, ignore_eos; the same tokens and steps in both runs",
        "plain": plain,
        "json_schema": schema,
        "overhead_ms_per_step": round(schema["ms_per_step"] - plain["ms_per_step"], 2),
        "overhead_fraction": round(schema["elapsed_s"] / plain["elapsed_s"] - 1, 4),
        "same_tokens_counted": plain_lengths == lengths,
        "steps_equal": plain["steps"] == schema["steps"],
    }
    print(record, flush=True)
    if args.output_json:
        write_json(record, args.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

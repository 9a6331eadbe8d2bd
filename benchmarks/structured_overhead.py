"""The cost of structured outputs per engine step: W-CPU (64 requests, in/out U[16,256], seed 0,
T = 0.6, ignore_eos) run with a JSON schema on every request and without, on SmolLM2 (the
embedded Q4_1 GGUF), alternately (ABBA: schema, plain, plain, schema, ... for --rounds rounds)
so drift and warm-up weigh on both sides alike.

The schema is an array of integers of any length. A sample whose array closes ends there, so
the first structured run fixes each request's token count and every later run asks for exactly
that many tokens: all runs produce the same tokens' count per request in the same number of
steps, and the difference in time is the grammar's (masks computed by llguidance, applied to
the logits, matchers advanced). Besides the wall-clock difference, the structured runs time the
grammar's own work directly (StructuredOutputs.bitmasks and accept, apply_grammar_bitmask),
which run-to-run noise does not blur. Every structured output is checked: a fresh matcher of
the schema accepts all its tokens.

    python benchmarks/structured_overhead.py --output-json \
        benchmarks/results/issue21/structured_overhead.json
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
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
    timers, untime = _time_grammar_work(llm) if structured else ({}, lambda: None)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, [params(n) for n in lengths], use_tqdm=False)
    elapsed = time.perf_counter() - t0
    untime()
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
        result["grammar_ms_per_step"] = {k: round(v / steps * 1000, 3) for k, v in timers.items()}
        result["outputs_inside_the_grammar"] = outputs_follow_the_schema(llm, tokens)
    del llm
    gc.collect()
    return result, [len(t) for t in tokens]


def _time_grammar_work(llm: Any) -> tuple[dict[str, float], Callable[[], None]]:
    """Wrap the engine's grammar calls with timers (seconds spent in each, summed), and the
    function that unwraps them."""
    import pagoda.runner.model_runner as model_runner

    totals = {"masks": 0.0, "apply": 0.0, "accept": 0.0}
    structured = llm.engine.structured
    apply = model_runner.apply_grammar_bitmask

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - t0

        return wrapper

    structured.bitmasks = timed("masks", structured.bitmasks)
    structured.accept = timed("accept", structured.accept)
    model_runner.apply_grammar_bitmask = timed("apply", apply)

    def untime() -> None:
        model_runner.apply_grammar_bitmask = apply

    return totals, untime


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
    p.add_argument("--rounds", type=int, default=2, help="ABBA rounds (2 runs per side each)")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    requests = random_workload(args.num_prompts, (16, 256), (16, 256), seed=0)
    first, lengths = run(True, requests, [r.output_len for r in requests], args.temperature)
    runs: dict[str, list[dict[str, Any]]] = {"json_schema": [first], "plain": []}
    same = True
    order = ["plain", "plain", "json_schema"] + ["json_schema", "plain", "plain", "json_schema"] * (
        args.rounds - 1
    )
    for side in order:
        result, got = run(side == "json_schema", requests, lengths, args.temperature)
        same = same and got == lengths
        runs[side].append(result)
        print(side, result, flush=True)
    plain_ms = statistics.median(r["ms_per_step"] for r in runs["plain"])
    schema_ms = statistics.median(r["ms_per_step"] for r in runs["json_schema"])
    grammar_ms = statistics.median(
        sum(r["grammar_ms_per_step"].values()) for r in runs["json_schema"]
    )
    record = {
        "bench": "structured_overhead",
        "model": "SmolLM2-135M-Instruct Q4_1 (embedded), -O0, 2-core CPU",
        "workload": f"W-CPU: {args.num_prompts} requests, in/out U[16,256], seed 0, "
        f"T={args.temperature}, ignore_eos; the same tokens and steps in every run",
        "order": ["json_schema", *order],
        "plain": runs["plain"],
        "json_schema": runs["json_schema"],
        "median_ms_per_step": {"plain": plain_ms, "json_schema": schema_ms},
        "overhead_ms_per_step": round(schema_ms - plain_ms, 2),
        "overhead_fraction": round(schema_ms / plain_ms - 1, 4),
        "grammar_work_ms_per_step": round(grammar_ms, 3),
        "grammar_work_fraction": round(grammar_ms / plain_ms, 4),
        "same_tokens_counted": same,
        "steps_equal": len({r["steps"] for r in runs["plain"] + runs["json_schema"]}) == 1,
    }
    print(record, flush=True)
    if args.output_json:
        write_json(record, args.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

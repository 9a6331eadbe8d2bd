"""What a speculative verification step costs on this CPU, by the number of rows it verifies:
batch 1, SmolLM2's GGUF at -O2, a step of k drafts runs k + 1 one-token rows (the compiled
decode path). A draft that is accepted saves a whole plain step, so a proposer pays off where
the acceptance it expects beats these ratios.

The drafts come from the plain engine's own greedy output (every one is accepted), so each
verification step has exactly k + 1 rows; k cycles through --ks for --rounds rounds in one
engine, and the median step time per row count is set against the plain one-row step.

    python benchmarks/verify_rows.py --output-json benchmarks/results/issue18/verify_rows.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from pagoda.bench.common import write_json

PROMPT = list(range(1000, 1200))  # 200 token ids
MAX_TOKENS = 120


class Continuation:
    """Proposes the plain run's next k tokens (a stand-in for prompt lookup that never misses);
    keeps no per-request state."""

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.prompt, self.output, self.k = prompt, output, 1

    def propose(self, requests: Sequence[tuple[str, Sequence[int], int]]) -> list[list[int]]:
        drafts = []
        for _, tokens, allowed in requests:
            done = len(tokens) - len(self.prompt)
            drafts.append(list(self.output[done : done + min(self.k, allowed)]))
        return drafts

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        pass

    def remove(self, request_id: str) -> None:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ks", default="0,1,2,3,4,5,6,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-json")
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]

    from pagoda.client.llm import LLM
    from pagoda.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = [{"prompt_token_ids": PROMPT}]
    plain = LLM(None, optimization_level=2, seed=0, num_gpu_blocks_override=256)
    output = list(plain.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
    del plain
    spec = {"method": "ngram", "num_speculative_tokens": max(ks), "prompt_lookup_min": 1}
    llm = LLM(
        None, optimization_level=2, seed=0, num_gpu_blocks_override=256, speculative_config=spec
    )
    runner = llm.engine.executor.runner
    assert runner.proposer is not None
    proposer = Continuation(PROMPT, output)
    runner.proposer.proposer = proposer  # type: ignore[assignment]
    times: dict[int, list[float]] = {}
    execute = runner.execute

    def timed(out: Any) -> Any:
        t0 = time.perf_counter()
        result = execute(out)
        # decode and verification steps only: a prefill (the prompt's uncached tail, after the
        # first run) has several rows and no drafts
        if len(out.scheduled) == 1:
            step = out.scheduled[0]
            if len(step.token_ids) == 1 + step.num_draft_tokens and step.start > 0:
                times.setdefault(len(step.token_ids), []).append(time.perf_counter() - t0)
        return result

    runner.execute = timed  # type: ignore[method-assign]
    for _ in range(args.rounds):
        for k in ks:
            proposer.k = k
            got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
            assert list(got) == output, "drafts changed the greedy output"
    one = statistics.median(times[1])
    table = []
    for rows in sorted(times):
        ms = statistics.median(times[rows]) * 1e3
        row = {
            "rows": rows,
            "steps": len(times[rows]),
            "step_ms": round(ms, 2),
            "of_one_row": round(ms / (one * 1e3), 3),
            "ms_per_token_all_accepted": round(ms / rows, 2),
        }
        table.append(row)
        print(row, file=sys.stderr, flush=True)
    record = {
        "bench": "verify_rows",
        "model": "SmolLM2-135M-Instruct (embedded Q4_1 GGUF), -O2, batch 1",
        "workload": {"prompt_len": len(PROMPT), "max_tokens": MAX_TOKENS, "ks": ks},
        "rounds": args.rounds,
        "rows": table,
    }
    print(json.dumps(record))
    if args.output_json:
        write_json(record, args.output_json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

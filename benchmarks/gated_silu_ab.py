"""A burst's prompts with the gate | up projection's SiLU in its own call (q4x16_matmul_norm_silu,
Linear.gated_after_norm) against the separate calls (the norm and matmul, then SiLU inside the
down projection's call), in one engine, one process, alternately: the A side is the tree as it
is, the B side replaces Linear.gated_after_norm by one that declines, which is the decoder
layer's path without the fusion. Prefill steps run eagerly at every -O level, so the switch
takes effect at once. The first tokens of both sides must agree (the same bits).

    python benchmarks/gated_silu_ab.py --rounds 8 --output-json ab.json   # the embedded SmolLM2
    python benchmarks/gated_silu_ab.py --model /path/to/qwen2.5-coder-1.5b.gguf --rounds 4

One process, because this 2-vCPU machine moves 20-40% from one run to the next. Each round is
a new burst (64 prompts of U[16, 256] random tokens, max_tokens 1), run by both sides in turn,
the order alternating; the ratio is separate / fused prompt tokens a second per round.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from typing import Any

from pagoda import LLM, SamplingParams
from pagoda.bench.common import write_json
from pagoda.bench.machine import machine_record, pagoda_version
from pagoda.layers import linear


def _declined(self: Any, *args: Any, **kwargs: Any) -> None:
    return None


def burst(seed: int, prompts: int) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(rng.randint(16, 256))]}
        for _ in range(prompts)
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: embedded SmolLM2)")
    parser.add_argument("-O", "--optimization-level", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    llm = LLM(
        args.model,
        optimization_level=args.optimization_level,
        enable_prefix_caching=False,
        max_model_len=1024,
    )
    fused = linear.Linear.gated_after_norm
    sides = {"fused": fused, "separate": _declined}
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def run(side: str, prompts: list[dict[str, list[int]]]) -> tuple[float, list[Any]]:
        linear.Linear.gated_after_norm = sides[side]  # type: ignore[method-assign]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]

    first = burst(1, args.prompts)
    same = run("fused", first)[1] == run("separate", first)[1]
    rounds = []
    for i in range(args.rounds):
        prompts = burst(10 + i, args.prompts)
        tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        order = ("fused", "separate") if i % 2 == 0 else ("separate", "fused")
        tok_s = {side: tokens / run(side, prompts)[0] for side in order}
        rounds.append({"prompt_tokens": tokens, **{k: round(v, 1) for k, v in tok_s.items()}})
        rounds[-1]["ratio"] = round(tok_s["fused"] / tok_s["separate"], 3)
        print(rounds[-1], flush=True)
    linear.Linear.gated_after_norm = fused  # type: ignore[method-assign]
    ratios = [r["ratio"] for r in rounds]
    record = {
        "benchmark": "gated_silu_ab",
        "method": (
            "one engine in one process; each round a new burst run by both sides in turn, "
            "the order alternating; ratio = fused / separate prompt tok/s per round"
        ),
        "model": args.model or "embedded SmolLM2-135M Q4_1",
        "optimization_level": args.optimization_level,
        "first_tokens_equal": same,
        "rounds": rounds,
        "ratio_median": round(statistics.median(ratios), 3),
        "ratio_range": [min(ratios), max(ratios)],
        "pagoda": pagoda_version(),
        "machine": machine_record(),
    }
    print({k: record[k] for k in ("first_tokens_equal", "ratio_median", "ratio_range")})
    if args.output_json:
        write_json(record, args.output_json)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

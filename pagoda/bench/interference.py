"""Prefill/decode interference against any OpenAI-compatible endpoint (a `pagoda serve`, or a
`pagoda proxy` in front of prefill and decode instances): a decode-heavy stream (closed-loop
clients, short prompts, long outputs) while long prompts arrive periodically. Reports each
class's TTFT / TPOT / ITL percentiles and goodput under an SLO: how much a long prompt's prefill
stalls its neighbours' decode."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from pagoda.bench.common import emit, log
from pagoda.bench.serve import check_server
from pagoda.bench.serve_client import (
    RequestConfig,
    RequestResult,
    auth_headers,
    count_output_tokens,
    first_model_id,
    http_client,
    send_request,
)
from pagoda.bench.serve_prompts import ServeRequest, build_requests, load_bench_tokenizer
from pagoda.bench.serve_stats import summarize

NAME = "interference"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--tokenizer", default=None, help="HF folder or .gguf (default: SmolLM2)")
    parser.add_argument("--label", default=None)
    parser.add_argument("--duration-s", type=float, default=90.0)
    parser.add_argument("--decode-clients", type=int, default=4, help="closed-loop decode clients")
    parser.add_argument("--decode-input-len", type=int, default=64)
    parser.add_argument("--decode-output-len", type=int, default=128)
    parser.add_argument("--long-input-len", type=int, default=2048)
    parser.add_argument("--long-output-len", type=int, default=8)
    parser.add_argument("--long-interval-s", type=float, default=10.0, help="a long prompt every")
    parser.add_argument("--slo-ttft-ms", type=float, default=None)
    parser.add_argument("--slo-tpot-ms", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)


async def _run(
    args: argparse.Namespace,
    cfg: RequestConfig,
    decode: list[ServeRequest],
    long: list[ServeRequest],
) -> tuple[list[RequestResult], list[RequestResult], float]:
    decode_results: list[RequestResult] = []
    long_results: list[RequestResult] = []
    async with http_client() as client:
        start = time.perf_counter()
        end = start + args.duration_s

        async def decode_client(i: int) -> None:
            k = i
            while time.perf_counter() < end:
                result = await send_request(client, decode[k % len(decode)], cfg)
                result.start -= start
                decode_results.append(result)
                k += args.decode_clients

        async def long_prompts() -> None:
            tasks = []
            for k, req in enumerate(long):
                at = start + (k + 0.5) * args.long_interval_s
                if at >= end:
                    break
                await asyncio.sleep(max(0.0, at - time.perf_counter()))
                tasks.append(asyncio.create_task(send_request(client, req, cfg)))
            for result in await asyncio.gather(*tasks):
                result.start -= start
                long_results.append(result)

        await asyncio.gather(
            long_prompts(), *(decode_client(i) for i in range(args.decode_clients))
        )
        duration = time.perf_counter() - start
    return decode_results, long_results, duration


def main(args: argparse.Namespace) -> int:
    tokenizer = load_bench_tokenizer(args.tokenizer)
    headers = auth_headers(None)
    model = first_model_id(args.base_url, headers)
    cfg = RequestConfig(
        url=args.base_url.rstrip("/") + "/v1/completions",
        endpoint="/v1/completions",
        model=model,
        temperature=0.0,
        ignore_eos=True,
        logit_bias=None,
        extra_body=None,
        headers=headers,
    )
    num_long = int(args.duration_s // args.long_interval_s) + 1
    decode = build_requests(
        tokenizer,
        64,
        (args.decode_input_len, args.decode_input_len),
        (args.decode_output_len, args.decode_output_len),
        seed=args.seed,
    )
    long = build_requests(
        tokenizer,
        num_long,
        (args.long_input_len, args.long_input_len),
        (args.long_output_len, args.long_output_len),
        seed=args.seed + 1,
    )
    warm = check_server(decode, cfg)
    if not warm.success:
        log(f"error: the test request failed: {warm.error}")
        return 1
    decode_results, long_results, duration = asyncio.run(_run(args, cfg, decode, long))
    count_output_tokens(decode_results + long_results, tokenizer)
    slo = (args.slo_ttft_ms, args.slo_tpot_ms)
    record: dict[str, Any] = {
        "bench": NAME,
        "label": args.label,
        "model": model,
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "decode": summarize(decode_results, duration, *slo),
        "long": summarize(long_results, duration, *slo),
        "all": summarize(decode_results + long_results, duration, *slo),
    }
    emit(record, None)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(record, f)
            f.write("\n")
    return 0

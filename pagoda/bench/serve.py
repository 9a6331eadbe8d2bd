"""Online serving load generator for any OpenAI-compatible server (pagoda, vLLM, llama.cpp):
seeded random-token prompts, Poisson arrivals and/or a concurrency cap, streamed responses;
TTFT / TPOT / ITL / E2E percentiles, throughput and goodput; JSON and PNG plots."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import time
from collections.abc import Sequence
from typing import Any

from pagoda.bench.common import emit, log, parse_range
from pagoda.bench.serve_client import (
    RequestConfig,
    RequestResult,
    auth_headers,
    count_output_tokens,
    first_model_id,
    http_client,
    send_request,
)
from pagoda.bench.serve_plots import plot_cdfs, plot_sweep
from pagoda.bench.serve_prompts import (
    ServeRequest,
    build_requests,
    load_bench_tokenizer,
    special_token_ids,
)
from pagoda.bench.serve_stats import request_records, summarize

NAME = "serve"


# ---- arguments -----------------------------------------------------------------------------
def parse_rates(text: str) -> list[float]:
    """argparse type for "r1,r2,...": positive request rates ("inf" allowed)."""
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected r1,r2,... (numbers), got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"request rates must be > 0, got {text!r}")
    return rates


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _server_arguments(parser)
    _workload_arguments(parser)
    _load_arguments(parser)
    _output_arguments(parser)


def _server_arguments(parser: argparse.ArgumentParser) -> None:
    s = parser.add_argument_group("server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000")
    s.add_argument(
        "--endpoint",
        default="/v1/completions",
        choices=["/v1/completions", "/v1/chat/completions"],
    )
    s.add_argument("--model", default=None, help="model name to send (default: GET /v1/models)")
    s.add_argument(
        "--tokenizer",
        default=None,
        help="HF folder or .gguf file to build prompts and count tokens with (default: SmolLM2)",
    )
    s.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    s.add_argument("--label", default=None, help="name of the system under test (in the JSON)")


def _workload_arguments(parser: argparse.ArgumentParser) -> None:
    w = parser.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=64)
    w.add_argument("--input-len-range", type=parse_range, default=(64, 256), metavar="A,B")
    w.add_argument("--output-len-range", type=parse_range, default=(64, 128), metavar="A,B")
    w.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="every prompt starts with the same L tokens (prefix caching)",
    )
    w.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals")
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send ignore_eos and min_tokens = max_tokens (vLLM's extension fields), so every "
        "request runs to its output length",
    )
    w.add_argument(
        "--logit-bias-eos",
        action="store_true",
        help="send logit_bias -100 on the tokenizer's special tokens (every end-of-generation "
        "id) instead of min_tokens: what keeps llama-cpp-python's server from stopping early",
    )
    w.add_argument(
        "--extra-body",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="extra fields merged into every request body, e.g. '{\"repeat_penalty\": 1.0}'",
    )


def _load_arguments(parser: argparse.ArgumentParser) -> None:
    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s with Poisson arrivals (default inf: all at once)",
    )
    load.add_argument("--max-concurrency", type=int, default=None, help="cap of in-flight requests")
    load.add_argument(
        "--sweep-rates",
        type=parse_rates,
        default=None,
        metavar="R1,R2,...",
        help="run once per request rate, same prompts each time (overrides --request-rate)",
    )
    load.add_argument("--slo-ttft-ms", type=float, default=None)
    load.add_argument("--slo-tpot-ms", type=float, default=None)


def _output_arguments(parser: argparse.ArgumentParser) -> None:
    o = parser.add_argument_group("output")
    o.add_argument(
        "--output-json",
        default=None,
        help="write the full result (config, summaries, per-request latencies) here",
    )
    o.add_argument("--plot-dir", default=None, help="write latency CDFs (and sweep plots) here")
    o.add_argument("--disable-tqdm", action="store_true")


def check_args(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.shared_prefix_len < 0:
        raise ValueError(f"--shared-prefix-len must be >= 0, got {args.shared_prefix_len}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        raise ValueError("--extra-body must be a JSON object, e.g. '{\"top_k\": 1}'")


# ---- load ----------------------------------------------------------------------------------
def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: a Poisson process at `rate` requests/s (the first
    request at 0); all zero for rate inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    times = [0.0]
    for _ in range(n - 1):
        times.append(times[-1] + rng.expovariate(rate))
    return times


async def run_load(
    requests: Sequence[ServeRequest],
    cfg: RequestConfig,
    rate: float,
    max_concurrency: int | None,
    seed: int,
    disable_tqdm: bool = False,
) -> tuple[list[RequestResult], float]:
    """All requests at their arrival times, at most max_concurrency in flight; time spent waiting
    for a slot is not latency (it is not the server's). Returns (results, duration_s)."""
    from tqdm.auto import tqdm

    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    times = arrival_times(len(requests), rate, seed)
    desc = f"rate {rate:g}" + (f", concurrency {max_concurrency}" if max_concurrency else "")
    pbar = tqdm(total=len(requests), desc=desc, disable=disable_tqdm)
    async with http_client() as client:
        start = time.perf_counter()

        async def one(req: ServeRequest, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            if sem is None:
                result = await send_request(client, req, cfg)
            else:
                async with sem:
                    result = await send_request(client, req, cfg)
            result.start -= start
            pbar.update(1)
            return result

        results = await asyncio.gather(*(one(r, t) for r, t in zip(requests, times)))
        duration = time.perf_counter() - start
    pbar.close()
    return list(results), duration


# ---- main ----------------------------------------------------------------------------------
def request_config(args: argparse.Namespace, model: str, tokenizer: Any) -> RequestConfig:
    headers = auth_headers(args.api_key)
    bias = None
    if args.logit_bias_eos:
        bias = {str(i): -100.0 for i in special_token_ids(tokenizer)}
    return RequestConfig(
        url=args.base_url.rstrip("/") + args.endpoint,
        endpoint=args.endpoint,
        model=model,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        logit_bias=bias,
        extra_body=args.extra_body,
        headers=headers,
    )


def run_config(
    args: argparse.Namespace, cfg: RequestConfig, requests: list[ServeRequest]
) -> dict[str, Any]:
    return {
        "label": args.label,
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "model": cfg.model,
        "num_prompts": len(requests),
        "input_len_range": list(args.input_len_range),
        "output_len_range": list(args.output_len_range),
        "shared_prefix_len": args.shared_prefix_len,
        "seed": args.seed,
        "temperature": args.temperature,
        "ignore_eos": args.ignore_eos,
        "logit_bias_eos": args.logit_bias_eos,
        "extra_body": args.extra_body,
        "max_concurrency": args.max_concurrency,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
        "num_prompt_tokens": sum(r.prompt_len for r in requests),
        "num_output_tokens_asked": sum(r.output_len for r in requests),
    }


def rate_key(rate: float) -> float | str:
    """JSON has no inf: an infinite rate is written "inf"."""
    return "inf" if math.isinf(rate) else rate


def rate_label(rate: float | str) -> str:
    return f"{float(rate):g} req/s"


def workload_prompts(
    args: argparse.Namespace, tokenizer: Any, seed: int, n: int
) -> list[ServeRequest]:
    """n requests of the workload flags (--input-len-range, --output-len-range,
    --shared-prefix-len) drawn with `seed`."""
    return build_requests(
        tokenizer,
        n,
        args.input_len_range,
        args.output_len_range,
        seed=seed,
        shared_prefix_len=args.shared_prefix_len,
    )


def check_server(requests: list[ServeRequest], cfg: RequestConfig) -> RequestResult:
    """One short request before the timed runs: checks the setup and warms the server."""

    async def go() -> RequestResult:
        async with http_client() as client:
            return await send_request(client, requests[0], cfg, max_tokens=4)

    return asyncio.run(go())


def run_rate(
    args: argparse.Namespace,
    tokenizer: Any,
    requests: list[ServeRequest],
    cfg: RequestConfig,
    rate: float,
) -> dict[str, Any]:
    """One timed run: {"summary": ..., "requests": per-request records}."""
    results, duration = asyncio.run(
        run_load(requests, cfg, rate, args.max_concurrency, args.seed, args.disable_tqdm)
    )
    count_output_tokens(results, tokenizer)
    summary = {
        "request_rate": rate_key(rate),
        "max_concurrency": args.max_concurrency,
        **summarize(results, duration, args.slo_ttft_ms, args.slo_tpot_ms),
    }
    return {"summary": summary, "requests": request_records(results)}


def main(args: argparse.Namespace) -> int:
    check_args(args)
    tokenizer = load_bench_tokenizer(args.tokenizer)
    headers = auth_headers(args.api_key)
    try:
        model = args.model or first_model_id(args.base_url, headers)
    except Exception as e:
        log(f"error: cannot list models at {args.base_url} ({e}); is the server up?")
        return 1
    cfg = request_config(args, model, tokenizer)

    def prompts(seed: int, n: int = args.num_prompts) -> list[ServeRequest]:
        return workload_prompts(args, tokenizer, seed, n)

    # The test request's prompt is none of the runs' (it would be a prefix cache hit), and the
    # i-th rate of a sweep sends the prompts of seed + i: prompts a run before it sent would be
    # served from the prefix cache, flattering every rate after the first.
    check = check_server(prompts(args.seed - 1, 1), cfg)
    if not check.success:
        log(f"error: the test request to {cfg.url} failed: {check.error}")
        return 1
    rates = args.sweep_rates or [args.request_rate]
    runs = [
        run_rate(args, tokenizer, prompts(args.seed + i), cfg, rate) for i, rate in enumerate(rates)
    ]
    config = run_config(args, cfg, prompts(args.seed))
    head: dict[str, Any] = {
        "bench": NAME,
        "label": args.label,
        "model": model,
        "endpoint": args.endpoint,
    }
    if args.sweep_rates:
        line = {**head, "sweep": [r["summary"] for r in runs]}
    else:
        line = {**head, **runs[0]["summary"]}
    emit(line, None)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"bench": NAME, "config": config, "runs": runs}, f)
            f.write("\n")
    if args.plot_dir:
        write_plots(runs, args.plot_dir, args.label or model, bool(args.sweep_rates))
    return 0


def write_plots(runs: list[dict[str, Any]], plot_dir: str, name: str, sweep: bool) -> list[str]:
    os.makedirs(plot_dir, exist_ok=True)
    series = {rate_label(r["summary"]["request_rate"]): r["requests"] for r in runs}
    paths = [os.path.join(plot_dir, "latency_cdf.png")]
    plot_cdfs(series, paths[0], f"{name}: latency CDFs")
    if sweep:
        summaries = [
            {**r["summary"], "request_rate": float(r["summary"]["request_rate"])} for r in runs
        ]
        paths.append(os.path.join(plot_dir, "sweep.png"))
        plot_sweep({name: summaries}, paths[1], f"{name}: rate sweep")
    return paths


if __name__ == "__main__":
    import sys

    _parser = argparse.ArgumentParser(prog="pagoda bench serve", description=__doc__)
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))

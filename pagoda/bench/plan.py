"""`pagoda plan`: capacity planning from the goodput curve, against a running OpenAI-compatible
server (or one it starts with --serve-args), with `bench serve`'s load generator.

1. Batch size: the same prompts at saturation with at most c requests in flight, for each c of
   --concurrencies. The server then runs batches of at most c, so the largest c whose P99 TPOT
   meets its SLO is the largest `--max-num-seqs` that keeps decode inside it.
2. Rate: Poisson arrivals at each rate of --rates (default: fractions of the request throughput
   measured at that batch size). The highest rate whose P99 TTFT and P99 TPOT both meet their
   SLOs, with no failed request, is the rate one server sustains.
3. Cost per 1K output tokens = --price-per-hour / 3600 / (output tokens/s at that rate) * 1000;
   replicas for --target-rate = ceil(target / that rate).
4. Check (unless --no-check): fresh prompts at that rate and at 1.5x it, the first expected
   inside the SLOs and the second outside.

Prints one JSON line (and --output-json), and draws the goodput curve (--plot PNG).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import shlex
from collections.abc import Sequence
from typing import Any

from pagoda.bench import serve
from pagoda.bench.common import emit, log, started_server, write_json
from pagoda.bench.serve_client import count_output_tokens, first_model_id
from pagoda.bench.serve_prompts import ServeRequest, build_requests, load_bench_tokenizer
from pagoda.bench.serve_stats import summarize

NAME = "plan"
DEFAULT_CONCURRENCIES = (1, 2, 4, 8, 16, 32)
DEFAULT_RATE_FRACTIONS = (0.25, 0.5, 0.7, 0.85, 1.0, 1.2)
CHECK_FACTOR = 1.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve._server_arguments(parser)
    serve._workload_arguments(parser)
    p = parser.add_argument_group("plan")
    p.add_argument("--slo-ttft-ms", type=float, required=True, help="P99 TTFT SLO")
    p.add_argument("--slo-tpot-ms", type=float, required=True, help="P99 TPOT SLO")
    p.add_argument("--price-per-hour", type=float, default=None, help="the machine's price")
    p.add_argument("--target-rate", type=float, default=None, help="req/s the service must take")
    p.add_argument(
        "--concurrencies",
        type=_positive_ints,
        default=DEFAULT_CONCURRENCIES,
        metavar="C1,C2,...",
        help="batch sizes to try (requests in flight)",
    )
    p.add_argument(
        "--rates",
        type=serve.parse_rates,
        default=None,
        metavar="R1,R2,...",
        help="request rates to sweep (default: fractions of the measured throughput)",
    )
    p.add_argument("--no-check", action="store_true", help="skip the run at the rate and 1.5x")
    p.add_argument(
        "--serve-args",
        default=None,
        metavar="ARGS",
        help="start `pagoda serve ARGS` on a free port for the plan (instead of --base-url)",
    )
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, metavar="PNG", help="write the goodput curve here")
    p.add_argument("--disable-tqdm", action="store_true")
    # bench serve's checks and workload record read these; a plan sets its own rates.
    parser.set_defaults(request_rate=1.0, max_concurrency=None)


def _positive_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected C1,C2,... (integers), got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return tuple(sorted(set(values)))


# ---- decisions (pure) ----------------------------------------------------------------------
def within_slo(summary: dict[str, Any], slo_ttft_ms: float | None, slo_tpot_ms: float) -> bool:
    """No failed request, P99 TPOT within its SLO, and P99 TTFT within its SLO if given."""
    if summary["failed"] or summary["completed"] == 0:
        return False
    tpot = summary["p99_tpot_ms"]
    if tpot is not None and tpot > slo_tpot_ms:
        return False
    return slo_ttft_ms is None or summary["p99_ttft_ms"] <= slo_ttft_ms


def largest_within(
    runs: Sequence[dict[str, Any]], key: str, slo_ttft_ms: float | None, slo_tpot_ms: float
) -> dict[str, Any] | None:
    """The run with the largest `key` among those within the SLOs; None if none is."""
    ok = [r for r in runs if within_slo(r, slo_ttft_ms, slo_tpot_ms)]
    return max(ok, key=lambda r: float(r[key])) if ok else None


def cost_per_1k_tokens(price_per_hour: float, tokens_per_s: float) -> float:
    if tokens_per_s <= 0:
        raise ValueError(f"tokens/s must be > 0, got {tokens_per_s}")
    return price_per_hour / 3600.0 / tokens_per_s * 1000.0


def replicas_for(target_rate: float, rate_per_replica: float) -> int:
    if rate_per_replica <= 0:
        raise ValueError(f"the rate per replica must be > 0, got {rate_per_replica}")
    return max(1, math.ceil(target_rate / rate_per_replica - 1e-9))


# ---- runs ----------------------------------------------------------------------------------
def _run(
    args: argparse.Namespace,
    requests: list[ServeRequest],
    cfg: Any,
    tokenizer: Any,
    rate: float,
    concurrency: int | None,
) -> dict[str, Any]:
    results, duration = asyncio.run(
        serve.run_load(requests, cfg, rate, concurrency, args.seed, args.disable_tqdm)
    )
    count_output_tokens(results, tokenizer)
    summary = summarize(results, duration, args.slo_ttft_ms, args.slo_tpot_ms)
    return {"request_rate": serve.rate_key(rate), "max_concurrency": concurrency, **summary}


def plan(args: argparse.Namespace, base_url: str) -> dict[str, Any]:
    tokenizer = load_bench_tokenizer(args.tokenizer)
    args.base_url = base_url
    model = args.model or first_model_id(base_url, serve.auth_headers(args.api_key))
    cfg = serve.request_config(args, model, tokenizer)

    def prompts(seed: int) -> list[ServeRequest]:
        return build_requests(
            tokenizer,
            args.num_prompts,
            args.input_len_range,
            args.output_len_range,
            seed=seed,
            shared_prefix_len=args.shared_prefix_len,
        )

    requests = prompts(args.seed)
    check = serve.check_server(requests, cfg)
    if not check.success:
        raise RuntimeError(f"the test request to {cfg.url} failed: {check.error}")
    slo = (args.slo_ttft_ms, args.slo_tpot_ms)
    batch_runs = []
    for c in args.concurrencies:
        log(f"plan: batch {c}")
        batch_runs.append(_run(args, requests, cfg, tokenizer, math.inf, c))
    # The batch choice bounds TPOT only: at saturation TTFT is queueing, which the rate sets.
    batch = largest_within(batch_runs, "max_concurrency", None, args.slo_tpot_ms)
    saturated = batch or batch_runs[0]
    rates = args.rates or [
        round(f * saturated["request_throughput"], 4) for f in DEFAULT_RATE_FRACTIONS
    ]
    rate_runs = []
    for rate in rates:
        log(f"plan: rate {rate:g} req/s")
        rate_runs.append(_run(args, requests, cfg, tokenizer, rate, None))
    best = largest_within(rate_runs, "request_rate", *slo)
    result: dict[str, Any] = {
        "bench": NAME,
        "label": args.label,
        "model": model,
        "slo": {"p99_ttft_ms": args.slo_ttft_ms, "p99_tpot_ms": args.slo_tpot_ms},
        "workload": serve.run_config(args, cfg, requests),
        "max_num_seqs": batch["max_concurrency"] if batch else None,
        "max_request_rate": best["request_rate"] if best else None,
        "output_tokens_per_s_at_max_rate": best["output_throughput"] if best else None,
        "price_per_hour": args.price_per_hour,
        "cost_per_1k_output_tokens": None,
        "target_rate": args.target_rate,
        "replicas_for_target_rate": None,
        "batch_sweep": batch_runs,
        "rate_sweep": rate_runs,
        "check": [],
    }
    if best is not None:
        if args.price_per_hour is not None:
            result["cost_per_1k_output_tokens"] = round(
                cost_per_1k_tokens(args.price_per_hour, best["output_throughput"]), 6
            )
        if args.target_rate is not None:
            result["replicas_for_target_rate"] = replicas_for(
                args.target_rate, best["request_rate"]
            )
        if not args.no_check:
            fresh = prompts(args.seed + 1)
            for factor in (1.0, CHECK_FACTOR):
                rate = best["request_rate"] * factor
                log(f"plan: check at {rate:g} req/s")
                run = _run(args, fresh, cfg, tokenizer, rate, None)
                run["factor"] = factor
                run["within_slo"] = within_slo(run, *slo)
                result["check"].append(run)
    return result


def main(args: argparse.Namespace) -> int:
    serve.check_args(args)
    with contextlib.ExitStack() as stack:
        url = args.base_url
        if args.serve_args is not None:
            url = stack.enter_context(started_server(shlex.split(args.serve_args))).url
        result = plan(args, url)
    emit(headline(result), None)
    if args.output_json:
        write_json(result, args.output_json)
    if args.plot:
        from pagoda.bench.serve_plots import plot_plan

        plot_plan(result, args.plot)
    return 0 if result["max_request_rate"] is not None else 1


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The printed line: the decisions, and each check's rate, P99s and verdict."""
    keys = ("request_rate", "p99_ttft_ms", "p99_tpot_ms", "within_slo")
    line = {k: v for k, v in result.items() if k not in ("batch_sweep", "rate_sweep", "workload")}
    line["check"] = [{k: run[k] for k in keys} for run in result["check"]]
    return line
